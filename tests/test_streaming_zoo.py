"""streaming's dataset zoo (text / vision / multimodal) is imported on first use, not with streaming
(grape_stream/streaming_compat/zoo.py). Each case runs in a fresh interpreter: what is imported is the point."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration


def _run(code: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_mixer_imports_streaming_without_its_zoo_and_the_zoo_still_works_when_used() -> None:
    got = _run("""
import json, sys
import grape_stream.mixing.mixer
from streaming import StreamingDataset, MDSWriter
import streaming
before = {m: m in sys.modules for m in ("torchvision", "streaming.text.c4", "streaming.vision.base",
                                        "streaming.multimodal.webvid")}
from streaming.text import StreamingC4            # a name from a placeholder: the real subpackage
import streaming.vision.base                      # a submodule through a placeholder
from streaming.vision import StreamingADE20K
web = streaming.multimodal.StreamingInsideWebVid  # through the attribute streaming's __init__ bound
print(json.dumps({"before": before, "c4": StreamingC4.__module__, "ade": StreamingADE20K.__module__,
                  "web": web.__module__, "text_is_real": sys.modules["streaming.text"].__name__ == "streaming.text"
                  and type(sys.modules["streaming.text"]).__name__ == "module",
                  "same": streaming.text.StreamingC4 is StreamingC4 and streaming.vision.base is sys.modules[
                      "streaming.vision.base"]}))
""")
    assert got["before"] == {"torchvision": False, "streaming.text.c4": False, "streaming.vision.base": False,
                             "streaming.multimodal.webvid": False}
    assert (got["c4"], got["ade"], got["web"]) == ("streaming.text.c4", "streaming.vision.ade20k",
                                                    "streaming.multimodal.webvid")
    assert got["text_is_real"] and got["same"]


def test_nothing_is_deferred_once_streaming_was_imported_first() -> None:
    got = _run("""
import json, sys
import streaming
from grape_stream.streaming_compat.zoo import defer_dataset_zoo
print(json.dumps({"deferred": defer_dataset_zoo(), "c4": "streaming.text.c4" in sys.modules}))
""")
    assert got == {"deferred": False, "c4": True}
