"""Neuron-block priority predictors (paper §3.3): which FFN blocks of a layer matter for a token,
and in what order to load and compute them.

    profile.py   llama.cpp activation profiling (cb_eval)      -- needs llama_cpp
    hashing.py   stacked learnable hashing, torch training       -- needs torch
    mlp.py       DejaVu-style low-rank MLP baseline             -- needs torch
    pipeline.py  profile -> PCA -> train -> export -> evaluate; build_predictors() for the converter
    export.py    the versioned bit-packed file format           -- numpy only
    native.py    owner of the C evaluator (native/src/predictor.c) -- runtime-safe, no torch
    metrics.py   top-10 % recall, importance ratio              -- numpy only

Importing this package imports nothing heavy; the runtime needs only export/native.
"""
