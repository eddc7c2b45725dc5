"""Streaming's shared-memory registration survives another streaming job racing for the same prefix."""

from __future__ import annotations

import pytest

from grape_stream.streaming_compat.registration import create_registered


def test_a_taken_prefix_is_retried_and_other_errors_are_not():
    calls = []

    def factory():
        calls.append(1)
        if len(calls) < 3:  # what streaming 0.13 raises when another job took the prefix it picked
            raise FileExistsError(17, "File exists", "/000006_locals")
        return "dataset"

    assert create_registered(factory) == "dataset" and len(calls) == 3

    def other():
        raise FileExistsError(17, "File exists", "/some/other/file")

    with pytest.raises(FileExistsError, match="other"):
        create_registered(other)


def test_a_prefix_that_stays_taken_fails_after_bounded_attempts():
    n = []

    def always():
        n.append(1)
        raise FileExistsError(17, "File exists", "/000001_locals")

    with pytest.raises(FileExistsError):
        create_registered(always, attempts=4)
    assert len(n) == 4
