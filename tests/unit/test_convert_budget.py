"""The conversion within a memory limit (leanstream_convert/budget.py, leanstream_convert/stages.py; docs/design.md
§22): a model converted in a memory cgroup smaller than the model itself, resuming after a kill
in each new stage, the limit read from the cgroup, and the checks made before anything is
written (disk space, one layer's work)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

gs = pytest.importorskip("gguf_synth")
from convert_runs import ROOT, convert_in_child, digests, tiny_source_and_reference  # noqa: E402


SETTINGS = dict(progress=False, profile_tokens=96)


def _convert(src, out, kill_at=None, **kw):
    return convert_in_child(src, out, {**SETTINGS, **kw}, kill_at)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_source_and_reference(tmp_path_factory.mktemp("budget"), _convert)


def test_the_default_conversion_records_its_stages(tiny):
    from leanstream_ggml.model import manifest

    _, ref = tiny
    m = manifest.load(ref)
    c = m.extra["conversion"]
    assert set(c["stages"]) == {"read", "write", "activations", "order", "reorder", "sketch", "vocab"}
    assert all(r["seconds"] >= 0 and r["peak_rss_bytes"] > 0 for r in c["stages"].values())
    assert c["memory_limit"] > 0 and c["memory_limit_source"]
    assert m.sketch.quality == []                 # calibration is opt-in
    assert m.draft_vocab_file() and (ref / m.draft_vocab_file()).is_file()
    # the block files are in the order the importance ranking chose (not the source's)
    from leanstream_convert import blockfile

    h = blockfile.read_header(ref / m.layers[0].file)
    perm = blockfile.read_perm(ref / m.layers[0].file, h)
    assert sorted(perm.tolist()) == list(range(m.n_ff)) and not np.array_equal(perm, np.arange(m.n_ff))
    imp = np.load(ref / m.block_importance_file())
    assert np.all(np.diff(imp[0]) <= 0)           # most important first


def test_decode_rows_halve_down_to_the_least_under_a_tight_limit(tiny, monkeypatch):
    """The pass's tokens per decode: ROWS without a limit; under ever tighter limits halved down to
    MIN_ROWS, never more where less fits (each step frees captures and logits for the cache). The
    process's size is held fixed, so that only the limit moves."""
    from leanstream_convert.activations import MIN_ROWS, ROWS, decode_rows
    from leanstream_ggml.model import manifest
    from leanstream_ggml import memplan

    _, ref = tiny
    m = manifest.load(ref)
    assert decode_rows(ref, m, None, True) == ROWS
    now = memplan.process_bytes()
    monkeypatch.setattr(memplan, "process_bytes", lambda: now)
    coarse = [(limit, decode_rows(ref, m, limit, True))
              for limit in range(now, now + 400 * memplan.MiB, 2 * memplan.MiB)]
    assert coarse[0][1] == MIN_ROWS and coarse[-1][1] == ROWS
    lo = max(limit for limit, r in coarse if r == MIN_ROWS)
    hi = min(limit for limit, r in coarse if r == ROWS)
    seen = [decode_rows(ref, m, limit, True) for limit in range(lo, hi + 1, 4096)]
    assert seen == sorted(seen)
    assert {r for r in seen} == {ROWS >> i for i in range(ROWS.bit_length()) if ROWS >> i >= MIN_ROWS}


def test_the_pass_plans_its_captures_and_logits_as_parts(tiny, monkeypatch):
    """The activations pass's plan is the one its Llama makes (llama.memory_plan, one function):
    its capture buffers and every row's logits (twice: the graph's and llama.cpp's copy) are named
    parts; decode_rows is memplan.fit over those plans, against a direct computation of the most
    rows whose plan leaves the engine one layer's blocks and the fit's spare."""
    from leanstream_convert.activations import MIN_ROWS, ROWS, capture_bytes, decode_rows, pass_plan
    from leanstream_ggml.model import manifest
    from leanstream_ggml import memplan

    _, ref = tiny
    m = manifest.load(ref)
    monkeypatch.setattr(memplan, "process_bytes", lambda: 50 * memplan.MiB)
    base = memplan.read_base(ref / m.base.file)
    p = pass_plan(ref, m, 10**10, 32, True)
    n_slots = m.layers[0].n_blocks * m.block.k
    assert p.parts["captures"] == capture_bytes(m, 32) == m.n_layer * 32 * n_slots * 4
    assert p.parts["logits"] == 2 * 32 * base.n_vocab * 4
    assert "captures" in p.to_dict() and any(line.split()[0] == "captures" for line in p.lines())
    assert "captures" not in pass_plan(ref, m, 10**10, 32, False).parts
    # the reference: every part by hand at each row count, the first that leaves one layer and the
    # fit's spare (else the fewest rows)
    layer = max(e.n_blocks * e.block_stride for e in m.layers)
    tables = memplan.TABLES_FIXED + memplan.TABLES_PER_BLOCK * sum(e.n_blocks for e in m.layers)

    def reserve(rows):
        return (50 * memplan.MiB + base.per_token_weights + base.embedding_rows(512) + 512 * base.kv_width * 2
                + memplan.HEAP_FIXED + memplan.HEAP_PER_VOCAB * base.n_vocab
                + memplan.COMPUTE_FIXED + memplan.COMPUTE_PER_UBATCH_VALUE * rows * base.n_embd + tables
                + 2 * rows * base.n_vocab * 4 + m.n_layer * rows * n_slots * 4 + memplan.MARGIN)

    assert pass_plan(ref, m, 10**10, 32, True).reserve == reserve(32)
    candidates = [ROWS >> i for i in range(ROWS.bit_length()) if ROWS >> i >= MIN_ROWS]
    for limit in np.linspace(reserve(MIN_ROWS), reserve(ROWS) + 2 * layer + memplan.FIT_SPARE, 40).astype(int):
        want = next((r for r in candidates if int(limit) - reserve(r) >= layer + memplan.FIT_SPARE), MIN_ROWS)
        assert decode_rows(ref, m, int(limit), True) == want, limit


def test_the_pass_and_llama_plan_through_one_function(tiny, monkeypatch):
    """The activations pass's rows, its Llama's plan and a plain Llama's all come from
    llama.memory_plan's function (llama._fit: memplan.fit over memplan.plan, one fit, never one
    inside another): the pass's plan is
    its Llama's part by part (the process measured apart), and the converter's budget reads /proc
    through memplan's reader."""
    from leanstream_convert import budget
    from leanstream_convert.activations import decode_rows, pass_keywords, pass_plan
    from leanstream_ggml import Llama, llama, memplan
    from leanstream_ggml.model import manifest

    _, ref = tiny
    m = manifest.load(ref)
    calls = []
    real_plan, real_fit = memplan.plan, memplan.fit

    def plan(*a, **k):
        calls.append(("plan", k.get("n_outputs"), k.get("captures")))
        return real_plan(*a, **k)

    def fit(*a, **k):
        calls.append(("fit",))
        return real_fit(*a, **k)

    monkeypatch.setattr(memplan, "plan", plan)
    monkeypatch.setattr(memplan, "fit", fit)
    rows = decode_rows(ref, m, 10**10, True)
    assert calls[0] == ("fit",) and calls.count(("fit",)) == 1    # one fit: Llama's, which gives way on rows
    calls.clear()
    got = pass_plan(ref, m, 10**10, rows, True)
    llm = Llama.converting(str(ref), memory_limit=10**10, n_threads=1, verbose=False, **pass_keywords(m, rows, True))
    try:
        want = llm.memory_plan
    finally:
        llm.close()
    assert calls[0] == ("fit",) and calls[1][1:] == (rows, got.parts["captures"]) and calls.count(calls[1]) == 2
    assert {k: v for k, v in got.parts.items() if k != "process"} == \
           {k: v for k, v in want.parts.items() if k != "process"}
    assert got.notes["logits"] == want.notes["logits"] and "converter pass" in want.notes["logits"]
    plain = llama.memory_plan(ref, 10**10, speculative="off", n_ctx=512, n_batch=rows, n_ubatch=rows)
    assert {k: v for k, v in plain.parts.items() if k not in ("process", "logits")} == \
           {k: v for k, v in got.parts.items() if k not in ("process", "logits", "captures")}
    assert budget.proc_field is memplan.proc_field


def test_process_bytes_does_not_count_heap_the_allocator_kept():
    """Heap freed behind a live allocation stays in VmRSS until the allocator hands it back:
    process_bytes (what a memory plan counts as held) does not count it."""
    from leanstream_ggml import memplan

    before = memplan.process_bytes()
    chunks = [bytearray(64 * 1024) for _ in range(640)]          # 40 MiB of heap (under mmap's threshold)
    for c in chunks:
        c[::4096] = b"x" * len(c[::4096])                          # touched: resident
    pin = bytearray(64 * 1024)                                    # above them: the heap cannot shrink
    held = memplan.process_bytes()
    del chunks
    after = memplan.process_bytes()
    assert held - before > 30 * memplan.MiB
    assert after - before < 10 * memplan.MiB, (before, held, after)
    del pin


@pytest.mark.parametrize("kill_at", ["write-layer:1", "reorder-layer:0", "reorder-layer:2", "sketch-layer:1"])
def test_killed_conversion_resumes_to_the_same_files(tiny, tmp_path, kill_at):
    """SIGKILL inside the write stage, while the block files are reordered in place (some in the
    new order, some still in the source's), or inside the sketch stage: the same command again
    writes the same files."""
    src, ref = tiny
    out = tmp_path / "m.lsm"
    r = _convert(src, out, kill_at)
    assert r.returncode == -9, (r.returncode, r.stderr[-3000:])
    assert not (out / "manifest.json").exists()
    r = _convert(src, out)
    assert r.returncode == 0, r.stderr[-3000:]
    assert digests(out) == digests(ref)


def test_a_limit_too_small_for_one_layer_is_refused_with_the_numbers(tiny, tmp_path):
    from leanstream_convert.convert_gguf import ConvertError
    from leanstream_convert.stages import convert_model

    src, _ = tiny
    out = tmp_path / "m.lsm"
    with pytest.raises(ConvertError, match=r"memory limit 1 MB is too small .* one layer's work takes .* at least \d+ MB"):
        convert_model(src, out, progress=False, memory_limit="1MB", log=lambda *a: None)
    assert not out.exists() or not any(out.iterdir())


def test_not_enough_disk_is_refused_before_writing(tiny, tmp_path, monkeypatch):
    from leanstream_convert import budget
    from leanstream_convert.convert_gguf import ConvertError
    from leanstream_convert.stages import convert_model

    src, _ = tiny
    out = tmp_path / "m.lsm"
    monkeypatch.setattr(budget, "free_disk", lambda path: 1000)
    with pytest.raises(ConvertError, match=r"not enough disk space: the conversion writes about \d+ MB"):
        convert_model(src, out, progress=False, log=lambda *a: None)
    assert not out.exists() or not any(out.iterdir())


def test_cgroup_limits_are_read_up_the_hierarchy(tmp_path):
    """v1 (memory.limit_in_bytes) and v2 (memory.max): every limit set on our cgroup or above it;
    "no limit" (v1's page-rounded 2^63 - 1, v2's "max") is none."""
    from leanstream_ggml.memplan import cgroup_limits

    v1 = tmp_path / "memory" / "a" / "b"
    v1.mkdir(parents=True)
    (tmp_path / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    (tmp_path / "memory" / "a" / "memory.limit_in_bytes").write_text("2000000000\n")
    (v1 / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    got = cgroup_limits("4:memory:/a/b\n3:cpu:/x\n", root=tmp_path)
    assert [n for n, _ in got] == [2_000_000_000]
    v2 = tmp_path / "c"
    v2.mkdir()
    (tmp_path / "cgroup.controllers").write_text("memory\n")
    (v2 / "memory.max").write_text("max\n")
    (tmp_path / "memory.max").write_text("1000000000\n")
    assert [n for n, _ in cgroup_limits("0::/c\n", root=tmp_path)] == [1_000_000_000]


def _cgroup_or_skip():
    from leanstream_tools.cgroup import availability

    ok, why = availability()
    if not ok:
        pytest.skip(f"no writable memory cgroup here ({why}): the conversion under a real limit is not tested")


def test_a_model_larger_than_the_limit_converts_within_it(tmp_path):
    """A 0.9 GB model (F32 FFN) converted in a memory cgroup of 300 MB, with no --memory-limit: the
    converter reads the cgroup's limit, runs the model through the dense engine within it (the
    FFN streamed from the block files it just wrote) and finishes; every file verifies, each layer
    is a permutation of its neurons, most important first."""
    _cgroup_or_skip()
    from leanstream_convert import blockfile
    from leanstream_ggml.model import manifest
    from leanstream_tools.cgroup import run_command

    src = tmp_path / "big.gguf"
    # (the dense engine holds one layer's blocks at least, 28 MB here)
    gs.write_tiny_model(src, arch="llama", n_layer=32, n_embd=1024, n_ff=2304, n_head=8, n_head_kv=2,
                        types={"ffn": "F32", "attn": "Q4_0", "embd": "F16", "output": "F16"}, seed=3)
    limit = 300_000_000
    assert src.stat().st_size > 3 * limit
    out = tmp_path / "big.lsm"
    cmd = [sys.executable, "-m", "leanstream_ggml.cli", "convert", str(src), str(out), "--quiet", "--profile-tokens", "128"]
    r = run_command(cmd, limit_bytes=limit, timeout_s=600, cwd=str(ROOT))
    assert r.status == "ok", (r.status, r.stderr[-6000:])
    assert f"memory limit {limit / 1e6:.0f} MB (the memory cgroup's limit" in r.stderr
    m = manifest.load(out)
    c = m.extra["conversion"]
    assert 0 <= limit - c["memory_limit"] < 4096           # (the kernel rounds the limit down to a page)
    assert set(c["stages"]) >= {"write", "activations", "order", "reorder", "sketch"}
    v = subprocess.run([sys.executable, "-m", "leanstream_ggml.cli", "verify", str(out)], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert v.returncode == 0, v.stdout + v.stderr
    imp = np.load(out / m.block_importance_file())
    for il in range(m.n_layer):
        path = out / m.layers[il].file
        perm = blockfile.read_perm(path, blockfile.read_header(path))
        assert sorted(perm.tolist()) == list(range(m.n_ff))
        assert np.all(np.diff(imp[il]) <= 0)


@pytest.mark.slow
def test_smollm2_converts_in_a_300MB_cgroup(smollm2_gguf, smollm2_sketch_dir, tmp_path):
    """The real model's default conversion, the whole process in a memory cgroup of 300 MB (its
    GGUF is 98 MB, the converted directory ~180 MB): status 0, every file intact, and what the
    activations pass decided is what it decides without a limit: each layer's most important 30 %
    of neurons (dense mode's resident set, the draft FFN) and the draft vocabulary. (Under the
    limit the pass decodes fewer tokens at a time, so neurons of near-equal importance can trade
    places, and with them the order of dense mode's float sums: greedy answers of the two
    directories can part at a near-tie, each matching stock llama.cpp within its rounding.)"""
    _cgroup_or_skip()
    from leanstream_convert import blockfile
    from leanstream_ggml.model import manifest
    from leanstream_tools.cgroup import run_command

    out = tmp_path / "smol.lsm"
    limit = 300_000_000
    r = run_command([sys.executable, "-m", "leanstream_ggml.cli", "convert", str(smollm2_gguf), str(out), "--quiet"],
                    limit_bytes=limit, timeout_s=1200, cwd=str(ROOT))
    assert r.status == "ok", (r.status, r.cgroup, r.stderr[-3000:])
    m, ref = manifest.load(out), manifest.load(smollm2_sketch_dir)
    c = m.extra["conversion"]
    assert 0 <= limit - c["memory_limit"] < 4096
    assert max(s["peak_rss_bytes"] for s in c["stages"].values()) <= limit
    v = subprocess.run([sys.executable, "-m", "leanstream_ggml.cli", "verify", str(out)], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert v.returncode == 0, v.stdout + v.stderr
    for il in range(m.n_layer):
        perms = [blockfile.read_perm(d / mm.layers[il].file, blockfile.read_header(d / mm.layers[il].file))
                 for d, mm in ((out, m), (smollm2_sketch_dir, ref))]
        n = int(0.3 * m.n_ff)
        assert len(set(perms[0][:n]) & set(perms[1][:n])) >= 0.98 * n, il
    va, vb = np.load(out / m.draft_vocab_file()), np.load(smollm2_sketch_dir / ref.draft_vocab_file())
    assert len(set(va[:32768]) & set(vb[:32768])) >= 0.99 * 32768


def test_the_activations_pass_runs_fewer_positions_on_a_larger_model():
    """Its default: 4096 positions up to Qwen2.5-1.5B's FFN (SmolLM2, Qwen2.5 0.5B / 1.5B keep
    them), fewer in proportion above, never fewer than one chunk of each bundled domain."""
    from leanstream_convert.activations import MAX_TOKENS, N_CTX, SKIP, default_tokens

    assert default_tokens(30, 576, 1536) == default_tokens(28, 1536, 8960) == MAX_TOKENS
    assert default_tokens(32, 4096, 11008) == 3 * (N_CTX - SKIP)             # a 7B: the floor
    assert default_tokens(32, 2048, 8192) < MAX_TOKENS                          # ~1.6e9 FFN weights
    assert default_tokens(32, 2048, 8192) == int(MAX_TOKENS * 1.2e9 / (3 * 32 * 2048 * 8192))
    assert default_tokens(32, 4096, 11008, n_domains=4) == 4 * (N_CTX - SKIP)  # with --calibration
