"""`leanstream compare` (leanstream_tools/compare/): the decisions, the Pareto front, the
report's shape, and one real run on SmolLM2 through the CLI (slow: it converts SmolLM2 with its
sketch, and every setup runs in its own process)."""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from leanstream_ggml.native import params
from leanstream_tools import compare

REPO = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------------------------------------
# the Pareto front

def reference_front(points: dict) -> set:
    """Straight from the definition: not dominated by any other point (at least as fast and at
    least as good, better in one)."""
    def dominates(a, b):
        return a[0] >= b[0] and a[1] <= b[1] and a != b
    return {s for s, p in points.items() if not any(dominates(q, p) for t, q in points.items() if t != s)}


def test_pareto_front_matches_the_definition():
    rng = random.Random(7)
    for _ in range(300):
        n = rng.randint(1, 9)
        # few distinct values: ties in speed, in quality and whole duplicates are common
        points = {f"s{i}": (float(rng.randint(0, 5)), 1 + rng.randint(0, 4) / 10) for i in range(n)}
        front = compare.pareto_front(points)
        assert set(front) == reference_front(points), points
        assert len(front) == len(set(front))
        xs = [points[s][0] for s in front]
        assert xs == sorted(xs, reverse=True)   # fastest first


def test_pareto_front_small_cases():
    assert compare.pareto_front({}) == []
    pts = {"stock": (10.0, 1.0), "q2": (30.0, 1.6), "dense": (12.0, 1.01), "slow-bad": (5.0, 1.2),
           "q3": (11.0, 1.1)}
    assert compare.pareto_front(pts) == ["q2", "dense", "stock"]   # q3: dense is faster and better
    assert compare.pareto_front({"a": (1.0, 1.0), "b": (1.0, 1.0)}) == ["a", "b"]   # equal: neither dominates


# ---------------------------------------------------------------------------------------------
# what runs

def test_parse_limit():
    assert compare.parse_limit("1GB") == 10**9
    assert compare.parse_limit("600MiB") == 600 * 2**20
    assert compare.parse_limit("none") is None and compare.parse_limit(None) is None
    with pytest.raises(params.ParameterError, match="--memory-limit"):
        compare.parse_limit("lots")


def test_setup_names_are_checked():
    assert compare.check_setups(list(compare.DEFAULT_SETUPS)) == list(compare.DEFAULT_SETUPS)
    assert compare.plugin_mode("leanstream@ppl+5%") == ("leanstream", "ppl+5%")
    assert compare.plugin_mode("dense") == ("dense", None)
    assert compare.plugin_mode("leanstream@ppl+5%+off") == ("leanstream", "ppl+5%")
    # a quality preset's "+5%" is no speculative suffix
    assert compare.split_speculative("leanstream@ppl+5%") == ("leanstream@ppl+5%", None)
    assert compare.split_speculative("stock-q3_k_m+lookup") == ("stock-q3_k_m", "lookup")
    assert compare.is_stock("stock-q3_k_m+lookup") and compare.stock_quant("stock-q3_k_m+lookup") == "Q3_K_M"
    assert compare.is_stock("stock+lookup") and compare.stock_quant("stock+lookup") is None
    assert not compare.is_stock("dense+off") and compare.plugin_mode("dense+off") == ("dense", None)
    # the kind each decodes with: a bare plugin setup the library's default, a sparse one off
    kinds = {"stock": "off", "stock+lookup": "lookup", "dense": params.speculative(None, "dense"),
             "dense+off": "off", "dense+ngram": "ngram", "leanstream": "off", "leanstream+auto": "off"}
    assert compare.check_setups(list(kinds)) == list(kinds)
    assert {s: compare.speculative_kind(s) for s in kinds} == kinds and kinds["dense"] == "auto"
    for bad, why in (("stock-q9_z", "no quantization Q9_Z"), ("warp", "no engine mode 'warp'"),
                     ("dense@ppl+5%", "write leanstream@ppl\\+5%"), ("leanstream@fast", "quality")):
        with pytest.raises(params.ParameterError, match=why):
            compare.check_setups([bad])
    # a sparse mode decodes plainly: the dense pass verifies drafts, so self and ngram are refused there
    for bad, why in (("leanstream+self", "leanstream mode decodes sparse"),
                     ("leanstream@ppl+5%+ngram", "dense\\+ngram"), ("stock+auto", "\\+lookup"),
                     ("dense+lookup", "no speculative kind 'lookup'")):
        with pytest.raises(params.ParameterError, match=why) as e:
            compare.check_setups(["stock", bad])
        assert e.value.name == "--setups" and repr(bad) in str(e.value)


def test_does_not_fit_decision():
    mb = 10**6
    # the source always runs (beyond the limit its mmap'd pages are re-read); the answer is whether it fits
    assert compare.stock_fit(1100 * mb, 1100 * mb, 1000 * mb, source=True)[:2] == (True, False)
    assert compare.stock_fit(1100 * mb, 1100 * mb, 2000 * mb, source=True) == (True, True, None)
    assert compare.stock_fit(1100 * mb, 1100 * mb, None, source=True) == (True, None, None)
    # a smaller quantization: runs if its file fits
    assert compare.stock_fit(800 * mb, 1100 * mb, 1000 * mb, source=False) == (True, True, None)
    runs, fits, why = compare.stock_fit(1050 * mb, 1100 * mb, 1000 * mb, source=False)
    assert (runs, fits) == (False, False) and "does not fit" in why and "1.05GB" in why
    runs, fits, why = compare.stock_fit(1200 * mb, 1100 * mb, 2000 * mb, source=False)
    assert not runs and fits and "not smaller" in why
    assert compare.stock_fit(800 * mb, 1100 * mb, None, source=False) == (True, None, None)


def test_plan_of_stock_setups(tmp_path):
    files = {}
    for name, size in (("stock", 1000), ("stock-q3_k_m", 700), ("stock-q2_k", 500)):
        files[name] = tmp_path / f"{name}.gguf"
        files[name].write_bytes(b"\0" * size)
    files["stock-q2_k+lookup"] = files["stock-q2_k"]
    plans = compare.plan_setups(list(files), files, None, limit=600, enforced=True, sparsity=None)
    assert {s: p["status"] for s, p in plans.items()} == \
        {"stock": "planned", "stock-q3_k_m": "does not fit", "stock-q2_k": "planned", "stock-q2_k+lookup": "planned"}
    assert [plans[s]["fits"] for s in files] == [False, False, True, True]
    assert plans["stock-q2_k"]["file_bytes"] == 500 and plans["stock-q2_k"]["file"] == "stock-q2_k.gguf"
    assert [plans[s]["speculative"] for s in files] == ["off", "off", "off", "lookup"]


def test_plan_of_plugin_setups_on_both_kinds(tiny_moe, tiny_dense):
    """A mixture-of-experts directory runs dense mode with prompt lookup or plain decoding; its
    other plugin setups are not run, with the library's reason (not a missing sketch). A dense
    directory without a sketch runs every speculative kind of dense mode, and not leanstream."""
    systems = ["dense", "dense+off", "dense+ngram", "dense+self", "leanstream", "leanstream@ppl+5%"]
    plans = {}
    for kind, (src, model) in (("moe", tiny_moe), ("dense", tiny_dense)):
        plans[kind] = compare.plan_setups(systems, {"stock": src}, model, limit=None, enforced=False, sparsity=None)
    assert [plans["moe"][s]["status"] for s in systems] == ["planned"] * 3 + ["not run"] * 3
    assert "prompt lookup" in plans["moe"]["dense+self"]["reason"]
    assert all("mixture-of-experts model runs in dense mode" in plans["moe"][s]["reason"] for s in systems[-2:])
    assert [plans["dense"][s]["status"] for s in systems] == ["planned"] * 4 + ["not run"] * 2
    assert all("needs a sketch or predictors" in plans["dense"][s]["reason"] for s in systems[-2:])


def test_commands_select_each_setup():
    args = argparse.Namespace(n_prompt=16, n_gen=8, repetitions=1, ctx_size=512, batch_size=512, threads=2,
                              sparsity=0.4, ppl_ctx=512, ppl_chunks=1)
    preset = compare.bench_command(Path("m.lsm"), "leanstream@ppl+5%", args, 12345)
    assert preset[preset.index("--mode") + 1] == "leanstream" and preset[preset.index("--quality") + 1] == "ppl+5%"
    assert "--sparsity" not in preset and preset[preset.index("--memory-budget") + 1] == "12345"
    lean = compare.bench_command(Path("m.lsm"), "leanstream", args, None)
    assert lean[lean.index("--sparsity") + 1] == "0.4" and "--memory-budget" not in lean
    dense = compare.perplexity_command(Path("m.lsm"), "dense", args)
    assert "--sparsity" not in dense and dense[dense.index("--chunks") + 1] == "1"
    stock = compare.bench_command(Path("m.gguf"), "stock-q2_k", args, 12345)
    assert stock[stock.index("--system") + 1] == "stock" and "--memory-budget" not in stock
    # the speculative suffix selects how bench decodes; perplexity scores logits, which it leaves as they are
    lookup = compare.bench_command(Path("m.gguf"), "stock+lookup", args, None)
    assert lookup[lookup.index("--system") + 1] == "stock+lookup"
    lookup = compare.perplexity_command(Path("m.gguf"), "stock+lookup", args)
    assert lookup[lookup.index("--system") + 1] == "stock"
    off = compare.bench_command(Path("m.lsm"), "dense+off", args, None)
    assert off[off.index("--mode") + 1] == "dense" and off[off.index("--speculative") + 1] == "off"
    assert "--speculative" not in compare.bench_command(Path("m.lsm"), "dense", args, None)
    assert "--speculative" not in compare.perplexity_command(Path("m.lsm"), "dense+off", args)


def _parse(*argv):
    from leanstream_ggml.cli import build_parser

    args = build_parser("compare").parse_args(["compare", "m.gguf", *argv])
    compare._sized(args)
    return args


def test_short_sizes_and_explicit_ones():
    a = _parse("--short")
    assert (a.n_prompt, a.n_gen, a.repetitions, a.ppl_chunks) == (16, 8, 1, 1)
    a = _parse("--short", "-n", "4")
    assert a.n_gen == 4 and a.repetitions == 1
    a = _parse()
    assert (a.n_prompt, a.n_gen, a.repetitions, a.ppl_chunks) == (64, 32, 3, None) and a.threads >= 1
    assert a.setups.split(",") == list(compare.DEFAULT_SETUPS) and a.memory_limit is None


# ---------------------------------------------------------------------------------------------
# the report

def _fake_report(applied=True):
    """A report as `run` assembles it, from made-up plans, runs and perplexities."""
    systems = ["stock", "stock+lookup", "stock-q3_k_m", "stock-q3_k_m+lookup", "stock-q2_k", "dense", "dense+off",
               "leanstream", "leanstream@ppl+5%"]
    mb = 10**6
    plans = {
        "stock": {"kind": "stock", "file": "m.Q4_K_M.gguf", "file_bytes": 1100 * mb, "fits": False,
                  "status": "planned", "reason": "its file is larger than the limit: mmap'd pages re-read from disk"},
        "stock-q3_k_m": {"kind": "stock", "file": "m.Q3_K_M.gguf", "file_bytes": 1050 * mb, "fits": False,
                         "status": "does not fit", "reason": "does not fit: its file alone (1.05GB) is larger than the limit"},
        "stock-q2_k": {"kind": "stock", "file": "m.Q2_K.gguf", "file_bytes": 700 * mb, "fits": True,
                       "status": "planned", "reason": None},
        "dense": {"kind": "plugin", "fits": True, "sparsity": None, "status": "planned", "reason": None},
        "dense+off": {"kind": "plugin", "fits": True, "sparsity": None, "status": "planned", "reason": None,
                      "speculative": "off"},
        "leanstream": {"kind": "plugin", "fits": True, "sparsity": None, "status": "planned", "reason": None},
        "leanstream@ppl+5%": {"kind": "plugin", "fits": True, "sparsity": 0.53, "status": "planned", "reason": None},
    }

    def run(system, status, budget=None, reserve=None, **kw):
        return compare.RunRecord(system=system, limit_bytes=1000 * mb, memory_budget_bytes=budget,
                                 plugin_reserve_bytes=reserve, page_cache_resident_at_start_bytes=0,
                                 loadavg_1min_at_start=0.5, status=status, **kw)

    def ok(system, tok_s, peak, budget=None, generated=(1, 2, 3), **kw):
        return run(system, "ok", budget, None if budget is None else 1000 * mb - budget, returncode=0, wall_s=9.0,
                   cgroup={"max_usage_bytes": peak},
                   result={"decode_tok_s": tok_s, "prefill_tok_s": 5 * tok_s, "peak_rss_bytes": peak + mb,
                           "generated": list(generated), "stock": "llama-cpp-python"}, **kw)

    # the stock+q3 twins are planned, not run (as plan_setups decides them); "stock", "stock-q2_k"
    # and "dense" are records as a report before the speculative fields has them
    for s in ("stock+lookup", "stock-q3_k_m+lookup"):
        plans[s] = plans[s.removesuffix("+lookup")] | {"speculative": "lookup"}
    spec = {"passes": 4, "drafted": 9, "accepted": 6, "tokens_per_pass": 2.5, "acceptance": 0.6667,
            "draft_step_ms": 12.5, "proposals": {"self": 3, "ngram": 1, "both": 0}}
    runs = {"stock": ok("stock", 1.2, 990 * mb),
            "stock+lookup": ok("stock+lookup", 1.5, 992 * mb, generated=(1, 2, 4), speculative="lookup"),
            "stock-q2_k": ok("stock-q2_k", 24.0, 800 * mb),
            "dense": ok("dense", 2.6, 995 * mb, budget=48 * mb, speculative="auto", speculative_stats=spec),
            "dense+off": ok("dense+off", 2.0, 994 * mb, budget=48 * mb, speculative="off"),
            "leanstream": run("leanstream", "skipped", 0, 1050 * mb, reason="limit below the reserve (1.05GB)"),
            "leanstream@ppl+5%": run("leanstream@ppl+5%", "error", returncode=1, wall_s=3.0,
                                     stderr_tail="Traceback ...\nValueError: budget too small\n")}
    compare.add_greedy_match(list(runs.values()))
    ppl = {"stock": {"ppl": 10.0}, "stock+lookup": {"ppl": 10.0, "measured_as": "stock"}, "stock-q2_k": {"ppl": 13.4},
           "dense": {"ppl": 10.01}, "dense+off": {"ppl": 10.01, "measured_as": "dense"}}
    rows = compare.make_rows(systems, plans, runs, ppl, accounted=True)
    return compare.Report(
        model="m.Q4_K_M.gguf", model_path="/models/m.Q4_K_M.gguf", model_bytes=1100 * mb, model_dir=None,
        model_dir_bytes=None, memory_limit_bytes=1000 * mb, limit_applied=applied,
        cgroup={"writable": True, "path": "/x"} if applied else {"writable": False, "reason": "read-only"},
        setups=rows, pareto_front=compare.front_of(rows),
        settings={"n_prompt": 16, "n_gen": 8, "repetitions": 1, "ppl_ctx": 512, "ppl_chunks": 1, "n_threads": 2},
        stock="llama-cpp-python", stock_files={}, machine={"cpu": "AMD EPYC", "cores": 2, "date": "2026-12-01"},
        runs=list(runs.values()), perplexity=ppl)


def test_rows_ratios_and_reasons():
    report = _fake_report()
    rows = {r.setup: r for r in report.setups}
    assert list(rows) == list(compare.DEFAULT_SETUPS)
    assert rows["stock"].ppl_ratio == 1.0 and rows["dense"].ppl_ratio == pytest.approx(1.001)
    assert rows["stock-q2_k"].ppl_ratio == pytest.approx(1.34) and rows["stock-q2_k"].peak_bytes == 800 * 10**6
    assert rows["stock-q3_k_m"].status == "does not fit" and rows["stock-q3_k_m"].decode_tok_s is None
    assert rows["leanstream"].fits is False and "reserve" in rows["leanstream"].reason
    assert rows["leanstream@ppl+5%"].reason == "failed: ValueError: budget too small"
    assert rows["leanstream@ppl+5%"].sparsity == 0.53
    assert rows["dense"].greedy_match_vs_stock == 1.0 and rows["leanstream"].greedy_match_vs_stock is None
    assert rows["stock+lookup"].greedy_match_vs_stock == pytest.approx(2 / 3)   # against stock's, not its own
    for r in rows.values():   # every setup: a rate, or the reason it has none
        assert (r.decode_tok_s or 0) > 0 or r.reason
    assert rows["stock+lookup"].ppl_ratio == 1.0 and rows["dense+off"].ppl_ratio == rows["dense"].ppl_ratio
    assert {s: r.speculative for s, r in rows.items()} == {
        "stock": None, "stock+lookup": "lookup", "stock-q3_k_m": None, "stock-q3_k_m+lookup": "lookup",
        "stock-q2_k": None, "dense": "auto", "dense+off": "off", "leanstream": None, "leanstream@ppl+5%": None}
    assert (rows["dense"].tokens_per_pass, rows["dense"].acceptance, rows["dense"].draft_step_ms) == (2.5, 0.6667, 12.5)
    assert rows["dense+off"].tokens_per_pass is None and rows["stock+lookup"].tokens_per_pass is None
    # a row without speculative fields (a report from before them) writes none; one with them, those set
    assert "speculative" not in rows["stock"].to_dict() and "tokens_per_pass" not in rows["dense+off"].to_dict()
    assert rows["dense"].to_dict()["tokens_per_pass"] == 2.5
    assert report.pareto_front == ["stock-q2_k", "dense", "stock+lookup"]
    doc = json.loads(json.dumps(report.to_dict()))   # the JSON --out writes
    assert doc["benchmark"] == "compare" and compare.Report.from_dict(doc) == report


def test_table_says_what_ran_and_what_did_not():
    text = compare.format_table(_fake_report())
    assert text.splitlines()[0] == "m.Q4_K_M.gguf: 1GB whole-process memory limit (cgroup), page cache included"
    assert "| setup | fits? | decode tok/s | peak MB (cgroup) | ppl × stock | note |" in text
    assert "| stock | no | 1.20 | 990 | 1.000 | m.Q4_K_M.gguf (1.10GB); its file is larger than the limit" in text
    assert "| stock-q3_k_m | no | does not fit | – | – |" in text
    assert ("| dense * | yes | 2.60 | 995 | 1.001 | budget 48MB; speculative auto, 2.50 tokens/pass, 67% of drafts "
            "accepted, draft step 12.5 ms |") in text
    assert "| dense+off | yes | 2.00 | 994 | 1.001 | budget 48MB |" in text
    assert "| stock+lookup * | no | 1.50 | 992 | 1.000 | m.Q4_K_M.gguf (1.10GB); speculative lookup; its file" in text
    assert "| stock-q3_k_m+lookup | no | does not fit | – | – |" in text
    assert "| leanstream | no | skipped | – | – | limit below the reserve (1.05GB) |" in text
    assert "| leanstream@ppl+5% | yes | error | – | – | sparsity 0.53; failed: ValueError: budget too small |" in text


def test_a_limit_not_applied_is_said():
    report = _fake_report(applied=False)
    assert "NOT APPLIED" in compare.limit_line(report) and "read-only" in compare.limit_line(report)
    assert "NOT APPLIED" in compare.format_table(report).splitlines()[0]
    assert "peak MB (RSS)" in compare.format_table(report)


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib", reason="the plot needs matplotlib (pip install matplotlib)")
    out = tmp_path / "front.png"
    compare.plot(_fake_report(), str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# the reports in bench/results, written while the records were dicts: the fixtures of what the JSON holds
RESULTS = sorted((REPO / "bench" / "results").glob("compare-*.json"))
_results = pytest.mark.parametrize("path", RESULTS or [pytest.param(None, marks=pytest.mark.skip(
    reason="no bench/results/compare-*.json to read back"))], ids=lambda p: p.name if p else "none")


@_results
def test_a_report_reads_back_as_it_was_written(path):
    """Report.from_dict then to_dict: the same JSON text, key for key and value for value (every
    run record and every row included)."""
    text = path.read_text()
    report = compare.Report.from_dict(json.loads(text))
    assert all(isinstance(r, compare.RunRecord) for r in report.runs)
    assert all(isinstance(r, compare.ReportRow) for r in report.setups)
    assert json.dumps(report.to_dict(), indent=1) + "\n" == text


@_results
def test_rows_are_made_again_from_a_report_s_runs(path):
    """make_rows on the RunRecords of a real report (its plans taken back from its rows) gives
    the rows it wrote as dicts, and front_of its Pareto front."""
    doc = json.loads(path.read_text())
    report = compare.Report.from_dict(doc)
    plans = {r.setup: {"kind": r.kind, "file": r.file, "file_bytes": r.file_bytes, "sparsity": r.sparsity,
                       "fits": r.fits, "status": r.status, "reason": r.reason, "speculative": r.speculative}
             for r in report.setups}
    runs = {e.system: e for e in report.runs}
    rows = compare.make_rows([r.setup for r in report.setups], plans, runs, report.perplexity,
                             accounted=report.cgroup["writable"])
    assert [r.to_dict() for r in rows] == doc["setups"]
    assert compare.front_of(rows) == doc["pareto_front"]


@_results
def test_table_and_plot_read_the_rows_the_json_has(path):
    """The table's lines, the plot's points and the JSON's "setups" come from the same ReportRow
    objects."""
    report = compare.Report.from_dict(json.loads(path.read_text()))
    doc = report.to_dict()
    table = compare.format_table(report).splitlines()
    lines = table[table.index("| --- | --- | ---: | ---: | ---: | --- |") + 1:][:len(report.setups) + 1]
    assert lines[-1] == ""   # the table ends after a line per row
    assert len(lines) - 1 == len(report.setups) == len(doc["setups"])
    for line, row, d in zip(lines, report.setups, doc["setups"]):
        assert d == row.to_dict() and line.startswith(f"| {row.setup}")
        assert (f"{row.decode_tok_s:.2f}" if row.decode_tok_s is not None else row.status) in line
    shown, front, missing = compare.plot_rows(report)
    assert all(any(r is x for x in report.setups) for r in shown + front + missing)
    assert [r.setup for r in front] == report.pareto_front and len(shown) + len(missing) == len(report.setups)
    assert all(r.decode_tok_s is not None and r.ppl_ratio is not None for r in shown)


def test_side_by_side_gets_its_runs_as_the_json_s_objects(tmp_path):
    """bench/side_by_side.py keeps its runs as dicts: bench_run gives the record's to_dict(), and
    add_greedy_match on those sets the key the records would have."""
    d = tmp_path / "m.lsm"
    d.mkdir()
    (d / "manifest.json").write_text("{}")
    rec, bj = compare.bench_record("dense", d, 100, 100, argparse.Namespace(), env={}, account=False,
                                   drop_cache=False)
    e, _ = compare.bench_run("dense", d, 100, 100, argparse.Namespace(), env={}, account=False, drop_cache=False)
    assert bj is None and rec.status == "skipped" and "below the reserve" in rec.reason
    assert e == rec.to_dict() | {"loadavg_1min_at_start": e["loadavg_1min_at_start"]}
    assert list(e) == ["system", "limit_bytes", "memory_budget_bytes", "plugin_reserve_bytes",
                       "page_cache_resident_at_start_bytes", "loadavg_1min_at_start", "status", "cgroup", "reason",
                       "speculative"]
    assert e["speculative"] == "auto"   # the library's default, which a bare "dense" runs
    report = _fake_report()
    dicts = [r.to_dict() for r in report.runs]
    for x in dicts:
        x.pop("greedy_match_vs_stock", None)
    compare.add_greedy_match(dicts)
    assert dicts == [r.to_dict() for r in report.runs]


# ---------------------------------------------------------------------------------------------
# end to end on SmolLM2

def test_compare_on_smollm2(smollm2_sketch_dir, tmp_path):
    """The CI form: every default setup at a 600 MB limit, --short. SmolLM2's files all fit, so
    every setup runs; the plugin setups get what their memory plan leaves of 600 MB."""
    pytest.importorskip("matplotlib", reason="the plot needs matplotlib (pip install matplotlib)")
    out, png = tmp_path / "compare.json", tmp_path / "compare.png"
    r = subprocess.run([sys.executable, "-m", "leanstream_ggml.cli", "compare", "smollm2-135m-instruct",
                        "--model-dir", str(smollm2_sketch_dir), "--memory-limit", "600MB", "--short", "-t", "2",
                        "--timeout", "300", "--out", str(out), "--plot", str(png)],
                       capture_output=True, text=True, cwd=REPO, timeout=1800)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert compare.Report.from_dict(doc).to_dict() == doc
    rows = {row["setup"]: row for row in doc["setups"]}
    assert list(rows) == list(compare.DEFAULT_SETUPS)
    for row in rows.values():
        assert (row["decode_tok_s"] or 0) > 0 or row["reason"], row
        assert f"| {row['setup']}" in r.stdout
    assert rows["stock"]["ppl_ratio"] == 1.0
    # dense computes every neuron (ffn_down in q8_0): within a few % of stock over 255 scored tokens
    assert abs(rows["dense"]["ppl_ratio"] - 1) <= 0.03, rows["dense"]
    assert 0 < rows["leanstream@ppl+5%"]["sparsity"] < 1
    assert doc["pareto_front"] and set(doc["pareto_front"]) <= set(rows)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    if doc["cgroup"]["writable"]:
        assert doc["limit_applied"]
        for row in rows.values():
            if row["status"] == "ok":
                assert row["peak_bytes"] <= 600 * 10**6
            if row["kind"] == "plugin" and row["status"] == "ok":
                plan = row["memory_plan"]
                assert plan["limit"] == 600 * 10**6 and row["memory_budget_bytes"] == plan["budget"] > 0
                # (logits: a pass's output rows, a verify pass's where the setup speculates)
                assert plan["budget"] == plan["limit"] - sum(plan[k] for k in (
                    "process", "weights", "kv_cache", "heap", "compute", "tables", "margin", "logits"))
    else:
        assert not doc["limit_applied"] and "NOT APPLIED" in r.stdout


def test_a_budget_below_the_sketch_is_skipped_before_running(smollm2_sketch_dir):
    """A sparse setup whose budget (limit - reserve) cannot hold its resident sketch does not
    fit: skipped with both sizes, no process started; dense at the same budget is not."""
    import argparse

    from leanstream_tools import compare

    sketch = compare.sketch_bytes(smollm2_sketch_dir)
    assert sketch > 0
    reserve = 100 * 2**20
    e, bj = compare.bench_record("leanstream", smollm2_sketch_dir, reserve + sketch // 2, reserve,
                                 argparse.Namespace(), env={}, account=False, drop_cache=False)
    assert bj is None and e.status == "skipped" and "cannot hold the sketch" in e.reason
    e, _ = compare.bench_record("leanstream", smollm2_sketch_dir, reserve, reserve, argparse.Namespace(),
                                env={}, account=False, drop_cache=False)
    assert e.status == "skipped" and "below the reserve" in e.reason


def test_a_missing_directory_is_converted_by_the_cli(smollm2_gguf, tmp_path):
    """Without a converted directory compare converts one, through `leanstream convert` in a
    child process (the runtime never imports the converter); an existing one is used as is."""
    from leanstream_ggml.model import manifest
    from leanstream_tools import compare

    out = compare.resolve_model_dir(smollm2_gguf, str(smollm2_gguf), str(tmp_path / "m.lsm"))
    m = manifest.load(out)
    assert m.sketch is None and len(m.layers) == m.n_layer
    stamp = (out / "manifest.json").stat().st_mtime_ns
    assert compare.resolve_model_dir(smollm2_gguf, str(smollm2_gguf), str(out)) == out
    assert (out / "manifest.json").stat().st_mtime_ns == stamp


def _tiny_model(tmp_path) -> tuple[Path, Path]:
    """(a synthetic llama GGUF of 2 layers, its directory converted for dense mode): seconds."""
    from leanstream_convert import convert
    from gguf_synth import write_tiny_model

    src = tmp_path / "tiny.gguf"
    write_tiny_model(src, arch="llama", n_layer=2, n_embd=64, n_ff=96, types={"ffn": "F16"}, seed=2)
    d = tmp_path / "tiny.lsm"
    convert(src, d, progress=False, sketch="none")
    return src, d


def test_compare_on_a_tiny_model(tmp_path):
    """The command end to end in the fast tier: stock and dense, each plainly and speculatively,
    on a synthetic model, each in its own process; the JSON it writes reads back as the Report,
    and the table has a line per row."""
    src, d = _tiny_model(tmp_path)
    out = tmp_path / "compare.json"
    setups = ["stock", "stock+lookup", "dense", "dense+off"]
    r = subprocess.run([sys.executable, "-m", "leanstream_ggml.cli", "compare", str(src), "--model-dir", str(d),
                        "--setups", ",".join(setups), "--short", "-t", "1", "-c", "128", "-b", "128",
                        "--ppl-ctx", "64", "--timeout", "120", "--no-private-copy", "--out", str(out)],
                       capture_output=True, text=True, cwd=REPO, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(out.read_text())
    report = compare.Report.from_dict(doc)
    assert report.to_dict() == doc and [e.system for e in report.runs] == setups
    for row in report.setups:
        assert row.status == "ok" and row.decode_tok_s > 0 and row.ppl_ratio is not None, row
        assert f"| {row.setup}" in r.stdout and f"{row.decode_tok_s:.2f}" in r.stdout
        assert row.greedy_match_vs_stock is not None and len(report.runs[0].result["generated"]) == 8
    rows = {row.setup: row for row in report.setups}
    assert rows["stock"].ppl_ratio == 1.0
    # how each decoded; a bare "dense" speculates (the default), its stats recorded
    assert [e.speculative for e in report.runs] == ["off", "lookup", "auto", "off"]
    assert report.runs[2].speculative_stats["tokens_per_pass"] >= 0 and rows["dense"].tokens_per_pass is not None
    assert report.runs[1].speculative_stats is None and report.runs[3].speculative_stats is None
    # one perplexity per file and mode: speculation changes no logit
    assert doc["perplexity"]["stock+lookup"]["measured_as"] == "stock" and rows["stock+lookup"].ppl_ratio == 1.0
    assert doc["perplexity"]["dense+off"]["ppl"] == doc["perplexity"]["dense"]["ppl"]


def test_a_refused_memory_plan_is_a_typed_result(tmp_path):
    """A plugin run whose memory plan refuses the limit: the child writes the plan to the file the
    runner names and exits with its own status; the runner gives a PlanRefused carrying the plan
    (never read from the child's stderr), and bench_record's record says "does not fit"."""
    from leanstream_tools import cli

    _, d = _tiny_model(tmp_path)
    args = argparse.Namespace(n_prompt=4, n_gen=2, repetitions=1, ctx_size=128, batch_size=128, threads=2,
                              sparsity=None, timeout=120)
    child = compare.run_child(compare.bench_command(d, "dense", args, None, memory_limit=20 * 10**6),
                              limit_bytes=None, timeout_s=120, env=compare.child_env(), account=False)
    assert child.command.returncode == cli.PLAN_REFUSED_EXIT and child.doc is None
    assert isinstance(child.refused, compare.PlanRefused)
    assert child.refused.plan["limit"] == 20 * 10**6 and child.refused.plan["budget"] < child.refused.plan["limit"]
    assert child.refused.reason.startswith("memory_limit 20 MB cannot hold this model in dense mode")
    assert "\n" not in child.refused.reason
    ok = compare.run_child(compare.bench_command(d, "dense", args, None), limit_bytes=None, timeout_s=120,
                           env=compare.child_env(), account=False)
    assert ok.command.status == "ok" and ok.refused is None and ok.doc["decode_tok_s"] > 0


def test_the_reserve_without_a_measured_run_is_the_memory_plan_s(tmp_path):
    """side_by_side's reserve when no unlimited run measured it: the library's memory plan (what
    the process needs besides the engine), not a second model of memory in the tool."""
    from leanstream_ggml.model import manifest
    from leanstream_ggml import memplan

    _, d = _tiny_model(tmp_path)
    reserve, how = compare.choose_reserve(None, d, None, n_ctx=256)
    plan = memplan.plan(d, manifest.load(d), 0, mode="dense", n_ctx=256)
    assert "memory plan" in how
    # the plan's "process" part is this process's RSS now: equal up to what the interpreter grew by since
    assert abs(reserve - plan.reserve) < 16 * 2**20 and plan.reserve > plan.parts["process"]
