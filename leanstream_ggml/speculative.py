"""Exact speculative decoding whose drafts read nothing from disk (docs/design.md §21).

Under a memory limit a dense pass streams every non-resident FFN block once, and a pass of B
tokens costs little more than a pass of one. So the model guesses the next tokens with what RAM
holds, then one pass checks them all:

- the *self draft* is the same model whose FFN is made of the blocks resident now (dense mode
  pins each layer's best-ranked blocks; ``ls_engine_set_draft``): attention, the output matrix
  and the KV cache are the model's own, so a draft step reads nothing and costs an in-RAM
  decode of what it computes;
- *prompt lookup* (llama-cpp-python's ``LlamaPromptLookupDecoding``) copies what followed the
  last n-gram earlier in the context: free when it has a proposal;
- the verify pass is llama-cpp-python's own ``generate`` loop (``draft_model``): ``[last, d1 ..
  dk]`` decoded at once with logits for those rows only, the user's sampler applied to the
  target's logits at each position, the longest matching prefix kept and the KV cache trimmed
  past it. Every emitted token is sampled from the target, so greedy output is the dense
  model's (up to batch rounding at near-ties) and a temperature samples the target's
  distribution.

How far to draft is a small finite-horizon decision (the paper's controller, applied to
drafting): the state after i drafted tokens is (i, P), P the chance that all i are accepted,
estimated from each draft token's top-1 probability bucket through the measured acceptance
rate of that bucket; the action is *draft one more* (cost: a draft step) or *verify now* (cost:
a pass of i + 1 tokens). Solved by backward recursion for tokens per second (Dinkelbach: maximise
tokens - lambda * seconds, lambda updated to the policy's rate until it settles). The costs and
acceptance rates are what this process measures as it decodes (``Meter``).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np

# the draft's top-1 probability, binned (the acceptance rate is measured per bin)
Q_EDGES = (0.3, 0.5, 0.7, 0.8, 0.9, 0.95, 0.98)
N_Q = len(Q_EDGES) + 1
# the grid of P (chance that every drafted token so far is accepted) the table is solved on
P_GRID = np.concatenate([[1.0], np.geomspace(0.98, 0.02, 23)])

KINDS = ("auto", "self", "ngram", "off")


def q_bucket(q: float) -> int:
    return int(np.searchsorted(Q_EDGES, q, side="right"))


def _q_mid(b: int) -> float:
    edges = (0.0,) + Q_EDGES + (1.0,)
    return 0.5 * (edges[b] + edges[b + 1])


@dataclass
class Costs:
    """What the decision weighs: a draft step's seconds, a pass's seconds by batch size B
    (index B, 1..k_max + 1; NaN: not measured), acceptance per q bin, how often each bin comes."""

    k_max: int
    t_draft: float = math.nan
    t_pass: np.ndarray = None          # [k_max + 2] seconds, index = B
    accept: np.ndarray = None          # [N_Q] P(accepted | its prefix accepted, q bin)
    q_freq: np.ndarray = None          # [N_Q] how often a draft token falls in each bin

    def __post_init__(self):
        if self.t_pass is None:
            self.t_pass = np.full(self.k_max + 2, math.nan)
        if self.accept is None:
            self.accept = np.array([_q_mid(b) for b in range(N_Q)])
        if self.q_freq is None:
            self.q_freq = np.full(N_Q, 1.0 / N_Q)

    def pass_cost(self) -> np.ndarray:
        """t_pass with the unmeasured sizes filled in: linear between measured ones, the slope of
        the last two beyond them (a single measured size: flat, so that drafting gets tried)."""
        t = self.t_pass.copy()
        known = [b for b in range(1, len(t)) if math.isfinite(t[b])]
        if not known:
            raise ValueError("no pass has been timed")
        xs, ys = np.array(known, float), t[known]
        out = np.interp(np.arange(len(t), dtype=float), xs, ys)
        if len(known) >= 2 and known[-1] < len(t) - 1:
            slope = max((ys[-1] - ys[-2]) / (xs[-1] - xs[-2]), 0.0)
            for b in range(known[-1] + 1, len(t)):
                out[b] = ys[-1] + slope * (b - known[-1])
        return out


@dataclass
class DraftTable:
    """draft[i, j]: after i drafted tokens with P = P_GRID[j] (interpolated), draft one more."""

    draft: np.ndarray                  # [k_max + 1, len(P_GRID)] bool
    rate: float                        # the solved policy's expected tokens per second
    tokens_per_pass: float

    def more(self, i: int, p: float) -> bool:
        if i >= self.draft.shape[0]:
            return False
        j = int(np.argmin(np.abs(P_GRID - p)))
        return bool(self.draft[i, j])


def _interp_v(v: np.ndarray, p: np.ndarray) -> np.ndarray:
    """v on P_GRID (descending) at the points p."""
    return np.interp(p, P_GRID[::-1], v[::-1])


def solve(costs: Costs, iters: int = 30) -> DraftTable:
    """The draft-or-verify table maximising expected tokens per second (backward recursion over
    the draft position for tokens - lambda * seconds, lambda updated to the policy's own rate)."""
    k, T = costs.k_max, costs.pass_cost()
    a, f = np.clip(costs.accept, 0.0, 1.0), costs.q_freq / max(costs.q_freq.sum(), 1e-12)
    td = costs.t_draft if math.isfinite(costs.t_draft) else 0.0
    lam = 1.0 / T[1]
    draft = np.zeros((k + 1, len(P_GRID)), bool)
    n_tok = cost = None
    for _ in range(iters):
        # V[i]: value at (i, P) for P on the grid; N and C: the policy's expected tokens and time
        V = 1.0 - lam * T[k + 1] * np.ones(len(P_GRID))
        N, C = np.ones(len(P_GRID)), T[k + 1] * np.ones(len(P_GRID))
        for i in range(k, -1, -1):
            stop_v = 1.0 - lam * T[i + 1]
            if i == k:
                draft[i] = False
                V, N, C = np.full(len(P_GRID), stop_v), np.ones(len(P_GRID)), np.full(len(P_GRID), T[i + 1])
                continue
            pn = P_GRID[:, None] * a[None, :]                         # [grid, q]: P after the next token
            go_v = -lam * td + (f[None, :] * (pn + _interp_v(V, pn))).sum(1)
            go_n = (f[None, :] * (pn + _interp_v(N, pn))).sum(1)
            go_c = td + (f[None, :] * _interp_v(C, pn)).sum(1)
            d = go_v > stop_v
            draft[i] = d
            V = np.where(d, go_v, stop_v)
            N = np.where(d, go_n, 1.0)
            C = np.where(d, go_c, T[i + 1])
        n_tok, cost = float(N[0]), float(C[0])
        new = n_tok / cost
        if abs(new - lam) <= 1e-9 * max(lam, 1.0):
            break
        lam = new
    # the passes the policy makes each yield tokens_per_pass tokens on average
    return DraftTable(draft=draft.copy(), rate=n_tok / cost, tokens_per_pass=n_tok)


class Meter:
    """The costs as this process measures them (EWMA per pass size), the acceptance per q bin
    (counts, with a prior of a few tokens at the bin's midpoint), re-solved every few rounds."""

    PRIOR = 4.0
    ALPHA = 0.3

    def __init__(self, k_max: int):
        self.k_max = k_max
        self.costs = Costs(k_max=k_max)
        self.acc_n = np.full(N_Q, self.PRIOR)
        self.acc_hit = self.acc_n * np.array([_q_mid(b) for b in range(N_Q)])
        self.q_n = np.full(N_Q, 1.0)
        self._table: DraftTable | None = None
        self._dirty = True

    def _ewma(self, old: float, new: float) -> float:
        return new if not math.isfinite(old) else (1 - self.ALPHA) * old + self.ALPHA * new

    def pass_timed(self, n_rows: int, seconds: float) -> None:
        if not 1 <= n_rows <= self.k_max + 1:
            return
        self.costs.t_pass[n_rows] = self._ewma(self.costs.t_pass[n_rows], seconds)
        self._dirty = True

    def draft_timed(self, seconds: float) -> None:
        self.costs.t_draft = self._ewma(self.costs.t_draft, seconds)
        self._dirty = True

    def outcome(self, qbins: list[int], n_accepted: int) -> None:
        """A verified draft: its tokens' q bins and how many were accepted (the first rejected
        one counts as a miss; the ones after it are not observed)."""
        for i, b in enumerate(qbins[: n_accepted + 1]):
            self.acc_n[b] += 1
            self.acc_hit[b] += i < n_accepted
        for b in qbins:
            self.q_n[b] += 1
        self.costs.accept = self.acc_hit / self.acc_n
        self.costs.q_freq = self.q_n / self.q_n.sum()
        self._dirty = True

    def ready(self) -> bool:
        return math.isfinite(self.costs.t_pass[1])

    def table(self) -> DraftTable | None:
        if not self.ready():
            return None
        if self._dirty or self._table is None:
            self._table = solve(self.costs)
            self._dirty = False
        return self._table


@dataclass
class SpecStats:
    passes: int = 0          # verify passes with a draft
    drafted: int = 0         # draft tokens proposed
    accepted: int = 0        # of them, accepted
    draft_steps: int = 0     # self-draft decode steps
    draft_s: float = 0.0
    verify_s: float = 0.0
    plain_passes: int = 0    # one-token passes (nothing drafted)
    by_kind: dict = field(default_factory=lambda: {"self": 0, "ngram": 0})

    def as_dict(self) -> dict:
        d = {k: getattr(self, k) for k in ("passes", "drafted", "accepted", "draft_steps", "plain_passes")}
        d["draft_time_s"] = round(self.draft_s, 6)
        d["verify_time_s"] = round(self.verify_s, 6)
        d["tokens_per_pass"] = round((self.accepted + self.passes) / self.passes, 4) if self.passes else 0.0
        d["acceptance"] = round(self.accepted / self.drafted, 4) if self.drafted else 0.0
        d["proposals"] = dict(self.by_kind)
        return d


def parse_stop(value) -> tuple[str, float]:
    """draft_stop: None/"controller" (the solved table), "fixed" (always draft_max), or
    "p_min:X" (llama.cpp's rule: stop when the draft's top-1 probability falls below X)."""
    if value is None or value == "controller":
        return "controller", 0.0
    if value == "fixed":
        return "fixed", 0.0
    if isinstance(value, str) and value.startswith("p_min:"):
        try:
            x = float(value.split(":", 1)[1])
        except ValueError:
            x = math.nan
        if 0.0 <= x <= 1.0:
            return "p_min", x
    raise ValueError(f"expected 'controller', 'fixed' or 'p_min:X' (0 <= X <= 1), got {value!r}")


class Drafter:
    """llama-cpp-python's draft_model interface over the engine's self draft and prompt lookup.

    ``generate`` calls it with the context so far (the KV cache holds all but the last
    ``len(input_ids) - llm.n_tokens`` tokens); it returns the draft and tells the Llama that the
    next eval is a verify pass (logits for every row)."""

    def __init__(self, llm, kind: str, draft_max: int, stop: str | None, fraction: float = 1.0,
                 ngram_size: int = 3):
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        from ._llama_cpp import Batch   # the draft's own batch on the model's context

        self.llm, self.kind, self.k_max, self.fraction = llm, kind, draft_max, fraction
        self.stop, self.p_min = parse_stop(stop)
        self.meter = Meter(draft_max)
        # prompt lookup's proposals are free; how much of one to verify is solved from its own
        # acceptance (one bin) and the same pass costs
        self.lookup_meter = Meter(draft_max)
        self.lookup_meter.costs.t_pass = self.meter.costs.t_pass
        self.lookup_meter.costs.t_draft = 0.0
        self.lookup_meter.costs.q_freq = np.eye(N_Q)[N_Q - 1]
        self.lookup_meter.q_n = self.lookup_meter.costs.q_freq * 1e9
        self.stats = SpecStats()
        self.lookup = LlamaPromptLookupDecoding(max_ngram_size=ngram_size, num_pred_tokens=draft_max)
        self._draft_batch = Batch(max(llm.n_batch, draft_max + 1))
        self._pending: tuple[int, list[int], str] | None = None   # (n_past of the verify, q bins, kind)

    # -- what generate calls -------------------------------------------------------------------
    def __call__(self, input_ids: np.ndarray, /, **kwargs) -> np.ndarray:
        llm = self.llm
        self._settle()
        n_past = llm.n_tokens
        pending = [int(t) for t in input_ids[n_past:]]
        room = llm.n_ctx() - n_past - len(pending) - 1
        k_cap = min(self.k_max, room)
        if k_cap <= 0 or not pending:
            return np.array([], dtype=np.intc)
        draft, bins, kind = [], [], "none"
        if self.kind in ("auto", "ngram"):
            draft = self._lookup_cut([int(t) for t in self.lookup(np.asarray(input_ids, dtype=np.intc))[:k_cap]])
            bins = [N_Q - 1] * len(draft)
            kind = "ngram" if draft else kind
        if self.kind in ("auto", "self") and len(draft) < k_cap:
            own, own_bins = self._self_draft(n_past, pending, k_cap)
            if len(own) > len(draft):
                draft, bins, kind = own, own_bins, "self"
        if draft:
            self.stats.by_kind[kind] += 1
            self._pending = (n_past, bins, kind)
            llm._verify_rows = len(pending) + len(draft)
        return np.array(draft, dtype=np.intc)

    def _settle(self) -> None:
        """Account for the last verify: generate kept n_tokens - n_past - 1 of its drafts."""
        if self._pending is None:
            return
        n_past, bins, kind = self._pending
        self._pending = None
        n_acc = max(0, min(len(bins), self.llm.n_tokens - n_past - 1))
        self.stats.passes += 1
        self.stats.drafted += len(bins)
        self.stats.accepted += n_acc
        (self.meter if kind == "self" else self.lookup_meter).outcome(bins, n_acc)

    def finish(self) -> None:
        self._settle()

    def close(self) -> None:
        self._draft_batch.close()

    # -- the self draft --------------------------------------------------------------------------
    def _decide(self, i: int, p: float, q: float) -> bool:
        if i >= self.k_max:
            return False
        if self.stop == "fixed":
            return True
        if self.stop == "p_min":
            return i == 0 or q >= self.p_min
        t = self.meter.table()
        return t is not None and t.more(i, p)

    def _lookup_cut(self, proposal: list[int]) -> list[int]:
        """The part of a prompt-lookup proposal worth verifying (the whole of it unless the
        controller decides)."""
        if self.stop != "controller" or not proposal:
            return proposal
        t = self.lookup_meter.table()
        if t is None:
            return []
        a = float(self.lookup_meter.costs.accept[N_Q - 1])
        n = 0
        while n < len(proposal) and t.more(n, a ** n):
            n += 1
        return proposal[:n]

    def _self_draft(self, n_past: int, pending: list[int], k_cap: int) -> tuple[list[int], list[int]]:
        if not self._decide(0, 1.0, 1.0):
            return [], []
        from ._llama_cpp import kv_cache_trim

        llm, eng = self.llm, self.llm._engine
        out, bins, p, pos, toks = [], [], 1.0, n_past, pending
        eng.set_draft(True, self.fraction)
        try:
            while len(out) < k_cap:
                t0 = time.perf_counter()
                self._draft_batch.decode(llm, toks, pos)
                logits = llm.logits(len(toks) - 1)
                tok = int(np.argmax(logits))
                q = float(1.0 / np.exp(logits - logits[tok]).sum())
                dt = time.perf_counter() - t0
                self.stats.draft_steps += 1
                self.stats.draft_s += dt
                self.meter.draft_timed(dt)
                pos += len(toks)
                toks = [tok]
                b = q_bucket(q)
                out.append(tok)
                bins.append(b)
                p *= float(self.meter.costs.accept[b])
                if tok == llm.token_eos() or not self._decide(len(out), p, q):
                    break
        finally:
            eng.set_draft(False)
            kv_cache_trim(llm, n_past)
        return out, bins

    def verify_timed(self, n_rows: int, seconds: float) -> None:
        self.stats.verify_s += seconds
        if n_rows == 1:
            self.stats.plain_passes += 1
        self.meter.pass_timed(n_rows, seconds)
        self.lookup_meter._dirty = True   # (it shares the pass costs)
