"""Stacked learnable hashing predictor (paper §3.3), trained in torch.

One predictor per FFN layer maps a residual-stream vector x [n_embd] to a priority for every
neuron block of that layer [n_blocks]. Data flow (shapes per token):

    x [n_embd] f32
      -> u = (x - mean) * scale                         per-channel standardisation
      -> z = P u                 [n_pca]                PCA (paper: keep 30 % of the dims)
      -> hashing layer 1: M*tau hyperplanes on z  ->  M codes of tau bits
                           y1 = sign(sum_m T1[m][code_m])            [n_bits] in {-1,+1}
      -> hashing layer k>=2: M*tau binary hyperplanes on y (XNOR + popcount) -> M codes
                           yk = sign(sum_m Tk[m][code_m] + w_skip * y_{k-1})  (skip vote)
      -> head: prio_b = (y_L . w_b) * a_b + c_b     w_b in {-1,+1}^n_bits, one per block

Choices where the paper is silent (see also pipeline.py):

* Width. Read literally (W_k is d x tau), every layer emits one tau-bit code, so the whole
  stack could tell only 2^tau = 256 inputs apart -- fine for the paper's classification
  outputs, far too coarse for ranking thousands of blocks per token. Each layer therefore
  holds M parallel hash functions whose looked-up binary rows are summed and re-binarised
  (a majority vote); M = 1 is the paper's literal layer. Layers >= 2 add the previous layer's
  output as w_skip more votes, a residual path that keeps deep stacks trainable. Why it must be
  strong: a layer's code has only M*tau bits, so with one skip vote against M table votes the
  stack forgets its input at the first binary layer -- measured on SmolLM2 (layer 15, s = 0.5,
  L = 3, M = 4): importance ratio 0.658, exactly the static prior (the per-token part trained
  to zero), vs 0.683 with w_skip = M - 1 (the default: the tables flip a bit only when all M
  of them vote against it) and 0.687 for L = 1.
* Head. A table of block scores per hash bucket costs 2^tau * n_blocks entries per head
  (2.3 MB per layer at tau = 8 for Qwen2.5-1.5B's 8960 neurons, times the number of heads
  and layers) and only sees tau bits. The head here is instead the last hashing layer's own
  hyperplane step without the sign: one binary hyperplane per block evaluated with XNOR +
  popcount, whose integer pre-activation, calibrated by a per-block affine map (a_b, c_b), is
  the block's priority. It reads all n_bits of the final code and costs n_bits/8 + 8 bytes
  per block (40 bytes at n_bits = 256).
* Exactness. The float front end is quantised for inference (int8 PCA and hyperplanes with
  float scales, symmetric per-vector int8 activations) so that C and torch compute integer
  dot products, which are exact in any order, followed by the same few elementwise IEEE
  float operations. `HashingPredictor.infer()` is that inference path; the C evaluator
  (native/src/predictor.c) reproduces it bit for bit. Training uses the float front end.
* Training: straight-through sign (hardtanh gradient) for codes and binary weights; the
  lookup uses the paper's Eq. 12 relaxation -- softmax over Z[i].f with gumbel noise -- in the
  backward pass only (straight-through gumbel-softmax), so the forward pass is the exact
  hard lookup.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from .export import unpack_signs  # noqa: F401  (the format's bit order, defined once)


@dataclass
class HashConfig:
    n_hash_layers: int = 5   # L (paper default 5)
    tau: int = 8             # bits per hash code (paper default 8)
    n_bits: int = 256        # d, width of the binary tables (paper default 256), multiple of 64
    n_tables: int = 4        # M parallel hash functions per layer (paper's literal reading: 1)
    skip_weight: int = 0     # votes of y_{k-1} in layers >= 2; 0 = M - 1 (at least 1)
    pca_frac: float = 0.3    # fraction of input dims kept by PCA (paper: reduce by 70 %)
    # training
    steps: int = 600
    batch: int = 256
    lr: float = 0.05
    temp: float = 1.0        # gumbel-softmax temperature
    seed: int = 0

    def to_dict(self):
        return asdict(self)

    @property
    def skip(self) -> int:
        return self.skip_weight if self.skip_weight > 0 else max(1, self.n_tables - 1)


def ste_sign(a: torch.Tensor) -> torch.Tensor:
    """sign with sign(0) = +1 forward, hardtanh gradient backward."""
    hard = torch.where(a >= 0, 1.0, -1.0).to(a.dtype)
    soft = a.clamp(-1.0, 1.0)
    return soft + (hard - soft).detach()


def code_matrix(tau: int) -> torch.Tensor:
    """Z [2^tau, tau] in {-1,+1}: row i = phi^-1(i), bit j of i set <=> Z[i, j] = +1."""
    i = torch.arange(1 << tau)[:, None]
    j = torch.arange(tau)[None, :]
    return torch.where((i >> j) & 1 == 1, 1.0, -1.0)


def codes_of(a: torch.Tensor, tau: int) -> torch.Tensor:
    """a [N, M*tau] pre-activations -> bucket index [N, M] (bit j <=> a[.., m*tau+j] >= 0)."""
    n = a.shape[0]
    bits = (a >= 0).reshape(n, -1, tau).long()
    return (bits << torch.arange(tau)).sum(-1)


class HashLayer(nn.Module):
    def __init__(self, d_in: int, cfg: HashConfig, binary_input: bool):
        super().__init__()
        self.cfg, self.binary_input, self.d_in = cfg, binary_input, d_in
        mt, kk = cfg.n_tables * cfg.tau, 1 << cfg.tau
        self.w = nn.Parameter(torch.randn(mt, d_in) * (0.5 if binary_input else 1.0 / math.sqrt(d_in)))
        self.b = nn.Parameter(torch.zeros(mt))
        self.table = nn.Parameter(torch.randn(cfg.n_tables, kk, cfg.n_bits) * 0.3)
        self.register_buffer("Z", code_matrix(cfg.tau))

    def preact(self, x):
        if self.binary_input:
            return x @ ste_sign(self.w).t() + self.b
        return x @ self.w.t() + self.b

    def forward(self, x, temp: float, noise: bool):
        cfg = self.cfg
        a = self.preact(x)                                   # [N, M*tau]
        n = a.shape[0]
        idx = codes_of(a.detach(), cfg.tau)                  # [N, M] hard codes
        soft_scale = math.sqrt(self.d_in) if self.binary_input else 1.0
        f = torch.tanh(a / soft_scale).reshape(n, cfg.n_tables, cfg.tau)
        logits = f @ self.Z.t() * 2.0                        # Eq. 12: Z[i] . f   [N, M, 2^tau]
        if noise:
            logits = logits - torch.log(-torch.log(torch.rand_like(logits).clamp_(1e-9, 1.0)))
        p = F.softmax(logits / temp, dim=-1)
        onehot = F.one_hot(idx, 1 << cfg.tau).to(p.dtype)
        sel = p + (onehot - p).detach()                      # forward: exact lookup
        t = ste_sign(self.table)                             # [M, 2^tau, n_bits]
        out = torch.bmm(sel.transpose(0, 1), t).sum(0)       # [N, n_bits], sum over tables
        if self.binary_input:
            out = out + cfg.skip * x                         # skip votes
        votes = cfg.n_tables + (cfg.skip if self.binary_input else 0)
        return ste_sign(out / votes)


class HashingPredictor(nn.Module):
    """Stacked learnable hashing for one FFN layer: x [N, n_embd] -> block logits [N, n_blocks]."""

    def __init__(self, n_embd: int, n_blocks: int, cfg: HashConfig, mean: np.ndarray,
                 scale: np.ndarray, pca: np.ndarray):
        super().__init__()
        self.cfg, self.n_embd, self.n_blocks = cfg, n_embd, n_blocks
        assert cfg.n_bits % 64 == 0
        self.register_buffer("mean", torch.as_tensor(mean, dtype=torch.float32))
        self.register_buffer("scale", torch.as_tensor(scale, dtype=torch.float32))
        self.register_buffer("pca", torch.as_tensor(pca, dtype=torch.float32))   # [n_pca, n_embd]
        n_pca = self.pca.shape[0]
        layers = [HashLayer(n_pca, cfg, binary_input=False)]
        layers += [HashLayer(cfg.n_bits, cfg, binary_input=True) for _ in range(cfg.n_hash_layers - 1)]
        self.layers = nn.ModuleList(layers)
        self.head_w = nn.Parameter(torch.randn(n_blocks, cfg.n_bits) * 0.3)
        self.head_a = nn.Parameter(torch.full((n_blocks,), 1.0 / math.sqrt(cfg.n_bits)))
        self.head_c = nn.Parameter(torch.zeros(n_blocks))

    def init_prior(self, logit: np.ndarray):
        with torch.no_grad():
            self.head_c.copy_(torch.from_numpy(logit))
            self.head_a.fill_(0.02)

    def features(self, x):
        return ((x - self.mean) * self.scale) @ self.pca.t()

    def forward(self, x, temp: float = 1.0, noise: bool = False):
        y = self.features(x)
        for layer in self.layers:
            y = layer(y, temp, noise)
        dot = y @ ste_sign(self.head_w).t()
        return dot * self.head_a + self.head_c

    def clip_latent(self):
        with torch.no_grad():
            for layer in self.layers[1:]:
                layer.w.clamp_(-1, 1)
            for layer in self.layers:
                layer.table.clamp_(-1, 1)
            self.head_w.clamp_(-1, 1)

    # ---- inference path (quantised; what the C evaluator computes) -------------------------

    def export_params(self) -> dict:
        """The inference parameters as numpy arrays (see export.py for the file layout)."""
        cfg = self.cfg
        with torch.no_grad():
            pca_q, pca_s = quantize_rows(self.pca)
            l1 = self.layers[0]
            hp_q, hp_s = quantize_rows(l1.w)
            out = {
                "in_mean": self.mean.numpy().astype(np.float32),
                "in_scale": self.scale.numpy().astype(np.float32),
                "pca_q": pca_q, "pca_scale": pca_s,
                "hp1_q": hp_q, "hp1_scale": hp_s, "hp1_bias": l1.b.numpy().astype(np.float32),
                "tables": [pack_signs(layer.table.reshape(-1, cfg.n_bits)) for layer in self.layers],
                "hp": [pack_signs(layer.w) for layer in self.layers[1:]],
                # bit = (dot + b >= 0) <=> dot >= ceil(-b) for an integer dot
                "thr": [np.ceil(-layer.b.numpy().astype(np.float64)).clip(-(1 << 30), 1 << 30).astype(np.int32)
                        for layer in self.layers[1:]],
                "head_w": pack_signs(self.head_w),
                "head_a": self.head_a.numpy().astype(np.float32),
                "head_c": self.head_c.numpy().astype(np.float32),
                "skip_weight": cfg.skip,
            }
        return out

    def infer(self, x) -> torch.Tensor:
        """Inference mode: the exported, quantised predictor. Equals the C evaluator bit for bit."""
        return infer_params(self.export_params(), self.cfg.tau, self.cfg.n_tables, x)


# ---- quantisation and bit packing (shared with export.py through numpy arrays) --------------

def quantize_rows(w: torch.Tensor):
    """Symmetric int8 per row: w ~ q * s[row]."""
    w = w.detach().float()
    m = w.abs().amax(dim=1)
    s = torch.where(m > 0, m / 127.0, torch.ones_like(m))
    q = torch.round(w / s[:, None]).clamp(-127, 127).to(torch.int8)
    return q.numpy(), s.numpy().astype(np.float32)


def pack_signs(w: torch.Tensor) -> np.ndarray:
    """[R, n_bits] latent weights -> [R, n_bits/64] uint64, bit k set <=> w[:, k] >= 0."""
    bits = (w.detach().numpy() >= 0)
    r, n = bits.shape
    packed = np.packbits(bits.reshape(r, n // 8, 8)[:, :, ::-1], axis=-1).reshape(r, n // 8)
    return packed.view("<u8").copy()   # little-endian: byte j of word holds bits 8j..8j+7


def quantize_act(v: torch.Tensor):
    """Symmetric per-vector int8 (rows of v [N, D] f32): v ~ q * s, s = max|v| / 127 (1 if 0)."""
    m = v.abs().amax(dim=1)
    s = torch.where(m > 0, m / torch.tensor(127.0), torch.ones_like(m))
    q = torch.round(v / s[:, None]).clamp(-127, 127)
    return q, s


def infer_params(params: dict, tau: int, n_tables: int, x) -> torch.Tensor:
    """Exact inference from exported parameters: x [N, n_embd] f32 -> priorities [N, n_blocks] f32.

    Integer dot products are done in float64 (exact: every partial sum < 2^53); the float
    steps are single IEEE operations in a fixed order, matching predictor.c.
    """
    x = torch.as_tensor(np.asarray(x, dtype=np.float32))
    u = (x - torch.from_numpy(params["in_mean"])) * torch.from_numpy(params["in_scale"])
    q, s = quantize_act(u)
    dot = (q.double() @ torch.from_numpy(params["pca_q"]).double().t()).float()
    z = dot * s[:, None] * torch.from_numpy(params["pca_scale"])
    qz, sz = quantize_act(z)
    dot = (qz.double() @ torch.from_numpy(params["hp1_q"]).double().t()).float()
    a = dot * sz[:, None] * torch.from_numpy(params["hp1_scale"]) + torch.from_numpy(params["hp1_bias"])
    n_bits = params["tables"][0].shape[1] * 64
    y = None
    for k, tab in enumerate(params["tables"]):
        if k > 0:
            w = torch.from_numpy(unpack_signs(params["hp"][k - 1], n_bits))
            dot = y @ w.t()
            a = dot - torch.from_numpy(params["thr"][k - 1]).double()   # >= 0 <=> dot >= thr
        idx = codes_of(a, tau)                                           # [N, M]
        t = torch.from_numpy(unpack_signs(tab, n_bits)).reshape(n_tables, 1 << tau, n_bits)
        acc = sum(t[m][idx[:, m]] for m in range(n_tables))
        if k > 0:
            acc = acc + params.get("skip_weight", 1) * y
        y = torch.where(acc >= 0, 1.0, -1.0).double()
    dot = (y @ torch.from_numpy(unpack_signs(params["head_w"], n_bits)).t()).float()
    return dot * torch.from_numpy(params["head_a"]) + torch.from_numpy(params["head_c"])


# ---- training -------------------------------------------------------------------------------

def block_targets(imp: np.ndarray, sparsities=(0.5, 0.7, 0.8, 0.9)):
    """imp [N, B] block importance -> soft target [N, B] and weight [N, B] (float32 numpy).

    target = fraction of the target sparsities at which the block is in the true top set
    (ordinal: a block in the top 10 % scores 1, one outside the top 50 % scores 0); weight
    grows with the block's importance relative to the token's mean, so mistakes on blocks
    that carry the output cost more.
    """
    imp = np.asarray(imp, dtype=np.float32)
    b = imp.shape[1]
    srt = np.sort(imp, axis=1)                          # one sort for all thresholds
    t = np.zeros_like(imp)
    for s in sparsities:
        t += imp > srt[:, min(b - 1, int(s * b))][:, None]
    t /= len(sparsities)
    w = 1.0 + imp / np.maximum(imp.mean(axis=1, keepdims=True), 1e-12)
    return t, w


def weighted_bce(logits, target, weight):
    return (F.binary_cross_entropy_with_logits(logits, target, reduction="none") * weight).mean()


def train_model(model: nn.Module, x_train: np.ndarray, imp_train: np.ndarray, *, steps: int,
                batch: int, lr: float, seed: int = 0, hashing: bool = True, log=None,
                target_rows: np.ndarray | None = None, targets=None) -> list[float]:
    """Minimise importance-weighted BCE against ordinal top-set targets. Returns loss per step.

    target_rows[i], when given, is the row of imp_train that x_train[i] is scored against (several
    inputs -- one-shot and refined -- share one target); else row i. targets: block_targets(imp_train)
    when the caller already has them (several models trained on one layer).
    """
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    warm = max(1, steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda i: min(1.0, (i + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(i, steps) / max(steps, 1))))
    n = x_train.shape[0]
    tgt, wgt = targets if targets is not None else block_targets(imp_train)
    if hasattr(model, "init_prior"):
        # start from the per-block prior (a static hot set); training adds the per-token part
        prior = np.clip((tgt * wgt).sum(0) / wgt.sum(0), 1e-3, 1 - 1e-3)
        model.init_prior(np.log(prior / (1 - prior)).astype(np.float32))
    losses = []
    t0 = time.time()
    for step in range(steps):
        idx = torch.randint(0, n, (min(batch, n),), generator=g).numpy()
        xb = torch.as_tensor(np.asarray(x_train[idx], dtype=np.float32))
        ti = idx if target_rows is None else target_rows[idx]
        tb, wb = torch.from_numpy(tgt[ti]), torch.from_numpy(wgt[ti])
        if hashing:
            temp = 1.0
            logits = model(xb, temp=temp, noise=True)
        else:
            logits = model(xb)
        loss = weighted_bce(logits, tb, wb)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        if hashing:
            model.clip_latent()
        losses.append(float(loss.detach()))
        if log is not None and (step % 100 == 0 or step == steps - 1):
            log(f"step {step} loss {np.mean(losses[-50:]):.4f} ({time.time() - t0:.1f}s)")
    return losses


def fit_pca(u: np.ndarray, frac: float) -> np.ndarray:
    """u [N, D] standardised inputs -> P [p, D], p = ceil(frac*D): top principal directions,
    each scaled by 1/sigma so the projected features have unit variance."""
    d = u.shape[1]
    p = max(1, int(math.ceil(frac * d)))
    uc = u - u.mean(0, keepdims=True)
    cov = (uc.T.astype(np.float64) @ uc.astype(np.float64)) / max(1, len(u) - 1)
    evals, evecs = np.linalg.eigh(cov)
    order = np.argsort(evals)[::-1][:p]
    sig = np.sqrt(np.maximum(evals[order], 1e-12))
    return (evecs[:, order].T / sig[:, None]).astype(np.float32)


def input_stats(x: np.ndarray):
    """Per-channel mean and 1/std of the predictor inputs x [N, n_embd]."""
    x = x.astype(np.float64)
    mean = x.mean(0)
    std = x.std(0)
    scale = 1.0 / np.maximum(std, 1e-6 * max(std.max(), 1e-30))
    return mean.astype(np.float32), scale.astype(np.float32)
