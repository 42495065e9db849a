"""The conversion's memory limit and what each stage used (docs/design.md §22).

A conversion holds one limit for its whole run, like chat's ``memory_limit``: by default what
the machine allows this process (the smallest memory cgroup limit above it, and the memory
available now), or ``convert(memory_limit=...)`` / ``--memory-limit``. The write and sketch stages
hold one layer at a time; the profile stage runs the model through the plugin's dense engine,
whose memory plan (leanstream_ggml/memplan.py) fits the engine into what the limit leaves.

Each stage's wall time and peak resident memory (VmHWM, reset at the stage's start through
/proc/self/clear_refs) are printed at its end and recorded in the manifest (``extra.conversion``).
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

from leanstream_ggml.memplan import proc_field

MiB = 1 << 20


def _status(field: str) -> int:
    """A /proc/self/status field in bytes (VmRSS, VmHWM), 0 where unreadable (memplan's reader)."""
    return proc_field(field) or 0


class StageMeter:
    """Times each stage and its peak memory; ``records`` {stage: {"seconds", "peak_rss_bytes"}}."""

    def __init__(self, log, records: dict | None = None, on_record=None):
        self.log = log
        self.records = dict(records or {})
        self._on_record = on_record

    @staticmethod
    def _reset_peak() -> None:
        with contextlib.suppress(OSError):
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")      # resets VmHWM to the current VmRSS (proc(5))

    @contextlib.contextmanager
    def stage(self, name: str, done: bool = False):
        """Measure the block as stage ``name``; done: a stage an interrupted run finished (its
        record stays as it was)."""
        if done:
            yield
            return
        self._reset_peak()
        t0 = time.perf_counter()
        yield
        rec = {"seconds": round(time.perf_counter() - t0, 2), "peak_rss_bytes": _status("VmHWM")}
        self.records[name] = rec
        self.log(f"{name}: {rec['seconds']:.1f} s, peak {rec['peak_rss_bytes'] / MiB:.0f} MiB resident")
        if self._on_record:
            self._on_record(self.records)


def free_disk(path: Path) -> int:
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    st = os.statvfs(p)
    return st.f_bavail * st.f_frsize
