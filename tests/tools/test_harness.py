"""The measurement harness: parsing, cgroup handling, perplexity math, runner and table helpers.

Fast tests only (no model). The cgroup tests need a writable cgroup v1 memory hierarchy under
our own cgroup (docs/design.md §6) and skip with the reason when there is none.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import bench_modules

from leanstream_ggml import scoring
from leanstream_tools import cgroup, compare, measure, perplexity



side_by_side = bench_modules.load("side_by_side")
make_readme_table = bench_modules.load("make_readme_table")

CG_OK, CG_WHY = cgroup.availability()
needs_cgroup = pytest.mark.skipif(not CG_OK, reason=f"no writable cgroup v1 memory hierarchy: {CG_WHY}")


# ---------------------------------------------------------------------------------------------
# measure.py

@pytest.mark.parametrize("text,expected", [
    ("900MB", 900 * 10**6), ("512MiB", 512 * 2**20), ("1.5GB", 1_500_000_000), ("1.5G", 1_500_000_000),
    ("123", 123), (" 2 GiB ", 2 * 2**30), ("64k", 64_000), (4096, 4096), ("none", None), ("", None), (None, None),
])
def test_parse_size(text, expected):
    assert measure.parse_size(text) == expected


@pytest.mark.parametrize("bad", ["12XB", "MB", "-5MB", "1.2.3G", "five"])
def test_parse_size_rejects(bad):
    with pytest.raises(ValueError):
        measure.parse_size(bad)


def test_format_size_round_trips_whole_megabytes():
    for n in (900 * 10**6, 1500 * 10**6, 2 * 10**9):
        assert measure.parse_size(measure.format_size(n)) == n
    assert measure.format_size(None) == "none"


STATUS_SAMPLE = """Name:\tpython
VmPeak:\t  900000 kB
VmHWM:\t  184276 kB
VmRSS:\t  180000 kB
RssFile:\t   96000 kB
Threads:\t3
voluntary_ctxt_switches:\t12
"""

IO_SAMPLE = """rchar: 6976
wchar: 0
syscr: 10
syscw: 0
read_bytes: 13713408
write_bytes: 0
cancelled_write_bytes: 0
"""


def test_parse_proc_status_in_bytes():
    d = measure.parse_proc_status(STATUS_SAMPLE)
    assert d["VmHWM"] == 184276 * 1024
    assert d["RssFile"] == 96000 * 1024
    assert "Threads" not in d and "Name" not in d


def test_parse_proc_io():
    d = measure.parse_proc_io(IO_SAMPLE)
    assert d["read_bytes"] == 13713408 and d["rchar"] == 6976 and d["cancelled_write_bytes"] == 0


def test_live_counters_are_numbers():
    assert measure.peak_rss_bytes() > 0
    rb = measure.disk_read_bytes()
    assert rb is None or rb >= 0
    info = measure.machine_info()
    assert info["cores"] >= 1 and info["date"]


def test_model_files_of_a_directory_and_a_file(tmp_path):
    (tmp_path / "ffn").mkdir()
    for name in ("manifest.json", "base.gguf", "ffn/blk.0.bin", "ffn/blk.1.bin"):
        (tmp_path / name).write_bytes(b"x" * 10)
    files = measure.model_files(tmp_path)
    assert [f.relative_to(tmp_path).as_posix() for f in files] == \
        ["base.gguf", "ffn/blk.0.bin", "ffn/blk.1.bin", "manifest.json"]
    assert measure.files_size(files) == 40
    assert measure.model_files(tmp_path / "base.gguf") == [tmp_path / "base.gguf"]


def test_drop_page_cache_empties_residency(tmp_path):
    f = tmp_path / "weights.bin"
    data = os.urandom(4 << 20)
    with open(f, "wb") as fo:
        fo.write(data)
        fo.flush()
        os.fsync(fo.fileno())  # dirty pages cannot be dropped
    f.read_bytes()
    before = measure.resident_bytes(f)
    if before is None:
        pytest.skip("mincore unavailable here")
    if before == 0:
        pytest.skip("this filesystem keeps no page cache for the file (e.g. a FUSE mount)")
    measure.drop_page_cache([f])
    after = measure.resident_bytes(f)
    if after == before and Path("/proc/mounts").read_text().find(" tmpfs ") >= 0 and after == len(data):
        pytest.skip("the file lives on tmpfs, whose pages cannot be dropped")
    assert after < before
    assert after <= len(data) // 8


# ---------------------------------------------------------------------------------------------
# cgroup.py: parsing

PROC_CGROUP_V1 = """9:name=systemd:/
8:pids:/
4:memory:/process_api/0cad8e2a
3:cpuset:/
2:cpu,cpuacct:/grp
0::/
"""


def test_parse_proc_cgroup_v1_and_v2():
    d = cgroup.parse_proc_cgroup(PROC_CGROUP_V1)
    assert d["memory"] == "/process_api/0cad8e2a"
    assert d["cpu"] == "/grp" and d["cpuacct"] == "/grp"
    assert d[""] == "/"
    assert cgroup.parse_proc_cgroup("0::/user.slice/session-3.scope\n") == {"": "/user.slice/session-3.scope"}


def test_own_memory_cgroup_resolves_under_the_mount(tmp_path):
    own = tmp_path / "process_api" / "0cad8e2a"
    own.mkdir(parents=True)
    (own / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    assert cgroup.own_memory_cgroup(tmp_path, PROC_CGROUP_V1) == own


def test_own_memory_cgroup_explains_why_not(tmp_path):
    with pytest.raises(cgroup.CgroupUnavailable, match="no cgroup v1 memory controller"):
        cgroup.own_memory_cgroup(tmp_path, "0::/user.slice\n")
    with pytest.raises(cgroup.CgroupUnavailable, match="not a cgroup v1 memory directory"):
        cgroup.own_memory_cgroup(tmp_path, PROC_CGROUP_V1)  # directory missing


def test_parse_oom_control():
    d = cgroup.parse_oom_control("oom_kill_disable 0\nunder_oom 0\noom_kill 2\n")
    assert d == {"oom_kill_disable": 0, "under_oom": 0, "oom_kill": 2}


def test_run_command_without_limit_and_timeout():
    r = cgroup.run_command([sys.executable, "-c", "print('hi')"])
    assert r.status == "ok" and r.stdout.strip() == "hi" and r.limit_bytes is None
    r = cgroup.run_command([sys.executable, "-c", "import sys; sys.exit(3)"])
    assert r.status == "error" and r.returncode == 3


def test_run_command_timeout_kills_the_whole_group():
    t0 = time.monotonic()
    # a child that itself spawns a grandchild: both must go
    code = "import subprocess, time; subprocess.Popen(['sleep', '60']); time.sleep(60)"
    r = cgroup.run_command([sys.executable, "-c", code], timeout_s=1.5)
    assert r.status == "timeout"
    assert time.monotonic() - t0 < 20


# ---------------------------------------------------------------------------------------------
# cgroup.py: a real child cgroup

@needs_cgroup
def test_child_cgroup_is_created_with_its_limit_and_removed():
    own = cgroup.own_memory_cgroup()
    with cgroup.MemoryCgroup.create(64 * 2**20) as cg:
        assert cg.path.parent == own and cg.path.is_dir()
        assert int((cg.path / "memory.limit_in_bytes").read_text()) == 64 * 2**20
        assert cg.pids() == []
        assert cg.stats()["usage_bytes"] >= 0
    assert not cg.path.exists()


@needs_cgroup
def test_accounting_only_cgroup_has_no_limit():
    r = cgroup.run_command([sys.executable, "-c", "b = bytearray(50 * 10**6)"], account=True, timeout_s=60)
    assert r.status == "ok" and r.limit_bytes is None
    assert r.cgroup["max_usage_bytes"] >= 50 * 10**6


@needs_cgroup
def test_run_command_runs_inside_the_child_cgroup():
    r = cgroup.run_command(["cat", "/proc/self/cgroup"], limit_bytes=256 * 2**20, timeout_s=30)
    assert r.status == "ok"
    mem = cgroup.parse_proc_cgroup(r.stdout)["memory"]
    own = cgroup.parse_proc_cgroup(Path("/proc/self/cgroup").read_text())["memory"]
    assert mem.startswith(own.rstrip("/") + "/leanstream-")
    leftovers = [p for p in cgroup.own_memory_cgroup().glob(f"leanstream-{os.getpid()}-*")]
    assert leftovers == []


@needs_cgroup
def test_command_over_its_limit_is_reported_oom_not_hung():
    # 400 MB of touched anonymous memory under a 64 MiB limit: the kernel OOM-kills it
    code = "import numpy as np; a = np.ones(400 * 10**6 // 8); print(a.sum())"
    t0 = time.monotonic()
    r = cgroup.run_command([sys.executable, "-c", code], limit_bytes=64 * 2**20, timeout_s=120)
    assert r.status == "oom", (r.status, r.returncode, r.cgroup, r.stderr[-500:])
    assert r.cgroup.get("oom_kill", 0) >= 1 or r.cgroup.get("failcnt", 0) > 0
    assert r.cgroup["max_usage_bytes"] <= 64 * 2**20
    assert time.monotonic() - t0 < 120
    assert r.to_dict()["status"] == "oom"


@needs_cgroup
def test_page_cache_counts_against_the_limit(tmp_path):
    # reading a 96 MB file under a 48 MiB limit succeeds (page cache is reclaimed, not OOM) and
    # the cgroup's peak stays at the limit: this is what makes stock's mmap really hit the disk
    f = tmp_path / "big.bin"
    with open(f, "wb") as fo:
        for _ in range(24):
            fo.write(os.urandom(4 << 20))
        fo.flush()
        os.fsync(fo.fileno())
    measure.drop_page_cache([f])
    code = f"f = open({str(f)!r}, 'rb')\nwhile f.read(1 << 20): pass\nprint('done')"
    r = cgroup.run_command([sys.executable, "-c", code], limit_bytes=48 * 2**20, timeout_s=120)
    assert r.status == "ok", r.stderr[-500:]
    assert r.cgroup["max_usage_bytes"] <= 48 * 2**20


# ---------------------------------------------------------------------------------------------
# perplexity.py (its windows and scored positions: the library's scoring.py)

def test_windows_cut_and_bos():
    toks = list(range(10, 30))  # 20 tokens
    w = scoring.windows(toks, 8, add_bos=True, bos=1)
    assert len(w) == 2 and w[0] == [1] + list(range(11, 18)) and w[1] == [1] + list(range(19, 26))
    w = scoring.windows(toks, 8, add_bos=False, bos=1)
    assert w[1] == list(range(18, 26))
    assert len(scoring.windows(toks, 4, False, 1, max_chunks=3)) == 3
    with pytest.raises(ValueError, match="fewer than one window"):
        scoring.windows(toks, 32, False, 1)
    assert list(scoring.scored_range(8)) == [4, 5, 6]


def test_window_nll_matches_a_direct_computation():
    rng = np.random.default_rng(0)
    n_ctx, vocab = 8, 11
    logits = rng.normal(size=(n_ctx, vocab)).astype(np.float32)
    window = list(rng.integers(0, vocab, n_ctx))
    nll = scoring.window_nll(logits, window)
    for i, j in enumerate(range(4, 7)):
        p = np.exp(logits[j].astype(np.float64))
        p /= p.sum()
        assert nll[i] == pytest.approx(-math.log(p[window[j + 1]]), rel=1e-9)


class FakeLlama:
    """Enough of llama_cpp.Llama for perplexity: a deterministic 'model' whose logits at each
    position depend on the token there (and an optional perturbation)."""

    def __init__(self, vocab=13, bias=0.0, add_bos=True):
        self.vocab, self.bias, self.add_bos = vocab, bias, add_bos
        rng = np.random.default_rng(1)
        self.table = rng.normal(size=(vocab, vocab)).astype(np.float32)
        self.scores = None
        self.evals = 0
        self.metadata = {}   # no chat template: a chat is rendered as "Role: content" lines

    def tokenize(self, text: bytes, add_bos: bool = True, special: bool = False):
        body = [2 + (b % (self.vocab - 2)) for b in text]
        return ([1] if add_bos and self.add_bos else []) + body

    def token_bos(self):
        return 1

    def reset(self):
        self.scores = None

    def eval(self, tokens):
        self.evals += 1
        s = self.table[np.asarray(tokens)].copy()
        s[:, 0] += self.bias
        self.scores = s


def test_compare_against_itself_is_exact():
    text = "abcdefghij" * 5  # 51 tokens with BOS
    a, b = FakeLlama(), FakeLlama()
    r = perplexity.compare(a, b, text, n_ctx=16)
    assert r["n_chunks"] == 3 and r["n_scored"] == 3 * 7
    assert r["top1_agreement"] == 1.0 and r["kl_mean"] == pytest.approx(0.0, abs=1e-12)
    assert r["ppl_ratio"] == pytest.approx(1.0)
    assert r["ppl"] == pytest.approx(perplexity.perplexity(FakeLlama(), text, 16).ppl)


def test_a_file_is_scored_as_the_model_sees_it(tmp_path):
    """`leanstream perplexity --text FILE`: a text file scores as its text; a .jsonl file's chats
    as the model's chat format renders them (leanstream_ggml/texts.py)."""
    text = "the quick brown fox jumps over the lazy dog" * 2
    (tmp_path / "t.txt").write_text(text)
    assert perplexity.perplexity(FakeLlama(), tmp_path / "t.txt", 16).ppl == perplexity.perplexity(
        FakeLlama(), text, 16).ppl
    chat = [{"role": "user", "content": "count the lazy dogs"}, {"role": "assistant", "content": "two lazy dogs"}]
    (tmp_path / "c.jsonl").write_text(json.dumps({"messages": chat}) + "\n" + json.dumps(chat) + "\n")
    rendered = "User: count the lazy dogs\nAssistant: two lazy dogs\n" * 2
    got = perplexity.compare(FakeLlama(bias=1.0), FakeLlama(), tmp_path / "c.jsonl", n_ctx=16)
    want = perplexity.compare(FakeLlama(bias=1.0), FakeLlama(), rendered, n_ctx=16)
    assert got == want and got["n_chunks"] == (1 + len(rendered)) // 16 == 6


def test_compare_measures_a_perturbation():
    text = "the quick brown fox jumps over the lazy dog" * 2
    r = perplexity.compare(FakeLlama(bias=3.0), FakeLlama(), text, n_ctx=16)
    assert r["kl_mean"] > 0.01 and r["kl_max"] >= r["kl_mean"]
    assert r["top1_agreement"] < 1.0
    assert r["ppl_ratio"] != pytest.approx(1.0)


def test_compare_refuses_different_vocabularies():
    with pytest.raises(ValueError, match="tokenize the text differently"):
        perplexity.compare(FakeLlama(add_bos=True), FakeLlama(add_bos=False), "x" * 40, n_ctx=8)


# ---------------------------------------------------------------------------------------------
# the side-by-side runs (leanstream_tools/compare/, bench/side_by_side.py) and bench/make_readme_table.py

def test_parse_limits_orders_none_first_then_largest():
    assert side_by_side.parse_limits("900MB,none,1500MB,1.2GB") == [None, 1500 * 10**6, 1200 * 10**6, 900 * 10**6]
    assert side_by_side.parse_limits("512MiB,512MiB") == [512 * 2**20]
    assert compare.parse_systems("stock, dense,,stock") == ["stock", "dense"]


def test_a_child_s_document_is_read_from_the_file_it_wrote(tmp_path):
    f = tmp_path / "doc.json"
    f.write_text('{"decode_tok_s": 12.5}\n')
    assert compare.read_json(f) == {"decode_tok_s": 12.5}
    f.write_text("{broken")
    assert compare.read_json(f) is None
    f.write_text("[1, 2]")
    assert compare.read_json(f) is None
    assert compare.read_json(tmp_path / "missing.json") is None


def test_greedy_match_and_budget():
    assert compare.greedy_match([1, 2, 3, 4], [1, 2, 9, 4]) == 0.5
    assert compare.greedy_match([1, 2], [1, 2]) == 1.0
    assert compare.greedy_match(None, [1]) is None
    assert compare.plugin_budget(None, 100) is None
    assert compare.plugin_budget(1000, 300) == 700
    assert compare.plugin_budget(200, 300) == 0


def test_choose_reserve_from_an_unlimited_run(tmp_path):
    r, how = compare.choose_reserve(None, tmp_path, {"peak_rss_bytes": 500, "engine_total": {"cache_bytes": 200}})
    assert r == 300 + compare.RESERVE_MARGIN and how.startswith("measured")
    assert compare.choose_reserve(123, tmp_path, None) == (123, "--reserve")
    r, how = compare.choose_reserve(None, tmp_path, {"peak_rss_bytes": 500, "engine_total": {"cache_bytes": 200}},
                                    charged_peak=450)
    assert r == 250 + compare.RESERVE_MARGIN and "cgroup peak" in how
    # the budget covers the resident sketch/predictors too: they are not part of the reserve
    r, _ = compare.choose_reserve(None, tmp_path, {"peak_rss_bytes": 500,
                                                   "engine_total": {"cache_bytes": 200, "resident_bytes": 120}})
    assert r == 180 + compare.RESERVE_MARGIN


def test_private_copies(tmp_path):
    g = tmp_path / "m.gguf"
    g.write_bytes(b"GGUF" + b"\0" * 100)
    d = tmp_path / "m.lsm"
    (d / "ffn").mkdir(parents=True)
    (d / "ffn" / "blk.0.bin").write_bytes(b"x" * 4096)
    q = tmp_path / "m.Q2_K-from-Q4_K_M.gguf"
    q.write_bytes(b"GGUF" + b"\1" * 50)
    g2, d2 = compare.private_copies({"stock": g, "stock-q2_k": q}, d, tmp_path / "copies")
    assert g2["stock"].read_bytes() == g.read_bytes() and g2["stock-q2_k"].read_bytes() == q.read_bytes()
    assert (d2 / "ffn" / "blk.0.bin").read_bytes() == b"x" * 4096
    assert g2["stock"].parent == g2["stock-q2_k"].parent == d2.parent == tmp_path / "copies"


def test_bench_command_passes_identical_settings():
    args = side_by_side.build_parser().parse_args(["-p", "16", "-n", "4", "-r", "2", "-t", "2"])
    stock = compare.bench_command(Path("m.gguf"), "stock", args, None)
    dense = compare.bench_command(Path("m.lsm"), "dense", args, 12345)
    common = ["-p", "16", "-n", "4", "-r", "2", "-c", "512", "-b", "512", "-t", "2"]
    for c in (stock, dense):
        assert " ".join(common) in " ".join(c) and "--json" in c
    assert stock[stock.index("--system") + 1] == "stock"
    assert dense[dense.index("--mode") + 1] == "dense" and dense[dense.index("--memory-budget") + 1] == "12345"
    # a smaller quant is stock llama-cpp-python on another GGUF, with the same settings
    q2 = compare.bench_command(Path("m.Q2_K.gguf"), "stock-q2_k", args, None)
    assert q2 == [x if x != "m.gguf" else "m.Q2_K.gguf" for x in stock]
    assert compare.is_stock("stock-q3_k_m") and not compare.is_stock("dense")
    assert compare.stock_quant("stock-q3_k_m") == "Q3_K_M" and compare.stock_quant("stock") is None
    ppl = compare.perplexity_command(Path("m.lsm"), "dense", args)
    assert ppl[ppl.index("--mode") + 1] == "dense" and ppl[ppl.index("-c") + 1] == "512"


def _fake_doc():
    res = lambda dec, rss, disk: {"decode_tok_s": dec, "prefill_tok_s": 10 * dec, "peak_rss_bytes": rss,  # noqa: E731
                                  "disk_read_bytes_per_decode_token": disk, "generated": [1, 2, 3]}
    return {
        "benchmark": "side_by_side", "model": "Tiny.gguf", "model_bytes": 10**9, "stock": "llama-cpp-python 0.3.36",
        "systems": ["stock", "dense"], "limits_bytes": [None, 900 * 10**6],
        "cgroup": {"writable": True, "path": "/x"},
        "settings": {"n_prompt": 16, "n_gen": 4, "repetitions": 3, "n_ctx": 512, "n_threads": 2,
                     "page_cache_dropped": True, "plugin_reserve": {"dense": {"bytes": 400 * 10**6, "how": "measured"}}},
        "machine": {"cpu": "AMD EPYC", "cores": 2, "mem_total_bytes": 24 * 10**9, "date": "2026-01-01"},
        "runs": [
            {"system": "stock", "limit_bytes": None, "status": "ok", "result": res(13.4, 1.8e9, 0)},
            {"system": "dense", "limit_bytes": None, "status": "ok", "result": res(10.1, 1.2e9, 0),
             "greedy_match_vs_stock": 1.0},
            {"system": "stock", "limit_bytes": 900 * 10**6, "status": "ok", "result": res(1.39, 0.9e9, 7.5e8)},
            {"system": "dense", "limit_bytes": 900 * 10**6, "status": "oom", "plugin_reserve_bytes": 400 * 10**6},
        ],
    }


def test_readme_table_from_json(tmp_path, capsys):
    p = tmp_path / "r.json"
    p.write_text(json.dumps(_fake_doc()))
    assert make_readme_table.main([str(p)]) == 0
    out = capsys.readouterr().out
    assert "**Tiny.gguf**" in out and "2-core AMD EPYC" in out and "2026-01-01" in out
    assert "| none | stock | – | 13.40 | 1.80 GB | 0 MB |" in out
    assert "| none | leanstream dense | – | 10.10 | 1.20 GB | 0 MB |" in out
    assert "| 900 MB | stock | – | 1.39 | 900 MB | 750 MB |" in out
    assert "| 900 MB | leanstream dense | – | oom | – | – |" in out
    doc = _fake_doc()
    doc["runs"][0]["result"]["decode_tok_s_best"] = 14.0
    assert "| none | stock | – | 13.40 (14.00) |" in make_readme_table.table(doc)


def test_readme_table_with_smaller_quants_and_perplexity():
    doc = _fake_doc()
    doc["model"] = "Tiny.Q4_K_M.gguf"
    doc["systems"] = ["stock", "stock-q2_k", "dense"]
    doc["stock_files"] = {"stock": {"file": "Tiny.Q4_K_M.gguf", "bytes": 10**9, "made": None},
                          "stock-q2_k": {"file": "Tiny.Q2_K-from-Q4_K_M.gguf", "bytes": 6 * 10**8,
                                         "made": "llama_model_quantize from Tiny.Q4_K_M.gguf"}}
    doc["model_dir_bytes"] = 12 * 10**8
    doc["runs"].append({"system": "stock-q2_k", "limit_bytes": 900 * 10**6, "status": "ok",
                        "result": {"decode_tok_s": 25.0, "peak_rss_bytes": 7e8, "disk_read_bytes_per_decode_token": 0}})
    doc["perplexity"] = {"stock": {"ppl": 10.0, "n_scored": 1000}, "stock-q2_k": {"ppl": 18.2}, "dense": {"ppl": 10.01}}
    out = make_readme_table.table(doc)
    assert "| 900 MB | stock Q2_K | 600 MB | 18.20 (×1.820) | 25.00 | 700 MB | 0 MB |" in out
    assert "| none | stock Q4_K_M | 1.00 GB | 10.00 | 13.40 | 1.80 GB | 0 MB |" in out
    assert "| none | leanstream dense | 1.20 GB | 10.01 (×1.001) | 10.10 |" in out
    assert "| none | stock Q2_K | 600 MB | 18.20 (×1.820) | – | – | – |" in out
    assert "stock Q2_K = llama_model_quantize from Tiny.Q4_K_M.gguf" in out
    assert "1000 scored tokens" in out and "taken from" not in out
    for v in doc["perplexity"].values():
        v["measured_in"] = "earlier.json"
    assert "taken from the run in earlier.json" in make_readme_table.table(doc)


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is needed for the side-by-side plot (pip install matplotlib)")
    out = tmp_path / "fig.png"
    side_by_side.plot(_fake_doc(), str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
