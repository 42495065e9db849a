"""The FFN kernels of a verify pass, one by one: gate/up of a neuron against T token rows
(ls_dot2_q4_K_rows, ls_dot2_q4_1_rows) and the down projection for T rows (ls_axpy_q6_K_rows,
ls_axpy_q8_0_rows), on random blocks, in every instruction set this build and CPU run (the scalar
C, the reference, included). Each is checked against the numpy reference
(tests/support/reference.py, within float tolerance) and, row by row, against the one-row kernel
the op uses for a single token, bit for bit: that is what makes a verify pass agree with plain
decoding (docs/design.md §21). The op as a whole is tested in test_kernels.py; every kernel against
the scalar one, from C: native/tests/test_kernels.c.

The kernels are the library's own (leanstream.h exports them for tests and benchmarks), with the
instruction set taken by ls_kernels_force.
"""

from __future__ import annotations

import numpy as np
import pytest

import reference as ref
from leanstream_ggml.native._native import ffi, lib

ROW_COUNTS = [1, 2, 3, 5, 8, 17, 64]


def isas_here() -> list[str]:
    """The instruction sets this build and CPU run, from the scalar C up."""
    here = [name for name in ("scalar", "avx2", "avx512", "avx512vnni", "neon", "neon+dotprod") if lib.ls_kernels_force(name.encode())]
    lib.ls_kernels_select()
    return here


@pytest.fixture(params=isas_here())
def k(request):
    """The library with its kernels of one instruction set."""
    assert lib.ls_kernels_force(request.param.encode()) == 1
    isa = ffi.string(lib.ls_kernel_isa()).decode()
    assert isa == request.param, f"a start-up check failed: {isa}"
    yield ffi, lib, isa
    lib.ls_kernels_select()


def _ptr(ffi, a: np.ndarray, ctype: str = "void *"):
    return ffi.cast(ctype, a.ctypes.data)


def _f16(rng, lo: float, hi: float, shape) -> np.ndarray:
    return rng.uniform(lo, hi, shape).astype(np.float16)


# ---- random blocks ----------------------------------------------------------------------------------

def q4_K_rows(rng, n_rows: int, n: int) -> np.ndarray:
    """[n_rows, n/256 * 144] bytes: f16 d and dmin, random 6-bit scales/mins and nibbles."""
    b = rng.integers(0, 256, (n_rows, n // 256, 144), dtype=np.uint8)
    b[..., 0:2] = _f16(rng, 1e-3, 2e-2, (n_rows, n // 256, 1)).view(np.uint8)
    b[..., 2:4] = _f16(rng, 1e-3, 2e-2, (n_rows, n // 256, 1)).view(np.uint8)
    return b.reshape(n_rows, -1)


def q4_1_rows(rng, n_rows: int, n: int) -> np.ndarray:
    b = rng.integers(0, 256, (n_rows, n // 32, 20), dtype=np.uint8)
    b[..., 0:2] = _f16(rng, 1e-3, 2e-2, (n_rows, n // 32, 1)).view(np.uint8)
    b[..., 2:4] = _f16(rng, -0.1, 0.1, (n_rows, n // 32, 1)).view(np.uint8)
    return b.reshape(n_rows, -1)


def q8_K_tokens(rng, T: int, n: int) -> np.ndarray:
    x = np.zeros((T, n // 256), ref.BLOCK_Q8_K)
    x["d"] = rng.uniform(1e-3, 3e-2, x.shape)
    x["qs"] = rng.integers(-127, 128, x["qs"].shape)
    x["bsums"] = x["qs"].reshape(T, n // 256, 16, 16).astype(np.int32).sum(-1)
    return x


def q8_1_tokens(rng, T: int, n: int) -> np.ndarray:
    x = np.zeros((T, n // 32), ref.BLOCK_Q8_1)
    x["d"] = _f16(rng, 1e-3, 3e-2, x.shape)
    x["qs"] = rng.integers(-127, 128, x["qs"].shape)
    x["s"] = (x["d"].astype(np.float32) * x["qs"].astype(np.float32).sum(-1)).astype(np.float16)
    return x


def q8_0_cols(rng, m: int, n: int) -> np.ndarray:
    c = np.zeros((m, n // 32), ref.BLOCK_Q8_0)
    c["d"] = _f16(rng, 1e-3, 2e-2, c.shape)
    c["qs"] = rng.integers(-127, 128, c["qs"].shape)
    return c.view(np.uint8).reshape(m, -1)


def q6_K_cols(rng, m: int, n: int) -> np.ndarray:
    b = rng.integers(0, 256, (m, n // 256, 210), dtype=np.uint8)
    b[..., 208:210] = _f16(rng, 1e-4, 2e-3, (m, n // 256, 1)).view(np.uint8)
    return b.reshape(m, -1)


# ---- gate and up against T rows -----------------------------------------------------------------------

DOT2 = {   # format: (its rows, the activation's blocks, the reference, the one-row and the rows kernel)
    "q4_K": (q4_K_rows, q8_K_tokens, ref.dot_q4_K_q8_K, "ls_dot2_q4_K", "ls_dot2_q4_K_rows"),
    "q4_1": (q4_1_rows, q8_1_tokens, ref.dot_q4_1_q8_1, "ls_dot2_q4_1", "ls_dot2_q4_1_rows"),
}


@pytest.mark.parametrize("fmt", DOT2)
@pytest.mark.parametrize("T", ROW_COUNTS)
def test_dot2_rows_equal_the_one_row_kernel_and_the_reference(k, fmt, T):
    ffi, lib, isa = k
    make_rows, make_x, reference, one_name, rows_name = DOT2[fmt]
    one, rows = getattr(lib, one_name), getattr(lib, rows_name)
    rng = np.random.default_rng(T)
    n = 1536                                     # Qwen2.5-1.5B's width: 6 super-blocks, 48 blocks of 32
    w = make_rows(rng, 2, n)                     # a neuron's gate and up rows
    x = make_x(rng, T, n)
    # the rows at a stride larger than a row (as in a buffer holding other data between them)
    xs = np.zeros((T, x.shape[1] + 3), x.dtype)
    xs[:, :x.shape[1]] = x
    pf = np.zeros(64 * 64, np.uint8)             # a prefetch stream: it must not change the result
    ra, rb = np.empty(T, np.float32), np.empty(T, np.float32)
    rows(n, _ptr(ffi, w[0]), _ptr(ffi, w[1]), _ptr(ffi, xs), xs.strides[0], T, _ptr(ffi, ra, "float *"),
         _ptr(ffi, rb, "float *"), _ptr(ffi, pf, "const uint8_t *"), 1)
    want = reference(w, x)                        # [T, 2]
    # f32 sums: the error bound scales with sum |w_i x_i| (the activation's values: d * qs)
    xv = np.abs((x["d"][..., None].astype(np.float64) * x["qs"]).reshape(T, -1))
    mag = xv @ np.abs(ref.dequantize_blocks(w, fmt.upper())).T
    assert np.all(np.abs(np.stack([ra, rb], 1) - want) <= 1e-5 * mag + 1e-6), isa
    for t in range(T):
        a1, b1 = ffi.new("float *"), ffi.new("float *")
        one(n, _ptr(ffi, w[0]), _ptr(ffi, w[1]), _ptr(ffi, x[t:t + 1]), a1, b1, ffi.NULL, 0)
        assert (np.float32(a1[0]).tobytes(), np.float32(b1[0]).tobytes()) == (ra[t].tobytes(), rb[t].tobytes()), \
            f"{isa} {fmt}: row {t} of {T} differs from the one-row kernel"


# ---- the down projection for T rows ------------------------------------------------------------------

AXPY = {   # column format: (its columns, the one-row and the rows kernel)
    "Q8_0": (q8_0_cols, "ls_axpy_q8_0_multi", "ls_axpy_q8_0_rows"),
    "Q6_K": (q6_K_cols, "ls_axpy_q6_K_multi", "ls_axpy_q6_K_rows"),
}


@pytest.mark.parametrize("fmt", AXPY)
@pytest.mark.parametrize("m", [1, 8, 11, 32])   # whole groups of 8 columns and the columns left over
@pytest.mark.parametrize("T", ROW_COUNTS + [70])  # 70: more rows than the kernels' factor table holds
def test_axpy_rows_equal_the_one_row_kernel_and_the_reference(k, fmt, m, T):
    ffi, lib, isa = k
    make_cols, one_name, rows_name = AXPY[fmt]
    one, rows = getattr(lib, one_name), getattr(lib, rows_name)
    rng = np.random.default_rng(1000 * m + T)
    n = 1536
    cols = make_cols(rng, m, n)
    h = rng.standard_normal((m, T)).astype(np.float32)   # [m][T], as the op stages it
    h[0, 0] = 0.0                                         # (a neuron that is off in one row)
    acc0 = rng.standard_normal((T, n)).astype(np.float32)  # a partial output already there
    cp = ffi.new("void *[]", [_ptr(ffi, c) for c in cols])
    acc = acc0.copy()
    rows(_ptr(ffi, acc, "float *"), _ptr(ffi, h, "float *"), cp, m, T, n)
    want = ref.axpy_columns(acc0, h, cols, fmt)
    mag = np.abs(acc0) + np.abs(h.astype(np.float64)).T @ np.abs(ref.dequantize_blocks(cols, fmt))
    assert np.all(np.abs(acc - want) <= 1e-6 * mag + 1e-7), isa
    for t in range(T):
        row, ht = acc0[t].copy(), np.ascontiguousarray(h[:, t])
        one(_ptr(ffi, row, "float *"), _ptr(ffi, ht, "float *"), cp, m, n)
        assert row.tobytes() == acc[t].tobytes(), f"{isa} {fmt}: row {t} of {T} differs from the one-row kernel"

