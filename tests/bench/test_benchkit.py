"""bench/benchkit.py: the run in a fresh process (--child JSON in, the last stdout line out), its
errors, the one JSON document and JSON lines."""

from __future__ import annotations

import json
import sys

import bench_modules

benchkit = bench_modules.load("benchkit")

SCRIPT = '''
import sys
sys.path.insert(0, {bench!r})
import benchkit

def child(a):
    if a.get("fail"):
        print("noise", file=sys.stderr)
        raise SystemExit("the child failed: " + a["fail"])
    print("chatter first")          # only the last stdout line is the answer
    return {{"twice": 2 * a["x"], "argv": sys.argv[1]}}

ap = benchkit.parser(__doc__, child=True)
args = ap.parse_args()
sys.exit(benchkit.answer_child(args.child, child))
'''


def test_a_run_in_a_fresh_process_answers_or_says_why_not(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(SCRIPT.format(bench=str(bench_modules.BENCH)))
    out, r = benchkit.run_child(script, {"x": 21}, timeout_s=60)
    assert out == {"twice": 42, "argv": "--child"} and r.status == "ok"
    out, r = benchkit.run_child(script, {"fail": "on purpose"}, timeout_s=60)
    assert out == {"error": f"{r.status}: the child failed: on purpose"} and r.status != "ok"


def test_regimes_and_their_limits():
    assert benchkit.regime_limit("1000MB") == 10**9
    assert [benchkit.regime_limit(r) for r in ("ram", "35%", "budget=415MB")] == [None, None, None]


def test_one_document_and_lines(tmp_path, capsys):
    assert benchkit.emit({"a": [1, 2]}, tmp_path / "doc.json") == 0
    assert json.loads(capsys.readouterr().out) == {"a": [1, 2]}
    assert (tmp_path / "doc.json").read_text() == json.dumps({"a": [1, 2]}, indent=1) + "\n"
    benchkit.emit({"b": 1})
    assert json.loads(capsys.readouterr().out) == {"b": 1}
    with benchkit.Lines(tmp_path / "rows.jsonl") as emit:
        emit({"i": 0})
        emit({"i": 1})
    assert capsys.readouterr().out.splitlines() == ['{"i": 0}', '{"i": 1}']
    with benchkit.Lines(tmp_path / "rows.jsonl") as emit:   # appended
        emit({"i": 2})
    assert [json.loads(x)["i"] for x in (tmp_path / "rows.jsonl").read_text().splitlines()] == [0, 1, 2]
    assert sys.modules["bench_benchkit"] is benchkit
