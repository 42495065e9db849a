"""`leanstream convert` and `leanstream info`.

    leanstream convert [IN.gguf | MODEL_NAME] [OUT_DIR] [--k K] [--align N] [--force] [--quiet]
                       [--sketch ls2|none] [--predictors none|quick|full] [--order importance|coact|freq|none]
                       [--calibration FILE] [--calibrate] [--memory-limit BYTES]
    leanstream info [DIR]

Without IN, convert uses the default model (SmolLM2-135M-Instruct, fetched into the model cache);
without OUT_DIR it writes next to the model: ``<model cache>/<name>.lsm`` for a cached model,
``<IN without .gguf>.lsm`` for a path.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def _default_out(model: str | None, src: Path) -> Path:
    from leanstream_ggml import models

    if model is None or model in models.RECIPES:
        return models.lsm_dir(model or models.DEFAULT_MODEL)
    return src.with_suffix(".lsm") if src.suffix == ".gguf" else src.with_name(src.name + ".lsm")


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover


def _usable(d: Path) -> bool:
    """A model directory this version can run: manifest, checksums and block file headers."""
    from leanstream_ggml.manifest import ManifestError, load

    from . import blockfile

    try:
        m = load(d)
        m.check_checksums(d)
        for il in range(m.n_layer):
            blockfile.read_header(m.layer_path(d, il))
        return True
    except (ManifestError, ValueError, OSError):
        return False


def cmd_convert(args: argparse.Namespace) -> int:
    from leanstream_ggml import models

    from .convert_gguf import ConvertError
    from .stages import convert_model

    try:
        src = models.resolve(args.model)
    except (KeyError, RuntimeError) as e:
        print(f"leanstream convert: {e}", file=sys.stderr)
        return 1
    out = Path(args.out_dir) if args.out_dir else _default_out(args.model, src)
    if args.model is None and args.out_dir is None and not args.force:
        if _usable(out):
            print(f"{out}: the default model is already converted (use --force to convert it again)")
            return 0
        if out.exists():   # our own cache folder: written by another version, or damaged
            print(f"{out}: converted by another version of leanstream-ggml or damaged; converting it again",
                  file=sys.stderr)
            args.force = True
    if args.predictors not in (None, "none"):
        try:
            import torch  # noqa: F401
        except ImportError:
            print("leanstream convert: training the predictors needs torch (pip install 'leanstream-ggml[convert]'); "
                  "or convert with --predictors none for dense mode only", file=sys.stderr)
            return 1
    # the options given, and for the others convert_model's defaults (the only place they are set)
    given = {name: getattr(args, name) for name in _CONVERT_OPTIONS if getattr(args, name) is not None}
    if args.calibration is not None:
        err = _calibration_error(Path(args.calibration))
        if err:
            print(f"leanstream convert: --calibration {args.calibration}: {err}", file=sys.stderr)
            return 1
    t0 = time.perf_counter()
    try:
        m = convert_model(src, out, force=args.force, progress=not args.quiet, **given)
    except ConvertError as e:
        print(f"leanstream convert: {e}", file=sys.stderr)
        return 1
    t = m.totals
    sketch = ""
    if m.sketch:
        why = _dense_only(m)
        sketch = (f"; {m.sketch.type} sketch ({_fmt_bytes(m.sketch.bytes)}, "
                  + (f"dense mode only: {why})" if why else "leanstream mode ready)"))
    print(f"wrote {out} in {time.perf_counter() - t0:.1f} s: {m.n_layer} layers, "
          f"FFN {_fmt_bytes(t.ffn_bytes_on_disk)} on disk "
          f"(source {_fmt_bytes(t.ffn_bytes_source)}), padding waste {t.padding_waste:.1%}" + sketch
          + (f"; {m.n_layer} predictors ({_fmt_bytes(m.predictor.bytes)})" if m.predictor else ""))
    return 0


def _calibration_error(path: Path) -> str | None:
    """Why the user's calibration file cannot be used (checked before hours of work), or None."""
    from leanstream_ggml.texts import is_chat, read_chats

    if not path.is_file():
        return "no such file"
    try:
        if is_chat(path):
            read_chats(path)
        elif not path.read_text(encoding="utf-8").strip():
            return "the file is empty"
    except UnicodeDecodeError:
        return "not UTF-8 text"
    except ValueError as e:
        return str(e)
    return None


def cmd_info(args: argparse.Namespace) -> int:
    from leanstream_ggml.manifest import ManifestError, load

    from leanstream_ggml import models

    named = args.dir in models.RECIPES and not Path(args.dir).exists()
    d = Path(args.dir) if args.dir and not named else _default_out(args.dir, Path())
    try:
        m = load(d)
    except ManifestError as e:
        print(f"leanstream info: {e}", file=sys.stderr)
        return 1
    types = sorted({(e.gate_type, e.up_type, e.down_type) for e in m.layers})
    t = m.totals
    lines = [
        f"model directory  {d}",
        f"source           {m.source.filename} ({_fmt_bytes(m.source.size)}), sha256 {m.source.sha256}",
        f"architecture     {m.architecture}, activation {m.activation}",
        f"dims             n_layer {m.n_layer}, n_embd {m.n_embd}, n_ff {m.n_ff}",
        "FFN types        " + "; ".join(f"gate {g}, up {u}, down {dn} (columns)" for g, u, dn in types),
        f"blocks           k {m.block.k} neurons/block, align {m.block.align} B, "
        f"{m.layers[0].n_blocks} blocks/layer of {m.layers[0].block_stride} B "
        f"(payload {m.layers[0].block_payload} B)",
        f"FFN size         source {_fmt_bytes(t.ffn_bytes_source)}, on disk {_fmt_bytes(t.ffn_bytes_on_disk)}",
        f"padding          {_fmt_bytes(t.padding_bytes)} ({t.padding_waste:.1%} of block bytes)",
        f"base             {m.base.file} ({_fmt_bytes(m.base.size)})",
        f"sketch           {_sketch_line(m)}",
        f"predictor        {_predictor_line(m)}",
        f"sparse modes     {_sparse_line(m, d)}",
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


def _in_ram_line(m, d: Path) -> str:
    """What Llama(d) runs with no limit and no budget (leanstream_ggml/stock.py)."""
    try:
        from leanstream_ggml import params, stock

        src, why = stock.choose(d, m, params.llama_options({}), {})
    except (ImportError, OSError) as e:
        return f"unknown: {e}"
    return f"the source GGUF on llama.cpp's own kernels ({src})" if src else f"the op ({why})"


def runtime_line() -> str:
    """Which of llama.cpp's CPU backend variants this machine runs, and the FFN kernels' ISA."""
    try:
        from leanstream_ggml import _native
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
    line = f"{k.type}, {len(k.files)} layer files, {_fmt_bytes(k.bytes)} resident in leanstream mode"
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
    parts = [f"{p.format} v{p.version}", f"{len(p.files)} layer files", _fmt_bytes(p.bytes)]
    if p.config.get("n_hash_layers") is not None:
        parts.append(f"{p.config['n_hash_layers']} hashing layers")
    if p.block_freq:
        parts.append("calibration block frequencies")
    return ", ".join(parts)


def _dense_only(m) -> str | None:
    """Why no sparse mode runs on this model's architecture, or None."""
    from leanstream_ggml.manifest import DENSE_ONLY_ARCHS

    return DENSE_ONLY_ARCHS.get(m.architecture)


def _sparse_line(m, d: Path) -> str:
    from .convert_gguf import PREDICTOR_ARCHS

    ready, why = m.sparse_modes(d)
    if ready:
        return "ready: " + ", ".join(ready) + (f" ({why})" if why else "")
    if _dense_only(m):   # (no conversion changes that)
        return f"not ready: {why}; dense only"
    hint = f"leanstream convert {m.source.filename} {d} --force"
    if m.architecture not in PREDICTOR_ARCHS:
        hint += " (the sketch; predictor training supports " + ", ".join(PREDICTOR_ARCHS) + ")"
    return f"not ready: {why}; dense only. For leanstream mode convert the source again: {hint}"


# convert options passed to convert_model only when given (their parsers' default is None)
_CONVERT_OPTIONS = ("k", "align", "profile_dir", "sketch", "order", "calibrate", "predictors", "calibration",
                    "down_type", "memory_limit", "profile_tokens")


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "convert", help="convert a GGUF model into a LeanStream model directory",
        description="Rewrite a GGUF's FFN into neuron block files streamed with O_DIRECT (the rest of "
                    "the model goes to base.gguf) and write the 2-bit sketch leanstream mode selects "
                    "neurons with (no training: minutes); predictors are trained on request. Stages: read, write "
                    "(source order), activations (one pass of the plugin's dense engine over the calibration "
                    "text), order, reorder (in place), sketch, manifest; all within --memory-limit; each prints "
                    "its time and peak memory. Restartable: re-run the same command after an interruption and "
                    "it resumes where it stopped.")
    p.add_argument("model", nargs="?", default=None,
                   help="GGUF file or known model name (default: the cached SmolLM2-135M-Instruct)")
    p.add_argument("out_dir", nargs="?", default=None,
                   help="output directory (default: next to the model, with suffix .lsm)")
    p.add_argument("--k", type=int, default=None, help="neurons per block (default 1)")
    p.add_argument("--align", type=int, default=None,
                   help="block alignment in bytes (default: logical block size of the output device, >= 512)")
    p.add_argument("--down-type", choices=["auto", "q8_0", "q6_k", "q5_k"], default=None,
                   help="format of the ffn_down columns of a quantized model: q8_0 (8.5 bits), q6_k / q5_k "
                        "(6.56 / 5.5 bits, a larger requantization error; n_embd a multiple of 256); default "
                        "auto: q6_k where the source's ffn_down has at most 6.56 bits and n_embd allows, else "
                        "q8_0 (q6_k decodes faster under a memory limit, q8_0 in RAM)")
    p.add_argument("--force", action="store_true", help="overwrite an existing conversion in OUT_DIR")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--profile-dir", default=None,
                   help="keep the activation profile here (reused if complete, resumable; default: inside "
                        "OUT_DIR/.convert/, removed when the conversion is complete)")
    from leanstream_ggml.manifest import SKETCH_TYPES
    from .order import METHODS as ORDER_METHODS

    p.add_argument("--sketch", choices=[*SKETCH_TYPES, "none"], default=None,
                   help="write the 2-bit gate/up sketch leanstream mode selects from each layer's own input "
                        "with (default ls2; none: dense mode only, unless predictors are trained)")
    p.add_argument("--order", choices=list(ORDER_METHODS), default=None,
                   help="on-disk order of each layer's neurons: most important first (importance, default: "
                        "dense mode's resident prefix, speculative decoding's draft, is each layer's best neurons "
                        "and the rest streams in one piece), neurons the sparse modes read together placed "
                        "together (coact), most often read first (freq), or as in the GGUF (none)")
    p.add_argument("--calibrate", action=argparse.BooleanOptionalAction, default=None,
                   help="with the sketch: also measure what each sparsity costs on the bundled prose, code and chat "
                        "texts (the table quality='ppl+5%%' chooses from, by its worst domain; off by default: only "
                        "quality= needs it, and it takes longer than the rest of the conversion, ~5 minutes for a "
                        "1.5B model)")
    p.add_argument("--profile-tokens", type=int, default=None, metavar="N",
                   help="positions of the calibration text the model runs on to order the neurons and rank the "
                        "draft vocabulary (default 4096; the conversion's longest stage is proportional to it)")
    p.add_argument("--calibration", default=None, metavar="FILE",
                   help="your own text (or .jsonl chats, one {\"messages\": [...]} per line): profiled for the "
                        "neuron order and the draft vocabulary, calibrated as one more domain with --calibrate (and "
                        "it replaces the bundled prompts when training predictors)")
    p.add_argument("--predictors", choices=["none", "quick", "full"], default=None,
                   help="also profile the model and train layer-ahead predictors: the baselines' (oneshot, "
                        "dejavu+, powerinfer2) selection and leanstream's prefetch (default none; quick: "
                        "CI-sized; full: about an hour on 2 cores for a 1.5B model; their profile runs stock "
                        "llama.cpp on the source, outside --memory-limit)")
    from leanstream_ggml.options import add_flags

    add_flags(p, "convert", names=("memory_limit",))
    p.set_defaults(func=cmd_convert)

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
