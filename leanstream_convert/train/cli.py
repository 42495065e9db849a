"""`leanstream profile` and `leanstream train-predictor`. Torch is imported only when a command
runs (registering the parsers imports nothing heavy)."""

from __future__ import annotations

import json


def register(sub) -> None:
    p = sub.add_parser("profile", help="profile a GGUF with stock llama.cpp (its FFN inputs and outputs on calibration text) for predictor training")
    p.add_argument("model", help="the original GGUF file")
    p.add_argument("out", help="profile directory (restartable)")
    p.add_argument("--calibration", help="plain text or .jsonl chats (default: the model's own answers to bundled prompts)")
    p.add_argument("--prompts", type=int, default=None, help="use only the first N bundled prompts")
    p.add_argument("--max-tokens", type=int, default=192, help="tokens generated per prompt")
    p.add_argument("--max-total-tokens", type=int, default=None, help="cap on profiled positions (--calibration)")
    p.add_argument("--threads", type=int, default=2)
    p.set_defaults(func=_profile)

    from .pipeline import FULL_HASH as F   # numpy only: torch stays out of parser registration

    t = sub.add_parser("train-predictor", help="train and export the hashing predictors from a profile")
    t.add_argument("model", help="the original GGUF file (for ffn_down, used by refinement inputs)")
    t.add_argument("profile", help="directory written by `leanstream profile`")
    t.add_argument("out", help="model directory; predictors go to <out>/predictor/")
    t.add_argument("--layers", type=int, default=None, help="train only the first N layers")
    t.add_argument("--hash-layers", type=int, default=F["n_hash_layers"], help="L (paper: 5)")
    t.add_argument("--tau", type=int, default=F["tau"], help="bits per hash code (paper: 8)")
    t.add_argument("--bits", type=int, default=F["n_bits"], help="d, code width (paper: 256)")
    t.add_argument("--tables", type=int, default=F["n_tables"], help="M hash functions per layer (paper's literal layer: 1)")
    t.add_argument("--skip-weight", type=int, default=0, help="votes of the previous code in layers >= 2 (0: M - 1)")
    t.add_argument("--pca", type=float, default=0.3, help="fraction of dimensions PCA keeps (paper: 0.3)")
    t.add_argument("--steps", type=int, default=F["steps"])
    t.add_argument("--batch", type=int, default=F["batch"])
    t.add_argument("--lr", type=float, default=0.05)
    t.add_argument("--no-mlp", action="store_true", help="skip the DejaVu MLP baseline")
    t.add_argument("--mlp-rank", type=int, default=None)
    t.add_argument("--eval-layers", type=int, default=6, help="layers on which the refinement curve is measured")
    t.add_argument("--threads", type=int, default=2)
    t.set_defaults(func=_train)


def _profile(args) -> int:
    from ..profile import profile_model

    profile_model(args.model, args.out, calibration=args.calibration, n_prompts=args.prompts,
                  max_tokens=args.max_tokens, max_total_tokens=args.max_total_tokens, n_threads=args.threads)
    return 0


def _train(args) -> int:
    import numpy as np

    from leanstream_ggml.model import manifest

    from .. import blockfile
    from ..convert_gguf import save_manifest
    from . import hashing as H
    from .pipeline import train_from_profile

    cfg = H.HashConfig(n_hash_layers=args.hash_layers, tau=args.tau, n_bits=args.bits, n_tables=args.tables,
                       skip_weight=args.skip_weight, pca_frac=args.pca, steps=args.steps, batch=args.batch, lr=args.lr)
    layers = range(args.layers) if args.layers else None
    try:
        m = manifest.load(args.out)
    except manifest.ManifestError:
        m = None   # not a converted model directory: predictors for one neuron per block, file order
    blocks = None
    if m is not None:   # the directory's block geometry: which neurons each block holds
        geo = []
        for il in range(m.n_layer):
            h = blockfile.read_header(m.layer_path(args.out, il))
            geo.append((blockfile.read_perm(m.layer_path(args.out, il), h), h.k))
        blocks = None if all(k == 1 and np.array_equal(p, np.arange(len(p))) for p, k in geo) else geo
    s = train_from_profile(args.profile, args.model, args.out, cfg=cfg, train_mlp=not args.no_mlp,
                           blocks_of_layer=blocks, mlp_rank=args.mlp_rank, eval_layers=args.eval_layers,
                           n_threads=args.threads, layers=layers)
    print(json.dumps({k: s[k] for k in ("bytes", "train_seconds", "oneshot_mean")}, indent=1))
    if m is not None and len(s.get("files", [])) == m.n_layer:
        # point the manifest at the new predictors (what the runtime loads)
        m.predictor = manifest.PredictorInfo(files=s["files"], version=s["version"], bytes=s["bytes"],
                                             block_freq=s.get("block_freq"), summary=manifest.PREDICTOR_SUMMARY,
                                             config=s["config"])
        save_manifest(m, args.out)
    return 0
