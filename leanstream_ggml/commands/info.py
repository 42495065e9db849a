"""`leanstream info`: what a converted model directory holds, what runs it here, and (with
--memory-limit) the memory plan Llama would make for it. It reads the manifest and asks the
runtime; the converter is not imported.

    leanstream info [DIR | MODEL_NAME] [--memory-limit 1GB] [--mode dense] [-c N_CTX] [-b N_UBATCH]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from leanstream_ggml.model import registry
from leanstream_ggml.model.manifest import DENSE_ONLY_ARCHS, GGML_TYPE_IDS, PREDICTOR_ARCHS, ManifestError, load


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover


def cmd_info(args: argparse.Namespace) -> int:

    named = args.dir in registry.RECIPES and not Path(args.dir).exists()
    d = Path(args.dir) if args.dir and not named else registry.default_lsm_dir(args.dir, Path())
    try:
        m = load(d)
    except ManifestError as e:
        print(f"leanstream info: {e}", file=sys.stderr)
        return 1
    t = m.totals
    lines = [
        f"model directory  {d}",
        f"source           {m.source.path or m.source.filename} ({fmt_bytes(m.source.size)}), sha256 {m.source.sha256}",
        f"architecture     {m.architecture}, activation {m.activation}",
        f"dims             n_layer {m.n_layer}, n_embd {m.n_embd}, n_ff {m.n_ff}",
        *(_ffn_lines(m) if m.moe is None else _expert_lines(m)),
        f"FFN size         source {fmt_bytes(t.ffn_bytes_source)}, on disk {fmt_bytes(t.ffn_bytes_on_disk)}",
        f"padding          {fmt_bytes(t.padding_bytes)} ({t.padding_waste:.1%} of block bytes)",
        f"base             {m.base.file} ({fmt_bytes(m.base.size)})",
        f"sketch           {_sketch_line(m)}",
        f"predictor        {_predictor_line(m)}",
        f"sparse modes     {_sparse_line(m, d)}",
        *_speculative_lines(m, d),
    ]
    conv = m.extra.get("conversion")
    if isinstance(conv, dict) and conv.get("stages"):
        stages = ", ".join(f"{k} {v['seconds']:.0f} s / {v['peak_rss_bytes'] / 2**20:.0f} MiB"
                           for k, v in conv["stages"].items())
        lines.append(f"conversion       {conv.get('seconds', 0):.0f} s within {conv.get('memory_limit', 0) / 1e6:.0f} MB "
                     f"(stage: seconds / peak resident): {stages}")
    lines += _quality_lines(m)
    lines.append(f"runtime          {runtime_line()}")
    lines.append(f"in RAM           {_in_ram_line(m, d)}")
    if args.memory_limit is not None:
        try:
            lines += [""] + _plan_lines(m, d, args)
        except ValueError as e:   # ParameterError, MemoryPlanError: the plan says why
            print("\n".join(lines), flush=True)
            print(f"leanstream info: {e}", file=sys.stderr)
            return 1
    print("\n".join(lines))
    return 0


def _ffn_lines(m) -> list[str]:
    types = sorted({(e.gate_type, e.up_type, e.down_type) for e in m.layers})
    return ["FFN types        " + "; ".join(f"gate {g}, up {u}, down {dn} (columns)" for g, u, dn in types),
            f"blocks           k {m.block.k} neurons/block, align {m.block.align} B, "
            f"{m.layers[0].n_blocks} blocks/layer of {m.layers[0].block_stride} B "
            f"(payload {m.layers[0].block_payload} B)"]


def _expert_lines(m) -> list[str]:
    """A mixture-of-experts model's routed experts (docs/design.md §24)."""
    moe = m.moe
    names = {v: k for k, v in GGML_TYPE_IDS.items()}
    layers = moe.expert_layers()
    types = sorted({tuple(names.get(x, str(x)) for x in (e.gate_type, e.up_type, e.down_type)) for _, e in layers})
    strides = sorted({e.expert_stride for _, e in layers})
    extras = [w for bit, w in ((1, "biases"), (2, "scales")) if any(e.flags & bit for _, e in layers)]
    others = m.n_layer - len(layers) - len(moe.mtp_layers)
    return [f"experts          {moe.n_expert} per layer, {moe.n_expert_used} routed per token, {moe.n_ff_exp} neurons "
            f"each, {moe.activation}" + (" of router-weighted inputs" if moe.weight_before else "")
            + (f", per-expert {' and '.join(extras)}" if extras else "")
            + (", a shared expert (in base.gguf)" if moe.shared_expert else ""),
            f"MoE layers       {len(layers)} of {m.n_layer}" + (f"; {others} dense (their FFN in base.gguf)" if others else "")
            + (f"; MTP layers {moe.mtp_layers} left out (llama.cpp skips them)" if moe.mtp_layers else ""),
            "expert types     " + "; ".join(f"gate {g}, up {u}, down {dn}" for g, u, dn in types),
            f"expert files     one per layer, an expert is one read of {'/'.join(fmt_bytes(s) for s in strides)}, "
            f"align {m.block.align} B",
            "expert cache     " + ("the least used expert gives way (expert_cache='lfu'), counted from the routing "
                                   "pass's frequencies (experts/routing_freq.npy) on" if moe.routing_freq else
                                   "the least used expert gives way (expert_cache='lfu'), counted from the first token "
                                   "(no routing pass: converted by an older leanstream; convert again for its prior)")
            + "; the next layer's experts read early only with read_ahead='auto' or 'on'"]


def _plan_lines(m, d: Path, args) -> list[str]:
    """The memory plan (leanstream_ggml/memplan.py) that Llama(d, memory_limit=...) makes with the
    same defaults (dense mode, speculation on), or in --mode."""
    from leanstream_ggml.llama import memory_plan

    plan = memory_plan(d, args.memory_limit, n_ctx=args.n_ctx,
                       **({"n_batch": args.batch_size, "n_ubatch": args.batch_size} if args.batch_size else {}),
                       **({"mode": args.mode} if args.mode else {}))
    out = plan.lines()
    plan.check()
    return out


def _speculative_lines(m, d: Path) -> list[str]:
    """Why Llama(d) drafts nothing (a recurrent state: leanstream_ggml/speculation/recurrent.py,
    from base.gguf's header), or no line."""
    try:
        from leanstream_ggml.speculation import recurrent

        why = recurrent.reason(m.resolve(d, m.base.file), m.architecture)
    except (ImportError, OSError, ValueError):
        return []
    return [f"speculative      {why}"] if why else []


def _in_ram_line(m, d: Path) -> str:
    """What Llama(d) runs with no limit and no budget (leanstream_ggml/llamacpp/stock.py)."""
    try:
        from leanstream_ggml.native import params
        from leanstream_ggml.llamacpp import stock

        src, why = stock.choose(d, m, params.llama_options({}), {})
    except (ImportError, OSError) as e:
        return f"unknown: {e}"
    return f"the source GGUF on llama.cpp's own kernels ({src})" if src else f"the op ({why})"


def runtime_line() -> str:
    """Which of llama.cpp's CPU backend variants this machine runs, and the FFN kernels' ISA."""
    try:
        from leanstream_ggml.native import _native
    except ImportError as e:
        return f"not loadable: {e}"
    lib, ffi = _native.lib, _native.ffi
    lib.ls_kernels_select()
    variant = ffi.string(lib.ls_ggml_cpu_variant()).decode()
    have = ", ".join(_native.cpu_variants()) or "none"
    return (f"ggml CPU backend {variant} (this build has {have}), "
            f"FFN kernels {ffi.string(lib.ls_kernel_isa()).decode()}")


def _sketch_line(m) -> str:
    k = m.sketch
    if not k:
        return "none"
    line = f"{k.type}, {len(k.files)} layer files, {fmt_bytes(k.bytes)} resident in leanstream mode"
    return line + ("" if k.quality else "; not calibrated (quality= needs `leanstream convert --calibrate`; "
                                         "sparsity= works without)")


def _quality_lines(m) -> list[str]:
    """The calibration table: perplexity ratio vs dense (and top-1 agreement) per sparsity and
    domain; quality= reads the worst column."""
    q = m.sketch.quality if m.sketch else []
    if not q:
        return []
    names = list(q[0].get("domains") or {"prose": None})
    out = ["quality          ppl x vs dense (= stock within its rounding; top-1 agreement) of leanstream decode, per domain;",
           "                 quality=\"ppl+N%\" takes the largest sparsity whose worst domain is within N %",
           "                 " + f"{'s':>4}  " + "".join(f"{n:>16}" for n in names) + f"{'worst':>10}"]
    for row in q:
        doms = row.get("domains") or {"prose": row}
        cells = "".join(f"{doms[n]['ppl_ratio']:>8.3f} ({doms[n].get('agreement', float('nan')):.3f})"
                        if n in doms else f"{'-':>16}" for n in names)
        out.append("                 " + f"{row['sparsity']:>4g}  " + cells + f"{row['ppl_ratio']:>10.3f}")
    return out


def _predictor_line(m) -> str:
    p = m.predictor
    if not p:
        return "none"
    parts = [f"{p.format} v{p.version}", f"{len(p.files)} layer files", fmt_bytes(p.bytes)]
    if p.config.get("n_hash_layers") is not None:
        parts.append(f"{p.config['n_hash_layers']} hashing layers")
    if p.block_freq:
        parts.append("calibration block frequencies")
    return ", ".join(parts)


def dense_only(m) -> str | None:
    """Why no sparse mode runs on this model's architecture, or None."""
    return DENSE_ONLY_ARCHS.get(m.architecture)


def _sparse_line(m, d: Path) -> str:
    if m.moe is not None:
        return "none: a mixture-of-experts model reads only its router's experts (dense mode, exact)"
    ready, why = m.sparse_modes(d)
    if ready:
        return "ready: " + ", ".join(ready) + (f" ({why})" if why else "")
    if dense_only(m):   # (no conversion changes that)
        return f"not ready: {why}; dense only"
    hint = f"leanstream convert {m.source.filename} {d} --force"
    if m.architecture not in PREDICTOR_ARCHS:
        hint += " (the sketch; predictor training supports " + ", ".join(PREDICTOR_ARCHS) + ")"
    return f"not ready: {why}; dense only. For leanstream mode convert the source again: {hint}"


def register(subparsers) -> None:
    q = subparsers.add_parser("info", help="describe a converted model directory",
                              description="Print what a model directory's manifest.json says.")
    q.add_argument("dir", nargs="?", default=None,
                   help="model directory, or a known model name (default: the default model's)")
    from leanstream_ggml.options import add_flags

    add_flags(q, "info")    # --memory-limit, --mode
    q.add_argument("-c", "--n-ctx", type=int, default=512, help="the plan's n_ctx (default 512)")
    q.add_argument("-b", "--batch-size", type=int, default=None,
                   help="the plan's n_ubatch (default: Llama's, 512, or less where the limit needs it)")
    q.set_defaults(func=cmd_info)
