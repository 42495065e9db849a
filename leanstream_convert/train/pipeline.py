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
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import numpy as np

from leanstream_ggml.model import manifest as mf

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
    from ..profile import ProfileData

    torch.set_num_threads(n_threads)
    cfg = cfg or H.HashConfig()
    data = ProfileData(profile_dir)
    model_dir = Path(model_dir)
    (model_dir / mf.PREDICTOR_DIR).mkdir(parents=True, exist_ok=True)
    layers = list(range(data.n_layer)) if layers is None else list(layers)
    n_train, ev = _split_rows(data.n_tokens, holdout, eval_tokens)
    job = _Job(data=data, down=DownWeights(gguf_path), model_dir=model_dir, cfg=cfg, blocks_of_layer=blocks_of_layer,
               n_train=n_train, ev=ev, curve_layers=_curve_layers(data.n_layer, eval_layers, layers),
               train_mlp=train_mlp, mlp_rank=mlp_rank, mlp_steps=mlp_steps, noise_sigma=noise_sigma, pool=pool)
    summary = {"format": "lspred", "version": FILE_VERSION, "files": [], "config": cfg.to_dict(),
               "n_tokens_profile": int(data.n_tokens), "n_tokens_train": int(n_train), "n_tokens_eval": int(len(ev)),
               "layers": {}, "curve_layers": job.curve_layers}
    tally = _Tally(summary=summary, rng=np.random.default_rng(cfg.seed))
    resume = _TrainResume(resume_dir, cfg, layers) if resume_dir is not None else None
    if resume is not None and tally.restore(resume):
        log(f"resuming predictor training: {len(tally.done)} of {len(layers)} layers done")
    prev = None   # state of layer il-1: arrays and one-shot predictions on the eval rows
    for il in layers:
        if il not in tally.done:
            prev = _train_layer(job, il, prev, tally, log)
            if resume is not None:
                tally.done.add(il)
                tally.save(resume, pred_m=prev["pred_m"])
                kill_point("train-layer")
        elif il + 1 in layers and il + 1 not in tally.done:   # the next layer trains from this one's state
            prev = _finished_layer_state(job, il, resume.pred_m())
    _write_block_freq(job, tally)
    tally.write_summary(job)
    return tally.summary


def _split_rows(n_tokens: int, holdout: float, eval_tokens: int):
    """The profile's first n_train rows train; at most eval_tokens of the rest, evenly spaced,
    evaluate. Returns (n_train, ev [n_eval] row indices)."""
    n_train = int(n_tokens * (1 - holdout))
    ev = np.arange(n_train, n_tokens)
    if len(ev) > eval_tokens:
        ev = ev[np.linspace(0, len(ev) - 1, eval_tokens).astype(int)]
    return n_train, ev


def _curve_layers(n_layer: int, eval_layers: int, layers: list) -> list:
    """The representative layers (evenly spaced over 1..n_layer-1) that get a refinement curve:
    those trained in this run together with the layer before them."""
    if n_layer <= 1:
        return []
    picked = sorted(set(int(round(v)) for v in np.linspace(1, n_layer - 1, min(eval_layers, n_layer - 1))))
    return [il for il in picked if il in layers and il - 1 in layers]


@dataclass
class _Job:
    """What every layer's training reads and nothing changes: the profile, the source's
    ffn_down, the split of the profile's rows (the first n_train train, ev evaluates) and the
    options of train_from_profile."""
    data: object              # ..profile.ProfileData
    down: DownWeights
    model_dir: Path
    cfg: object               # hashing.HashConfig
    blocks_of_layer: object
    n_train: int
    ev: np.ndarray            # [n_eval] held-out row indices
    curve_layers: list
    train_mlp: bool
    mlp_rank: int | None
    mlp_steps: int | None
    noise_sigma: float
    pool: int


@dataclass
class _Tally:
    """What the layers add up to (summary, file sizes, seconds, refinement curves, hot-set
    frequencies, finished layers) and the random generator: a resume saves and restores all of it."""
    summary: dict
    rng: np.random.Generator
    sizes: list = field(default_factory=list)         # bytes of each written predictor file
    mlp_sizes: list = field(default_factory=list)     # bytes of each MLP baseline
    t_train: float = 0.0                              # seconds, hashing predictors
    t_mlp: float = 0.0                                # seconds, MLP baselines
    curves: dict = field(default_factory=lambda: {"hashing": {}, "mlp": {}, "oracle": {}})
    block_freq: dict = field(default_factory=dict)    # il -> [n_blocks] f32
    done: set = field(default_factory=set)

    def restore(self, resume: _TrainResume) -> bool:
        """Take over the saved state; False (and nothing changed) when there is none for these arguments."""
        st = resume.load()
        if st is None:
            return False
        self.done = set(st["done"])
        self.rng.bit_generator.state = st["rng"]
        self.summary, self.sizes, self.mlp_sizes = st["summary"], st["sizes"], st["mlp_sizes"]
        self.t_train, self.t_mlp = st["t_train"], st["t_mlp"]
        self.curves = {name: {int(il): c for il, c in per.items()} for name, per in st["curves"].items()}
        self.block_freq = resume.block_freq()
        return True

    def save(self, resume: _TrainResume, pred_m) -> None:
        resume.save(done=sorted(self.done), rng=self.rng.bit_generator.state, summary=self.summary, sizes=self.sizes,
                    mlp_sizes=self.mlp_sizes, t_train=self.t_train, t_mlp=self.t_mlp, curves=self.curves,
                    block_freq=self.block_freq, pred_m=pred_m)

    def add_file(self, il: int, size: int, seconds: float) -> None:
        """Count layer il's written predictor file (its bytes and training seconds)."""
        self.t_train += seconds
        self.sizes.append(size)
        self.summary["files"] = sorted(set(self.summary["files"]) | {mf.PREDICTOR_FILE.format(il=il)},
                                       key=lambda f: int(f.split(".")[-2]))

    def write_summary(self, job: _Job) -> None:
        _write_summary(job.model_dir, self.summary, self.sizes, self.mlp_sizes, self.t_train, self.t_mlp,
                       job.train_mlp, self.curves)


def _train_layer(job: _Job, il: int, prev: dict | None, tally: _Tally, log) -> dict:
    """Layer il: train its predictor (and the MLP baseline), write its file, score both on the
    held-out rows, log it and write the summary so far. Returns the state layer il+1 trains from."""
    x_own = job.data.layer("x", il)
    a_own = job.data.layer("a", il)
    imp = M.block_importance(np.abs(a_own), *_perm(job.blocks_of_layer, il))   # [T, n_blocks]
    # calibration frequency of each block in the top half (powerinfer2's hot set)
    top = M.topk_mask(imp[:job.n_train], M.n_selected(imp.shape[1], 0.5))
    tally.block_freq[il] = top.mean(axis=0).astype(np.float32)
    inp = _layer_input(job, il, x_own, prev)
    rows, x_pool = _training_pool(job, inp, tally.rng)
    fit = _fit_hashing(job, il, rows, x_pool, imp, tally.rng)
    tally.add_file(il, fit.size, fit.seconds)
    mlp = None
    if job.train_mlp:
        t0 = time.time()
        mlp = _fit_mlp(job, il, rows, x_pool, imp, fit)
        tally.t_mlp += time.time() - t0
        tally.mlp_sizes.append(mlp.size_bytes())
    one, pred_h, pred_m = _evaluate(job, il, inp, imp, mlp, prev, tally.curves)
    entry = {"bytes": fit.size, "train_seconds": round(fit.seconds, 1),
             "loss_first": float(np.mean(fit.losses[:20])), "loss_last": float(np.mean(fit.losses[-20:])),
             "oneshot": one}
    tally.summary["layers"][str(il)] = entry
    h = one["hashing"]["0.8"]
    msg = f"layer {il}: {fit.size} B, {fit.seconds:.1f}s, loss {entry['loss_first']:.3f}->{entry['loss_last']:.3f}, " \
          f"s=0.8 recall hash {h['recall_top10']:.3f}"
    if "mlp" in one:
        msg += f" mlp {one['mlp']['0.8']['recall_top10']:.3f}"
    log(msg)
    tally.write_summary(job)   # partial, per layer
    # keep layer il's arrays for layer il+1: its input rows and its one-shot predictions
    return _layer_state(job, il, x_own, a_own, pred_h, pred_m)


def _layer_state(job: _Job, il: int, x_own, a_own, pred_h, pred_m) -> dict:
    """What layer il+1 trains and evaluates from: layer il's x [T, n_embd], a [T, n_ff], ffn_down
    (None for the last layer) and one-shot predictions on the eval rows [n_eval, n_blocks]."""
    return {"il": il, "x": x_own, "a": a_own, "w_down": job.down(il) if il + 1 < job.data.n_layer else None,
            "pred_h": pred_h, "pred_m": pred_m}


def _finished_layer_state(job: _Job, il: int, pred_m) -> dict:
    """_layer_state of a layer a resumed run skips: its arrays read again, its one-shot
    predictions from its written file, the MLP's (pred_m) from the resume state."""
    from .export import NativePredictor

    x_own = job.data.layer("x", il)
    with NativePredictor(predictor_path(job.model_dir, il)) as cpred:
        pred_h = cpred(_oneshot_input(job, il, x_own)[job.ev])
    return _layer_state(job, il, x_own, job.data.layer("a", il), pred_h, pred_m)


def _oneshot_input(job: _Job, il: int, x_own: np.ndarray) -> np.ndarray:
    """Layer il's one-shot input [T, n_embd]: x_{il-1}; layer 0: its own ffn_inp."""
    return x_own if il == 0 else job.data.layer("x", il - 1)


@dataclass
class _LayerInput:
    """What layer il's predictor reads: x [T, n_embd] its one-shot input and, when layer il-1 was
    trained just before in this run, what refines x (Eq. 2): layer il-1's signed swiglu
    a [T, n_ff], ffn_down w_down [n_embd, n_ff], block importance imp [T, B] and blocks (perm, k)."""
    x: np.ndarray
    a: np.ndarray | None = None
    w_down: np.ndarray | None = None
    imp: np.ndarray | None = None
    perm: np.ndarray | None = None
    k: int = 1

    def refined(self, rows, prio, s, j) -> np.ndarray:
        """refined_inputs of the rows [N]: prio [N, B] the order of layer il-1's blocks, s [N]
        sparsity, j [N] stages done -> [N, n_embd]."""
        return refined_inputs(self.x[rows], self.a[rows], self.w_down, prio, s, j, self.perm, self.k)


def _layer_input(job: _Job, il: int, x_own: np.ndarray, prev: dict | None) -> _LayerInput:
    if il == 0 or prev is None or prev["il"] != il - 1:
        return _LayerInput(_oneshot_input(job, il, x_own))
    perm, k = _perm(job.blocks_of_layer, il - 1)
    return _LayerInput(prev["x"], prev["a"], prev["w_down"], M.block_importance(np.abs(prev["a"]), perm, k), perm, k)


def _training_pool(job: _Job, inp: _LayerInput, rng):
    """The training set: every training row `pool` times, each copy with its own draw of a
    target sparsity s, a stage count j = 0..K and a noisy order of layer il-1's blocks (built
    once per layer: a fresh draw per batch cost most of the training time). Returns rows [N]
    (the profile row each input is scored against) and x_pool [N, n_embd] f32."""
    if inp.a is None:   # layer 0, or no previous layer in this run: nothing to refine from
        return np.arange(job.n_train), inp.x[:job.n_train]
    rows = np.tile(np.arange(job.n_train), job.pool)
    x_pool = np.empty((len(rows), job.data.n_embd), dtype=np.float32)
    for lo in range(0, len(rows), 2048):
        idx = rows[lo:lo + 2048]
        s = rng.choice(M.SPARSITIES, size=len(idx))
        j = rng.integers(0, K_STAGES + 1, size=len(idx))
        noisy = inp.imp[idx] * np.exp(job.noise_sigma * rng.standard_normal(inp.imp[idx].shape)).astype(np.float32)
        x_pool[lo:lo + len(idx)] = inp.refined(idx, noisy, s, j)
    return rows, x_pool


class _Fit(NamedTuple):
    """Layer il's trained and written hashing predictor, and what the MLP baseline shares with it."""
    mean: np.ndarray          # [n_embd] input standardisation
    scale: np.ndarray         # [n_embd]
    targets: tuple            # hashing.block_targets of the training rows
    losses: list
    size: int                 # bytes of the predictor file
    seconds: float            # training and writing


def _fit_hashing(job: _Job, il: int, rows, x_pool, imp, rng) -> _Fit:
    """Train layer il's hashing predictor on the pool and write its file."""
    import torch

    from . import hashing as H
    from .export import write_predictor

    cfg = job.cfg
    # input statistics and PCA over the training distribution (one-shot and refined rows)
    stat_idx = rng.choice(len(rows), size=min(len(rows), 4096), replace=False)
    x_stat = x_pool[stat_idx]
    mean, scale = H.input_stats(x_stat)
    pca = H.fit_pca((x_stat - mean) * scale, cfg.pca_frac)

    t0 = time.time()
    torch.manual_seed(cfg.seed + il)
    model = H.HashingPredictor(job.data.n_embd, imp.shape[1], cfg, mean, scale, pca)
    targets = H.block_targets(imp[:job.n_train])   # shared by the hashing model and the MLP
    losses = H.train_model(model, x_pool, imp[:job.n_train], steps=cfg.steps, batch=cfg.batch, lr=cfg.lr,
                           seed=cfg.seed + il, hashing=True, target_rows=rows, targets=targets)
    size = write_predictor(predictor_path(job.model_dir, il), model.export_params(), tau=cfg.tau,
                           n_tables=cfg.n_tables, layer=il)
    return _Fit(mean, scale, targets, losses, size, time.time() - t0)


def _fit_mlp(job: _Job, il: int, rows, x_pool, imp, fit: _Fit):
    """The DejaVu-style MLP baseline of layer il, on the same pool, targets and standardisation."""
    import torch

    from . import hashing as H
    from .mlp import MLPPredictor

    cfg = job.cfg
    torch.manual_seed(cfg.seed + il)
    rank = job.mlp_rank or max(64, job.data.n_embd // 4)
    mlp = MLPPredictor(job.data.n_embd, imp.shape[1], rank, fit.mean, fit.scale)
    H.train_model(mlp, x_pool, imp[:job.n_train], steps=job.mlp_steps or cfg.steps, batch=cfg.batch, lr=3e-3,
                  seed=cfg.seed + il, hashing=False, target_rows=rows, targets=fit.targets)
    return mlp


def _evaluate(job: _Job, il: int, inp: _LayerInput, imp, mlp, prev: dict | None, curves: dict):
    """Evaluation on held-out rows: one-shot (j = 0) for every layer, the hashing predictor through
    its written file and the C evaluator; on the curve layers also the refinement curve j = 0..K
    (into curves). Returns (one-shot scores, pred_h and pred_m [n_eval, n_blocks], pred_m None
    without the MLP)."""
    from .export import NativePredictor

    ev = job.ev
    with NativePredictor(predictor_path(job.model_dir, il)) as cpred:
        pred_h = cpred(inp.x[ev])
        one = {"hashing": M.summarize(pred_h, imp[ev])}
        pred_m = mlp.predict(inp.x[ev]) if mlp is not None else None
        if pred_m is not None:
            one["mlp"] = M.summarize(pred_m, imp[ev])
        one["oracle"] = M.summarize(imp[ev], imp[ev])
        # a static ranking (mean calibration importance, the same every token): what the
        # predictors add per token is their distance above this
        one["prior"] = M.summarize(np.broadcast_to(imp[:job.n_train].mean(0), imp[ev].shape), imp[ev])
        if il in job.curve_layers and inp.a is not None:
            for name, predict, prev_pred in (("hashing", cpred, prev["pred_h"]),
                                             ("mlp", mlp.predict if mlp is not None else None, prev.get("pred_m")),
                                             ("oracle", None, None)):
                if name != "mlp" or mlp is not None:
                    curves[name].setdefault(il, {}).update(_refinement_curve(predict, prev_pred, inp, imp, ev))
    return one, pred_h, pred_m


def _refinement_curve(predict, prev_pred, inp: _LayerInput, imp, ev) -> dict:
    """{"s/j": (top-10 % recall, importance ratio)} at every sparsity s and stage count j = 0..K:
    layer il predicted after j of K stages of layer il-1, whose blocks run in the order of
    prev_pred [n_eval, B] (the method's own one-shot prediction for layer il-1). predict None:
    the oracle (the true importance, whatever j)."""
    c = {}
    for s in M.SPARSITIES:
        for j in range(K_STAGES + 1):
            if predict is None:
                p = imp[ev]
            else:
                p = predict(inp.refined(ev, prev_pred, np.full(len(ev), s), np.full(len(ev), j)))
            c[f"{s:.1f}/{j}"] = (M.top_recall(p, imp[ev], s), M.importance_ratio(p, imp[ev], s))
    return c


def _write_block_freq(job: _Job, tally: _Tally) -> None:
    """Every layer's hot-set frequency as one [n_layer, n_blocks] f32 file, when all layers have
    one of the same length (it is named in the summary then)."""
    block_freq, n_layer = tally.block_freq, job.data.n_layer
    if block_freq and len(block_freq) == n_layer and len({len(v) for v in block_freq.values()}) == 1:
        with atomic_writer(job.model_dir / mf.PREDICTOR_BLOCK_FREQ, durable=False) as f:
            np.save(f, np.stack([block_freq[il] for il in range(n_layer)]))
        tally.summary["block_freq"] = mf.PREDICTOR_BLOCK_FREQ


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


def profile_for_training(src_gguf, work, *, quick: bool = False, calibration=None, profile_kwargs: dict | None = None,
                         n_threads: int = 2, progress: bool = True, log=print) -> dict:
    """The converter's profile stage: stock llama.cpp's FFN activations of the ORIGINAL GGUF on the
    calibration text, into ``work`` (leanstream_convert/profile.py; resumable by chunk). Returns what its
    marker keeps: the folder and the stage's seconds."""
    from ..profile import profile_model

    t0 = time.time()
    profile_model(src_gguf, work, calibration=calibration, n_threads=n_threads, progress=progress, log=log,
                  **_profile_settings(quick, calibration, profile_kwargs))
    return {"profile": str(work), "seconds": round(time.time() - t0, 1)}


def train_predictors(work, src_gguf, model_dir, *, state_dir, blocks_of_layer=None, quick: bool = False, cfg=None,
                     train_mlp: bool | None = None, n_threads: int = 2, profile_seconds: float = 0.0, log=print) -> dict:
    """The converter's train stage: one predictor per layer from the profile in ``work`` into
    `<model_dir>/predictor/` (resumable per layer: checkpoints in state_dir/train), and the summary
    beside them. blocks_of_layer[il]: None (identity, k = 1), a perm array (k = 1) or (perm, k) with
    block b = neurons perm[b*k:(b+1)*k], -1 = padding. quick: a setting CI can afford (SmolLM2: a
    couple of minutes on 2 cores). Returns what its marker keeps (the files)."""
    from . import hashing as H

    if cfg is None:
        cfg = H.HashConfig(**(QUICK_HASH if quick else FULL_HASH))
    elif isinstance(cfg, dict):
        cfg = H.HashConfig(**cfg)
    summary = train_from_profile(work, src_gguf, model_dir, blocks_of_layer=blocks_of_layer, cfg=cfg,
                                 train_mlp=(not quick) if train_mlp is None else train_mlp,
                                 eval_layers=2 if quick else 6, eval_tokens=128 if quick else 512,
                                 n_threads=n_threads, resume_dir=Path(state_dir) / "train", log=log)
    summary["profile_seconds"] = profile_seconds
    summary["input"] = ("layer il: residual x_{il-1} entering FFN il-1 (ffn_inp), optionally plus the partial "
                        "outputs of the first j of K stages of FFN il-1 (Eq. 2); layer 0: its own ffn_inp")
    summary["k_stages"] = K_STAGES
    atomic_write_json(Path(model_dir) / mf.PREDICTOR_SUMMARY, summary)
    return {"files": summary["files"]}


def predictor_info(model_dir):
    """The manifest's PredictorInfo of the predictors the train stage wrote (from their summary)."""
    from leanstream_ggml.model.manifest import PredictorInfo

    summary = json.loads((Path(model_dir) / mf.PREDICTOR_SUMMARY).read_text())
    return PredictorInfo(files=summary["files"], version=summary["version"], bytes=summary["bytes"],
                         block_freq=summary.get("block_freq"), summary=mf.PREDICTOR_SUMMARY,
                         config=summary["config"])
