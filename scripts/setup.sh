#!/usr/bin/env bash
# Set up leanstream-ggml in a virtual environment (default ./.venv, or $LEANSTREAM_VENV):
# the patched llama-cpp-python (built once, cached in ~/.cache/leanstream-ggml), the native
# library, and the package, editable, with its converter, training, test, bench, server and eval
# extras. The same two steps install it anywhere (README: Install); the editable install compiles
# the native library in place (setup.py), where the first step left it built.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${LEANSTREAM_VENV:-.venv}
PY=${PYTHON:-python3}
for tool in "$PY" cc c++ cmake patch; do
  command -v "$tool" >/dev/null || { echo "setup: '$tool' is required but not found on PATH" >&2; exit 1; }
done
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m leanstream_ggml.build
# torch pinned to the CPU build (a bare "torch" can resolve to a multi-GB CUDA build)
"$VENV/bin/python" -m pip install -q "torch==2.13.0"
"$VENV/bin/python" -m pip install -q -e ".[convert,train,test,bench,server,eval]"
echo "setup: done. Activate with: source $VENV/bin/activate"
