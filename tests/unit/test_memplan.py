"""The memory plan (leanstream_ggml/memplan.py): base.gguf's header read with ggml's own gguf reader
against what gguf-py wrote; the plan's arithmetic and its refusal; Llama(memory_limit=) giving the
engine the plan's budget; `leanstream info --memory-limit`; and a real run of SmolLM2 inside a
memory cgroup at a limit the plan says is enough (no OOM kill)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from gguf_synth import write_tiny_model
from leanstream_ggml.model import manifest as manifest_mod
from leanstream_ggml import memplan, options
from leanstream_ggml.native import params

REPO = Path(__file__).resolve().parents[2]
MB = 10**6


def test_the_header_reader_agrees_with_gguf_py(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny_model(path, arch="qwen2", n_layer=3, n_embd=64, n_ff=96, n_head=4, n_head_kv=2)
    info = memplan.read_base(path)
    r = gguf.GGUFReader(str(path))
    want = {t.name: int(t.n_bytes) for t in r.tensors}
    assert info.tensor_bytes == want
    assert (info.arch, info.n_layer, info.n_embd) == ("qwen2", 3, 64)
    assert info.n_vocab == len(r.fields["tokenizer.ggml.tokens"].data)
    assert info.kv_width == 3 * 2 * (16 + 16)          # layers x kv heads x (key + value head size)
    assert info.n_ctx_train == r.fields["qwen2.context_length"].parts[-1][0]
    # an output matrix of its own: every tensor but the token embedding, whose rows are counted apart
    assert info.per_token_weights == sum(want.values()) - want["token_embd.weight"]
    assert 0 < info.embedding_rows(8) <= want["token_embd.weight"]
    assert info.embedding_rows(10**6) == want["token_embd.weight"]


def test_a_tied_embedding_is_counted_whole():
    info = memplan.BaseModelInfo(arch="llama", n_layer=1, n_embd=8, n_vocab=100, kv_width=16,
                                 tensor_bytes={"token_embd.weight": 800, "blk.0.attn_q.weight": 64})
    assert info.per_token_weights == 864 and info.embedding_rows(10) == 0


def _plan(limit, resident=0, process=50 * MB):
    base = memplan.BaseModelInfo(arch="llama", n_layer=30, n_embd=576, n_vocab=49152, kv_width=11520,
                                 tensor_bytes={"token_embd.weight": 40 * MB, "blk.0.attn_q.weight": 4 * MB})
    return memplan.plan(None, None, limit, mode="leanstream", n_ctx=512, n_ubatch=512, resident=resident,
                        process=process, base=base)


def test_the_budget_is_the_limit_less_every_part():
    p = _plan(600 * MB, resident=20 * MB)
    parts = p.parts
    assert parts["weights"] == 44 * MB and parts["process"] == 50 * MB
    assert parts["kv_cache"] == 512 * 11520 * 2
    assert parts["heap"] == memplan.HEAP_FIXED + memplan.HEAP_PER_VOCAB * 49152
    assert parts["compute"] == memplan.COMPUTE_FIXED + memplan.COMPUTE_PER_UBATCH_VALUE * 512 * 576
    assert p.budget == 600 * MB - sum(parts.values()) and p.cache == p.budget - 20 * MB
    p.check()
    text = "\n".join(p.lines())
    for k in (*parts, "engine", "resident", "cache"):
        assert k in text


def test_a_limit_that_cannot_hold_the_model_is_refused_with_the_numbers():
    p = _plan(200 * MB, resident=20 * MB)
    with pytest.raises(memplan.MemoryPlanError) as e:
        p.check()
    msg = str(e.value)
    assert "cannot hold this model in leanstream mode" in msg
    need = (p.reserve + 20 * MB + memplan.MIN_CACHE) / 2**20
    assert f"at least {need:.0f} MiB" in msg and "weights" in msg and "dense mode" in msg


def test_memory_limit_gives_the_engine_the_plans_budget(smollm2_sketch_dir):
    from leanstream_ggml import Llama

    # this process holds the test session (a conversion ran in it): the plan counts it, so the
    # limit is generous here; the cgroup test below runs a fresh process at a tight one
    llm = Llama(str(smollm2_sketch_dir), mode="leanstream", memory_limit="3000MB", n_ctx=256, verbose=False)
    try:
        plan = llm.memory_plan
        assert plan.limit == 3000 * MB and plan.parts["process"] > 0 and plan.parts["kv_cache"] == 256 * memplan.read_base(
            smollm2_sketch_dir / "base.gguf").kv_width * 2
        assert llm.engine.memory_budget == plan.budget
        m = manifest_mod.load(smollm2_sketch_dir)
        assert plan.resident == sum((smollm2_sketch_dir / f).stat().st_size for f in m.sketch_files())
        assert llm.create_completion("The capital of France is", max_tokens=4)["choices"][0]["text"]
    finally:
        llm.close()
    with pytest.raises(params.ParameterError, match="not both"):
        Llama(str(smollm2_sketch_dir), memory_limit="600MB", memory_budget="100MiB", verbose=False)
    with pytest.raises(memplan.MemoryPlanError, match="cannot hold this model"):
        Llama(str(smollm2_sketch_dir), mode="leanstream", memory_limit="150MB", verbose=False)


def test_memory_plan_is_the_llamas(smollm2_sketch_dir):
    """llama.memory_plan (what `info` prints) is the plan Llama makes with the same arguments, part
    by part (the process part is each one's own measure; the limit is far above both, whatever
    the test process holds by then)."""
    from leanstream_ggml import Llama
    from leanstream_ggml.llama import memory_plan

    for kw in ({}, {"speculative": "off", "n_ctx": 1024}, {"mode": "leanstream", "n_batch": 64}):
        llm = Llama(str(smollm2_sketch_dir), memory_limit="8GB", verbose=False, **kw)
        try:
            got, want = memory_plan(smollm2_sketch_dir, "8GB", **kw), llm.memory_plan
        finally:
            llm.close()
        assert got.mode == want.mode and got.resident == want.resident
        assert {k: v for k, v in got.parts.items() if k != "process"} == \
               {k: v for k, v in want.parts.items() if k != "process"}, kw


def test_info_prints_the_plan_and_refuses_a_limit_too_small(smollm2_sketch_dir):
    cmd = [sys.executable, "-m", "leanstream_ggml.cli", "info", str(smollm2_sketch_dir)]
    r = subprocess.run(cmd + ["--memory-limit", "600MB", "-c", "1024"], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0, r.stderr
    # what Llama gets by default: dense mode, with the logits of speculation's verify pass
    assert "memory plan for dense mode under a whole-process limit of 600 MB" in r.stdout
    assert "n_ctx 1024" in r.stdout and "memory_budget = limit - the above" in r.stdout
    assert "a speculative verify pass" in r.stdout
    r = subprocess.run(cmd + ["--memory-limit", "600MB", "--mode", "leanstream"], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0 and "memory plan for leanstream mode" in r.stdout, r.stderr
    r = subprocess.run(cmd + ["--memory-limit", "100MB"], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 1 and "cannot hold this model" in r.stderr


def test_the_plan_holds_inside_a_memory_cgroup(smollm2_sketch_dir):
    """SmolLM2 under a real whole-process limit the plan says is enough (its reserve + the sketch +
    64 MB of cache): the run finishes, is not OOM-killed, and its engine got the plan's budget."""
    from leanstream_tools import cgroup, measure

    ok, why = cgroup.availability()
    if not ok:
        pytest.skip(f"memory cgroups not writable here: {why}")
    m = manifest_mod.load(smollm2_sketch_dir)
    probe = memplan.plan(smollm2_sketch_dir, m, 10**12, mode="leanstream", n_ctx=512, n_ubatch=512,
                         resident=m.sketch.bytes, process=60 * MB)
    limit = probe.reserve + m.sketch.bytes + 64 * MB
    measure.drop_page_cache([p for p in smollm2_sketch_dir.rglob("*") if p.is_file()])
    cmd = [sys.executable, "-m", "leanstream_ggml.cli", "bench", str(smollm2_sketch_dir), "--mode", "leanstream",
           "--memory-limit", str(limit), "-p", "64", "-n", "16", "-r", "1", "-t", "2", "--json"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    res = cgroup.run_command(cmd, limit_bytes=limit, timeout_s=600, env=env, cwd=str(REPO))
    assert res.status == "ok", (res.status, res.stderr[-2000:])
    assert res.cgroup.get("oom_kill", 0) == 0
    doc = json.loads(res.stdout.strip().splitlines()[-1])
    assert doc["memory_plan"]["limit"] == limit
    assert doc["memory_budget_bytes"] == doc["memory_plan"]["budget"] >= m.sketch.bytes + 32 * MB
    assert doc["decode_tok_s"] > 0 and np.isfinite(doc["decode_tok_s"])


_NO_ARGUMENTS = r"""
import json, sys
from leanstream_ggml import Llama
llm = Llama(sys.argv[1], n_ctx=256, n_threads=2, verbose=False)
out = llm.create_completion("The capital of France is", max_tokens=8, temperature=0)
print(json.dumps({"backend": llm.backend, "limit": llm.settings.memory_limit, "plan": llm.memory_plan.to_dict()
                  if llm.memory_plan else None, "budget": llm.engine.memory_budget if llm.engine else None,
                  "text": out["choices"][0]["text"]}))
"""


def test_with_no_arguments_a_model_streams_inside_a_cgroup_it_does_not_fit(smollm2_dir):
    """Llama with no memory argument in a memory cgroup smaller than the whole model needs takes
    the cgroup's limit as its own (memplan.machine_limit, the converter's default) and streams,
    instead of running everything from a thrashing mmap; in RAM nothing changes."""
    from leanstream_tools import cgroup

    ok, why = cgroup.availability()
    if not ok:
        pytest.skip(f"memory cgroups not writable here: {why}")
    m = manifest_mod.load(smollm2_dir)
    least, whole = memplan.ffn_geometry(m)
    probe = memplan.plan(smollm2_dir, m, 10**12, mode="dense", n_ctx=256, n_ubatch=128, process=60 * MB)
    limit = probe.reserve + whole // 2
    cmd = [sys.executable, "-c", _NO_ARGUMENTS, str(smollm2_dir)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    res = cgroup.run_command(cmd, limit_bytes=limit, timeout_s=600, env=env, cwd=str(REPO))
    assert res.status == "ok", (res.status, res.stderr[-2000:])
    doc = json.loads(res.stdout.strip().splitlines()[-1])
    page = os.sysconf("SC_PAGE_SIZE")   # the kernel keeps a cgroup's limit in whole pages
    assert doc["backend"] == "stream" and doc["limit"] == limit // page * page
    assert doc["plan"]["limit"] == doc["limit"] and doc["plan"]["budget"] == doc["budget"]
    assert least <= doc["budget"] < whole, "the engine holds less than the whole FFN: it streams"
    assert doc["text"].strip()
    free = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=str(REPO), timeout=600)   # no cgroup
    assert free.returncode == 0, free.stderr[-2000:]
    unlimited = json.loads(free.stdout.strip().splitlines()[-1])
    assert not unlimited["limit"] and unlimited["plan"] is None and unlimited["text"] == doc["text"]


def test_the_memory_breakdown_reports_every_stage(smollm2_sketch_dir, capsys):
    """bench/memory_breakdown.py (where the plan's numbers come from) on SmolLM2: one snapshot per
    stage, the engine's resident sketch seen, the page cache of each model file counted."""
    import bench_modules

    mb = bench_modules.load("memory_breakdown")
    assert mb.main([str(smollm2_sketch_dir), "--mode", "leanstream", "-c", "256", "-b", "64", "-p", "8",
                    "-n", "2", "-t", "2"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [s["stage"] for s in doc["stages"]] == ["imports", "open", "prefill 8", "decode 2"]
    m = manifest_mod.load(smollm2_sketch_dir)
    for s in doc["stages"]:
        assert s["rss"] > 0 and 0 < s["anonymous"] <= s["rss"]
        assert set(s["page_cache"]) == set(doc["file_bytes"]) and "base.gguf" in s["page_cache"]
    assert doc["stages"][-1]["engine"]["resident_bytes"] == m.sketch.bytes
    assert doc["stages"][1]["anonymous"] > doc["stages"][0]["anonymous"]


def test_a_tight_limit_gives_way_in_order(smollm2_sketch_dir, monkeypatch):
    """A model that streams under its limit takes a batch of 128 (its activations' memory goes to
    the cache); where the defaults leave the engine less than its least cache and FIT_SPARE more,
    what the caller left to its default gives way: then the batch (to 64), the draft tree's width,
    speculation; what the caller set never does, and the plan says what changed."""
    from leanstream_ggml.llama import memory_plan

    monkeypatch.setattr(memplan, "process_bytes", lambda: 50 * MB)   # the test session's size aside
    d = str(smollm2_sketch_dir)
    spare = memplan.FIT_SPARE
    roomy = memory_plan(d, 8000 * MB)
    # as many rows as a verify pass has (1 + 8 steps x 3 wide, VERIFY_ROWS at most), in the graph
    # and in llama.cpp's output buffer
    assert roomy.fitted == {} and roomy.parts["logits"] == 2 * min(25, options.VERIFY_ROWS) * 49152 * 4
    least = roomy.min_cache      # dense: one layer's blocks, the engine's least working set
    assert least == max(e.n_blocks * e.block_stride for e in manifest_mod.load(d).layers)
    # the least limit that streams nothing at the default batch, and a MiB less
    whole = roomy.reserve + roomy.ffn_bytes
    assert not memory_plan(d, whole).streams and memory_plan(d, whole).fitted == {}
    p = memory_plan(d, whole - MB)
    assert p.fitted == {"n_batch": 128} and p.parts["compute"] < roomy.parts["compute"] and p.cache > roomy.ffn_bytes - MB
    assert "fitted to the limit: n_batch=128" in "\n".join(p.lines())
    at128 = memory_plan(d, 8000 * MB, n_batch=128).reserve + least   # the least limit the streaming default fits in
    p = memory_plan(d, at128 + spare - MB)
    assert p.fitted == {"n_batch": 64} and p.spare >= spare
    at64 = memory_plan(d, 8000 * MB, n_batch=64)
    p = memory_plan(d, at64.reserve + least + spare - MB)
    assert p.fitted == {"n_batch": 64, "draft_width": 1} and p.spare >= spare
    off = memory_plan(d, 8000 * MB, n_batch=64, speculative="off")
    p = memory_plan(d, off.reserve + least + spare)
    assert p.fitted["speculative"] == "off" and p.mode == "dense" and p.spare == spare
    # short of the spare with everything given way: the plan that gives the most, which still fits
    p = memory_plan(d, off.reserve + least)
    assert p.fitted == {"n_batch": 64, "draft_width": 1, "speculative": "off"} and p.spare == 0
    p.check()
    # set by the caller: kept, and the plan refuses
    p = memory_plan(d, at128 - 8 * MB, n_batch=512, speculative="auto")
    assert p.fitted == {}
    with pytest.raises(memplan.MemoryPlanError):
        p.check()


def test_a_refusal_names_the_largest_context_that_fits():
    import re

    base = memplan.BaseModelInfo(arch="llama", n_layer=30, n_embd=576, n_vocab=49152, kv_width=11520,
                                 tensor_bytes={"token_embd.weight": 40 * MB})

    def at(limit, n_ctx):
        return memplan.plan(None, None, limit, mode="dense", n_ctx=n_ctx, n_ubatch=512, resident=0, process=50 * MB,
                            base=base)

    p = at(200 * MB, 2048)
    with pytest.raises(memplan.MemoryPlanError) as e:
        p.check()
    kv = 2048 * 11520 * 2
    assert f"n_ctx 2048 holds {kv / 2**20:.0f} MiB of KV cache" in str(e.value)
    fit = int(re.search(r"n_ctx (\d+), `-c \1` on the command line, would fit", str(e.value)).group(1))
    assert fit % 256 == 0 and 256 <= fit < 2048
    assert at(200 * MB, fit).fits and not at(200 * MB, fit + 256).fits   # the largest that fits
    with pytest.raises(memplan.MemoryPlanError, match="even n_ctx 256 would leave too little"):
        at(60 * MB, 2048).check()


def _small_base():
    return memplan.BaseModelInfo(arch="llama", n_layer=30, n_embd=576, n_vocab=49152, kv_width=11520,
                                 tensor_bytes={"token_embd.weight": 40 * MB, "blk.0.attn_q.weight": 4 * MB})


def test_a_passes_logits_scores_and_captures_are_parts_of_the_plan():
    """What a pass holds besides a Llama's own is counted as named parts (lines, to_dict, budget):
    every row's logits twice (the graph's and llama.cpp's copy), llama-cpp-python's logits_all
    rows, a converter pass's capture buffers; a plain plan has neither of the last two."""
    p = memplan.plan(None, None, 2000 * MB, mode="dense", n_ctx=256, n_ubatch=128, resident=0, process=50 * MB,
                     base=_small_base(), n_outputs=128, outputs_of="a converter pass keeping every row's",
                     scores=256, captures=7 * MB)
    assert p.parts["logits"] == 2 * 128 * 49152 * 4
    assert p.parts["scores"] == 256 * 49152 * 4 and p.parts["captures"] == 7 * MB
    assert p.budget == 2000 * MB - sum(p.parts.values())
    d = p.to_dict()
    assert all(d[k] == p.parts[k] for k in ("logits", "scores", "captures"))
    text = "\n".join(p.lines())
    assert "  captures " in text and "  scores " in text and "a converter pass keeping every row's" in text
    plain = memplan.plan(None, None, 2000 * MB, mode="dense", resident=0, process=50 * MB, base=_small_base())
    assert "scores" not in plain.parts and "captures" not in plain.parts
    assert plain.parts["logits"] == 2 * 49152 * 4 and "verify pass" not in plain.notes["logits"]


@pytest.mark.parametrize("spare", [memplan.FIT_SPARE, 0])
def test_fit_takes_the_first_step_whose_plan_leaves_the_least_cache_and_spare(spare):
    """memplan.fit against a direct computation: the cache each n_ubatch leaves (numpy, part by
    part) and the first that holds MIN_CACHE + spare; where none does, the last (refused by check
    where it leaves less than MIN_CACHE)."""
    base = _small_base()
    ubatches = np.array([512, 256, 128, 64, 32])
    fixed = (50 * MB + 44 * MB + 512 * 11520 * 2 + memplan.HEAP_FIXED + memplan.HEAP_PER_VOCAB * 49152
             + memplan.COMPUTE_FIXED + 2 * 49152 * 4 + memplan.MARGIN)
    cache_at = lambda limit: limit - fixed - memplan.COMPUTE_PER_UBATCH_VALUE * ubatches * 576 - 20 * MB  # noqa: E731
    calls = []

    def plan_for(s):
        calls.append(dict(s))
        return memplan.plan(None, None, limit, mode="leanstream", n_ubatch=s.get("n_ubatch", 512), resident=20 * MB,
                            process=50 * MB, base=base)

    lo = int(fixed + 20 * MB + memplan.MIN_CACHE)
    for limit in np.linspace(lo - 4 * MB, lo + spare + 40 * MB, 57).astype(int).tolist():
        calls.clear()
        p = memplan.fit(plan_for, [{"n_ubatch": int(u)} for u in ubatches[1:]], spare=spare)
        ok = np.flatnonzero(cache_at(limit) >= memplan.MIN_CACHE + spare)
        want = int(ubatches[ok[0]] if len(ok) else ubatches[-1])
        assert p.fitted.get("n_ubatch", 512) == want, limit
        assert p.cache == cache_at(limit)[list(ubatches).index(want)] and p.spare == p.cache - memplan.MIN_CACHE
        assert p.fits == (p.cache >= memplan.MIN_CACHE)
        assert len(calls) == list(ubatches).index(want) + 1          # stops at the first that has its spare
        if not p.fits:
            with pytest.raises(memplan.MemoryPlanError):
                p.check()

def test_fit_lays_its_steps_over_each_other():
    """Steps are laid over each other, from ``start``; the plan's own fitted is kept."""
    base = _small_base()
    seen = []

    def never(s):
        seen.append(dict(s))
        q = memplan.plan(None, None, 0, mode="dense", resident=0, process=0, base=base)
        q.fitted = {"inner": 1}
        return q

    p = memplan.fit(never, [{"a": 1}, {"b": 2}, {"a": 3}], start={"c": 0})
    assert seen == [{"c": 0}, {"c": 0, "a": 1}, {"c": 0, "a": 1, "b": 2}, {"c": 0, "a": 3, "b": 2}]
    assert p.fitted == {"inner": 1, "c": 0, "a": 3, "b": 2} and not p.fits


def test_proc_field_reads_kb_lines(tmp_path):
    f = tmp_path / "status"
    f.write_text("Name:\tpython\nVmHWM:\t  2048 kB\nVmRSS:\t  1024 kB\n")
    assert memplan.proc_field("VmRSS", str(f)) == 1024 * 1024 and memplan.proc_field("VmHWM", str(f)) == 2 << 20
    assert memplan.proc_field("VmSwap", str(f)) is None and memplan.proc_field("VmRSS", str(tmp_path / "no")) is None
    assert memplan.proc_field("VmRSS") > 0 and memplan.proc_field("MemAvailable", "/proc/meminfo") > 0
