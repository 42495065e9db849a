"""The plain memory-read speed of this machine: what the FFN kernels' GB/s of weights are compared
with (tests/bench/test_kernel_bench.py).

    python bench/memory_read.py [--bytes 268435456] [--threads 2] [--rounds 7] [--out FILE]

Builds bench/memory_read.c with the system C compiler (-O2 -mavx2) and runs it: a buffer of
--bytes written first (every page in RAM), then read --rounds times by --threads threads with AVX2
loads, each thread a contiguous share of whole 64-byte lines (as the dense op streams its share of
a layer). Every round's xor fold of the buffer is checked against a scalar fold before a time is
kept. Prints one JSON object: bytes, threads, the seconds of each round, and gb_s (bytes over the
median round).
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import benchkit

HERE = Path(__file__).resolve().parent


def build(out_dir: Path) -> Path:
    """bench/memory_read.c compiled into out_dir (cc -O2 -mavx2 -pthread)."""
    return benchkit.build_c(HERE / "memory_read.c", out_dir, "-mavx2", "-pthread")


def run(exe: Path, n_bytes: int, n_threads: int, rounds: int) -> dict:
    """One run of the reader: n_bytes (rounded down to whole 64-byte lines) read rounds times."""
    n = n_bytes // 64 * 64
    p = subprocess.run([str(exe), str(n), str(n_threads), str(rounds)], capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"memory_read: {p.stderr.strip() or 'failed'}")
    fold, *seconds = p.stdout.split()
    seconds = [float(s) for s in seconds]
    return {"bytes": n, "threads": n_threads, "fold": fold, "seconds": seconds,
            "gb_s": round(n / statistics.median(seconds) / 1e9, 3)}


def measure(n_bytes: int, n_threads: int, rounds: int = 7) -> dict:
    """build + run in a temporary directory."""
    with tempfile.TemporaryDirectory() as tmp:
        return run(build(Path(tmp)), n_bytes, n_threads, rounds)


def main() -> int:
    ap = benchkit.parser(__doc__)
    ap.add_argument("--bytes", type=int, default=256 << 20, help="buffer size (larger than the last-level cache)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", type=Path, help="also write the JSON here")
    a = ap.parse_args()
    if a.bytes < 64 or a.threads < 1 or a.rounds < 1:
        ap.error("--bytes must be >= 64, --threads and --rounds >= 1")
    return benchkit.emit(measure(a.bytes, a.threads, a.rounds), a.out)


if __name__ == "__main__":
    sys.exit(main())
