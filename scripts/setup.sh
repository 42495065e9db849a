#!/usr/bin/env bash
# Set up leanstream-ggml in a virtual environment (default ./.venv, or $LEANSTREAM_VENV):
# the patched llama-cpp-python (built once, cached in ~/.cache/leanstream-ggml), the native
# library, and the package with its converter, test, bench, server and eval extras.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${LEANSTREAM_VENV:-.venv}
PY=${PYTHON:-python3}
for tool in "$PY" cc c++ cmake patch; do
  command -v "$tool" >/dev/null || { echo "setup: '$tool' is required but not found on PATH" >&2; exit 1; }
done
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q "scikit-build-core>=0.9.2" "typing-extensions>=4.5.0" \
  "numpy>=1.20.0" "diskcache>=5.6.1" "jinja2>=2.11.3"
"$VENV/bin/python" -m leanstream_ggml.build
# torch pinned to the CPU build (a bare "torch" can resolve to a multi-GB CUDA build)
"$VENV/bin/python" -m pip install -q "torch==2.13.0"
"$VENV/bin/python" -m pip install -q -e ".[convert,test,bench,server,eval]"
echo "setup: done. Activate with: source $VENV/bin/activate"
