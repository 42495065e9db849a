"""numpy references of the native code — the tests' oracles (file formats: docs/formats.md).

    import reference as ref       # from any test (tests/conftest.py puts tests/support/ on sys.path)

The FFN op: reads a layer's block file back into dense matrices (gguf-py dequantization) and computes

    y[t] = sum_n act(gate_n . x~[t]) * (up_n . x~[t]) * down_n

in float64, where x~ is x rounded the way ggml rounds a matmul's activations before its
quantized dot products (the weight type's vec_dot_type: Q8_0/Q8_1 per 32 values, Q8_K per 256,
F16), so the only differences left to the native op are f32 summation order.

The FFN kernels one by one (native/src/kernels.c): gate/up dot products of quantized rows with
the quantized activation (``dot_q4_K_q8_K``, ``dot_q4_1_q8_1``) and the down projection over
quantized columns (``axpy_columns``), in float64 from the blocks' bytes (numpy dtypes below).

The sketch scorer (``reference_scores``, native/src/sketch.c) and the predictor evaluator
(``reference_eval``, native/src/predictor.c), computed with numpy.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from leanstream_convert import blockfile
from leanstream_convert.train.export import unpack_signs


@dataclass
class LayerWeights:
    gate: np.ndarray   # [n_ff, n_embd] f32, row n = neuron n (original order)
    up: np.ndarray     # [n_ff, n_embd]
    down: np.ndarray   # [n_ff, n_embd] transposed down: row n = neuron n's column
    gate_type: int
    up_type: int
    down_type: int
    perm: np.ndarray   # [n_blocks * k] neuron id by slot, -1 = padding
    k: int


def load_layer(path) -> LayerWeights:
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import dequantize

    h = blockfile.read_header(path)
    perm = blockfile.read_perm(path, h)
    gate = np.zeros((h.n_ff, h.n_embd), np.float32)
    up = np.zeros_like(gate)
    down = np.zeros_like(gate)
    raw = np.fromfile(path, dtype=np.uint8, count=h.n_blocks * h.block_stride, offset=h.data_offset)
    raw = raw.reshape(h.n_blocks, h.block_stride)
    k, g, u, d = h.k, h.gate_row_bytes, h.up_row_bytes, h.down_col_bytes
    slots = perm.reshape(h.n_blocks, k)
    for j in range(k):
        real = slots[:, j] >= 0
        ids = slots[real, j]
        gate[ids] = dequantize(raw[real, j * g:(j + 1) * g], Q(h.gate_type)).reshape(-1, h.n_embd)
        up[ids] = dequantize(raw[real, k * g + j * u:k * g + (j + 1) * u], Q(h.up_type)).reshape(-1, h.n_embd)
        off = k * (g + u)
        down[ids] = dequantize(raw[real, off + j * d:off + (j + 1) * d], Q(h.down_type)).reshape(-1, h.n_embd)
    return LayerWeights(gate, up, down, h.gate_type, h.up_type, h.down_type, perm, k)


# ggml vec_dot_type of each weight type on x86 (ggml-cpu type traits)
_Q8_0_DOT = {2, 3, 6, 7, 8, 39}       # Q4_0, Q4_1(Q8_1), Q5_0, Q5_1(Q8_1), Q8_0, MXFP4: 32-value blocks
_Q8_K_DOT = {10, 11, 12, 13, 14}      # Q2_K..Q6_K
_F16, _F32 = 1, 0


def round_like_ggml(x: np.ndarray, weight_type: int) -> np.ndarray:
    """x [.., n] rounded as ggml's from_float(vec_dot_type) + vec_dot would see it."""
    x = np.asarray(x, np.float32)
    if weight_type == _F32:
        return x
    if weight_type == _F16:
        return x.astype(np.float16).astype(np.float32)
    if weight_type in _Q8_0_DOT:
        b = x.reshape(*x.shape[:-1], -1, 32)
        d = np.abs(b).max(-1, keepdims=True) / 127.0
        inv = np.divide(1.0, d, out=np.zeros_like(d), where=d > 0)
        q = np.round(b * inv)
        return (q * d.astype(np.float16).astype(np.float32)).reshape(x.shape)
    if weight_type in _Q8_K_DOT:
        b = x.reshape(*x.shape[:-1], -1, 256)
        idx = np.abs(b).argmax(-1)[..., None]
        mx = np.take_along_axis(b, idx, -1)
        iscale = np.divide(-127.0, mx, out=np.zeros_like(mx), where=mx != 0)
        q = np.minimum(np.round(b * iscale), 127)
        scale = np.divide(1.0, iscale, out=np.zeros_like(iscale), where=iscale != 0)
        return (q * scale).reshape(x.shape)
    raise ValueError(f"no reference rounding for ggml type {weight_type}")


def act(z: np.ndarray, activation: str = "silu") -> np.ndarray:
    if activation == "silu":
        return z / (1.0 + np.exp(-z))
    # GELU (tanh form) as ggml's CPU geglu evaluates it: a table over f16 inputs with f16
    # entries, 0 below -10 and the identity above 10
    zr = np.asarray(z, np.float32).astype(np.float16).astype(np.float64)
    c = np.sqrt(2.0 / np.pi)
    g = (0.5 * zr * (1.0 + np.tanh(c * zr * (1.0 + 0.044715 * zr * zr)))).astype(np.float16).astype(np.float64)
    return np.where(z <= -10.0, 0.0, np.where(z >= 10.0, z, g))


def ffn_reference(w: LayerWeights, x: np.ndarray, *, activation: str = "silu",
                  neurons: np.ndarray | None = None) -> np.ndarray:
    """y [n_tokens, n_embd] over all neurons, or only ``neurons`` (ids) if given."""
    x = np.atleast_2d(np.asarray(x, np.float32))
    xg = round_like_ggml(x, w.gate_type).astype(np.float64)
    xu = round_like_ggml(x, w.up_type).astype(np.float64)
    sel = slice(None) if neurons is None else np.asarray(neurons)
    h = act(xg @ w.gate[sel].T.astype(np.float64), activation) * (xu @ w.up[sel].T.astype(np.float64))
    return h @ w.down[sel].astype(np.float64)


# ---- the FFN kernels one by one ---------------------------------------------------------------------

# ggml's activation blocks (the vec_dot types of Q4_K and Q4_1 rows) and Q8_0 columns, as numpy dtypes
BLOCK_Q8_K = np.dtype([("d", "<f4"), ("qs", "i1", 256), ("bsums", "<i2", 16)])   # 292 bytes per 256 values
BLOCK_Q8_1 = np.dtype([("d", "<f2"), ("s", "<f2"), ("qs", "i1", 32)])             # s = d * sum(qs), in f16
BLOCK_Q8_0 = np.dtype([("d", "<f2"), ("qs", "i1", 32)])


def dequantize_blocks(raw: np.ndarray, type_name: str) -> np.ndarray:
    """f64 values of rows of ggml blocks (gguf-py's dequantization) [.., n_bytes] -> [.., n]."""
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import dequantize

    raw = np.ascontiguousarray(raw).view(np.uint8)
    return dequantize(raw, Q[type_name]).astype(np.float64)


def dot_q4_K_q8_K(w: np.ndarray, x: np.ndarray) -> np.ndarray:
    """w [n_rows, n/256 * 144] Q4_K rows (bytes), x [n_tokens, n/256] BLOCK_Q8_K -> [n_tokens, n_rows]:
    each row . x as ggml's vec_dot_q4_K_q8_K means it (x = d * qs; its bsums are the sums of qs)."""
    xv = (x["d"][..., None].astype(np.float64) * x["qs"]).reshape(len(x), -1)
    return xv @ dequantize_blocks(w, "Q4_K").T


def dot_q4_1_q8_1(w: np.ndarray, x: np.ndarray) -> np.ndarray:
    """w [n_rows, n/32 * 20] Q4_1 rows, x [n_tokens, n/32] BLOCK_Q8_1 -> [n_tokens, n_rows], as ggml's
    vec_dot_q4_1_q8_1: per block d * dx * sum(q4 q8) + m * s, with x's own f16 s for its sum."""
    b = np.ascontiguousarray(w).view(np.uint8).reshape(len(w), -1, 20)
    d = b[..., 0:2].copy().view("<f2")[..., 0].astype(np.float64)          # [rows, blocks]
    m = b[..., 2:4].copy().view("<f2")[..., 0].astype(np.float64)
    q = np.concatenate([b[..., 4:] & 15, b[..., 4:] >> 4], axis=-1).astype(np.float64)   # [rows, blocks, 32]
    xd, xs = x["d"].astype(np.float64), x["s"].astype(np.float64)          # [tokens, blocks]
    dots = np.einsum("rbi,tbi->trb", q, x["qs"].astype(np.float64))
    return (dots * d[None] * xd[:, None]).sum(-1) + xs @ m.T


def axpy_columns(acc: np.ndarray, h: np.ndarray, cols: np.ndarray, type_name: str) -> np.ndarray:
    """acc [T, n] + sum_j h[j, t] * column j for every row t: h [m, T], cols [m, column bytes] of
    type_name (Q8_0, Q6_K), in float64 (the down projection over transposed columns)."""
    return acc.astype(np.float64) + np.asarray(h, np.float64).T @ dequantize_blocks(cols, type_name)


# ---- the sketch scorer (LS2 rows) ------------------------------------------------------------------

def dequantize_rows(rows: np.ndarray, n_embd: int) -> np.ndarray:
    """f32 [n_rows, n_embd] values of LS2 rows."""
    rows = np.asarray(rows, np.uint8)
    d = rows[:, : n_embd // 16].copy().view("<f2").astype(np.float32)        # [r, G]
    c = rows[:, n_embd // 16:].reshape(len(rows), n_embd // 64, 16)
    u = np.stack([(c >> s) & 3 for s in (0, 2, 4, 6)], axis=2)              # [r, chunk, quarter, j]
    v = u.reshape(len(rows), n_embd // 32, 32).astype(np.float32) - 1.5
    return (v * d[:, :, None]).reshape(len(rows), n_embd)


def round_x(x: np.ndarray) -> np.ndarray:
    """x [n_embd] as the scorer sees it: int8 per group of 32 with scale max|x| / 127."""
    b = np.asarray(x, np.float32).reshape(-1, 32)
    d = np.abs(b).max(-1, keepdims=True) / np.float32(127.0)
    inv = np.divide(np.float32(1.0), d, out=np.zeros_like(d), where=d > 0)
    return (np.rint(b * inv) * d).reshape(-1)


def reference_scores(gate_rows: np.ndarray, up_rows: np.ndarray, weight: np.ndarray, x: np.ndarray,
                     k: int, act) -> np.ndarray:
    """Score of every block: sum over its k slots of |act(g~) * u~| * weight (float64), the numpy
    reference of the native scorer. act: the activation (``act``)."""
    n = np.asarray(x).size
    xr = round_x(x).astype(np.float64)
    g = dequantize_rows(gate_rows, n).astype(np.float64) @ xr
    u = dequantize_rows(up_rows, n).astype(np.float64) @ xr
    s = np.abs(act(g) * u) * np.asarray(weight, np.float64)
    return s.reshape(-1, k).sum(1)


# ---- the predictor evaluator ----------------------------------------------------------------------

def _quantize_act(v: np.ndarray):
    """Symmetric per-vector int8 of rows v [N, D] f32: v ~ q * s, s = max|v| / 127 (1 if 0),
    q rounded half to even (rintf in C)."""
    m = np.abs(v).max(axis=1)
    s = np.where(m > 0, m / np.float32(127.0), np.float32(1.0)).astype(np.float32)
    q = np.clip(np.rint(v / s[:, None]), -127, 127).astype(np.float32)
    return q, s


def reference_eval(params: dict, x: np.ndarray, *, tau: int, n_tables: int) -> np.ndarray:
    """The C evaluator's result, computed with numpy: x [N, n_embd] f32 -> priorities
    [N, n_blocks] f32, bit for bit. Integer dot products are done in float64 (exact: every
    partial sum < 2^53); every float step is one float32 IEEE operation in the C order."""
    f32 = np.float32
    x = np.asarray(x, dtype=f32).reshape(-1, params["in_mean"].shape[0])
    u = (x - params["in_mean"]) * params["in_scale"]
    q, s = _quantize_act(u)
    dot = (q.astype(np.float64) @ params["pca_q"].astype(np.float64).T).astype(f32)
    z = (dot * s[:, None]) * params["pca_scale"]
    qz, sz = _quantize_act(z)
    dot = (qz.astype(np.float64) @ params["hp1_q"].astype(np.float64).T).astype(f32)
    a = ((dot * sz[:, None]) * params["hp1_scale"]) + params["hp1_bias"]
    n_bits = params["tables"][0].shape[1] * 64
    n = x.shape[0]
    shifts = np.arange(tau)
    y = None
    for k, tab in enumerate(params["tables"]):
        if k > 0:
            dotk = y @ unpack_signs(params["hp"][k - 1], n_bits).T
            a = dotk - params["thr"][k - 1].astype(np.float64)      # >= 0 <=> popdot >= thr
        idx = ((a >= 0).reshape(n, -1, tau).astype(np.int64) << shifts).sum(-1)   # [N, M] bucket
        t = unpack_signs(tab, n_bits).reshape(n_tables, 1 << tau, n_bits)
        acc = sum(t[m][idx[:, m]] for m in range(n_tables))
        if k > 0:
            acc = acc + params.get("skip_weight", 1) * y
        y = np.where(acc >= 0, 1.0, -1.0)
    dot = (y @ unpack_signs(params["head_w"], n_bits).T).astype(f32)
    return (dot * params["head_a"]) + params["head_c"]


# ---- the MoE op (native/src/moe.c) ------------------------------------------------------------------

def load_expert(path, h: dict, e: int) -> tuple:
    """Router expert e of an expert file (h: its read_expert_header) dequantized with gguf-py:
    gate [n_ff_exp, n_embd], up [n_ff_exp, n_embd], down [n_embd, n_ff_exp] (ggml's row layout), f64;
    then its biases (gate, up, down; zeros without) and scales (gate, up, down; ones without)."""
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import dequantize

    from leanstream_ggml.model.formats import EXPERT_BIASES, EXPERT_SCALES, expert_extra_bytes

    s = int(np.flatnonzero(h["expert_of_slot"] == e)[0])
    raw = np.fromfile(path, dtype=np.uint8, count=h["expert_stride"], offset=h["data_offset"] + s * h["expert_stride"])
    n_embd, n_ff, flags = h["n_embd"], h["n_ff_exp"], h["flags"]
    x0 = expert_extra_bytes(flags, n_embd, n_ff)
    f32 = raw[:x0].view("<f4").astype(np.float64)
    biases = (f32[:n_ff], f32[n_ff:2 * n_ff], f32[2 * n_ff:2 * n_ff + n_embd]) if flags & EXPERT_BIASES else \
        (np.zeros(n_ff), np.zeros(n_ff), np.zeros(n_embd))
    at = 2 * n_ff + n_embd if flags & EXPERT_BIASES else 0
    scales = tuple(f32[at:at + 3]) if flags & EXPERT_SCALES else (1.0, 1.0, 1.0)
    g, u, d = h["gate_bytes"], h["up_bytes"], h["down_bytes"]
    raw = raw[x0:]
    gate = dequantize(raw[:g].reshape(n_ff, -1), Q(h["gate_type"])).reshape(n_ff, n_embd)
    up = dequantize(raw[g:g + u].reshape(n_ff, -1), Q(h["up_type"])).reshape(n_ff, n_embd)
    down = dequantize(raw[g + u:g + u + d].reshape(n_embd, -1), Q(h["down_type"])).reshape(n_embd, n_ff)
    return gate.astype(np.float64), up.astype(np.float64), down.astype(np.float64), biases, scales


def glu(g: np.ndarray, u: np.ndarray, activation: str = "silu", alpha: float = 1.702, limit: float = 7.0) -> np.ndarray:
    """A MoE expert's h from its gate and up values (build_moe_ffn's type_op)."""
    if activation == "swiglu_oai":
        x, y = np.minimum(g, limit), np.clip(u, -limit, limit)
        return x / (1.0 + np.exp(-alpha * x)) * (y + 1.0)
    if activation == "relu":
        return np.where(g > 0, g * u, 0.0)
    return act(g, activation) * u


def moe_reference(path, x: np.ndarray, ids: np.ndarray, weights: np.ndarray, *, activation: str = "silu",
                  weight_before: bool = False) -> np.ndarray:
    """y [n_tokens, n_embd] of llama.cpp's build_moe_ffn (separate gate and up experts) over an
    expert file: for each token t and k, e = ids[t, k], w = weights[t, k]:
    h = glu(s_g (gate_e . x~) + b_g, s_u (up_e . x~) + b_u), p_k = w (s_d (down_e . h~) + b_d),
    y_t = sum_k p_k (weight_before: x~ is w x_t rounded, and p_k is not multiplied by w); biases b
    and scales s the file's (zeros and ones without); x~ and h~ rounded as ggml rounds a matmul's
    activations (round_like_ggml: the weight type's vec_dot_type), in float64."""
    from leanstream_ggml.model.blockfile import read_expert_header

    h = read_expert_header(path)
    x = np.atleast_2d(np.asarray(x, np.float32))
    ids = np.asarray(ids).reshape(x.shape[0], -1)
    w32 = np.asarray(weights, np.float32).reshape(ids.shape)
    weights = w32.astype(np.float64)
    y = np.zeros((x.shape[0], h["n_embd"]))
    cache = {}
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            if e not in cache:
                cache[e] = load_expert(path, h, e)
            gate, up, down, (bg, bu, bd), (sg, su, sd) = cache[e]
            xt = (x[t] * w32[t, k]).astype(np.float32) if weight_before else x[t]
            xg = round_like_ggml(xt[None], h["gate_type"]).astype(np.float64)[0]
            xu = round_like_ggml(xt[None], h["up_type"]).astype(np.float64)[0]
            hv = glu(sg * (gate @ xg) + bg, su * (up @ xu) + bu, activation)
            hq = round_like_ggml(hv.astype(np.float32), h["down_type"]).astype(np.float64)
            p = sd * (down @ hq) + bd
            y[t] += p if weight_before else weights[t, k] * p
    return y
