#!/usr/bin/env bash
# Run the test suite: set up (fast when the llama.cpp build is cached), then pytest: every test but
# the benchmarks, with the 25 slowest durations at the end. Arguments go to pytest:
#   bash scripts/test.sh -m "not slow"     the fast tier (no real model), for the edit loop
#   bash scripts/test.sh tests/native/test_op.py  one file
# Benchmarks: .venv/bin/python -m pytest tests/bench/test_*_bench.py --benchmark-only (see pyproject.toml).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q --durations=25 "$@"
