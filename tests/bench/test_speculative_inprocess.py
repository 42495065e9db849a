"""bench/speculative_inprocess.py: configs loaded side by side in one process, each prompt decoded
by every config in turn; one JSON document with tok/s, the ratio to off and its spread by prompt,
and whether every answer equals off's (the real SmolLM2, greedy: the default must give off's)."""

from __future__ import annotations

import json

import bench_modules
import pytest

inprocess = bench_modules.load("speculative_inprocess")


def test_off_and_the_default_interleaved_in_one_process(smollm2_dir, tmp_path, capsys):
    out = tmp_path / "r.json"
    assert inprocess.main([str(smollm2_dir), "--configs", "off,auto", "--prompts", "1", "--max-tokens", "24",
                           "--rounds", "1", "--out", str(out)]) == 0
    got = json.loads(capsys.readouterr().out)
    assert json.loads(out.read_text()) == got
    assert [s["domain"] for s in got["summary"]] == ["code", "chat"]
    assert len(got["runs"]) == 4 and {r["config"] for r in got["runs"]} == {"off", "auto"}
    for s in got["summary"]:
        off, auto = s["configs"]["off"], s["configs"]["auto"]
        assert off["ratio_to_off"] == 1.0 and off["decode_tps"] > 0
        assert auto["same_answers"] is True
        r = auto["ratio_by_prompt"]
        assert r["min"] <= r["median"] <= r["max"] and r["min"] > 0
    assert got["speculative"]["auto"]["passes"] + got["speculative"]["auto"]["plain_passes"] > 0
    with pytest.raises(SystemExit) as e:
        inprocess.main([str(smollm2_dir), "--configs", "auto"])
    assert e.value.code == 2
