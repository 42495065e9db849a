"""`leanstream chat`: interactive chat (like llama.cpp's chat) with a converted model.

    leanstream chat [DIR | MODEL_NAME] [--memory-budget 512MiB | --memory-limit 1GB] [--prompt "..."] [--system "..."] [-v]

Streams tokens as they are generated, keeps the conversation history, formats it with the
GGUF's chat template. Ctrl-C while the model answers stops that answer; Ctrl-C or Ctrl-D at the
prompt quits. Without DIR it uses the default model (converted by `leanstream convert`). Prints
the load time; with --verbose, after every answer, the prefill and decode rates and the engine's
counters per decoded token.
"""

from __future__ import annotations

import argparse
import sys
import time


def _decoded(llm, after_prefill: dict, end: dict) -> tuple[int, int]:
    """(passes, tokens) of the decode between two stats(): with speculation a pass emits one token
    and its accepted drafts; without it a pass (one token row) is one token."""
    a, b = after_prefill.get("speculative"), end.get("speculative")
    if not (a and b):
        passes = end["tokens"] - after_prefill["tokens"]
        return passes, passes
    passes = (b["passes"] - a["passes"]) + (b["plain_passes"] - a["plain_passes"])
    return passes, passes + b["accepted"] - a["accepted"]


def _per_token_stats(llm, after_prefill: dict, end: dict) -> str:
    """The engine's counters over the decode passes of one answer, per decoded token (with
    speculation a pass decodes several: its verify rows read the streamed blocks once)."""
    _, tokens = _decoded(llm, after_prefill, end)
    if tokens <= 0:
        return "no decode steps"
    # the counters every engine has (engine.COMMON_STATS: an expert is a block), and the
    # predictor's time where the engine has one
    d = {k: end[k] - after_prefill[k] for k in ("blocks_computed", "blocks_read", "bytes_read", "io_stall_ns",
                                                 "op_ns", "predictor_ns") if k in end}
    miss = d["blocks_read"] / d["blocks_computed"] if d["blocks_computed"] else 0.0
    predictor = f", predictor {d['predictor_ns'] / tokens / 1e6:.2f} ms" if "predictor_ns" in d else ""
    return (f"per decoded token: {d['blocks_computed'] / tokens:.0f} blocks computed, {d['blocks_read'] / tokens:.0f} "
            f"read from disk (miss ratio {miss:.2f}), {d['bytes_read'] / tokens / 1e6:.1f} MB read, FFN op "
            f"{d['op_ns'] / tokens / 1e6:.1f} ms (I/O stall {d['io_stall_ns'] / tokens / 1e6:.1f} ms{predictor}); "
            f"FFN cache {end['cache_bytes'] / 1e6:.0f} MB")


def _print_answer_stats(llm, t0: float, t_first: float | None, t_end: float, after_prefill: dict | None) -> None:
    from leanstream_ggml.llamacpp import context

    # times from the clock (llama.cpp's own prompt time read 0.00 s on a streamed model, and its
    # counters take a speculative verify pass of several rows for a prompt); the decoded tokens
    # from the draft's counters with speculation, else from llama.cpp's
    parts = []
    now = llm.stats() if after_prefill is not None else None
    spec = now is not None and "speculative" in now
    perf = context.perf_context(llm)
    if t_first is not None:
        parts.append((f"prefill {perf.n_p_eval} tokens" if not spec and perf.n_p_eval else "prefill")
                     + f" and first token {t_first - t0:.2f} s")
        passes, tokens = _decoded(llm, after_prefill, now) if spec else (perf.n_eval, perf.n_eval)
        if tokens > 0 and t_end > t_first:
            parts.append(f"decode {tokens} tokens" + (f" in {passes} passes" if spec else "")
                         + f" {t_end - t_first:.2f} s ({tokens / (t_end - t_first):.1f} tok/s)")
    parts.append(f"answer {t_end - t0:.2f} s")
    print("[" + " | ".join(parts) + "]", file=sys.stderr)
    if now is not None:
        print("[" + _per_token_stats(llm, after_prefill, now) + "]", file=sys.stderr)
        sp = now.get("speculative")
        if sp and sp["passes"]:
            print(f"[speculative: {sp['passes']} verify passes, {sp['tokens_per_pass']:.2f} tokens per pass, "
                  f"{sp['accepted']}/{sp['drafted']} drafted tokens accepted, draft {sp['draft_time_s']:.2f} s, "
                  f"verify {sp['verify_time_s']:.2f} s (since the model was loaded)]", file=sys.stderr)


def _stream_answer(llm, messages, args) -> str:
    out = []
    if args.verbose:
        from leanstream_ggml.llamacpp import context

        context.reset_perf(llm)
    t0, t_first, after_prefill = time.perf_counter(), None, None
    stream = llm.create_chat_completion(messages=messages, stream=True, max_tokens=args.max_tokens,
                                        temperature=args.temp, seed=args.seed)
    try:
        for chunk in stream:
            if t_first is None:
                # the first chunk comes after the prompt's prefill and before any decode step
                t_first = time.perf_counter()
                after_prefill = llm.stats() if args.verbose and llm.backend != "stock" else None
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
    if args.verbose:
        _print_answer_stats(llm, t0, t_first, time.perf_counter(), after_prefill)
    return "".join(out)


CHAT_CONTEXTS = (2048, 1024, 512)   # the chat's context without -c: the largest the limit holds


def _context_that_fits(model_dir, opts: dict) -> int:
    """The chat's n_ctx when -c is not given: 2048, or under --memory-limit the largest of
    CHAT_CONTEXTS whose memory plan leaves the engine its least cache and memplan.FIT_SPARE more
    (memplan.fit; where none does, the smallest), said on stderr when it is less than 2048; where
    none fits at all, 2048, and Llama refuses with the plan."""
    if not opts.get("memory_limit"):
        return CHAT_CONTEXTS[0]
    from leanstream_ggml.llama import memory_plan
    from leanstream_ggml.memplan import fit

    kw = {k: v for k, v in opts.items() if k != "memory_limit"}
    plan = fit(lambda s: memory_plan(model_dir, opts["memory_limit"], n_ctx=s.get("n_ctx", CHAT_CONTEXTS[0]), **kw),
               [{"n_ctx": n} for n in CHAT_CONTEXTS[1:]])
    if not plan.fits:
        return CHAT_CONTEXTS[0]
    if plan.n_ctx < CHAT_CONTEXTS[0]:
        print(f"context {plan.n_ctx} tokens: {CHAT_CONTEXTS[0]} does not fit the memory limit (-c to choose)", file=sys.stderr)
    return plan.n_ctx


def cmd_chat(args: argparse.Namespace) -> int:
    from leanstream_ggml.native._native import LeanstreamError
    from leanstream_ggml.llama import Llama
    from leanstream_ggml.model.manifest import ManifestError
    from leanstream_ggml.model.registry import DEFAULT_MODEL, converted_model_dir
    from leanstream_ggml.native.modes import is_sparse
    from leanstream_ggml.options import given

    try:
        model_dir = converted_model_dir(args.model or DEFAULT_MODEL, "chat")
        t0 = time.perf_counter()
        opts = given(args, "chat")
        n_ctx = args.n_ctx or _context_that_fits(model_dir, opts)
        llm = Llama(str(model_dir), n_ctx=n_ctx, n_threads=args.threads, n_threads_batch=args.threads,
                    seed=args.seed, verbose=args.log, **opts)
    except (ValueError, ManifestError, LeanstreamError, RuntimeError) as e:
        print(f"leanstream chat: {e}", file=sys.stderr)
        return 1
    if llm.backend == "stock":
        print(f"loaded {model_dir} in {time.perf_counter() - t0:.2f} s (in RAM: its source {llm.source_path} on "
              f"llama.cpp's own kernels, the faster here; --in-ram stream for the op)", file=sys.stderr)
    else:
        from leanstream_ggml.commands.info import fmt_bytes

        budget = llm.engine.memory_budget
        print(f"loaded {model_dir} in {time.perf_counter() - t0:.2f} s (mode {llm.mode}{f', sparsity {llm.sparsity:g}' if is_sparse(llm.mode) else ''}, FFN budget "
              f"{fmt_bytes(budget) if budget else 'all'})", file=sys.stderr)
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
    p.add_argument("model", nargs="?", help="model directory from `leanstream convert`, or a converted known model "
                                            "name (default: SmolLM2)")
    p.add_argument("-p", "--prompt", help="answer this one message and exit")
    p.add_argument("--system", help="system message")
    from leanstream_ggml.options import add_flags

    add_flags(p, "chat")
    p.add_argument("-c", "--n-ctx", type=int, default=None,
                   help="context size (default: 2048, or under --memory-limit the largest of 2048/1024/512 it holds)")
    p.add_argument("-t", "--threads", type=int, default=None, help="compute threads (default: llama-cpp-python's)")
    p.add_argument("-n", "--max-tokens", type=int, default=512, help="max tokens per answer (default: 512)")
    p.add_argument("--temp", type=float, default=0.7, help="sampling temperature (default: 0.7)")
    p.add_argument("--seed", type=int, default=-1 & 0xFFFFFFFF, help="RNG seed")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="after every answer: prefill/decode rates and the engine's counters per decoded token")
    p.add_argument("--log", action="store_true", help="llama.cpp's log on stderr")
    p.set_defaults(func=cmd_chat)
