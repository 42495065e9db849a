"""Process counters, sizes and the machine: the measurements every harness number rests on.

Definitions (docs/design.md §5), used by `leanstream bench`, `leanstream perplexity` and bench/:

- peak RSS      = VmHWM of /proc/<pid>/status: the whole process's resident high-water mark,
                  file-backed (mmap'd model) pages included.
- disk bytes    = read_bytes of /proc/<pid>/io: bytes this process (all its threads) caused to be
                  fetched from the block device. Page faults on an mmap'd GGUF and O_DIRECT reads
                  are both counted; reads served by the page cache are not (that is `rchar`).
- tokens/s      = tokens / wall seconds of the phase (time.perf_counter), no load time included.

Standard library only.
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
from pathlib import Path

# ---------------------------------------------------------------------------------------------
# sizes

def parse_size(text: str | int | float | None) -> int | None:
    """Bytes from "900MB" (10^6), "512MiB" (2^20), "1.5G", "123" (bytes) or a number.
    "none", "" and None mean no limit and return None. (params.size_bytes parses.)"""
    from leanstream_ggml.native.params import size_bytes

    n = size_bytes(text, "size")
    return n or None


def format_size(n: int | None) -> str:
    """Short human form in decimal units (the unit `parse_size` reads back as the same bytes
    for whole MB)."""
    if n is None:
        return "none"
    for unit, f in (("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if n >= f:
            v = n / f
            if v == int(v):
                return f"{v:.0f}{unit}"
            return f"{v:.2f}{unit}" if v < 10 else f"{v:.1f}{unit}" if v < 100 else f"{v:.0f}{unit}"
    return f"{n}B"


# ---------------------------------------------------------------------------------------------
# /proc counters

def parse_proc_status(text: str) -> dict[str, int]:
    """The Vm*/Rss* fields of /proc/<pid>/status in bytes (the kernel writes them in kB)."""
    out = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if len(parts) == 2 and parts[1] == "kB" and parts[0].isdigit():
            out[key.strip()] = int(parts[0]) * 1024
    return out


def parse_proc_io(text: str) -> dict[str, int]:
    """/proc/<pid>/io as a dict of ints (rchar, wchar, syscr, syscw, read_bytes, write_bytes, ...)."""
    out = {}
    for line in text.splitlines():
        key, _, val = line.partition(":")
        val = val.strip()
        if key and val.isdigit():
            out[key.strip()] = int(val)
    return out


def proc_status(pid: int | str = "self") -> dict[str, int]:
    return parse_proc_status(Path(f"/proc/{pid}/status").read_text())


def proc_io(pid: int | str = "self") -> dict[str, int]:
    """Empty dict where the kernel does not provide /proc/<pid>/io (no task I/O accounting)."""
    try:
        return parse_proc_io(Path(f"/proc/{pid}/io").read_text())
    except OSError:
        return {}


def peak_rss_bytes(pid: int | str = "self") -> int | None:
    return proc_status(pid).get("VmHWM")


def disk_read_bytes(pid: int | str = "self") -> int | None:
    return proc_io(pid).get("read_bytes")


# ---------------------------------------------------------------------------------------------
# model files and the page cache

def model_files(path: str | os.PathLike) -> list[Path]:
    """The files a system reads its weights from: the GGUF itself, or every regular file of a
    model directory (manifest, base.gguf, ffn/blk.N.bin, predictor/...)."""
    p = Path(path)
    if p.is_dir():
        return sorted(f for f in p.rglob("*") if f.is_file())
    return [p]


def files_size(paths) -> int:
    return sum(Path(f).stat().st_size for f in paths)


def drop_page_cache(paths) -> None:
    """Ask the kernel to drop the page-cache pages of each file (after writing back dirty ones),
    so the next run reads them from disk. Pages another process has mapped stay, and a file
    another process reads comes back: check with `resident_bytes`, or benchmark a private copy."""
    for f in paths:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages (a fresh copy) are written back, not dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def resident_bytes(path: str | os.PathLike) -> int | None:
    """Bytes of the file now in the page cache (mincore; None where it cannot be told)."""
    from leanstream_ggml.model.pagecache import resident_bytes as rb

    return rb(path)


# ---------------------------------------------------------------------------------------------
# the machine

def _ggml_cpu_variant() -> str | None:
    """The CPU backend variant llama.cpp runs here (haswell, zen4, ...); None if not loadable."""
    try:
        from leanstream_ggml.native import engine
    except ImportError:
        return None
    return engine.ggml_cpu_variant()


def machine_info() -> dict:
    """What a reader needs to place the numbers: CPU model, cores, RAM, kernel, date."""
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = None
    try:
        mem = parse_proc_status(Path("/proc/meminfo").read_text()).get("MemTotal")
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "mem_total_bytes": mem,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "ggml_cpu": _ggml_cpu_variant(),
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d"),
    }
