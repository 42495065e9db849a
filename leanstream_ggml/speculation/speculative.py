"""Exact speculative decoding whose drafts read nothing from disk (docs/design.md §21).

Under a memory limit a dense pass streams every non-resident FFN block once, and a pass of B
tokens costs little more than a pass of one. So the model guesses the next tokens with what RAM
holds, then one pass checks them all:

- the *self draft* is the same model whose FFN is made of the blocks resident now (dense mode
  pins each layer's most important blocks; ``ls_engine_set_draft``): attention, the output matrix
  and the KV cache are the model's own, so a draft step reads nothing and costs an in-RAM decode
  of what it computes. At each step it offers its top token, and its runner-up tokens where it is
  unsure;
- *prompt lookup* (llama-cpp-python's ``LlamaPromptLookupDecoding``'s proposal, and the size of
  the n-gram it matched) copies what followed the last n-gram earlier in the context: free when
  it has a proposal;
- both go into one token tree (tree.py), the controller (draft_control.py) keeps the nodes worth
  a row, and one ``llama_decode`` verifies them all; the walk samples the model's own token at
  each node with the user's sampler, so every emitted token is the one plain decoding gives
  (rows of a batch round as the token alone: llama_set_exact_rows and the FFN op's rows), at any
  temperature (the sampler draws in the same order).

``generate`` is llama_cpp.Llama.generate's loop with the drafts: the same prompt cache, sampler,
stopping criteria and tokens sent back.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from leanstream_ggml.llamacpp import _llama_cpp
from leanstream_ggml.speculation.draft_control import MAX_RANK, LookupMeter, Meter, q_bucket, select
from leanstream_ggml.native.engine import DRAFT_TOP
from leanstream_ggml.speculation.tree import Tree, kept_prefix, layout, walk

# the self draft's sizes the controller chooses from: shares of what RAM holds of each layer (its
# resident blocks are its most important ones); a smaller draft steps faster and agrees less
ARMS = (1.0, 0.75, 0.55)
DRAFT_VOCAB = 32768    # the draft's output projection: this many of the ranked tokens, + the context's
# after this many passes with a draft, one without: a one-token pass is what drafting is weighed
# against, and it is timed only when nothing is drafted
REMEASURE = 64
# the draft size is chosen again after a new observation, or every this many passes (choosing
# checks every size's table: a tenth of a millisecond, a hundredth of a small model's token)
CHOOSE_EVERY = 16


@dataclass
class SpecStats:
    passes: int = 0          # verify passes with a draft
    drafted: int = 0         # draft tokens verified (tree nodes)
    accepted: int = 0        # of them, accepted
    draft_steps: int = 0     # self-draft decode steps
    head_missing: int = 0    # draft steps the output head did not run for (Drafter._head_top)
    draft_s: float = 0.0
    verify_s: float = 0.0
    plain_passes: int = 0    # one-token passes (nothing drafted)
    redecoded: int = 0       # accepted tokens off the main path, decoded again in the next pass
    by_kind: dict = field(default_factory=lambda: {"self": 0, "ngram": 0, "both": 0})   # passes by tree source
    tokens_by_kind: dict = field(default_factory=lambda: {"self": 0, "ngram": 0, "both": 0})  # their tokens
    by_shape: dict = field(default_factory=dict)   # "depth x nodes" -> [passes, tokens]
    by_fraction: dict = field(default_factory=dict)  # the self draft's size -> [steps, seconds]
    by_ngram: dict = field(default_factory=dict)     # lookup's matched n-gram size -> [passes, hits]

    def as_dict(self) -> dict:
        d = {k: getattr(self, k) for k in ("passes", "drafted", "accepted", "draft_steps", "head_missing",
                                           "plain_passes", "redecoded")}
        d["draft_time_s"] = round(self.draft_s, 6)
        d["verify_time_s"] = round(self.verify_s, 6)
        d["draft_step_ms"] = round(1e3 * self.draft_s / self.draft_steps, 3) if self.draft_steps else 0.0
        d["tokens_per_pass"] = round((self.accepted + self.passes) / self.passes, 4) if self.passes else 0.0
        d["acceptance"] = round(self.accepted / self.drafted, 4) if self.drafted else 0.0
        d["proposals"] = dict(self.by_kind)
        d["tokens_by_kind"] = dict(self.tokens_by_kind)
        d["tokens_per_pass_by_kind"] = {k: round(self.tokens_by_kind[k] / n, 3) for k, n in self.by_kind.items() if n}
        d["by_shape"] = {k: {"passes": v[0], "tokens_per_pass": round(v[1] / v[0], 3)} for k, v in sorted(self.by_shape.items())}
        d["by_fraction"] = {k: {"steps": v[0], "step_ms": round(1e3 * v[1] / v[0], 3)} for k, v in sorted(self.by_fraction.items())}
        d["lookup_by_ngram"] = {str(k): {"passes": v[0], "first_hit": round(v[1] / v[0], 3)} for k, v in sorted(self.by_ngram.items())}
        return d


def lookup(ids: np.ndarray, max_n: int, k: int) -> tuple[int, np.ndarray]:
    """Prompt lookup as llama-cpp-python's ``LlamaPromptLookupDecoding`` does it (the longest
    n-gram ≤ max_n ending the context that occurs earlier with a token after it; its earliest
    occurrence; the k tokens after it), and the size of that n-gram: what the proposal's
    acceptance depends on, which the library does not return. Vectorized on the positions where
    the last token occurred (the library's sliding windows cost a visible share of a small
    model's token)."""
    n_in = len(ids)
    ends = np.flatnonzero(ids[:-1] == ids[-1]) if n_in > 1 else ids[:0]
    for n in range(min(max_n, n_in - 1), 0, -1):
        e = ends[ends >= n - 1]
        for j in range(1, n):
            e = e[ids[e - j] == ids[n_in - 1 - j]]
        if len(e):
            return n, ids[e[0] + 1:e[0] + 1 + k]
    return 0, ids[:0]


class Drafter:
    """Proposes the token tree of a pass: the self draft's steps (their top ``width`` tokens) and
    prompt lookup's proposal, cut by the controller (or by draft_stop's rule)."""

    def __init__(self, llm, kind: str, draft_max: int, stop: tuple[str, float], fraction: float | None = None,
                 width: int = 3, max_rows: int = 64, ngram_size: int = 3, vocab=None, resident: float = 1.0):
        self.llm, self.kind, self.k_max = llm, kind, draft_max
        self.width = max(1, min(width, MAX_RANK))
        self.max_rows = max_rows
        self.stop, self.p_min = stop     # params.draft_stop's (rule, X)
        # one meter per draft size (its acceptance and step time; the pass costs are shared): the
        # given fraction of each layer's blocks, or the controller's choice among ARMS x the share
        # of each layer RAM holds (``resident``), the size whose solved rate is best
        self.fractions = [fraction] if fraction is not None else [max(1e-3, a * resident) for a in ARMS]
        self.meters = [Meter(draft_max, max_rows) for _ in self.fractions]
        for m in self.meters[1:]:
            m.costs.t_pass = self.meters[0].costs.t_pass
        self.arm = 0
        self._since_plain = 0
        self._since_choice = CHOOSE_EVERY
        # prompt lookup's proposals cost nothing to make; their acceptance is measured apart, over
        # the last few dozen passes, for each size of the n-gram matched (a copy after one
        # matching token is taken about a sixth of the time, after three about three quarters)
        self.ngram_size = ngram_size
        self.lookup_meters = [LookupMeter() for _ in range(ngram_size)]
        self.stats = SpecStats()
        # what the output head kept at the last draft step read (_head_top), and whether its op
        # runs as the draft on this context at all
        self._last_top: tuple[bytes, bytes] | None = None
        self._head_runs = True
        # the draft's vocabulary: the converter's ranked tokens (None: every token) and every token
        # of the context (names and identifiers a prompt brings are what a ranking misses)
        self._vocab = None if vocab is None else set(int(t) for t in vocab)
        self._vocab_stale = False
        if self._vocab is not None:
            llm.engine.set_draft_vocab(sorted(self._vocab))

    def vocab(self):
        return None if self._vocab is None else np.array(sorted(self._vocab), dtype=np.int32)

    def see(self, tokens) -> None:
        """Tokens of the context: the draft's vocabulary takes those it lacks (the engine's copy
        before the next draft step: passing the vocabulary has a cost, and where drafting does
        not pay no step comes)."""
        if self._vocab is None:
            return
        new = {int(t) for t in tokens} - self._vocab
        if new:
            self._vocab |= new
            self._vocab_stale = True

    def _sync_vocab(self) -> None:
        if self._vocab_stale:
            self.llm.engine.set_draft_vocab(np.fromiter(self._vocab, dtype=np.int32))
            self._vocab_stale = False

    @property
    def meter(self) -> Meter:
        """The meter of the draft size in use."""
        return self.meters[self.arm]

    def _choose_arm(self) -> None:
        """The draft size whose solved policy is fastest (an untried one first: its step time is
        not known, so its rate is the best; its acceptance starts from the prior)."""
        if len(self.meters) == 1 or self.stop != "controller":
            return
        self._since_choice += 1
        if self._since_choice < CHOOSE_EVERY and not any(m.changed() for m in self.meters):
            return
        self._since_choice = 0
        rates = [(t.rate if t is not None else 0.0) for t in (m.table() for m in self.meters)]
        self.arm = int(np.argmax(rates))

    # -- the tree of one pass --------------------------------------------------------------------
    def propose(self, context: np.ndarray, n_past: int, pending: list[int]) -> Tree:
        """The tree to verify after ``pending`` (the tokens not yet decoded; ``context``: the
        tokens in the KV cache, n_past of them, then ``pending``)."""
        room = min(self.llm.n_ctx() - n_past - len(pending) - 1, self.max_rows - len(pending))
        # nothing drafted before a one-token pass is timed (what a draft is weighed against), and
        # once every REMEASURE passes to retime it
        if room <= 0 or not self.meter.ready() or self._since_plain >= REMEASURE:
            return Tree()
        tree, t_spent = Tree(), 0.0
        self._choose_arm()
        tree.arm = self.arm
        if self.kind in ("auto", "ngram"):
            tree.ngram, prop = lookup(context, self.ngram_size, min(self.k_max, room))
            for m in self.lookup_meters:
                m.tick()
            if tree.ngram:
                a, cur = self.lookup_meters[tree.ngram - 1].chance(), -1
                for t in prop:
                    cur = tree.add(cur, int(t), a, "ngram")
        if self.kind in ("auto", "self"):
            t_spent = self._self_draft(tree, n_past, pending, min(self.k_max, room))
        if len(tree) and self.stop == "controller":
            t_pass = self.meter.costs.pass_cost()
            keep = select(tree.reach(), [n.parent for n in tree.nodes], t_spent, t_pass, len(pending))
            tree = tree.subtree(keep)
        if len(tree) > room:
            reach = tree.reach()
            tree = tree.subtree(sorted(range(len(tree)), key=lambda i: (-reach[i], i))[:room])
        return tree

    def _more(self, i: int, p: float, q: float) -> bool:
        if i >= self.k_max:
            return False
        if self.stop == "fixed":
            return True
        if self.stop == "p_min":
            return i == 0 or q >= self.p_min
        t = self.meter.table()
        return t is not None and t.more(i, p)

    def _head_top(self) -> tuple[np.ndarray, np.ndarray] | None:
        """The draft step's best ``width`` tokens and their probabilities, as the output head's op
        (native/src/head.c) kept them for the step's one output row; None where that op did not
        run for this step. Where patches/0004 declines (LoRA adapters, an output scale) llama.cpp
        builds its own head, and draft_top then has no row (the last head op was a verify
        pass's, which keeps none: this context never runs it as the draft, so the self draft
        stops for good) or still holds the last step's, which no other step gives bit for bit
        (DRAFT_TOP tokens and probabilities: this pass's draft stops)."""
        ids, probs = self.llm.engine.draft_top(0, DRAFT_TOP)
        key = (ids.tobytes(), probs.tobytes())
        if len(ids) and key != self._last_top:
            self._last_top = key
            return ids[:self.width], probs[:self.width]
        self.stats.head_missing += 1
        if not len(ids):
            self._head_runs = False
        return None

    def _self_draft(self, tree: Tree, n_past: int, pending: list[int], k_cap: int) -> float:
        """The self draft's steps from the root down its top-1 chain, each step's top tokens added
        to the tree; returns the seconds spent."""
        if not self._head_runs or not self._more(0, 1.0, 1.0):
            return 0.0
        llm, eng = self.llm, self.llm.engine
        self._sync_vocab()
        cur, p, pos, toks, spent, depth = -1, 1.0, n_past, pending, 0.0, 0
        eng.set_draft(True, self.fractions[self.arm])
        try:
            while depth < k_cap:
                t0 = time.perf_counter()
                # the logits of the last row only: the head's row 0
                _llama_cpp.decode(llm, toks, range(pos, pos + len(toks)), all_rows=False)
                top = self._head_top()
                dt = time.perf_counter() - t0
                spent += dt
                if top is None:
                    break
                ids, probs = top
                self.stats.draft_steps += 1
                self.stats.draft_s += dt
                fs = self.stats.by_fraction.setdefault(f"{self.fractions[self.arm]:.3g}", [0, 0.0])
                fs[0] += 1
                fs[1] += dt
                self.meter.draft_timed(dt)
                b = q_bucket(float(probs[0]))
                self.meter.drafted(b)
                tree.steps.append(([int(t) for t in ids], b))
                depth += 1
                main = -1
                for r, t in enumerate(ids):
                    i = tree.add(cur, int(t), self.meter.chance(b, r), "self", rank=r, qbin=b)
                    main = i if r == 0 else main
                p *= self.meter.chance(b, 0)
                pos += len(toks)
                toks = [int(ids[0])]
                cur = main
                if toks[0] == llm.token_eos() or not self._more(depth, p, float(probs[0])):
                    break
        finally:
            eng.set_draft(False)
            _llama_cpp.kv_cache_trim(llm, n_past)
        return spent

    # -- after a verify pass -----------------------------------------------------------------------
    def learn(self, tree: Tree, accepted: list[int], emitted: list[int]) -> None:
        """What the walk showed: at every self-draft step it reached along the draft's chain, the
        rank of the model's token among the draft's top tokens; prompt lookup's tokens likewise."""
        main_ok, meter = True, self.meters[tree.arm]
        for d, (cands, b) in enumerate(tree.steps):
            if d >= len(emitted) or not main_ok:
                break
            tok = emitted[d]
            meter.observe(b, cands.index(tok) if tok in cands else -1)
            main_ok = d < len(accepted) and tree.nodes[accepted[d]].source == "self" and tree.nodes[accepted[d]].rank == 0
        cur = -1
        for d, tok in enumerate(emitted):
            kids = [i for i, n in enumerate(tree.nodes) if n.parent == cur and n.source == "ngram"]
            if not kids:
                break
            hit = any(tree.nodes[i].token == tok for i in kids)
            self.lookup_meters[tree.ngram - 1].observe(hit)
            if d == 0:
                ns = self.stats.by_ngram.setdefault(tree.ngram, [0, 0])
                ns[0] += 1
                ns[1] += int(hit)
            if not hit or d >= len(accepted):
                break
            cur = accepted[d]

    def timed(self, n_rows: int, seconds: float) -> None:
        self.stats.verify_s += seconds
        self.meters[0].pass_timed(n_rows, seconds)   # (the other meters share its pass costs)
        self._since_plain = 0 if n_rows == 1 else self._since_plain + 1


def generate(llm, drafter: Drafter, tokens, *, reset: bool = True, stopping_criteria=None, **sampling):
    """llama_cpp.Llama.generate's loop (the prompt cache, the sampler built from the same
    arguments, stopping criteria, tokens sent back) with every pass verifying a draft tree."""
    tokens = list(tokens)
    tokens, reset = _llama_cpp.reuse_prefix(llm, tokens, reset)
    if reset:
        llm.reset()
    smp = _llama_cpp.sampler(llm, **sampling)
    drafter.see(list(_llama_cpp.input_ids(llm)) + tokens)
    if tokens:
        pending, first = tokens, True
    else:                       # the whole prompt is cached and the last decode's logits are its
        pending, first = [], False
    while True:
        if pending:
            emitted, base, in_kv = _pass(llm, drafter, smp, pending, plain=first)
        else:
            emitted, base, in_kv = [smp(-1)], llm.n_tokens, 0
        first = False
        pending = emitted[in_kv:]
        drafter.see(emitted)
        for k, tok in enumerate(emitted):
            if stopping_criteria is not None and stopping_criteria(
                    np.append(_llama_cpp.input_ids(llm)[:base], np.array(emitted[:k], dtype=np.intc)),
                    _llama_cpp.last_scores(llm)):
                return
            sent = yield tok
            if sent is not None:   # the caller's tokens follow this one: what was sampled after it is void
                keep = min(in_kv, k + 1)
                llm.rewind(base + keep)
                pending = emitted[keep:k + 1] + list(sent)
                break
        # the last decode's logits are not the last token's now: a cached prompt is evaluated again
        _llama_cpp.logits_stale(llm)


def _pass(llm, drafter: Drafter, smp, pending: list[int], plain: bool) -> tuple[list[int], int, int]:
    """Decodes ``pending`` (with a draft tree unless ``plain``) and walks it. Returns the emitted
    tokens, where they start (the position after ``pending``) and how many of them the KV cache
    holds (the rest are decoded again with the next pass)."""
    n_past, m = llm.n_tokens, len(pending)
    tree = Tree() if plain else drafter.propose(np.append(_llama_cpp.input_ids(llm), np.array(pending, dtype=np.intc)),
                                                n_past, pending)
    st = drafter.stats
    t0 = time.perf_counter()
    # a pass's cost as the controller weighs it: the decode, the sampling and the KV cache's upkeep
    if not len(tree):
        llm.eval(pending)
        tok = smp(-1)
        if m == 1:
            st.plain_passes += 1
            drafter.timed(1, time.perf_counter() - t0)
        return [tok], n_past + m, 0
    lay = layout(tree)
    rows = pending + [tree.nodes[i].token for i in lay.order]
    pos = list(range(n_past, n_past + m)) + [n_past + m - 1 + tree.nodes[i].depth for i in lay.order]
    seqs = [list(range(lay.n_seq))] * m + lay.seqs
    _llama_cpp.tree_decode(llm, rows, pos, seqs, lay.n_seq)
    path: list[int] = []

    def sample(r: int) -> int:
        # the sampler sees the context up to this row (logits processors read input_ids)
        _llama_cpp.set_context(llm, n_past, pending + path)
        tok = smp(m - 1 if r < 0 else m + r)
        path.append(tok)
        return tok

    accepted, emitted = walk(tree, lay, sample)
    n_keep = kept_prefix(lay, accepted)
    _llama_cpp.tree_keep(llm, n_past, pending + emitted[:n_keep], lay.n_seq)
    drafter.timed(len(rows), time.perf_counter() - t0)
    drafter.learn(tree, accepted, emitted)
    st.passes += 1
    st.drafted += len(tree)
    st.accepted += len(accepted)
    st.redecoded += len(accepted) - n_keep
    kinds = {n.source for n in tree.nodes}
    kind = "both" if len(kinds) > 1 else kinds.pop()
    st.by_kind[kind] += 1
    st.tokens_by_kind[kind] += len(emitted)
    s = st.by_shape.setdefault(f"{max(n.depth for n in tree.nodes)}x{len(tree)}", [0, 0])
    s[0] += 1
    s[1] += len(emitted)
    return emitted, n_past + m, n_keep
