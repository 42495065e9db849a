#!/usr/bin/env bash
# Run the test suite: set up (fast when the llama.cpp build is cached), then pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q "$@"
