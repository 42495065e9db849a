"""`leanstream chat`: interactive chat (like llama.cpp's chat) with a converted model.

    leanstream chat [DIR] [--memory-budget 512MiB] [--prompt "..."] [--system "..."]

Streams tokens as they are generated, keeps the conversation history, formats it with the
GGUF's chat template. Ctrl-C while the model answers stops that answer; Ctrl-C or Ctrl-D at the
prompt quits. Without DIR it uses the default model (converted by `leanstream convert`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def default_model_dir() -> Path:
    """The default model's directory; it must have been converted (`leanstream convert`)."""
    from . import manifest, models

    out = models.models_dir() / f"{models.DEFAULT_MODEL}.lsm"
    try:
        manifest.load(out)
    except manifest.ManifestError:
        raise manifest.ManifestError(
            f"the default model ({models.DEFAULT_MODEL}) is not converted yet: run `leanstream convert` "
            f"first (it downloads and converts it in a few seconds)") from None
    return out


def _stream_answer(llm, messages, args) -> str:
    out = []
    stream = llm.create_chat_completion(messages=messages, stream=True, max_tokens=args.max_tokens,
                                        temperature=args.temp, seed=args.seed)
    try:
        for chunk in stream:
            delta = chunk["choices"][0]["delta"].get("content")
            if delta:
                out.append(delta)
                sys.stdout.write(delta)
                sys.stdout.flush()
    except KeyboardInterrupt:
        stream.close()
        sys.stdout.write(" [stopped]")
    sys.stdout.write("\n")
    sys.stdout.flush()
    return "".join(out)


def cmd_chat(args: argparse.Namespace) -> int:
    from ._native import LeanstreamError
    from .llama import Llama
    from .manifest import ManifestError

    try:
        model_dir = Path(args.model) if args.model else default_model_dir()
        llm = Llama(str(model_dir), memory_budget=args.memory_budget, mode=args.mode, sparsity=args.sparsity,
                    n_stages=args.n_stages, n_ctx=args.n_ctx,
                    n_threads=args.threads, n_threads_batch=args.threads, seed=args.seed, verbose=args.verbose)
    except (ValueError, ManifestError, LeanstreamError, RuntimeError) as e:
        print(f"leanstream chat: {e}", file=sys.stderr)
        return 1
    messages = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    try:
        if args.prompt is not None:
            messages.append({"role": "user", "content": args.prompt})
            _stream_answer(llm, messages, args)
            return 0
        print(f"chatting with {model_dir} — Ctrl-C stops an answer, Ctrl-D or Ctrl-C at the prompt quits",
              file=sys.stderr)
        while True:
            try:
                line = input("> ")
            except (EOFError, KeyboardInterrupt):
                print(file=sys.stderr)
                return 0
            if not line.strip():
                continue
            messages.append({"role": "user", "content": line})
            answer = _stream_answer(llm, messages, args)
            messages.append({"role": "assistant", "content": answer})
    except LeanstreamError as e:
        print(f"leanstream chat: {e}", file=sys.stderr)
        return 1
    finally:
        llm.close()


def register(sub) -> None:
    p = sub.add_parser("chat", help="chat with a converted model (streams, keeps history)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", help="model directory from `leanstream convert` (default: SmolLM2)")
    p.add_argument("-p", "--prompt", help="answer this one message and exit")
    p.add_argument("--system", help="system message")
    p.add_argument("--memory-budget", default=None, help="FFN weights kept in RAM, e.g. 512MiB (default: all)")
    from .params import MODES

    p.add_argument("--mode", default="dense", choices=MODES,
                   help="dense: every neuron (exact); the others compute only the predicted top blocks (default: dense)")
    p.add_argument("--sparsity", type=float, default=None, help="fraction of blocks skipped per token in sparse modes (default 0.5)")
    p.add_argument("--n-stages", type=int, default=None, help="compute stages (refinement points) per layer, leanstream mode (default 4)")
    p.add_argument("-c", "--n-ctx", type=int, default=2048, help="context size (default: 2048)")
    p.add_argument("-t", "--threads", type=int, default=None, help="compute threads (default: llama-cpp-python's)")
    p.add_argument("-n", "--max-tokens", type=int, default=512, help="max tokens per answer (default: 512)")
    p.add_argument("--temp", type=float, default=0.7, help="sampling temperature (default: 0.7)")
    p.add_argument("--seed", type=int, default=-1 & 0xFFFFFFFF, help="RNG seed")
    p.add_argument("-v", "--verbose", action="store_true", help="llama.cpp's log on stderr")
    p.set_defaults(func=cmd_chat)
