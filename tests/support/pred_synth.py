"""Random (untrained) hashing predictor files for tests: the engine must follow whatever its
predictors say, so plumbing can be tested without training. Needs torch (the convert extra)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np


def write_random_predictors(model_dir, *, n_pca: int = 32, seed: int = 0, update_manifest: bool = True):
    """predictor/blk.<il>.lspred for every layer of a converted model; returns the torch models."""
    import torch

    from leanstream_ggml.model import manifest
    from leanstream_convert.convert_gguf import save_manifest
    from leanstream_convert.train.export import write_predictor
    from leanstream_convert.train.hashing import HashConfig, HashingPredictor

    model_dir = Path(model_dir)
    m = manifest.load(model_dir)
    cfg = HashConfig(n_hash_layers=2, tau=4, n_bits=64, n_tables=2)
    torch.manual_seed(seed)
    n_pca = min(n_pca, m.n_embd)
    pca = np.linalg.qr(np.random.default_rng(seed).standard_normal((m.n_embd, n_pca)))[0].T
    os.makedirs(model_dir / "predictor", exist_ok=True)
    files, models = [], []
    for il in range(m.n_layer):
        p = HashingPredictor(m.n_embd, m.layers[il].n_blocks, cfg, np.zeros(m.n_embd), np.ones(m.n_embd), pca)
        rel = f"predictor/blk.{il}.lspred"
        write_predictor(model_dir / rel, p.export_params(), tau=cfg.tau, n_tables=cfg.n_tables, layer=il)
        files.append(rel)
        models.append(p)
    if update_manifest:
        m.predictor = manifest.PredictorInfo(files=files, version=2, bytes=sum((model_dir / f).stat().st_size for f in files),
                                             config={"note": "random (untrained) predictors for tests"})
        save_manifest(m, model_dir)
    return [model_dir / f for f in files], models
