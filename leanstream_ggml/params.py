"""The engine's user-facing parameters, validated once, at the boundary.

``Llama``, ``leanstream chat``, ``bench`` and ``perplexity`` (and anything built on them, like a
server wrapping ``Llama``) pass what the user gave through ``engine_params``; each value is
checked and normalized here, and a bad one raises ``ParameterError`` naming the parameter. The
native engine re-checks its inputs (it never trusts its caller), but messages for people come
from here.

    engine_params(memory_budget="512MiB", mode="leanstream", sparsity=None, n_io_threads=8)
    -> {"memory_budget": 536870912, "mode": "leanstream", "sparsity": None, "n_io_threads": 8, ...}

A value left at None stays None: the engine's own default applies (ls_engine_params_init and the
mode table in native/src/mode.c are the one place defaults are written).
"""

from __future__ import annotations

import math
import numbers
import re

from ._native import MODES, lib

MAX_N_IO_THREADS = lib.LS_MAX_IO_THREADS
MAX_BYTES = (1 << 63) - 1       # the engine's budget is a u64; anything near it is a typo

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")
UNLIMITED = ("", "0", "none", "unlimited", "inf")


class ParameterError(ValueError):
    """A parameter value is out of range or of the wrong type; ``name`` says which."""

    def __init__(self, name: str, message: str):
        super().__init__(f"{name}: {message}")
        self.name = name


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _is_real(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def size_bytes(value, name: str = "memory_budget") -> int:
    """Bytes from 123, "512MiB" (2^20), "1.5GB" (10^9), "800 k"; None, 0, "none" and "unlimited"
    mean 0 (no limit). Fractions of a byte, negatives, NaN, infinities and sizes of 2^63 or
    more are refused."""
    if value is None:
        return 0
    if isinstance(value, bool):
        raise ParameterError(name, f"expected a size in bytes (an int or a string like '512MiB'), got {value!r}")
    if _is_int(value):
        n = int(value)
    elif _is_real(value):
        f = float(value)
        if not math.isfinite(f):
            raise ParameterError(name, f"must be a finite size in bytes, got {value!r}")
        if f != int(f):
            raise ParameterError(name, f"must be a whole number of bytes, got {value!r}")
        n = int(f)
    elif isinstance(value, str):
        s = value.strip().lower()
        if s in UNLIMITED:
            return 0
        m = _SIZE_RE.match(s)
        if not m or m.group(2) not in _UNITS:
            raise ParameterError(name, f"cannot parse {value!r} as a size (examples: 512MiB, 1.5GB, 800000000, "
                                       f"unlimited)")
        num, unit = m.group(1), _UNITS[m.group(2)]
        if "." in num:
            whole, frac = num.split(".")
            n_exact = int(whole or "0") * unit + int(frac or "0") * unit / 10 ** len(frac)
            n = int(n_exact)
            if n == 0:
                raise ParameterError(name, f"{value!r} is less than one byte (use 0 or 'unlimited' for no limit)")
        else:
            n = int(num) * unit
    else:
        raise ParameterError(name, f"expected a size in bytes (an int or a string like '512MiB'), "
                                   f"got {type(value).__name__}")
    if n < 0:
        raise ParameterError(name, f"must be >= 0, got {value!r}")
    if n > MAX_BYTES:
        raise ParameterError(name, f"{value!r} is too large (at most 2^63 - 1 bytes)")
    return n


def _int_in(value, name: str, lo: int, hi: int) -> int:
    if not _is_int(value):
        raise ParameterError(name, f"must be an integer in [{lo}, {hi}], got {value!r}")
    if not lo <= int(value) <= hi:
        raise ParameterError(name, f"must be in [{lo}, {hi}], got {value!r}")
    return int(value)


def _real_in(value, name: str, lo: float, hi: float, hi_open: bool) -> float:
    if not _is_real(value):
        raise ParameterError(name, f"must be a number, got {value!r}")
    f = float(value)
    if not (math.isfinite(f) and lo <= f and (f < hi if hi_open else f <= hi)):
        raise ParameterError(name, f"must be in [{lo:g}, {hi:g}{')' if hi_open else ']'}, got {value!r}")
    return f


def mode(value) -> str:
    if not isinstance(value, str) or value not in MODES:
        raise ParameterError("mode", f"unknown mode {value!r}; choose one of {', '.join(MODES)}")
    return value


_QUALITY_RE = re.compile(r"^\s*ppl\s*\+\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*%\s*$", re.IGNORECASE)


def quality(value) -> float:
    """"ppl+5%" -> 1.05: the largest perplexity ratio vs stock the user accepts."""
    m = _QUALITY_RE.match(value) if isinstance(value, str) else None
    if not m:
        raise ParameterError("quality", f"expected a perplexity budget like 'ppl+5%', got {value!r}")
    pct = float(m.group(1))
    if not 0.0 <= pct <= 1000.0:
        raise ParameterError("quality", f"the percentage must be in [0, 1000], got {value!r}")
    return 1.0 + pct / 100.0


def sparsity_for_quality(table: list[dict], max_ppl_ratio: float) -> float:
    """The largest sparsity whose calibrated perplexity ratio (the converter's table: [{"sparsity",
    "ppl_ratio"}]) stays within max_ppl_ratio, linearly interpolated between calibrated points
    (sparsity 0 costs nothing). The curve is made monotone first (calibration noise)."""
    pts = [(0.0, 1.0)] + sorted((float(q["sparsity"]), float(q["ppl_ratio"])) for q in table)
    mono, worst = [], 1.0
    for s, r in pts:
        worst = max(worst, r)
        mono.append((s, worst))
    best = 0.0
    for (s0, r0), (s1, r1) in zip(mono, mono[1:]):
        if r1 <= max_ppl_ratio:
            best = s1
            continue
        if r0 <= max_ppl_ratio < r1:
            best = s0 + (s1 - s0) * (max_ppl_ratio - r0) / (r1 - r0)
        break
    return round(best, 3)


_CONTROLLER_RE = re.compile(r"^(off|table|fixed:[0-9]{1,2})$")


def controller(value) -> str:
    """The streaming controller: None/"off", "table", or "fixed:K" (an action index)."""
    if value is None:
        return "off"
    if not isinstance(value, str) or not _CONTROLLER_RE.match(value.strip()):
        raise ParameterError("controller", f"expected 'off', 'table' or 'fixed:K', got {value!r}")
    return value.strip()


def engine_params(*, memory_budget=None, mode: str = "dense", sparsity=None, n_io_threads=None,
                  hot_fraction=None, candidate_ratio=None, bridge_bytes=None) -> dict:
    """Validated, normalized engine parameters (raises ParameterError naming the bad one).
    None stays None (the engine's default)."""
    def opt(value, check):
        return None if value is None else check(value)

    return {
        "memory_budget": size_bytes(memory_budget, "memory_budget"),
        "mode": globals()["mode"](mode),
        "sparsity": opt(sparsity, lambda v: _real_in(v, "sparsity", 0.0, 1.0, hi_open=True)),
        "n_io_threads": opt(n_io_threads, lambda v: _int_in(v, "n_io_threads", 1, MAX_N_IO_THREADS)),
        "hot_fraction": opt(hot_fraction, lambda v: _real_in(v, "hot_fraction", 0.0, 1.0, hi_open=False)),
        "candidate_ratio": opt(candidate_ratio, lambda v: _real_in(v, "candidate_ratio", 1.0, 1000.0, hi_open=False)),
        "bridge_bytes": opt(bridge_bytes, lambda v: _int_in(v, "bridge_bytes", 0, 1 << 30)),
    }


SPECULATIVE_KINDS = ("auto", "self", "ngram", "off")
DEFAULT_DRAFT_MAX = 8
MAX_DRAFT = 64


def speculative(value, mode: str) -> str:
    """speculative: None/"off" (the default until its speed bar is met; docs/design.md §21), "auto" (self draft + prompt lookup, the controller choosing how far; in
    a sparse mode "off"), "self", "ngram" or "off". Speculative decoding verifies with the dense
    pass, so a sparse mode refuses self and ngram (its answers would change)."""
    v = "off" if value is None else value
    if not isinstance(v, str) or v not in SPECULATIVE_KINDS:
        raise ParameterError("speculative", f"expected one of {', '.join(SPECULATIVE_KINDS)}, got {value!r}")
    if mode != "dense":
        if v in ("self", "ngram"):
            raise ParameterError("speculative", f"verifies drafts with the dense pass; mode={mode!r} decodes sparse "
                                                f"(use mode='dense', or speculative='off')")
        return "off"
    return v


def draft_max(value) -> int:
    return DEFAULT_DRAFT_MAX if value is None else _int_in(value, "draft_max", 1, MAX_DRAFT)


def draft_fraction(value) -> float:
    if value is None:
        return 1.0
    f = _real_in(value, "draft_fraction", 0.0, 1.0, hi_open=False)
    if f <= 0.0:
        raise ParameterError("draft_fraction", f"must be in (0, 1], got {value!r}")
    return f


def draft_stop(value) -> str | None:
    from .speculative import parse_stop

    try:
        parse_stop(value)
    except ValueError as e:
        raise ParameterError("draft_stop", str(e)) from None
    return value
