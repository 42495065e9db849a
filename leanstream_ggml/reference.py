"""numpy reference of the native FFN op — the oracle of the tests.

Reads a layer's block file back into dense matrices (gguf-py dequantization) and computes

    y[t] = sum_n act(gate_n . x~[t]) * (up_n . x~[t]) * down_n

in float64, where x~ is x rounded the way ggml rounds a matmul's activations before its
quantized dot products (the weight type's vec_dot_type: Q8_0/Q8_1 per 32 values, Q8_K per 256,
F16), so the only differences left to the native op are f32 summation order.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from leanstream_ggml import blockfile


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
_Q8_0_DOT = {2, 3, 6, 7, 8}           # Q4_0, Q4_1(Q8_1), Q5_0, Q5_1(Q8_1), Q8_0: 32-value blocks
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
