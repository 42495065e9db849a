"""What a random read costs on the disk a converted model sits on, by read size and depth, and the
fraction of a layer a token may need before reading only that part stops paying.

    python bench/disk_iops.py MODEL.lsm [--depths 1 4 16 64 128] [--sizes 4096 16384 65536 262144 1048576]
                              [--seconds 1.0] [--out FILE]

Builds bench/disk_iops.c with the system C compiler and runs it on the model's block files:
random O_DIRECT reads (4096-aligned, uniform over the files, so the page cache never serves them)
of each size, with DEPTH threads each keeping one read in flight. A warm-up of --warmup seconds
goes first (the first reads of a session ran up to 8x slower here: 9 k against 72 k reads/s at
4 KiB, depth 64); then each cell runs about --seconds (a pilot sizes it), twice, the faster kept
(as the engine's own probe does, native/src/io.c).

Prints one JSON object:

  cells      per size and depth: reads per second, µs per read (wall time / reads), MB/s
  model      per-read cost c = 1/IOPS(4 KiB) - 4 KiB/B at the best depth, and bandwidth B (the
             largest size at the best depth): a gap shorter than c·B is cheaper to read through
             than to skip
  breakeven  for the model's block (one neuron block: gate/up rows and down column), the largest
             fraction f* of a layer's blocks a token may need for reading them one by one (at the
             best depth's IOPS) to beat reading the whole layer front to back at B:
             f* = IOPS(block) * block_stride / B
  needs      the conversion's calibration read frequencies (sketch/block_freq.npy: the fraction of
             calibration tokens in which each block is read at the default setting), as
             percentiles over all blocks: the fraction of a layer an uncached block's token needs
             is at least the frequency of the blocks the cache does not hold

Nothing else may run during the measurement (docs/design.md §6).
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

import benchkit

HERE = Path(__file__).resolve().parent
DEPTHS = (1, 4, 16, 64, 128)
SIZES = (4096, 16384, 65536, 262144, 1 << 20)


def build(out_dir: Path) -> Path:
    """bench/disk_iops.c compiled into out_dir (cc -O2 -pthread)."""
    return benchkit.build_c(HERE / "disk_iops.c", out_dir, "-pthread")


def run_cell(exe: Path, files: list[str], size: int, depth: int, n_reads: int, seed: int) -> float:
    """Seconds n_reads random reads of size bytes took at depth."""
    p = subprocess.run([str(exe), str(size), str(depth), str(n_reads), str(seed), *files],
                       capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"disk_iops: {p.stderr.strip() or 'failed'}")
    return float(p.stdout.split()[1])   # "reads seconds"


def measure(exe: Path, files: list[str], size: int, depth: int, seconds: float, seed: int) -> dict:
    pilot = 8 * depth
    t = run_cell(exe, files, size, depth, pilot, seed)
    n = int(np.clip(pilot * seconds / max(t, 1e-6), pilot, 400_000))
    best = min(run_cell(exe, files, size, depth, n, seed + 1 + rep) for rep in range(2))
    return {"size": size, "depth": depth, "reads": n, "seconds": round(best, 6),
            "iops": round(n / best), "us_per_read": round(best * 1e6 / n, 2),
            "mb_s": round(n * size / best / 1e6, 1)}


def disk_model(cells: list[dict]) -> dict:
    """c and B from the cells (module doc)."""
    small = min(c["size"] for c in cells)
    large = max(c["size"] for c in cells)
    best_small = max((c for c in cells if c["size"] == small), key=lambda c: c["iops"])
    best_large = max((c for c in cells if c["size"] == large), key=lambda c: c["mb_s"])
    bandwidth = best_large["mb_s"] * 1e6
    per_read = max(1.0 / best_small["iops"] - small / bandwidth, 0.0)
    return {"per_read_us": round(per_read * 1e6, 2), "bandwidth_mb_s": round(bandwidth / 1e6, 1),
            "bridge_kib": round(per_read * bandwidth / 1024, 1),
            "best_depth_small": best_small["depth"], "best_depth_large": best_large["depth"]}


def breakeven(stride: int, iops_block: float, bandwidth: float) -> float:
    """f* = IOPS(block) * stride / B (module doc), at most 1."""
    return min(iops_block * stride / bandwidth, 1.0)


def main() -> int:
    ap = benchkit.parser(__doc__)
    ap.add_argument("model", type=Path, help="a converted model directory")
    ap.add_argument("--depths", type=int, nargs="+", default=list(DEPTHS))
    ap.add_argument("--sizes", type=int, nargs="+", default=list(SIZES), help="read sizes (multiples of 4096)")
    ap.add_argument("--seconds", type=float, default=1.0, help="about this long per cell")
    ap.add_argument("--warmup", type=float, default=5.0, help="seconds of reads before the first cell")
    ap.add_argument("--out", type=Path, help="also write the JSON here")
    a = ap.parse_args()
    from leanstream_ggml.model import manifest as mf
    from leanstream_tools import measure as hm

    m = mf.load(a.model)
    files = [str(m.resolve(a.model, e.file)) for e in m.layers]
    stride = max(e.block_stride for e in m.layers)
    bad = [s for s in a.sizes if s <= 0 or s % 4096]
    if bad:
        ap.error(f"--sizes must be positive multiples of 4096, got {bad}")
    block_size = -(-stride // 4096) * 4096   # one block, as an aligned read
    sizes = sorted(set(a.sizes) | {block_size})
    with tempfile.TemporaryDirectory() as tmp:
        exe = build(Path(tmp))
        if a.warmup > 0:
            t = run_cell(exe, files, 65536, 16, 128, seed=999)
            run_cell(exe, files, 65536, 16, max(int(128 * a.warmup / max(t, 1e-6)), 128), seed=998)
        cells = []
        for size in sizes:
            for depth in a.depths:
                cells.append(measure(exe, files, size, depth, a.seconds, seed=len(cells) * 10))
                print(f"{size:>8} B  depth {depth:>3}: {cells[-1]['iops']:>7} reads/s  "
                      f"{cells[-1]['us_per_read']:>8} µs/read  {cells[-1]['mb_s']:>7} MB/s", file=sys.stderr)
    model = disk_model(cells)
    iops_block = max(c["iops"] for c in cells if c["size"] == block_size)
    f_star = breakeven(stride, iops_block, model["bandwidth_mb_s"] * 1e6)
    out = {"model_dir": a.model.name, "block_stride": stride, "block_read": block_size, "cells": cells,
           "model": model,
           "breakeven": {"iops_block": iops_block, "fraction": round(f_star, 4)},
           "machine": hm.machine_info()}
    if m.sketch and m.sketch.block_freq:
        freq = np.load(m.resolve(a.model, m.sketch.block_freq)).ravel()
        out["needs"] = {"source": "sketch/block_freq.npy (read at the default setting, calibration text)",
                        "mean": round(float(freq.mean()), 4),
                        "percentiles": {str(q): round(float(np.percentile(freq, q)), 4) for q in (1, 5, 10, 25, 50, 75, 90)},
                        "share_of_blocks_below_breakeven": round(float((freq < f_star).mean()), 4)}
    return benchkit.emit(out, a.out)


if __name__ == "__main__":
    sys.exit(main())
