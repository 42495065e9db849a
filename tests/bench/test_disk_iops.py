"""bench/disk_iops.py: the disk model and break-even fraction against hand formulas, and the
script end to end on the real SmolLM2's block files (its C reader, its refusals)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

import bench_modules

disk_iops = bench_modules.load("disk_iops")


def _cell(size, depth, iops):
    return {"size": size, "depth": depth, "iops": iops, "us_per_read": 1e6 / iops, "mb_s": iops * size / 1e6}


def test_disk_model_takes_the_best_depth_of_the_smallest_and_largest_reads():
    cells = [_cell(4096, 1, 10_000), _cell(4096, 64, 80_000), _cell(65536, 64, 12_000),
             _cell(1 << 20, 1, 1_150), _cell(1 << 20, 64, 1_000)]
    got = disk_iops.disk_model(cells)
    bandwidth = 1_150 * (1 << 20)                     # bytes/s: the largest reads' best depth
    per_read = 1 / 80_000 - 4096 / bandwidth          # 4 KiB at its best depth, less the transfer
    assert got["bandwidth_mb_s"] == pytest.approx(bandwidth / 1e6, abs=0.05)
    assert got["per_read_us"] == pytest.approx(per_read * 1e6, abs=0.005)
    assert got["bridge_kib"] == pytest.approx(per_read * bandwidth / 1024, abs=0.05)
    assert (got["best_depth_small"], got["best_depth_large"]) == (64, 1)
    # a disk slower per read than its transfer: no negative cost
    assert disk_iops.disk_model([_cell(4096, 1, 1e9), _cell(8192, 1, 1e3)])["per_read_us"] == 0.0


def test_breakeven_is_the_fraction_where_one_by_one_costs_a_sweep():
    stride, iops, bw = 3072, 88_000, 1.2e9
    f = disk_iops.breakeven(stride, iops, bw)
    n = 8960   # a layer's blocks: reading f*n of them one by one takes as long as sweeping all n
    assert f * n / iops == pytest.approx(n * stride / bw)
    assert disk_iops.breakeven(stride, 1e9, bw) == 1.0


def test_disk_iops_on_smollm2(smollm2_sketch_dir, tmp_path):
    out = tmp_path / "iops.json"
    p = subprocess.run([sys.executable, str(bench_modules.BENCH / "disk_iops.py"), str(smollm2_sketch_dir),
                        "--depths", "1", "4", "--sizes", "4096", "8192", "--seconds", "0.05", "--warmup", "0",
                        "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    got = json.loads(out.read_text())
    assert got["block_read"] % 4096 == 0 and got["block_read"] >= got["block_stride"] > 0
    sizes = sorted({4096, 8192, got["block_read"]})
    assert [(c["size"], c["depth"]) for c in got["cells"]] == [(s, d) for s in sizes for d in (1, 4)]
    for c in got["cells"]:
        assert c["iops"] > 0 and c["reads"] >= 8 * c["depth"]
        assert c["iops"] == pytest.approx(c["reads"] / c["seconds"], rel=0.01, abs=1)
        assert c["mb_s"] == pytest.approx(c["iops"] * c["size"] / 1e6, rel=0.01, abs=0.2)
    best = max(c["iops"] for c in got["cells"] if c["size"] == got["block_read"])
    bw = max(c["mb_s"] for c in got["cells"] if c["size"] == max(sizes)) * 1e6
    assert got["breakeven"]["iops_block"] == best
    assert got["breakeven"]["fraction"] == pytest.approx(min(best * got["block_stride"] / bw, 1.0), abs=1e-3)
    freq = np.load(smollm2_sketch_dir / "sketch" / "block_freq.npy").ravel()
    needs = got["needs"]
    assert needs["mean"] == pytest.approx(float(freq.mean()), abs=1e-4)
    assert needs["percentiles"]["10"] == pytest.approx(float(np.percentile(freq, 10)), abs=1e-4)
    assert needs["share_of_blocks_below_breakeven"] == pytest.approx(
        float((freq < got["breakeven"]["fraction"]).mean()), abs=2e-3)


def test_disk_iops_reader_refuses_bad_arguments(tmp_path):
    exe = disk_iops.build(tmp_path)
    f = tmp_path / "data.bin"
    f.write_bytes(b"\0" * (1 << 16))
    for args in (["1000", "1", "8"], ["4096", "0", "8"], ["4096", "4", "2"]):   # unaligned, no depth, reads < depth
        p = subprocess.run([str(exe), *args, "1", str(f)], capture_output=True, text=True)
        assert p.returncode == 2 and "LEN must be" in p.stderr
    p = subprocess.run([str(exe), "131072", "1", "8", "1", str(f)], capture_output=True, text=True)
    assert p.returncode == 1 and "no file holds a read" in p.stderr
    p = subprocess.run([str(exe), "4096", "1", "8", "1", str(tmp_path / "missing.bin")], capture_output=True, text=True)
    assert p.returncode == 1 and "missing.bin" in p.stderr
