"""compare's setups: their names, what each runs on, and what is decided before anything runs.

A setup is "stock" (llama-cpp-python on the GGUF given), "stock-<type>" (the same on a smaller
quantization of it), an engine mode ("dense", "leanstream", ...: the plugin on the converted
directory) or "MODE@ppl+N%" (a mode at the sparsity a quality preset chooses), and after a "+"
how it decodes: "+lookup" (stock: llama-cpp-python's prompt lookup decoding) or a plugin
speculative kind ("dense+off", "dense+self", ...; without one the library's default).
"""

from __future__ import annotations

from pathlib import Path

from leanstream_ggml.native import modes

from .. import measure
from ..systems import LOOKUP

STOCK = "stock"
DEFAULT_SETUPS = ("stock", "stock+lookup", "stock-q3_k_m", "stock-q3_k_m+lookup", "stock-q2_k", "dense", "dense+off",
                  "leanstream", "leanstream@ppl+5%")


# ---------------------------------------------------------------------------------------------
# setup names

def split_speculative(system: str) -> tuple[str, str | None]:
    """(the setup without its speculative suffix, the suffix or None): "stock+lookup" ->
    ("stock", "lookup"), "dense" -> ("dense", None); a quality preset's "+5%" is no suffix."""
    base, plus, kind = system.rpartition("+")
    return (base, kind) if plus and kind.isalpha() else (system, None)


def is_stock(system: str) -> bool:
    """stock llama-cpp-python: on the GGUF given ("stock") or a smaller quantization of it."""
    base = split_speculative(system)[0]
    return base == STOCK or base.startswith(STOCK + "-")


def stock_quant(system: str) -> str | None:
    """"stock-q3_k_m" -> "Q3_K_M"; None for the GGUF as given."""
    base = split_speculative(system)[0]
    return base[len(STOCK) + 1:].upper() if base.startswith(STOCK + "-") else None


def plugin_mode(system: str) -> tuple[str, str | None]:
    """A plugin setup's (engine mode, quality preset): "leanstream@ppl+5%" -> ("leanstream",
    "ppl+5%"), "dense+off" -> ("dense", None)."""
    mode, _, quality = split_speculative(system)[0].partition("@")
    return mode, quality or None


def speculative_kind(system: str) -> str:
    """How a setup decodes: stock "lookup" or "off"; a plugin setup the kind its Llama's
    ``.speculative`` is (params.speculative, the validator Llama sets it from: its suffix, else
    the library's default; "off" in the sparse modes)."""
    from leanstream_ggml.native import params

    kind = split_speculative(system)[1]
    if is_stock(system):
        return LOOKUP if kind == LOOKUP else "off"
    return params.speculative(kind, plugin_mode(system)[0])


def check_setups(systems: list[str]) -> list[str]:
    """The setups, each checked: a stock quantization llama.cpp's quantizer makes, an engine
    mode, a quality preset of leanstream mode, a speculative kind that setup decodes with (none
    but "off" and "auto" in a sparse mode). ParameterError naming the bad one."""
    from leanstream_ggml.native import params

    from ..quants import FTYPES

    for s in systems:
        kind = split_speculative(s)[1]
        if is_stock(s):
            q = stock_quant(s)
            if q is not None and q not in FTYPES:
                raise params.ParameterError("--setups", f"{s!r}: no quantization {q} (known: "
                                                        f"{', '.join(t.lower() for t in FTYPES)})")
            if kind not in (None, LOOKUP):
                raise params.ParameterError("--setups", f"{s!r}: stock decodes plainly or with +{LOOKUP} "
                                                        f"(llama-cpp-python's prompt lookup decoding)")
            continue
        mode, quality = plugin_mode(s)
        if mode not in modes.MODES:
            raise params.ParameterError("--setups", f"{s!r}: not stock[-TYPE] and no engine mode {mode!r} "
                                                    f"(modes: {', '.join(modes.MODES)})")
        if quality is not None:
            params.quality(quality)
            if mode != modes.QUALITY:
                raise params.ParameterError("--setups", f"{s!r}: a quality preset chooses {modes.QUALITY} mode's "
                                                        f"sparsity (write {modes.QUALITY}@{quality})")
        if kind is not None and kind not in params.SPECULATIVE_KINDS:
            raise params.ParameterError("--setups", f"{s!r}: no speculative kind {kind!r} (kinds: "
                                                    f"{', '.join(params.SPECULATIVE_KINDS)})")
        if kind in ("self", "ngram") and modes.is_sparse(mode):
            # params.speculative refuses them there too: the dense pass verifies, the answers would change
            raise params.ParameterError("--setups", f"{s!r}: {mode} mode decodes sparse and speculative decoding "
                                                    f"verifies with the dense pass (write {modes.DEFAULT}+{kind}, "
                                                    f"or {mode}+off)")
    return systems


def parse_systems(text: str) -> list[str]:
    """"stock, dense,,stock" -> ["stock", "dense"]: the names of a comma list, once each, in order."""
    from leanstream_ggml.native import params

    out = [s.strip() for s in text.split(",") if s.strip()]
    if not out:
        raise params.ParameterError("--setups", "no setups given")
    return list(dict.fromkeys(out))


def parse_limit(text: str | None) -> int | None:
    """--memory-limit: bytes ("1GB" = 10^9, "600MiB" = 600 * 2^20), None for none; a bad value is
    a ParameterError naming the option."""
    from leanstream_ggml.native import params
    from leanstream_ggml.options import BY_NAME

    return params.size_bytes(text, BY_NAME["memory_limit"].flag) or None


# ---------------------------------------------------------------------------------------------
# what a setup's run takes of its model directory

def selecting_budget(model_dir: Path) -> int:
    """A memory budget one block short of every layer's blocks plus the sketch: every op then
    selects through the sketch's candidates, as under any smaller budget (one that holds
    everything makes the layers resident, and they select from the exact scores of every block:
    better than any limited run)."""
    from leanstream_ggml.model import manifest

    m = manifest.load(model_dir)
    ffn = sum(e.n_blocks * e.block_stride for e in m.layers)
    return ffn + sketch_bytes(model_dir) - max(e.block_stride for e in m.layers)


def sketch_bytes(model_dir: Path) -> int:
    """What leanstream mode's resident sketch takes of a budget (0 without one)."""
    from leanstream_ggml.model import manifest

    m = manifest.load(model_dir)
    return m.sketch.bytes if m.sketch else 0


# ---------------------------------------------------------------------------------------------
# decided before running: which setups run, which fit

def stock_fit(file_bytes: int, source_bytes: int, limit: int | None, source: bool) -> tuple[bool, bool | None, str | None]:
    """(runs, fits, reason) of a stock setup: fits = its file alone is within the limit (None:
    no limit). The source quant always runs (the baseline: beyond the limit llama.cpp reads its
    mmap'd pages from disk again); a smaller quantization runs only if it is smaller than the
    source and fits."""
    fits = None if limit is None else file_bytes <= limit
    if source:
        return True, fits, None if fits is not False else "its file is larger than the limit: mmap'd pages re-read from disk"
    if file_bytes >= source_bytes:
        return False, fits, (f"its file ({measure.format_size(file_bytes)}) is not smaller than the source's "
                             f"({measure.format_size(source_bytes)})")
    if fits is False:
        return False, False, (f"does not fit: its file alone ({measure.format_size(file_bytes)}) is larger than "
                              f"the limit")
    return True, fits, None


def plugin_availability(model_dir: Path, system: str) -> tuple[str | None, float | None]:
    """(why the directory cannot run this plugin setup or None, the sparsity a quality preset
    chooses or None): the library's own checks (the mode and speculative kind this kind of model
    takes, the mode's files, as Llama settles them; the calibration table)."""
    from leanstream_ggml import backend
    from leanstream_ggml.model import manifest
    from leanstream_ggml.native import params

    m = manifest.load(model_dir)
    mode, quality = plugin_mode(system)
    given = {"mode": mode, "speculative": speculative_kind(system)}
    try:   # (a mixture-of-experts model: dense mode and prompt lookup only)
        backend.streamed(model_dir, m).settle(params.llama_options(given), given, model_dir)
    except ValueError as e:   # ModeFilesError included
        return str(e), None
    if quality is None:
        return None, None
    if not m.sketch or not m.sketch.quality:
        return (f"quality={quality!r} needs the converter's calibration (convert again with it: "
                f"`leanstream convert SRC {model_dir} --calibrate --force`)"), None
    return None, params.sparsity_for_quality(m.sketch.quality, params.quality(quality))


def plan_setups(systems: list[str], ggufs: dict, model_dir: Path | None, limit: int | None, enforced: bool,
                sparsity: float | None) -> dict:
    """What is decided before anything runs: for each setup its kind, its file, whether it fits
    the limit by its file alone (stock), whether the directory can run it (plugin), its sparsity
    (the one a quality preset chooses, or --sparsity) and its speculative kind. A plugin setup
    fits an ``enforced`` limit until its reserve says otherwise. status "planned", or "does not
    fit" / "not run" with the reason."""
    plans = {}
    source = ggufs[STOCK].stat().st_size
    for s in systems:
        if is_stock(s):
            size = ggufs[s].stat().st_size
            runs, fits, reason = stock_fit(size, source, limit, stock_quant(s) is None)
            status = "planned" if runs else ("does not fit" if fits is False else "not run")
            plans[s] = {"kind": "stock", "file": ggufs[s].name, "file_bytes": size, "fits": fits,
                        "status": status, "reason": reason, "speculative": speculative_kind(s)}
        else:
            reason, chosen = plugin_availability(model_dir, s)
            mode, quality = plugin_mode(s)
            plans[s] = {"kind": "plugin", "fits": True if enforced and limit is not None and not reason else None,
                        "sparsity": chosen if quality else sparsity if modes.is_sparse(mode) else None,
                        "status": "not run" if reason else "planned", "reason": reason,
                        "speculative": speculative_kind(s)}
    return plans
