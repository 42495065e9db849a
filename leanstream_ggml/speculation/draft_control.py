"""How far to draft and which drafted tokens to verify: the draft controller (docs/design.md §21).

Two decisions per pass, both from what this process measures as it decodes (``Meter``):

- *how far the self draft goes* is a small finite-horizon decision (the paper's controller,
  applied to drafting): the state after i drafted tokens is (i, P), P the chance that all i are
  accepted, estimated from each draft token's top-1 probability bin through the measured
  acceptance of that bin; the action is *draft one more* (cost: a draft step) or *stop* (cost: a
  pass of i + 1 rows). Solved by backward recursion for tokens per second (Dinkelbach: maximise
  tokens - lambda * seconds, lambda updated to the policy's rate until it settles);
- *which of the drafted tokens to verify* (the tree's shape): every candidate node (the draft's
  tokens of rank 0 .. width - 1 at each step, prompt lookup's chain) has a chance of being
  accepted, the product of the measured chances down its path; the verify pass takes nodes in
  decreasing chance while one more row (the measured pass cost by rows) raises the expected
  tokens per second of the pass. A chain is the one-wide case; nothing drafted where a row does
  not pay.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

# the draft's top-1 probability, binned (the acceptance of each rank is measured per bin)
Q_EDGES = (0.3, 0.5, 0.7, 0.8, 0.9, 0.95, 0.98)
N_Q = len(Q_EDGES) + 1
# the grid of P (chance that every drafted token so far is accepted) the table is solved on
P_GRID = np.concatenate([[1.0], np.geomspace(0.98, 0.02, 23)])
MAX_RANK = 8         # the draft's ranks whose acceptance is measured


def q_bucket(q: float) -> int:
    return int(np.searchsorted(Q_EDGES, q, side="right"))


def _q_mid(b: int) -> float:
    edges = (0.0,) + Q_EDGES + (1.0,)
    return 0.5 * (edges[b] + edges[b + 1])


@dataclass
class Costs:
    """What the decisions weigh: a draft step's seconds, a pass's seconds by rows B (index B,
    1..max_rows; NaN: not measured), acceptance of the draft's top-1 per q bin, how often each
    bin comes."""

    k_max: int
    max_rows: int = 0
    t_draft: float = math.nan
    t_pass: np.ndarray = None          # [max_rows + 1] seconds, index = B
    accept: np.ndarray = None          # [N_Q] P(accepted | its prefix accepted, q bin)
    q_freq: np.ndarray = None          # [N_Q] how often a draft token falls in each bin

    def __post_init__(self):
        self.max_rows = max(self.max_rows, self.k_max + 1)
        if self.t_pass is None:
            self.t_pass = np.full(self.max_rows + 1, math.nan)
        if self.accept is None:
            self.accept = np.array([_q_mid(b) for b in range(N_Q)])
        if self.q_freq is None:
            self.q_freq = np.full(N_Q, 1.0 / N_Q)

    def pass_cost(self) -> np.ndarray:
        """t_pass with the unmeasured sizes filled in: linear between measured ones, the slope of
        the last two beyond them (a single measured size: flat, so that drafting gets tried)."""
        t = self.t_pass
        known = np.flatnonzero(np.isfinite(t[1:])) + 1
        if not len(known):
            raise ValueError("no pass has been timed")
        xs, ys = known.astype(float), t[known]
        out = np.interp(np.arange(len(t), dtype=float), xs, ys)
        if len(known) >= 2 and known[-1] < len(t) - 1:
            slope = max((ys[-1] - ys[-2]) / (xs[-1] - xs[-2]), 0.0)
            beyond = np.arange(known[-1] + 1, len(t))
            out[beyond] = ys[-1] + slope * (beyond - known[-1])
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


def _interp_matrix(p: np.ndarray) -> np.ndarray:
    """W with W @ v = v on P_GRID (descending) linearly interpolated at the points p (flattened),
    clamped at the grid's ends as np.interp does: the recursion below is then one product per
    draft position, whatever the values."""
    xp = P_GRID[::-1]
    p = np.clip(p.ravel(), xp[0], xp[-1])
    j = np.clip(np.searchsorted(xp, p, side="right") - 1, 0, len(xp) - 2)
    w = (p - xp[j]) / (xp[j + 1] - xp[j])
    g = len(P_GRID)
    W = np.zeros((len(p), g))
    rows = np.arange(len(p))
    W[rows, g - 1 - j] = 1.0 - w
    W[rows, g - 2 - j] += w
    return W


def solve(costs: Costs, iters: int = 30, rate: float | None = None) -> DraftTable:
    """The draft-or-verify table maximising expected tokens per second (backward recursion over
    the draft position for tokens - lambda * seconds, lambda updated to the policy's own rate,
    from ``rate`` if given: the last solved rate, for costs that moved a little)."""
    k, T = costs.k_max, costs.pass_cost()
    a, f = np.clip(costs.accept, 0.0, 1.0), costs.q_freq / max(costs.q_freq.sum(), 1e-12)
    td = costs.t_draft if math.isfinite(costs.t_draft) else 0.0
    g = len(P_GRID)
    # no policy that drafts can beat plain decoding when even drafting i tokens that are each
    # accepted at the best bin's chance does not (any history: every path's chance is at most
    # a_max ** depth): the table is then plain, and its deeper rows are never consulted (in RAM,
    # where a draft step costs about a token, that is every pass, and the recursion is skipped)
    i = np.arange(1, k + 1)
    bound = (1.0 + np.cumsum(float(a.max()) ** i)) / (i * td + T[2:k + 2])
    if not (bound > 1.0 / T[1]).any():
        return DraftTable(draft=np.zeros((k + 1, g), bool), rate=1.0 / T[1], tokens_per_pass=1.0)
    # after one more drafted token from P on the grid, with its q bin's acceptance: P * a[q]; the
    # expected value of a function on the grid there is M @ (its values), the tokens gained gain
    pn = P_GRID[:, None] * a[None, :]                          # [grid, q]
    M = np.einsum("q,gqh->gh", f, _interp_matrix(pn).reshape(g, len(a), g))
    gain = (f[None, :] * pn).sum(1)
    lam = max(rate or 0.0, 1.0 / T[1])     # (plain decoding's rate is always within reach)
    draft = np.zeros((k + 1, g), bool)
    n_tok = cost = None
    for _ in range(iters):
        # X: the value at (i, P), the policy's expected tokens and time, for P on the grid
        X = np.empty((g, 3))
        X[:] = (1.0 - lam * T[k + 1], 1.0, T[k + 1])
        for i in range(k - 1, -1, -1):
            stop_v = 1.0 - lam * T[i + 1]
            go = M @ X
            go[:, 0] += gain - lam * td
            go[:, 1] += gain
            go[:, 2] += td
            d = go[:, 0] > stop_v
            draft[i] = d
            X = np.where(d[:, None], go, np.array([stop_v, 1.0, T[i + 1]]))
        n_tok, cost = float(X[0, 1]), float(X[0, 2])
        new = n_tok / cost
        if abs(new - lam) <= 1e-9 * max(lam, 1.0):
            break
        lam = new
    # the passes the policy makes each yield tokens_per_pass tokens on average
    return DraftTable(draft=draft.copy(), rate=n_tok / cost, tokens_per_pass=n_tok)


def select(reach: list[float], parent: list[int], t_spent: float, t_pass: np.ndarray, n_pending: int) -> list[int]:
    """The nodes to verify: the first n by decreasing chance of acceptance (``reach``; a node's
    chance is at most its parent's, so such a prefix holds every chosen node's parent), n the one
    maximising (1 + their chances) / (t_spent + t_pass[n_pending + n]), the expected tokens per
    second of the pass (t_spent: the drafting already done; t_pass by rows may rise unevenly)."""
    order = sorted(range(len(reach)), key=lambda i: (-reach[i], i))
    order = order[:max(0, len(t_pass) - 1 - n_pending)]
    best_n, best, tokens = 0, 1.0 / (t_spent + t_pass[n_pending]), 1.0
    seen: set[int] = set()
    for n, i in enumerate(order, 1):
        if parent[i] >= 0 and parent[i] not in seen:   # (a tie broken against its parent)
            break
        seen.add(i)
        tokens += reach[i]
        r = tokens / (t_spent + t_pass[n_pending + n])
        if r > best:
            best_n, best = n, r
    return sorted(order[:best_n])


class Meter:
    """The costs as this process measures them (EWMA per pass size); the chance that the model's
    token is the draft's rank-r token, per q bin of the draft's top-1 (counts, with a prior of a
    few tokens); solved again when they change."""

    PRIOR = 4.0
    ALPHA = 0.3
    RTOL = 0.05      # the costs moved less than this since the table was solved: it stands
    CLIP = 1.5       # a time is taken as at most this factor from the estimate (one slow pass, a
                     # page fault or a neighbour's burst, must not make drafting look cheap for good)

    def __init__(self, k_max: int, max_rows: int = 0):
        self.costs = Costs(k_max=k_max, max_rows=max_rows)
        mid = np.array([_q_mid(b) for b in range(N_Q)])
        self.rank_n = np.full(N_Q, self.PRIOR)
        # prior: the top-1 at the bin's midpoint, the rest of the mass halving with each rank
        rest = (1.0 - mid)[:, None] * 0.5 ** np.arange(1, MAX_RANK)[None, :]
        self.rank_hit = self.PRIOR * np.concatenate([mid[:, None], rest], axis=1)   # [N_Q, MAX_RANK]
        self.q_n = np.full(N_Q, 1.0)
        self._table: DraftTable | None = None
        self._solved_costs: tuple | None = None
        self._dirty = True
        self._update()

    def _ewma(self, old: float, new: float) -> float:
        if not math.isfinite(old):
            return new
        new = min(max(new, old / self.CLIP), old * self.CLIP)
        return (1 - self.ALPHA) * old + self.ALPHA * new

    def pass_timed(self, n_rows: int, seconds: float) -> None:
        if not 1 <= n_rows < len(self.costs.t_pass):
            return
        self.costs.t_pass[n_rows] = self._ewma(self.costs.t_pass[n_rows], seconds)

    def draft_timed(self, seconds: float) -> None:
        self.costs.t_draft = self._ewma(self.costs.t_draft, seconds)

    def observe(self, qbin: int, rank: int) -> None:
        """A verified draft step: its q bin and the rank of the model's token among the draft's
        top tokens there (-1: none of them)."""
        self.rank_n[qbin] += 1
        if 0 <= rank < MAX_RANK:
            self.rank_hit[qbin, rank] += 1
        self._update()

    def drafted(self, qbin: int) -> None:
        self.q_n[qbin] += 1
        self.costs.q_freq = self.q_n / self.q_n.sum()
        self._dirty = True

    def _update(self) -> None:
        self.rank_p = self.rank_hit / self.rank_n[:, None]
        self.costs.accept = self.rank_p[:, 0]
        self._dirty = True

    def chance(self, qbin: int, rank: int) -> float:
        """P(the model's token is the draft's rank-``rank`` token | the draft's top-1 bin)."""
        return float(self.rank_p[qbin, rank]) if rank < MAX_RANK else 0.0

    def ready(self) -> bool:
        return math.isfinite(self.costs.t_pass[1])

    def changed(self) -> bool:
        """An observation came since the table was last solved."""
        return self._dirty

    def _costs_moved(self) -> bool:
        t_pass, t_draft = self._solved_costs
        now, d = self.costs.t_pass, self.costs.t_draft
        if math.isfinite(d) != math.isfinite(t_draft) or (math.isfinite(d) and abs(d - t_draft) > self.RTOL * t_draft):
            return True
        known = np.isfinite(now)
        if not np.array_equal(known, np.isfinite(t_pass)):
            return True              # a pass size timed for the first time
        return bool((np.abs(now[known] - t_pass[known]) > self.RTOL * t_pass[known]).any())

    def table(self) -> DraftTable | None:
        """The solved table; solved again after a new observation or when a cost moved more than
        RTOL (every pass retimes them, by a few per cent; solving the three arms' tables every pass
        costs a noticeable share of a small model's token in RAM)."""
        if not self.ready():
            return None
        if self._table is None or self._dirty or self._costs_moved():
            self._table = solve(self.costs, rate=None if self._table is None else self._table.rate)
            self._solved_costs = (self.costs.t_pass.copy(), self.costs.t_draft)
            self._dirty = False
        return self._table


class LookupMeter:
    """Prompt lookup's acceptance: the chance that the model's next token is the one lookup
    copied. It is a property of the text being written now (code repeating its own names accepts
    most, fresh prose almost nothing), so the counts start from a weak prior (PRIOR_N tokens at
    PRIOR_P) and decay toward it with every pass (DECAY: about 35 passes' half-life): two misses
    take lookup's chance below what a row costs in RAM, and it is tried again later."""

    PRIOR_N, PRIOR_P, DECAY = 2.0, 0.5, 0.98

    def __init__(self):
        self.n, self.hit = self.PRIOR_N, self.PRIOR_N * self.PRIOR_P

    def observe(self, hit: bool) -> None:
        self.n += 1.0
        self.hit += float(hit)

    def tick(self) -> None:
        """A pass went by."""
        self.n = self.PRIOR_N + (self.n - self.PRIOR_N) * self.DECAY
        self.hit = self.PRIOR_N * self.PRIOR_P + (self.hit - self.PRIOR_N * self.PRIOR_P) * self.DECAY

    def chance(self) -> float:
        return self.hit / self.n
