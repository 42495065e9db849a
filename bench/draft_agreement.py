"""How often the speculative self draft's top token is the model's own, teacher-forced on held-out
prompts: what a conversion's neuron order (dense mode's resident set, the draft FFN) and draft
vocabulary are worth, independent of timing.

    python bench/draft_agreement.py DIR [DIR ...] --memory-limit 1000MB [--prompts 4] [--tokens 96]

For each model directory (interleaved, prompt by prompt) and each held-out prompt
(bench/data/speculative-heldout.json, code and chat) in the chat template: the model's greedy
answer, and at every position of it the draft's top-1 token (the engine's draft FFN over the
blocks resident under the budget the memory plan gives at --memory-limit, no cgroup: this is
about what is resident, not about speed; fraction 1: every resident block; the draft vocabulary)
given the same context. Agreement = share of positions where the two are equal. Prints one JSON
object: per directory and domain the agreement, and per prompt.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

PROMPTS = Path(__file__).resolve().parent / "data" / "speculative-heldout.json"


def agreement(llm, prompt: list[int], n_tokens: int) -> tuple[int, int, list[int]]:
    """(positions where the draft's top-1 equals the model's greedy token, positions, answer)."""
    import numpy as np

    eng = llm.engine
    llm.reset()
    llm.eval(prompt)
    same = total = 0
    answer = []
    for _ in range(n_tokens):
        y = int(np.argmax(llm.logits(-1)))       # the model's greedy next token
        p = llm.n_tokens - 1
        last = int(llm.input_ids[p])
        llm.rewind(p)                            # the draft decodes the last token again
        eng.set_draft(True, 1.0)
        try:
            llm.eval([last])
            ids, _ = eng.draft_top(0, 1)
        finally:
            eng.set_draft(False)
        same += int(len(ids) > 0 and int(ids[0]) == y)
        total += 1
        answer.append(y)
        if y == llm.token_eos():
            break
        llm.rewind(p)
        llm.eval([last, y])                      # rows exact: as the two tokens one by one
    return same, total, answer


def main(argv=None) -> int:
    from leanstream_ggml import Llama, memplan, options
    from leanstream_ggml.model import manifest
    from leanstream_ggml.native import params
    from speculative import chat_prompt_tokens

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dirs", nargs="+")
    options.add_flags(ap, options.SCRIPT, names=("memory_limit",), defaults={"memory_limit": "1000MB"})
    ap.add_argument("--prompts", type=int, default=4, help="per domain")
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    data = json.loads(PROMPTS.read_text())
    limit = params.size_bytes(args.memory_limit, "memory_limit")
    # every budget planned before any model is open (the plan counts this process as it is)
    budgets = {d: memplan.plan(d, manifest.load(d), limit, mode="dense", n_ctx=1024, n_outputs=2).budget
               for d in args.dirs}
    llms = {d: Llama(d, n_ctx=1024, n_threads=args.threads, n_threads_batch=args.threads, verbose=False,
                     speculative="self", memory_budget=b) for d, b in budgets.items()}
    out = {d: {"prompts": []} for d in args.dirs}
    try:
        for domain in ("code", "chat"):
            for text in data[domain][:args.prompts]:
                answers = {}
                for d, llm in llms.items():
                    s, t, ans = agreement(llm, chat_prompt_tokens(llm, text), args.tokens)
                    out[d]["prompts"].append({"domain": domain, "same": s, "positions": t, "agreement": s / t})
                    answers[d] = ans
                first = next(iter(answers.values()))
                for d in answers:   # the models' own answers (plain decoding) should match too
                    out[d]["prompts"][-1]["answer_equal_to_first_dir"] = answers[d] == first
    finally:
        for llm in llms.values():
            llm.close()
    for d, r in out.items():
        for domain in ("code", "chat"):
            ps = [p for p in r["prompts"] if p["domain"] == domain]
            r[domain] = round(sum(p["same"] for p in ps) / max(sum(p["positions"] for p in ps), 1), 4)
        r["all"] = round(sum(p["same"] for p in r["prompts"]) / max(sum(p["positions"] for p in r["prompts"]), 1), 4)
    print(json.dumps({"memory_limit": limit, "tokens": args.tokens, "results": out}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
