"""`leanstream convert` (`leanstream info`, which reads a converted directory, is the runtime's:
leanstream_ggml/commands/info.py).

    leanstream convert [IN.gguf | MODEL_NAME] [OUT_DIR] [--k K] [--align N] [--force] [--quiet]
                       [--sketch ls2|none] [--predictors none|quick|full] [--order importance|coact|freq|none]
                       [--calibration FILE] [--calibrate] [--memory-limit BYTES]

Without IN, convert uses the default model (SmolLM2-135M-Instruct, fetched into the model cache);
without OUT_DIR it writes next to the model: ``<model cache>/<name>.lsm`` for a cached model,
``<IN without .gguf>.lsm`` for a path.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
import time
from pathlib import Path


def _usable(d: Path) -> bool:
    """A model directory this version can run: manifest, checksums and block file headers."""
    from leanstream_ggml.model.manifest import ManifestError, load

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
    from leanstream_ggml.model import registry
    from leanstream_ggml.commands.info import dense_only, fmt_bytes

    from .convert_gguf import ConvertError
    from .stages import convert_model

    try:
        src = registry.resolve(args.model)
    except (KeyError, RuntimeError) as e:
        print(f"leanstream convert: {e}", file=sys.stderr)
        return 1
    out = Path(args.out_dir) if args.out_dir else registry.default_lsm_dir(args.model, src)
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
            print("leanstream convert: training the predictors needs torch (pip install 'leanstream-ggml[train]'); "
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
        why = dense_only(m)
        sketch = (f"; {m.sketch.type} sketch ({fmt_bytes(m.sketch.bytes)}, "
                  + (f"dense mode only: {why})" if why else "leanstream mode ready)"))
    print(f"wrote {out} in {time.perf_counter() - t0:.1f} s: {m.n_layer} layers, "
          f"FFN {fmt_bytes(t.ffn_bytes_on_disk)} on disk "
          f"(source {fmt_bytes(t.ffn_bytes_source)}), padding waste {t.padding_waste:.1%}" + sketch
          + (f"; {m.n_layer} predictors ({fmt_bytes(m.predictor.bytes)})" if m.predictor else ""))
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


# convert options passed to convert_model only when given (their parsers' default is None)
_CONVERT_OPTIONS = ("k", "align", "profile_dir", "sketch", "order", "calibrate", "predictors", "calibration",
                    "down_type", "memory_limit", "profile_tokens")


def register(subparsers) -> None:
    from .stages import stage_table

    p = subparsers.add_parser(
        "convert", help="convert a GGUF model into a LeanStream model directory",
        description=textwrap.fill(
                    "Rewrite a GGUF's FFN into neuron block files streamed with O_DIRECT (the rest of "
                    "the model goes to base.gguf) and write the 2-bit sketch leanstream mode selects "
                    "neurons with (no training: minutes); predictors are trained on request. All within "
                    "--memory-limit; each stage prints its time and peak memory. Restartable: re-run the same "
                    "command after an interruption and it resumes at the first unfinished stage.", 100)
                    + "\n\nstages (what each reads -> writes; some run only with the options that need them):\n"
                    + stage_table(),
        formatter_class=argparse.RawDescriptionHelpFormatter)
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
                   help="with --predictors: keep their profile (stock llama.cpp's FFN activations) here (reused if "
                        "complete, resumable; default: inside OUT_DIR/.convert/, removed when the conversion is complete)")
    from leanstream_ggml.model.manifest import SKETCH_TYPES
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
                        "draft vocabulary (default 4096 up to a 1.5B model's FFN, fewer in proportion above, at "
                        "least 1488: the conversion's longest stage is proportional to it)")
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
