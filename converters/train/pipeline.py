"""Profile -> PCA -> train (hashing + optional MLP baseline) -> export -> evaluate.

What one layer's predictor sees (both uses share one predictor, paper §3.2 / Eq. 2):

    P_il(input) -> priorities of layer il's blocks, where input is
      layer-ahead one-shot:  x_{il-1}                              (DejaVu style)
      refinement j of K:     x_{il-1} + sum_{k<=j} Δm_{il-1}^{(k)} (Eq. 2)
      layer 0:               its own ffn_inp x_0 (nothing earlier exists)

x_n is the residual entering FFN n (llama.cpp "ffn_inp-n"); Δm^{(k)} is the output of the k-th
of K priority-ordered stages of layer il-1's sparse FFN. Refined inputs are made in distribution
by training on all j = 0..K: each training row (`pool` copies of it) draws a target sparsity s and
a stage count j, and orders layer il-1's blocks by a noisy oracle (true importance times log-normal noise, a stand-in
for the previous predictor's ranking), so the partial sums it sees look like the runtime's.

Evaluation (the paper's Fig. 12): on held-out positions, layer il-1's stages are ordered by the
method's own one-shot prediction for layer il-1, truncated at sparsity s and split into K=8
stages; after j stages the method predicts layer il, which is scored by top-10 % recall and
importance ratio at the same s. The hashing predictor is scored through the exported file and
the C evaluator (the runtime path); the oracle ranks by the true importance.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import numpy as np

from leanstream_ggml import manifest as mf

from .._faults import kill_point
from ..fileio import atomic_write_json, atomic_writer
from . import metrics as M
from .export import FILE_VERSION

K_STAGES = 8


def predictor_path(model_dir, il: int) -> Path:
    return Path(model_dir) / mf.PREDICTOR_FILE.format(il=il)


class DownWeights:
    """Dequantised ffn_down of the source GGUF, one layer at a time: W [n_embd, n_ff] f32."""

    def __init__(self, gguf_path):
        import gguf

        self.reader = gguf.GGUFReader(str(gguf_path))
        self.tensors = {t.name: t for t in self.reader.tensors}

    def __call__(self, il: int) -> np.ndarray:
        import gguf

        t = self.tensors[f"blk.{il}.ffn_down.weight"]
        w = gguf.quants.dequantize(t.data, t.tensor_type)
        return np.ascontiguousarray(w.reshape(int(t.shape[1]), int(t.shape[0])), dtype=np.float32)


def _perm(blocks_of_layer, il):
    if blocks_of_layer is None:
        return None, 1
    p = blocks_of_layer[il]
    if isinstance(p, tuple):
        return np.asarray(p[0]), int(p[1])
    return None if p is None else np.asarray(p), 1


def refined_inputs(x_prev, a_prev, w_down, prio_prev, s, j, perm=None, k=1, n_stages=K_STAGES):
    """Eq. 2 for a batch: x_prev [N, n_embd], a_prev [N, n_ff] signed swiglu of layer il-1,
    w_down [n_embd, n_ff], prio_prev [N, B] the order in which layer il-1's blocks are computed,
    s [N] sparsity, j [N] stages done -> x~ [N, n_embd]."""
    n, b = prio_prev.shape
    if not np.any(j > 0):
        return x_prev.copy()
    n_sel = np.array([M.n_selected(b, si) for si in np.atleast_1d(s)]) * np.ones(n, dtype=np.int64)
    cut = np.floor(n_sel * (np.asarray(j) / n_stages) + 1e-9).astype(np.int64)
    # the first cut[i] blocks of row i in priority order: at or above the cut-th largest priority
    # (a value sort, not an argsort: this runs for every training batch)
    desc = -np.sort(-prio_prev, axis=1)
    thr = desc[np.arange(n), np.maximum(cut - 1, 0)]
    block_mask = (prio_prev >= thr[:, None]) & (cut[:, None] > 0)
    nmask = M.neuron_mask_of_blocks(block_mask, perm, a_prev.shape[1], k)
    return x_prev + (a_prev * nmask) @ w_down.T


def train_from_profile(profile_dir, gguf_path, model_dir, *, blocks_of_layer=None, cfg=None,
                       train_mlp: bool = True, mlp_rank: int | None = None, mlp_steps: int | None = None,
                       holdout: float = 0.2, eval_tokens: int = 512, eval_layers: int = 6,
                       noise_sigma: float = 1.0, pool: int = 2, n_threads: int = 2, layers=None,
                       resume_dir=None, log=print) -> dict:
    """Train and export one predictor per layer from a profile directory. Returns the summary
    (also written to <model_dir>/predictor/predictor.json).

    resume_dir: after every layer, the state the next layers depend on (random generator, the
    summary so far, the last layer's MLP predictions) is saved there; a rerun with the same
    arguments skips the finished layers and writes the same files as an uninterrupted run."""
    import torch

    from . import hashing as H
    from .mlp import MLPPredictor
    from ..profile import ProfileData
    from .export import NativePredictor

    torch.set_num_threads(n_threads)
    cfg = cfg or H.HashConfig()
    data = ProfileData(profile_dir)
    down = DownWeights(gguf_path)
    n_layer, n_embd = data.n_layer, data.n_embd
    model_dir = Path(model_dir)
    (model_dir / mf.PREDICTOR_DIR).mkdir(parents=True, exist_ok=True)
    T = data.n_tokens
    n_train = int(T * (1 - holdout))
    ev = np.arange(n_train, T)
    if len(ev) > eval_tokens:
        ev = ev[np.linspace(0, len(ev) - 1, eval_tokens).astype(int)]
    layers = list(range(n_layer)) if layers is None else list(layers)
    curve_layers = sorted(set(int(round(v)) for v in np.linspace(1, n_layer - 1, min(eval_layers, n_layer - 1))))
    curve_layers = [il for il in curve_layers if il in layers and il - 1 in layers] if n_layer > 1 else []
    rng = np.random.default_rng(cfg.seed)

    summary = {"format": "lspred", "version": FILE_VERSION, "files": [], "config": cfg.to_dict(),
               "n_tokens_profile": int(T), "n_tokens_train": int(n_train), "n_tokens_eval": int(len(ev)),
               "layers": {}, "curve_layers": curve_layers}
    t_train = 0.0
    t_mlp = 0.0
    prev = None   # state of layer il-1: arrays and one-shot predictions on the eval rows
    sizes, mlp_sizes = [], []
    curves = {"hashing": {}, "mlp": {}, "oracle": {}}
    block_freq = {}
    resume = _TrainResume(resume_dir, cfg, layers) if resume_dir is not None else None
    done = set()
    if resume is not None and (st := resume.load()) is not None:
        done = set(st["done"])
        rng.bit_generator.state = st["rng"]
        summary, sizes, mlp_sizes = st["summary"], st["sizes"], st["mlp_sizes"]
        t_train, t_mlp = st["t_train"], st["t_mlp"]
        curves = {name: {int(il): c for il, c in per.items()} for name, per in st["curves"].items()}
        block_freq = resume.block_freq()
        log(f"resuming predictor training: {len(done)} of {len(layers)} layers done")
    for il in layers:
        perm, k = _perm(blocks_of_layer, il)
        if il in done:
            if il + 1 in layers and il + 1 not in done:   # the next layer trains from this one's state
                x_own = data.layer("x", il)
                x_in = x_own if il == 0 else data.layer("x", il - 1)
                with NativePredictor(predictor_path(model_dir, il)) as cpred:
                    pred_h = cpred(x_in[ev])
                prev = {"il": il, "x": x_own, "a": data.layer("a", il), "w_down": down(il) if il + 1 < n_layer else None,
                        "pred_h": pred_h, "pred_m": resume.pred_m()}
            continue
        x_own = data.layer("x", il)
        a_own = data.layer("a", il)
        imp = M.block_importance(np.abs(a_own), perm, k)
        n_blocks = imp.shape[1]
        # calibration frequency of each block in the top half (powerinfer2's hot set)
        top = M.topk_mask(imp[:n_train], M.n_selected(n_blocks, 0.5))
        block_freq[il] = top.mean(axis=0).astype(np.float32)
        if il == 0 or prev is None or prev["il"] != il - 1:
            x_in = x_own if il == 0 else data.layer("x", il - 1)
            a_in = w_in = None
        else:
            x_in, a_in, w_in = prev["x"], prev["a"], prev["w_down"]
        prev_perm, prev_k = _perm(blocks_of_layer, il - 1) if il > 0 else (None, 1)
        prev_imp = M.block_importance(np.abs(a_in), prev_perm, prev_k) if a_in is not None else None

        # the training set: every training row `pool` times, each copy with its own draw of a
        # target sparsity s, a stage count j = 0..K and a noisy order of layer il-1's blocks
        # (built once per layer: a fresh draw per batch cost most of the training time)
        if a_in is None:   # layer 0, or no previous layer in this run: nothing to refine from
            rows, x_pool = np.arange(n_train), x_in[:n_train]
        else:
            rows = np.tile(np.arange(n_train), pool)
            x_pool = np.empty((len(rows), n_embd), dtype=np.float32)
            for lo in range(0, len(rows), 2048):
                idx = rows[lo:lo + 2048]
                s = rng.choice(M.SPARSITIES, size=len(idx))
                j = rng.integers(0, K_STAGES + 1, size=len(idx))
                noisy = prev_imp[idx] * np.exp(noise_sigma * rng.standard_normal(prev_imp[idx].shape)).astype(np.float32)
                x_pool[lo:lo + len(idx)] = refined_inputs(x_in[idx], a_in[idx], w_in, noisy, s, j, prev_perm, prev_k)

        # input statistics and PCA over the training distribution (one-shot and refined rows)
        stat_idx = rng.choice(len(rows), size=min(len(rows), 4096), replace=False)
        x_stat = x_pool[stat_idx]
        mean, scale = H.input_stats(x_stat)
        pca = H.fit_pca((x_stat - mean) * scale, cfg.pca_frac)

        t0 = time.time()
        torch.manual_seed(cfg.seed + il)
        model = H.HashingPredictor(n_embd, n_blocks, cfg, mean, scale, pca)
        targets = H.block_targets(imp[:n_train])   # shared by the hashing model and the MLP
        losses = H.train_model(model, x_pool, imp[:n_train], steps=cfg.steps, batch=cfg.batch, lr=cfg.lr,
                               seed=cfg.seed + il, hashing=True, target_rows=rows, targets=targets)
        params = model.export_params()
        path = predictor_path(model_dir, il)
        from .export import write_predictor

        size = write_predictor(path, params, tau=cfg.tau, n_tables=cfg.n_tables, layer=il)
        t_layer = time.time() - t0
        t_train += t_layer
        sizes.append(size)
        summary["files"] = sorted(set(summary["files"]) | {mf.PREDICTOR_FILE.format(il=il)},
                                  key=lambda f: int(f.split(".")[-2]))

        mlp = None
        if train_mlp:
            t0 = time.time()
            torch.manual_seed(cfg.seed + il)
            rank = mlp_rank or max(64, n_embd // 4)
            mlp = MLPPredictor(n_embd, n_blocks, rank, mean, scale)
            H.train_model(mlp, x_pool, imp[:n_train], steps=mlp_steps or cfg.steps, batch=cfg.batch, lr=3e-3,
                          seed=cfg.seed + il, hashing=False, target_rows=rows, targets=targets)
            t_mlp += time.time() - t0
            mlp_sizes.append(mlp.size_bytes())

        # ---- evaluation on held-out rows: one-shot (j = 0) for every layer
        with NativePredictor(path) as cpred:
            pred_h = cpred(x_in[ev])
            one = {"hashing": M.summarize(pred_h, imp[ev])}
            pred_m = mlp.predict(x_in[ev]) if mlp is not None else None
            if pred_m is not None:
                one["mlp"] = M.summarize(pred_m, imp[ev])
            one["oracle"] = M.summarize(imp[ev], imp[ev])
            # a static ranking (mean calibration importance, the same every token): what the
            # predictors add per token is their distance above this
            one["prior"] = M.summarize(np.broadcast_to(imp[:n_train].mean(0), imp[ev].shape), imp[ev])
            entry = {"bytes": size, "train_seconds": round(t_layer, 1),
                     "loss_first": float(np.mean(losses[:20])), "loss_last": float(np.mean(losses[-20:])),
                     "oneshot": one}
            # refinement curve j = 0..K on representative layers
            if il in curve_layers and a_in is not None:
                for name, fn, prev_pred in (("hashing", cpred, prev["pred_h"]),
                                            ("mlp", pred_m is not None and mlp.predict, prev.get("pred_m")),
                                            ("oracle", None, prev_imp[ev])):
                    if name == "mlp" and pred_m is None:
                        continue
                    c = curves[name].setdefault(il, {})
                    for s in M.SPARSITIES:
                        for j in range(K_STAGES + 1):
                            if name == "oracle":
                                p = imp[ev]
                            else:
                                xr = refined_inputs(x_in[ev], a_in[ev], w_in, prev_pred, np.full(len(ev), s),
                                                    np.full(len(ev), j), prev_perm, prev_k)
                                p = fn(xr)
                            c[f"{s:.1f}/{j}"] = (M.top_recall(p, imp[ev], s), M.importance_ratio(p, imp[ev], s))
        summary["layers"][str(il)] = entry
        h = one["hashing"]["0.8"]
        msg = f"layer {il}: {size} B, {t_layer:.1f}s, loss {entry['loss_first']:.3f}->{entry['loss_last']:.3f}, " \
              f"s=0.8 recall hash {h['recall_top10']:.3f}"
        if "mlp" in one:
            msg += f" mlp {one['mlp']['0.8']['recall_top10']:.3f}"
        log(msg)
        _write_summary(model_dir, summary, sizes, mlp_sizes, t_train, t_mlp, train_mlp, curves)   # partial, per layer
        # keep layer il's arrays for layer il+1: its input rows and its one-shot predictions
        prev = {"il": il, "x": x_own, "a": a_own, "w_down": down(il) if il + 1 < n_layer else None,
                "pred_h": pred_h, "pred_m": pred_m}
        if resume is not None:
            done.add(il)
            resume.save(done=sorted(done), rng=rng.bit_generator.state, summary=summary, sizes=sizes,
                        mlp_sizes=mlp_sizes, t_train=t_train, t_mlp=t_mlp, curves=curves, block_freq=block_freq,
                        pred_m=pred_m)
            kill_point("train-layer")

    if block_freq and len(block_freq) == n_layer and len({len(v) for v in block_freq.values()}) == 1:
        with atomic_writer(model_dir / mf.PREDICTOR_BLOCK_FREQ, durable=False) as f:
            np.save(f, np.stack([block_freq[il] for il in range(n_layer)]))
        summary["block_freq"] = mf.PREDICTOR_BLOCK_FREQ
    _write_summary(model_dir, summary, sizes, mlp_sizes, t_train, t_mlp, train_mlp, curves)
    return summary


class _TrainResume:
    """Per-layer checkpoints of train_from_profile (json + npy files in one folder)."""

    def __init__(self, folder, cfg, layers):
        self.dir = Path(folder)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.key = {"config": cfg.to_dict(), "layers": list(layers)}

    def load(self) -> dict | None:
        try:
            st = json.loads((self.dir / "train-state.json").read_text())
        except (OSError, ValueError):
            return None
        return st if st.get("key") == self.key else None

    def block_freq(self) -> dict:
        with np.load(self.dir / "block_freq.npz") as z:
            return {int(k): z[k] for k in z.files}

    def pred_m(self):
        p = self.dir / "pred_m.npy"
        return np.load(p) if p.exists() else None

    def save(self, *, block_freq, pred_m, **state) -> None:
        # arrays first: the json names a state only once everything it needs is on disk
        with atomic_writer(self.dir / "block_freq.npz", durable=False) as f:
            np.savez(f, **{str(k): v for k, v in block_freq.items()})
        if pred_m is not None:
            with atomic_writer(self.dir / "pred_m.npy", durable=False) as f:
                np.save(f, pred_m)
        else:
            (self.dir / "pred_m.npy").unlink(missing_ok=True)
        curves = {name: {str(il): c for il, c in per.items()} for name, per in state.pop("curves").items()}
        atomic_write_json(self.dir / "train-state.json", {"key": self.key, "curves": curves, **state}, indent=None)


def _write_summary(model_dir: Path, summary, sizes, mlp_sizes, t_train, t_mlp, train_mlp, curves):
    summary["bytes"] = int(sum(sizes))
    summary["bytes_per_layer"] = int(np.mean(sizes)) if sizes else 0
    summary["train_seconds"] = round(t_train, 1)
    if train_mlp:
        summary["mlp_bytes"] = int(sum(mlp_sizes))
        summary["mlp_train_seconds"] = round(t_mlp, 1)
    summary["oneshot_mean"] = _mean_oneshot(summary["layers"])
    summary["refinement"] = _mean_curves(curves)
    atomic_write_json(model_dir / mf.PREDICTOR_SUMMARY, summary, durable=False)


def _mean_oneshot(layers: dict) -> dict:
    out = {}
    for e in layers.values():
        for name, d in e["oneshot"].items():
            for s, v in d.items():
                for key, val in v.items():
                    out.setdefault(name, {}).setdefault(s, {}).setdefault(key, []).append(val)
    return {n: {s: {k: float(np.mean(v)) for k, v in d.items()} for s, d in sd.items()} for n, sd in out.items()}


def _mean_curves(curves: dict) -> dict:
    """{method: {s: {"recall_top10": [j=0..K], "importance_ratio": [...]}}} averaged over layers."""
    out = {}
    for name, per_layer in curves.items():
        if not per_layer:
            continue
        out[name] = {}
        for s in M.SPARSITIES:
            rec = [float(np.mean([c[f"{s:.1f}/{j}"][0] for c in per_layer.values()])) for j in range(K_STAGES + 1)]
            ir = [float(np.mean([c[f"{s:.1f}/{j}"][1] for c in per_layer.values()])) for j in range(K_STAGES + 1)]
            out[name][f"{s:.1f}"] = {"recall_top10": rec, "importance_ratio": ir}
    return out


QUICK = dict(n_prompts=6, max_tokens=64)
FULL = dict(n_prompts=None, max_tokens=192)
# Hashing configurations of `convert --predictors full|quick` (and `train-predictor`'s defaults).
# The paper's L = 5, tau = 8 is HashConfig()'s default; on 2 shared cores we train a smaller
# stack (wider ones measured no better: README, predictors).
FULL_HASH = dict(n_hash_layers=3, tau=6, n_bits=256, n_tables=8, steps=300, batch=256)
QUICK_HASH = dict(n_hash_layers=2, tau=6, n_bits=128, n_tables=4, steps=40, batch=128)


def _profile_settings(quick: bool, calibration, profile_kwargs: dict | None) -> dict:
    kw = dict(QUICK) if quick else dict(FULL)
    if calibration is not None:
        kw = dict(max_total_tokens=2048 if quick else 16384)
    kw.update(profile_kwargs or {})
    return kw


def training_settings(choice: str, *, hash_config=None, profile_kwargs=None, calibration=None) -> dict:
    """What predictor files of `convert --predictors choice` depend on (JSON-able; numpy only):
    a resumed conversion must have the same."""
    quick = choice == "quick"
    cfg = dict(QUICK_HASH if quick else FULL_HASH)
    if hash_config is not None:
        cfg = hash_config if isinstance(hash_config, dict) else hash_config.to_dict()
    return {"choice": choice, "hash": cfg, "profile": _profile_settings(quick, calibration, profile_kwargs),
            "calibration": calibration}


def build_predictors(src_gguf, model_dir, *, state_dir, blocks_of_layer=None, quick: bool = False, calibration=None,
                     profile_dir=None, cfg=None, train_mlp: bool | None = None, n_threads: int = 2,
                     progress: bool = True, profile_kwargs: dict | None = None, log=print):
    """The converter's profile and train stages: profile the ORIGINAL GGUF (into profile_dir, or
    state_dir/profile), train one predictor per layer into `<model_dir>/predictor/`, and return
    the manifest's PredictorInfo. state_dir: the conversion's state folder (stage markers
    `profile.done`, `train.done`; per-layer training checkpoints). blocks_of_layer[il]: None
    (identity, k = 1), a perm array (k = 1) or (perm, k) with block b = neurons perm[b*k:(b+1)*k],
    -1 = padding. quick: a setting CI can afford (SmolLM2: a couple of minutes on 2 cores)."""
    from leanstream_ggml.manifest import PredictorInfo

    from . import hashing as H
    from ..profile import profile_model

    t0 = time.time()
    state_dir = Path(state_dir)
    work = Path(profile_dir) if profile_dir else state_dir / "profile"
    if not (state_dir / "profile.done").exists():
        profile_model(src_gguf, work, calibration=calibration, n_threads=n_threads, progress=progress, log=log,
                      **_profile_settings(quick, calibration, profile_kwargs))
        atomic_write_json(state_dir / "profile.done", {"profile": str(work)})
    t_prof = time.time() - t0
    if cfg is None:
        cfg = H.HashConfig(**(QUICK_HASH if quick else FULL_HASH))
    elif isinstance(cfg, dict):
        cfg = H.HashConfig(**cfg)
    summary_path = Path(model_dir) / mf.PREDICTOR_SUMMARY
    if not (state_dir / "train.done").exists():
        summary = train_from_profile(work, src_gguf, model_dir, blocks_of_layer=blocks_of_layer, cfg=cfg,
                                     train_mlp=(not quick) if train_mlp is None else train_mlp,
                                     eval_layers=2 if quick else 6, eval_tokens=128 if quick else 512,
                                     n_threads=n_threads, resume_dir=state_dir / "train", log=log)
        summary["profile_seconds"] = round(t_prof, 1)
        summary["input"] = ("layer il: residual x_{il-1} entering FFN il-1 (ffn_inp), optionally plus the partial "
                            "outputs of the first j of K stages of FFN il-1 (Eq. 2); layer 0: its own ffn_inp")
        summary["k_stages"] = K_STAGES
        atomic_write_json(summary_path, summary)
        atomic_write_json(state_dir / "train.done", {"files": summary["files"]})
    summary = json.loads(summary_path.read_text())
    if profile_dir is None:
        shutil.rmtree(work, ignore_errors=True)
    return PredictorInfo(files=summary["files"], version=summary["version"], bytes=summary["bytes"],
                         block_freq=summary.get("block_freq"), summary=mf.PREDICTOR_SUMMARY,
                         config=summary["config"])
