"""Speculative decoding (docs/design.md §21): the draft FFN against the numpy reference over the
blocks it holds, dense mode's ranked pinned set, the draft-length solver against brute force,
and on SmolLM2 that speculative output equals plain decoding token for token through every API
path (completion, chat, streaming, stops, max_tokens, logprobs, grammars) and sampling at a
temperature with a seed, with a read fault in a verify pass leaving the next request correct and
a draft step whose output head did not run (a LoRA adapter) drafting nothing."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

import engine_hooks
from leanstream_convert import blockfile, convert
from gguf_synth import write_tiny_model
from leanstream_ggml.native import params
from leanstream_ggml.native.engine import FFNEngine
from leanstream_ggml.speculation.draft_control import N_Q, P_GRID, Costs, LookupMeter, Meter, q_bucket, solve
from leanstream_ggml.speculation.speculative import Drafter, lookup
from reference import ffn_reference, load_layer

N_EMBD, N_FF, N_LAYER = 256, 512, 3


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("spec")
    write_tiny_model(d / "tiny.gguf", arch="llama", n_layer=N_LAYER, n_embd=N_EMBD, n_ff=N_FF, types={"ffn": "Q4_0"},
                     seed=3)
    m = convert(d / "tiny.gguf", d / "lsm", k=2, progress=False, sketch="none", down_type="q8_0")
    return [m.layer_path(d / "lsm", il) for il in range(N_LAYER)]


def _x(n, seed=0):
    return np.random.default_rng(seed).standard_normal((n, N_EMBD)).astype(np.float32)


def _check(y, ref):
    assert np.abs(y - ref).max() <= 1e-3 * np.abs(ref).max() + 1e-5


def test_dense_pins_each_layers_best_ranked_blocks(tiny):
    """Given a block_rank, dense mode under a budget pins an equal share of every layer (its
    best-ranked runs of blocks, not a prefix of the scan); its output does not change."""
    h = blockfile.read_header(tiny[0])
    rank = np.random.default_rng(1).random((N_LAYER, h.n_blocks)).astype(np.float32)
    budget = (2 * h.n_blocks) * h.block_stride        # 2 of 3 layers' blocks: one layer streams
    with FFNEngine(tiny, memory_budget=budget, block_rank=rank) as e, FFNEngine(tiny) as ref:
        for il in range(N_LAYER):
            assert np.array_equal(e.eval_layer(il, _x(1, il)), ref.eval_layer(il, _x(1, il)))
        n_pin = budget // h.block_stride - h.n_blocks
        assert e.stats()["hot_blocks"] == n_pin
        for _ in range(2):   # (the streaming slots keep what the LRU left; the pinned set stays)
            for il in range(N_LAYER):
                e.eval_layer(il, _x(1, il))
                res = set(np.flatnonzero(e.resident(il)))
                share = n_pin // N_LAYER + (il < n_pin % N_LAYER)
                assert len(res) >= share   # (ranked by runs of one read's length: native/src/engine.c)


def _io_settled(e, quiet_s: float = 0.2, timeout_s: float = 5.0) -> None:
    """Wait until no read has landed for quiet_s: reads a dense op queued ahead for the next layer
    may still land after it returns (seen once on a loaded machine, counted in the draft's time)."""
    import time

    last, t_quiet, t_end = e.stats()["blocks_read"], time.monotonic(), time.monotonic() + timeout_s
    while time.monotonic() < t_end:
        time.sleep(0.02)
        now = e.stats()["blocks_read"]
        if now != last:
            last, t_quiet = now, time.monotonic()
        elif time.monotonic() - t_quiet >= quiet_s:
            return


@pytest.mark.parametrize("n_tokens", [1, 3])
def test_draft_computes_the_resident_blocks_and_reads_nothing(tiny, n_tokens):
    h = blockfile.read_header(tiny[0])
    rank = np.random.default_rng(2).random((N_LAYER, h.n_blocks)).astype(np.float32)
    budget = (2 * h.n_blocks) * h.block_stride
    with FFNEngine(tiny, memory_budget=budget, block_rank=rank) as e:
        for il in range(N_LAYER):
            e.eval_layer(il, _x(1, il))          # a dense pass: pinned blocks in, the last layer's kept
        _io_settled(e)                           # (the dense pass's prefetch of the next layer lands)
        before = e.stats()
        e.set_draft(True, 1.0)
        drafted = 0
        for il in range(N_LAYER):
            res = e.resident(il).astype(bool)
            w = load_layer(tiny[il])
            slots = w.perm.reshape(-1, w.k)[res]
            neurons = slots[slots >= 0]
            x = _x(n_tokens, 10 + il)
            _check(e.eval_layer(il, x, n_threads=2), ffn_reference(w, x, neurons=neurons))
            drafted += res.sum()
        e.set_draft(False)
        s = e.stats()
        for k in ("blocks_read", "bytes_read", "op_calls", "tokens", "blocks_computed"):
            assert s[k] == before[k], k          # the target's counters: untouched
        assert s["draft_ops"] == N_LAYER and s["draft_blocks"] == drafted and s["draft_tokens"] == n_tokens
        # the draft off: exact again
        x = _x(1, 99)
        with FFNEngine(tiny) as ref:
            assert np.array_equal(e.eval_layer(0, x), ref.eval_layer(0, x))


@pytest.fixture(scope="module", params=["q4_0-cols-q8_0", "q4_K-cols-q6_k"])
def row_model(request, tmp_path_factory):
    d = tmp_path_factory.mktemp("rows")
    types = {"ffn": "Q4_0"} if request.param.startswith("q4_0") else {"gate": "Q4_K", "up": "Q4_K", "down": "Q4_K"}
    write_tiny_model(d / "t.gguf", arch="llama", n_layer=1, n_embd=N_EMBD, n_ff=N_FF, types=types, seed=4)
    m = convert(d / "t.gguf", d / "lsm", progress=False, sketch="none", down_type=request.param.split("-")[-1])
    return [m.layer_path(d / "lsm", 0)]


@pytest.mark.parametrize("n_tokens", [2, 5, 9, 16])
def test_a_verify_pass_row_equals_decoding_that_token_alone(row_model, n_tokens):
    """Up to 16 rows (a verify pass) every row of the op's output is bit for bit the one-token
    op's on that row: speculative decoding agrees with plain decoding even at near-ties."""
    x = _x(n_tokens, 5)
    with FFNEngine(row_model) as e:
        batch = e.eval_layer(0, x, n_threads=2)
        alone = np.concatenate([e.eval_layer(0, x[t:t + 1], n_threads=2) for t in range(n_tokens)])
    assert np.array_equal(batch, alone)


@pytest.mark.parametrize("n_tokens", [1, 5, 25])
def test_a_row_is_the_same_at_any_thread_count(row_model, n_tokens):
    """One token decodes with llama.cpp's n_threads, a verify pass with n_threads_batch: a row's
    output does not depend on how many threads computed it (up to EXACT_ROWS rows)."""
    x = _x(n_tokens, 6)
    with FFNEngine(row_model) as e:
        outs = [e.eval_layer(0, x, n_threads=n) for n in (1, 2, 3, 4, 5)]
        alone = e.eval_layer(0, x[:1], n_threads=1)
    for o in outs[1:]:
        assert np.array_equal(o, outs[0])
    assert np.array_equal(outs[0][:1], alone)


def test_draft_fraction_keeps_the_best_ranked_share(tiny):
    h = blockfile.read_header(tiny[0])
    rank = np.random.default_rng(2).random((N_LAYER, h.n_blocks)).astype(np.float32)
    with FFNEngine(tiny, memory_budget=(2 * h.n_blocks) * h.block_stride, block_rank=rank) as e:
        for il in range(N_LAYER):
            e.eval_layer(il, _x(1, il))
        e.reset_stats()
        e.set_draft(True, 0.2)
        x = _x(1, 3)
        w = load_layer(tiny[0])
        keep = sorted(np.flatnonzero(e.resident(0)))
        slots = w.perm.reshape(-1, w.k)[keep]
        y = e.eval_layer(0, x)
        assert 0 < e.stats()["draft_blocks"] <= min(len(keep), int(0.2 * h.n_blocks + 0.5))
        assert np.isfinite(y).all()
        with pytest.raises(Exception, match="fraction"):
            e.set_draft(True, 0.0)


# ---- how far to draft ----------------------------------------------------------------------

def _costs(k, t1, slope, td, accept, freq=None):
    c = Costs(k_max=k)
    c.t_pass[1:] = t1 + slope * np.arange(k + 1)
    c.t_draft = td
    c.accept = np.asarray(accept, float)
    c.q_freq = np.full(N_Q, 1.0 / N_Q) if freq is None else np.asarray(freq, float)
    return c


def test_in_ram_costs_never_draft():
    """A pass of B tokens costs about B times one and a draft step most of one: drafting loses."""
    t = solve(_costs(8, 0.04, 0.035, 0.03, np.linspace(0.3, 0.99, N_Q)))
    assert not t.draft[0].any()
    assert t.tokens_per_pass == pytest.approx(1.0)


def test_streamed_costs_draft_far_when_drafts_agree():
    """Under a limit a pass of 9 costs 1.6x one and a draft step an eighth of one."""
    t = solve(_costs(8, 0.22, 0.016, 0.028, np.full(N_Q, 0.95)))
    assert t.draft[:8, 0].all()                    # at P = 1: draft to draft_max
    assert t.rate > 2.5 / 0.22
    low = solve(_costs(8, 0.22, 0.016, 0.028, np.full(N_Q, 0.05)))
    assert not low.draft[0].any()                  # drafts that never agree: plain decoding


def _exact_rate(c: Costs, policy) -> float:
    """Expected tokens / expected seconds of a history-dependent policy, by enumerating every
    sequence of q bins (policy(bins) -> draft one more?)."""
    T, a, f = c.pass_cost(), c.accept, c.q_freq / c.q_freq.sum()
    n_tok = cost = 0.0

    def walk(bins, prob, p_alive, acc_tokens, secs):
        nonlocal n_tok, cost
        if len(bins) < c.k_max and policy(tuple(bins)):
            for b in range(N_Q):
                pn = p_alive * a[b]
                walk(bins + [b], prob * f[b], pn, acc_tokens + pn, secs + c.t_draft)
            return
        n_tok += prob * (acc_tokens + 1.0)
        cost += prob * (secs + T[len(bins) + 1])

    walk([], 1.0, 1.0, 0.0, 0.0)
    return n_tok / cost


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_solver_against_brute_force(seed):
    """k_max 2: every deterministic policy on the bin history (2^(1 + N_Q)) enumerated; the
    solved table's policy, evaluated exactly, is within 2 % of the best."""
    rng = np.random.default_rng(seed)
    c = _costs(2, 0.2, rng.uniform(0.005, 0.15), rng.uniform(0.01, 0.15), rng.uniform(0.05, 1.0, N_Q),
               rng.uniform(0.1, 1.0, N_Q))
    best = 0.0
    for d0 in (False, True):
        for d1 in itertools.product((False, True), repeat=N_Q):
            best = max(best, _exact_rate(c, lambda bins: d0 if not bins else d1[bins[0]]))
    t = solve(c)

    def table_policy(bins):
        p = float(np.prod([c.accept[b] for b in bins])) if bins else 1.0
        return t.more(len(bins), p)

    assert _exact_rate(c, table_policy) >= 0.98 * best
    assert t.rate == pytest.approx(_exact_rate(c, table_policy), rel=0.02)


def _solve_reference(costs: Costs, iters: int = 30):
    """The recursion written directly (np.interp of each next value at each point): the draft
    table and rate that solve()'s one product per position must equal."""
    k, T = costs.k_max, costs.pass_cost()
    a, f = np.clip(costs.accept, 0.0, 1.0), costs.q_freq / costs.q_freq.sum()
    td = costs.t_draft if math.isfinite(costs.t_draft) else 0.0
    at = lambda v, p: np.interp(p, P_GRID[::-1], v[::-1])    # noqa: E731
    lam, g = 1.0 / T[1], len(P_GRID)
    draft = np.zeros((k + 1, g), bool)
    for _ in range(iters):
        V, N, C = np.full(g, 1.0 - lam * T[k + 1]), np.ones(g), np.full(g, T[k + 1])
        for i in range(k - 1, -1, -1):
            stop_v = 1.0 - lam * T[i + 1]
            pn = P_GRID[:, None] * a[None, :]
            go_v = -lam * td + (f * (pn + at(V, pn))).sum(1)
            go_n = (f * (pn + at(N, pn))).sum(1)
            go_c = td + (f * at(C, pn)).sum(1)
            draft[i] = d = go_v > stop_v
            V, N, C = np.where(d, go_v, stop_v), np.where(d, go_n, 1.0), np.where(d, go_c, T[i + 1])
        new = N[0] / C[0]
        if abs(new - lam) <= 1e-9 * max(lam, 1.0):
            break
        lam = new
    return draft, N[0] / C[0]


@pytest.mark.parametrize("seed", range(16))
def test_solver_equals_the_direct_recursion(seed):
    rng = np.random.default_rng(seed)
    k = int(rng.integers(1, 9))
    c = _costs(k, rng.uniform(0.01, 0.3), rng.uniform(0.001, 0.1), rng.uniform(0.0, 0.1), rng.uniform(0.0, 1.0, N_Q),
               rng.uniform(0.1, 1.0, N_Q))
    draft, rate = _solve_reference(c)
    t = solve(c)
    assert t.rate == pytest.approx(rate, rel=1e-9)
    assert np.array_equal(t.draft[0], draft[0])
    if draft[0].any():
        # (a decision may differ only where drafting and stopping are worth the same; where
        # nothing is drafted at the start, the deeper rows are never consulted)
        assert (t.draft != draft).mean() <= 0.01
    # from the last solved rate (costs that moved a little): the same policy
    warm = solve(c, rate=rate * rng.uniform(0.7, 1.3))
    assert warm.rate == pytest.approx(rate, rel=1e-9)


def test_meter_learns_acceptance_and_costs():
    m = Meter(4)
    assert m.table() is None                       # nothing timed yet: no drafting
    m.pass_timed(1, 0.2)
    m.draft_timed(0.02)
    for _ in range(50):   # a verified step of the top bin: half the time the draft's top-1, else its third
        m.observe(N_Q - 1, 0)
        m.observe(N_Q - 1, 2)
    assert m.costs.accept[N_Q - 1] == pytest.approx((50 + 4 * 0.99) / (100 + 4))
    assert m.chance(N_Q - 1, 2) == pytest.approx((50 + 4 * 0.01 * 0.25) / (100 + 4))
    assert m.chance(N_Q - 1, 1) < 0.01
    assert m.table() is not None


def test_one_slow_pass_does_not_make_drafting_look_cheap():
    """A pass timed 5x slower (a page fault, a neighbour's burst) moves the estimate by at most
    CLIP: in RAM, where a draft step costs a token, the table still drafts nothing."""
    m = Meter(4)
    for _ in range(20):
        m.pass_timed(1, 0.010)
        m.pass_timed(2, 0.013)
    m.draft_timed(0.011)
    assert not m.table().draft[0].any()
    m.pass_timed(1, 0.050)
    assert m.costs.t_pass[1] == pytest.approx(0.7 * 0.010 + 0.3 * 0.015)
    assert not m.table().draft[0].any()


def test_the_table_is_solved_again_only_when_a_cost_moves():
    m = Meter(4)
    m.pass_timed(1, 0.2)
    m.draft_timed(0.02)
    t = m.table()
    m.pass_timed(1, 0.201)                         # within RTOL: the same table
    assert m.table() is t
    m.pass_timed(3, 0.25)                          # a size timed for the first time
    t2 = m.table()
    assert t2 is not t
    for _ in range(5):
        m.pass_timed(1, 0.3)                       # the costs moved
    assert m.table() is not t2
    t3 = m.table()
    m.observe(N_Q - 1, 0)                          # a new observation
    assert m.table() is not t3


def test_lookup_acceptance_follows_the_text_and_recovers():
    lm = LookupMeter()
    assert lm.chance() == pytest.approx(lm.PRIOR_P)
    for _ in range(2):
        lm.tick()
        lm.observe(False)
    assert lm.chance() < 0.26                      # two misses: below what a row costs in RAM
    for _ in range(200):                           # a long stretch without lookup's proposals
        lm.tick()
    assert lm.chance() == pytest.approx(lm.PRIOR_P, abs=0.01)
    for _ in range(10):
        lm.tick()
        lm.observe(True)
    assert lm.chance() > 0.85


def test_lookup_is_llama_cpp_pythons_and_says_the_ngram_size():
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    find = LlamaPromptLookupDecoding.find_candidate_pred_tokens
    rng = np.random.default_rng(0)
    sizes = set()
    for trial in range(600):
        ids = rng.integers(0, (3, 6, 40)[trial % 3], size=int(rng.integers(1, 60))).astype(np.intc)
        k = int(rng.integers(1, 9))
        n, prop = lookup(ids, 3, k)
        sizes.add(n)
        assert np.array_equal(prop, find(ids, 3, k))         # the library's proposal
        if n:
            assert np.array_equal(find(ids, n, k), prop)      # the same from that size
            # and the longest: no earlier occurrence of the last n + 1 tokens with one after it
            m = n + 1
            assert n == 3 or m > len(ids) - 1 or not any(
                np.array_equal(ids[i:i + m], ids[-m:]) for i in range(len(ids) - m))
        else:
            assert len(prop) == 0
    assert sizes == {0, 1, 2, 3}


def test_q_bins_and_grid():
    assert q_bucket(0.0) == 0 and q_bucket(1.0) == N_Q - 1 and q_bucket(0.5) == 2
    assert P_GRID[0] == 1.0 and np.all(np.diff(P_GRID) < 0)


def test_options_are_checked():
    assert params.speculative(None, "dense") == "auto"         # the default
    assert params.speculative(None, "leanstream") == "off"      # sparse decode: no verify pass
    with pytest.raises(params.ParameterError, match="speculative"):
        params.speculative("yes", "dense")
    with pytest.raises(params.ParameterError, match="dense pass"):
        params.speculative("self", "leanstream")
    with pytest.raises(params.ParameterError, match="draft_max"):
        params.draft_max(0)
    with pytest.raises(params.ParameterError, match="draft_stop"):
        params.draft_stop("p_min:2")
    # parsed once, into what the draft uses: (rule, X)
    assert params.draft_stop("p_min:0.75") == ("p_min", 0.75)
    assert params.llama_options({"draft_stop": "fixed"})["draft_stop"] == ("fixed", 0.0)
    assert params.llama_options({})["draft_stop"] == params.draft_stop(None) == ("controller", 0.0)


class _Engine:
    """The draft's side of an engine: each draft decode runs the output head or not, as
    ``script`` says (a step's top tokens, or None: llama.cpp's own head ran, draft_top keeps what
    it had)."""

    def __init__(self, script):
        self.script, self.top, self.decodes = list(script), None, 0

    def decode(self, llm, *args, **kwargs):
        self.decodes += 1
        step = self.script.pop(0)
        if step is not None:
            self.top = step

    def draft_top(self, row, k):
        if self.top is None or row != 0:
            return np.empty(0, np.int32), np.empty(0, np.float32)
        return self.top[0][:k], self.top[1][:k]

    def set_draft(self, on, fraction=1.0):
        pass


def _top(seed):
    rng = np.random.default_rng(seed)
    p = np.sort(rng.dirichlet(np.ones(16)))[::-1][:8].astype(np.float32)
    return rng.choice(1000, 8, replace=False).astype(np.int32), p


def test_a_draft_step_reads_only_what_its_own_head_op_kept(monkeypatch):
    """Where the output head's op does not run for a draft step (patches/0004 declines with LoRA
    adapters or an output scale), draft_top has no row or the last step's: the draft stops
    there instead of drafting from a stale step; with no row at all the head never runs as the
    draft, and the self draft stays off."""
    from leanstream_ggml.llamacpp import _llama_cpp

    class _Llm:
        def __init__(self, engine):
            self.engine = engine

        def n_ctx(self):
            return 512

        def token_eos(self):
            return -1

    def drafter(script):
        eng = _Engine(script)
        monkeypatch.setattr(_llama_cpp, "decode", eng.decode)
        monkeypatch.setattr(_llama_cpp, "kv_cache_trim", lambda llm, n: None)
        d = Drafter(_Llm(eng), "self", 4, ("fixed", 0.0), fraction=1.0, width=2)
        d.timed(1, 0.01)     # (a one-token pass timed: the draft may start)
        return d, eng

    ctx = np.array([5, 6, 7], np.intc)
    # the third step's head op did not run: its top is the second's
    d, eng = drafter([_top(0), _top(1), None, _top(2), _top(3), _top(4), _top(5)])
    tree = d.propose(ctx, 2, [7])
    assert [c for c, _ in tree.steps] == [list(_top(0)[0][:2]), list(_top(1)[0][:2])]
    assert d.stats.draft_steps == 2 and d.stats.head_missing == 1
    tree = d.propose(ctx, 2, [7])        # the next pass drafts again, from fresh steps
    assert len(tree.steps) == 4 and d.stats.head_missing == 1
    # the head op never runs as the draft: no row; one step tried, then no draft decode at all
    d, eng = drafter([None, _top(0)])
    assert len(d.propose(ctx, 2, [7])) == 0 and d.stats.head_missing == 1 and d.stats.draft_steps == 0
    assert len(d.propose(ctx, 2, [7])) == 0 and eng.decodes == 1


# ---- on SmolLM2 --------------------------------------------------------------------------------

PROMPTS = ["def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
           "The three most important things to know about compound interest are"]
CHAT = [{"role": "user", "content": "Write a Python function that reverses the words of a sentence."}]
BUDGET = "32MiB"


@pytest.fixture(scope="module")
def spec_dir(smollm2_sketch_dir):
    return smollm2_sketch_dir


def _llama(d, **kw):
    from leanstream_ggml import Llama

    kw.setdefault("memory_budget", BUDGET)
    kw.setdefault("n_threads", 2)
    return Llama(str(d), n_ctx=512, verbose=False, seed=7, **kw)


@pytest.fixture(scope="module")
def plain(spec_dir):
    # plain decoding with the attention speculative decoding uses (flash attention: Llama.__init__)
    llm = _llama(spec_dir, speculative="off", flash_attn=True)
    out = {"completion": [llm.create_completion(p, max_tokens=64, temperature=0)["choices"][0]["text"] for p in PROMPTS],
           "chat": llm.create_chat_completion(messages=CHAT, max_tokens=64, temperature=0)["choices"][0]["message"]["content"]}
    llm.close()
    return out


@pytest.mark.parametrize("kw", [dict(speculative="auto"), dict(speculative="self", draft_stop="fixed"),
                                dict(speculative="self", draft_stop="p_min:0.5", draft_max=4),
                                dict(speculative="ngram", draft_stop="fixed"),
                                # llama-cpp-python's default threads on 2 cores: one token decodes
                                # on 1 thread, a verify pass on 2
                                dict(speculative="auto", n_threads=1, n_threads_batch=2)],
                         ids=["auto", "self-fixed", "self-pmin", "ngram", "auto-1-2-threads"])
def test_speculative_greedy_equals_plain(spec_dir, plain, kw):
    llm = _llama(spec_dir, **kw)
    try:
        got = [llm.create_completion(p, max_tokens=64, temperature=0)["choices"][0]["text"] for p in PROMPTS]
        chat = llm.create_chat_completion(messages=CHAT, max_tokens=64, temperature=0)["choices"][0]["message"]["content"]
        s = llm.stats()["speculative"]
    finally:
        llm.close()
    assert got == plain["completion"]
    assert chat == plain["chat"]
    # drafts were verified and some accepted (the equality above holds for a draft that never
    # proposes too), and every draft step read its own head's top tokens
    assert s["passes"] > 0 and s["drafted"] > 0 and s["accepted"] > 0 and s["head_missing"] == 0
    assert s["tokens_per_pass"] == pytest.approx((s["accepted"] + s["passes"]) / s["passes"], abs=1e-3)
    # tokens per pass by the tree's source: every pass counted under one source, its tokens too
    assert sum(s["proposals"].values()) == s["passes"]
    assert sum(s["tokens_by_kind"].values()) == s["accepted"] + s["passes"]
    for k, n in s["proposals"].items():
        assert (k in s["tokens_per_pass_by_kind"]) == (n > 0)
        if n:
            assert s["tokens_per_pass_by_kind"][k] == pytest.approx(s["tokens_by_kind"][k] / n, abs=1e-3)
            assert s["tokens_per_pass_by_kind"][k] >= 1.0
    if kw["speculative"] == "self":
        assert s["draft_steps"] > 0 and s["draft_time_s"] > 0 and s["proposals"]["self"] > 0


def test_streaming_stops_and_max_tokens(spec_dir):
    """Nothing past a stop sequence or max_tokens is emitted, streamed or not."""
    ref = _llama(spec_dir, speculative="off", flash_attn=True)
    spec = _llama(spec_dir, speculative="self", draft_stop="fixed")
    try:
        for llm in (ref, spec):
            llm.reset()
        for kw in (dict(max_tokens=7), dict(max_tokens=64, stop=["\n\n", "return"])):
            a = ref.create_completion(PROMPTS[0], temperature=0, **kw)
            b = "".join(c["choices"][0]["text"] for c in spec.create_completion(PROMPTS[0], temperature=0, stream=True, **kw))
            c = spec.create_completion(PROMPTS[0], temperature=0, **kw)
            assert b == a["choices"][0]["text"] == c["choices"][0]["text"]
            assert c["usage"]["completion_tokens"] <= kw["max_tokens"]
            for s in kw.get("stop", []):
                assert s not in b
    finally:
        ref.close()
        spec.close()


def test_logprobs_and_grammar(spec_dir):
    from llama_cpp import LlamaGrammar

    grammar = 'root ::= "[" [0-9]+ ("," [0-9]+)* "]"'
    outs = []
    for spec in ("off", "self"):
        llm = _llama(spec_dir, speculative=spec, draft_stop="fixed", logits_all=True, flash_attn=True)
        try:
            lp = llm.create_completion(PROMPTS[1], max_tokens=24, temperature=0, logprobs=3)["choices"][0]
            g = llm.create_completion("A list of prime numbers: ", max_tokens=24, temperature=0,
                                      grammar=LlamaGrammar.from_string(grammar, verbose=False))["choices"][0]["text"]
            outs.append((lp["text"], lp["logprobs"]["token_logprobs"], g))
        finally:
            llm.close()
    (t0, l0, g0), (t1, l1, g1) = outs
    assert t0 == t1 and g0 == g1
    assert g0.startswith("[")
    assert np.allclose(l0, l1, atol=2e-3)


def test_temperature_samples_and_stays_within_max_tokens(spec_dir):
    llm = _llama(spec_dir, speculative="self", draft_stop="fixed")
    try:
        a = llm.create_completion(PROMPTS[1], max_tokens=40, temperature=0.8, seed=3)
        b = llm.create_completion(PROMPTS[1], max_tokens=40, temperature=0.8, seed=3)
        # top_k=1 at a temperature is greedy: the same answer as plain greedy decoding
        g = llm.create_completion(PROMPTS[1], max_tokens=40, temperature=0.8, top_k=1)["choices"][0]["text"]
    finally:
        llm.close()
    ref = _llama(spec_dir, speculative="off", flash_attn=True)
    try:
        r = ref.create_completion(PROMPTS[1], max_tokens=40, temperature=0)["choices"][0]["text"]
    finally:
        ref.close()
    assert a["usage"]["completion_tokens"] <= 40 and a["choices"][0]["text"] == b["choices"][0]["text"]
    assert g == r


def test_default_samples_as_plain_decoding_at_a_temperature(spec_dir):
    """Exact at any temperature: with the same seed the default's sampled answers are
    speculative="off"'s token for token (the walk samples each row with the user's sampler, its
    random draws in plain decoding's order), and drafts were verified and accepted on the way."""
    outs = {}
    for spec in ("off", None):
        llm = _llama(spec_dir, **({"speculative": spec} if spec else {}))
        try:
            outs[spec] = [llm.create_completion(p, max_tokens=32, temperature=0.8, seed=11)["choices"][0]["text"]
                          for p in PROMPTS]
            if spec is None:
                s = llm.stats()["speculative"]
        finally:
            llm.close()
    assert outs[None] == outs["off"]
    assert s["passes"] > 0 and s["accepted"] > 0


def _zero_lora(path, spec_dir):
    """A LoRA adapter of blk.0.attn_q whose B is zero: llama.cpp applies it (the graph changes,
    patches/0004's output builder declines) and the model's answers stay the same."""
    import gguf

    from leanstream_ggml.model import manifest

    m = manifest.load(spec_dir)
    name = "blk.0.attn_q.weight"
    n_in, n_out = (int(n) for n in next(t for t in gguf.GGUFReader(m.resolve(spec_dir, m.base.file)).tensors
                                        if t.name == name).shape)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_type(gguf.GGUFType.ADAPTER)
    w.add_string(gguf.Keys.Adapter.TYPE, "lora")
    w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, 1.0)
    w.add_tensor(name + ".lora_a", np.zeros((1, n_in), np.float32))     # ggml [n_in, rank 1]
    w.add_tensor(name + ".lora_b", np.zeros((n_out, 1), np.float32))    # ggml [1, n_out]
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_with_a_lora_adapter_the_draft_finds_no_head_and_stops(spec_dir, tmp_path):
    """With a LoRA adapter llama.cpp computes the output head itself, so the draft's head op
    never runs and draft_top has nothing for a draft step: the self draft stops after one step
    (it used to read probs[0] of nothing) and the answers are plain decoding's."""
    lora = _zero_lora(tmp_path / "zero-lora.gguf", spec_dir)
    outs = []
    for spec in ("off", "self"):
        llm = _llama(spec_dir, speculative=spec, draft_stop="fixed", lora_path=str(lora))
        try:
            outs.append(llm.create_completion(PROMPTS[0], max_tokens=24, temperature=0)["choices"][0]["text"])
            if spec == "self":
                s = llm.stats()["speculative"]
        finally:
            llm.close()
    assert outs[1] == outs[0]
    assert s["head_missing"] == 1 and s["draft_steps"] == 0 and s["passes"] == 0 and s["plain_passes"] > 0


def test_read_fault_in_a_verify_pass_is_a_clean_error(spec_dir):
    """A block read that fails during a verify pass raises; the KV cache is left consistent, so
    the next request's answer is plain decoding's after the same request. (llama-cpp-python keeps
    the prompt's prefix in the KV cache and evaluates its last token again alone, which rounds
    differently from the prompt's batch: the reference repeats a request too.)"""
    from leanstream_ggml.native._native import LeanstreamError

    ref = _llama(spec_dir, speculative="off", flash_attn=True)
    try:
        ref.create_completion(PROMPTS[0], max_tokens=4, temperature=0)
        want = ref.create_completion(PROMPTS[0], max_tokens=64, temperature=0)["choices"][0]["text"]
    finally:
        ref.close()

    probe = _llama(spec_dir, speculative="off")
    try:
        probe.eval(probe.tokenize(PROMPTS[0].encode()))
        after_prefill = probe.stats()["reads_issued"]
        probe.eval([probe.token_bos()])
        per_pass = probe.stats()["reads_issued"] - after_prefill
    finally:
        probe.close()
    # (the first pass is the prompt's, then a draft reads nothing): the third verify pass's reads
    fault_read = after_prefill + 2 * per_pass + per_pass // 2
    with engine_hooks.given({"fault": "eio", "fault_read": fault_read}):   # this Llama's engine only
        llm = _llama(spec_dir, speculative="self", draft_stop="fixed")
    try:
        with pytest.raises(LeanstreamError):
            llm.create_completion(PROMPTS[0], max_tokens=64, temperature=0)
        assert llm.stats()["speculative"]["passes"] >= 1
        assert llm.create_completion(PROMPTS[0], max_tokens=64, temperature=0)["choices"][0]["text"] == want
    finally:
        llm.close()


def test_sparse_modes_refuse_self_drafts(spec_dir):
    with pytest.raises(params.ParameterError, match="speculative"):
        _llama(spec_dir, mode="leanstream", speculative="self")
    llm = _llama(spec_dir, mode="leanstream")
    try:
        assert llm.speculative == "off" and "speculative" not in llm.stats()
    finally:
        llm.close()


def test_memory_plan_counts_the_verify_rows(spec_dir):
    from leanstream_ggml.model import manifest
    from leanstream_ggml import memplan

    m = manifest.load(spec_dir)
    one = memplan.plan(spec_dir, m, 10**9, mode="dense", process=0)
    nine = memplan.plan(spec_dir, m, 10**9, mode="dense", process=0, n_outputs=9)
    # the logits rows twice (the graph's result and llama.cpp's output buffer)
    assert nine.reserve - one.reserve == 2 * 8 * one_vocab(spec_dir) * 4
    assert nine.parts["logits"] == 9 * one.parts["logits"]


def one_vocab(d) -> int:
    from leanstream_ggml.model import manifest
    from leanstream_ggml import memplan

    m = manifest.load(d)
    return memplan.read_base(m.resolve(d, m.base.file)).n_vocab
