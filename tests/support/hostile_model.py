"""A tiny complete model directory for the integrity, hostile-input and fuzz tests: a synthetic
llama GGUF converted with random (untrained) predictors and calibration frequencies, so that
every kind of file a model directory can hold is there. Loads and decodes in milliseconds."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np

N_LAYER, N_EMBD, N_FF, K = 2, 64, 128, 2
# a budget of 1.5 layers: dense decode re-reads half a layer's blocks every token
BUDGET = "48KiB"
HAVE_TORCH = importlib.util.find_spec("torch") is not None
CTX = dict(n_ctx=64, n_threads=1, n_threads_batch=1, seed=0, verbose=False)
PROMPT = b"hello there"
N_GEN = 4


def make_model_dir(root: str | Path, *, predictors: bool = True) -> Path:
    """root/tiny.gguf and its conversion root/model.lsm (with predictors if torch is there)."""
    from leanstream_convert import convert
    from leanstream_convert.convert_gguf import save_manifest
    from gguf_synth import write_tiny_model
    from leanstream_ggml.model import manifest

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    src = root / "tiny.gguf"
    write_tiny_model(src, arch="llama", n_layer=N_LAYER, n_embd=N_EMBD, n_ff=N_FF, types={"ffn": "Q4_0"}, seed=7)
    out = root / "model.lsm"
    convert(src, out, k=K, align=512, progress=False, sketch="none")
    if predictors and HAVE_TORCH:
        from pred_synth import write_random_predictors

        write_random_predictors(out)
        m = manifest.load(out)
        n_blocks = m.layers[0].n_blocks
        freq = np.random.default_rng(1).random((N_LAYER, n_blocks)).astype(np.float32)
        np.save(out / "predictor" / "block_freq.npy", freq)
        m.predictor.block_freq = "predictor/block_freq.npy"
        save_manifest(m, out)
    return out


def run_model(model_dir, mode: str = "dense", **kw) -> tuple[list[int], bytes]:
    """(greedy tokens, last logits as bytes) of PROMPT + N_GEN tokens; raises what Llama raises."""
    from leanstream_ggml import Llama

    llm = Llama(str(model_dir), mode=mode, memory_budget=kw.pop("memory_budget", BUDGET), **CTX, **kw)
    try:
        toks = llm.tokenize(PROMPT, add_bos=False)
        llm.eval(toks)
        out = []
        for _ in range(N_GEN):
            logits = llm.logits()
            t = int(np.argmax(logits))
            out.append(t)
            llm.eval([t])
        logits = llm.logits().copy()
        return out, logits.tobytes()
    finally:
        llm.close()
