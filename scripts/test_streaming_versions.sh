#!/usr/bin/env bash
# Run the mixer's tests against another mosaicml-streaming release than the venv's (default 0.12.0).
#
# Why: grape_stream supports mosaicml-streaming >=0.12,<0.14 (llm-foundry 0.22 needs <0.13, the venv pins
# 0.13.0), and the mixer reaches streaming's private shard bookkeeping (grape_stream/streaming_compat/
# shard_state.py). This installs the other release with --no-deps into a cache folder (~/.cache/grape_stream/; its dependencies
# are the venv's: 0.12's differ only in google-cloud-storage's upper bound) and puts it first on
# PYTHONPATH, so the tests and every subprocess they start import it instead of the venv's.
#
#   scripts/test_streaming_versions.sh                 # 0.12.0, mixer + shm + fault tests
#   STREAMING_VERSION=0.12.0 scripts/test_streaming_versions.sh tests/test_mixer_basic.py -k resume
#
# Needs the package index (or a pip cache / PIP_FIND_LINKS holding the wheel) on first use.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION="${STREAMING_VERSION:-0.12.0}"
PY="${PYTHON:-$PWD/.venv/bin/python}"
TARGET="$(realpath -m "${STREAMING_TARGET:-${XDG_CACHE_HOME:-$HOME/.cache}/grape_stream/streaming-$VERSION}")"
if [ ! -f "$TARGET/streaming/__init__.py" ]; then
    "$PY" -m pip install -q --no-deps --target "$TARGET" "mosaicml-streaming==$VERSION"
fi
export PYTHONPATH="$PWD:$TARGET${PYTHONPATH:+:$PYTHONPATH}"
got="$("$PY" -c 'import streaming; print(streaming.__version__)')"
if [ "$got" != "$VERSION" ]; then
    echo "expected mosaicml-streaming $VERSION on PYTHONPATH, imported $got" >&2
    exit 1
fi
echo "mosaicml-streaming $got from $TARGET"
if [ "$#" -eq 0 ]; then
    set -- tests/test_mixer_*.py tests/test_shm_registration.py tests/test_faults_s3.py
fi
exec "$PY" -m pytest -q -p no:cacheprovider "$@"
