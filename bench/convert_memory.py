"""Time and memory of a whole `leanstream convert` run, phase by phase, from the outside.

    python bench/convert_memory.py [--limit 1000MB] -- leanstream convert model.gguf out.lsm --force

Runs the command (in a child memory cgroup of exactly --limit bytes where cgroups are writable,
leanstream_tools/cgroup.py), samples its resident memory (VmRSS of the process tree) every
0.2 s, and splits the run into phases by the progress bars' and log lines' names on stderr (a
converter's own stage records, when it has them, are in its manifest: extra.conversion). Prints
one JSON object: status, seconds, peak RSS, the cgroup's peak usage (page cache included) and
per phase its start, seconds and peak RSS. Works for converters that print nothing of their own
stages (an older version, for before/after figures).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# "writing FFN block files:  50%|..." (tqdm) or "profile: 12.3 s, ..." (a log line)
_PHASE = re.compile(r"^\s*([A-Za-z][A-Za-z0-9 ()_,.='-]{2,60}?)(?::\s+\d+%\||: \d)")


def _tree_rss(pid: int) -> int:
    total = 0
    pids = [pid]
    try:
        kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        pids += [int(k) for k in kids]
    except OSError:
        pass
    for p in pids:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--limit", default=None, help="whole-process limit, e.g. 1000MB (10^6 bytes per MB)")
    ap.add_argument("cmd", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd
    if not cmd:
        ap.error("no command")
    cg = None
    limit = None
    if a.limit:
        from leanstream_ggml.native.params import size_bytes
        from leanstream_tools.cgroup import CgroupUnavailable, MemoryCgroup

        limit = size_bytes(a.limit, "limit")
        try:
            cg = MemoryCgroup.create(limit)
        except CgroupUnavailable as e:
            print(f"convert_memory: no cgroup ({e}); running without a limit", file=sys.stderr)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1,
                            preexec_fn=(lambda: cg.add_pid(os.getpid())) if cg else None)
    samples: list[tuple[float, int]] = []
    events: list[tuple[float, str]] = []
    done = threading.Event()

    def sample():
        while not done.is_set():
            samples.append((time.perf_counter() - t0, _tree_rss(proc.pid)))
            time.sleep(0.2)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    tail: list[str] = []
    for chunk in proc.stderr:
        for line in re.split(r"[\r\n]", chunk):
            if not line.strip():
                continue
            tail = (tail + [line])[-20:]
            m = _PHASE.match(line)
            if m and (not events or events[-1][1] != m.group(1).strip()):
                events.append((time.perf_counter() - t0, m.group(1).strip()))
    stdout = proc.stdout.read()
    rc = proc.wait()
    done.set()
    th.join()
    total = time.perf_counter() - t0
    cg_stats = None
    if cg:
        cg_stats = cg.stats()
        cg.remove()
    phases = []
    for i, (ts, name) in enumerate(events):
        te = events[i + 1][0] if i + 1 < len(events) else total
        peak = max((r for t, r in samples if ts <= t <= te), default=0)
        phases.append({"phase": name, "start_s": round(ts, 1), "seconds": round(te - ts, 1), "peak_rss_bytes": peak})
    print(json.dumps({"command": cmd, "status": rc, "limit_bytes": limit, "in_cgroup": cg is not None,
                      "seconds": round(total, 1), "peak_rss_bytes": max((r for _, r in samples), default=0),
                      "cgroup": cg_stats, "phases": phases,
                      "stdout_tail": stdout.splitlines()[-5:], **({"stderr_tail": tail} if rc else {})}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
