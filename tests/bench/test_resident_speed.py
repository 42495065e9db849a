"""bench/resident_speed.py --op-rows: the FFN op per row count on a model directory (a synthetic one
here), each row of a verify pass checked against that token alone before it is timed; one JSON
object with a time per row count. (The stock comparison needs llama.cpp and a real GGUF: not here.)"""

from __future__ import annotations

import json

import bench_modules
from leanstream_convert import convert
from gguf_synth import write_tiny_model

resident_speed = bench_modules.load("resident_speed")


def test_op_rows_times_every_row_count(tmp_path, capsys):
    write_tiny_model(tmp_path / "m.gguf", arch="llama", n_layer=2, n_embd=256, n_ff=512,
                     types={"gate": "Q4_K", "up": "Q4_K", "down": "Q6_K"}, seed=1)
    convert(tmp_path / "m.gguf", tmp_path / "lsm", progress=False, sketch="none")
    assert resident_speed.main([str(tmp_path / "lsm"), "--op-rows", "3,1,70", "--rounds", "2"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["layers"] == 2 and got["rounds"] == 2 and got["kernel_isa"].startswith("avx")
    assert list(got["ms_per_pass"]) == ["1", "3", "70"] and all(v > 0 for v in got["ms_per_pass"].values())
    assert all(lo <= hi for lo, hi in got["ms_range"].values())
    assert set(got["ms_per_extra_row"]) == {"3", "70"}
