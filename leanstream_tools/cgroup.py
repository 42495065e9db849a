"""Whole-process memory limits for side-by-side runs (docs/design.md §6): a child memory cgroup.

cgroup v1 only: the child is made at ``<mount>/<our own memory cgroup>/<child>`` (our own cgroup
read from /proc/self/cgroup), never anywhere else, and removed afterwards. Its
``memory.limit_in_bytes`` caps everything charged to the processes in it: anonymous memory *and*
page cache (stock llama.cpp's mmap'd GGUF), so a stock run under a limit smaller than its model
really reads from disk, and a run whose anonymous memory does not fit is OOM-killed.
``memory.memsw.limit_in_bytes`` (where the kernel has swap accounting) gets the same value, so
swap cannot stretch the limit.

How a process enters the child: `run_command` forks, and the forked child writes its own pid to
``cgroup.procs`` *before* exec (Popen's preexec_fn). Everything the command ever allocates is
charged there, from the interpreter's first page on; writing the pid from the parent after spawn
would leave a window in which the child's early allocations are charged to us (v1 does not move
existing charges with a task unless move_charge_at_immigrate is set).

Where the hierarchy is not there or not writable, `CgroupUnavailable` says why, and callers run
without a limit and say so.
"""

from __future__ import annotations

import errno
import itertools
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

V1_MEMORY_ROOT = Path("/sys/fs/cgroup/memory")

_counter = itertools.count()


class CgroupUnavailable(RuntimeError):
    """No writable cgroup v1 memory hierarchy under our own cgroup; the message says why."""


def parse_proc_cgroup(text: str) -> dict[str, str]:
    """/proc/<pid>/cgroup as {controller: path}. Each v1 line is ``id:ctrl1,ctrl2:/path``; the
    v2 unified line ``0::/path`` is keyed by ""."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        parts = line.strip().split(":", 2)
        if len(parts) != 3:
            continue
        _, ctrls, path = parts
        if ctrls == "":
            out[""] = path
        for c in ctrls.split(","):
            if c:
                out[c] = path
    return out


def own_memory_cgroup(root: Path = V1_MEMORY_ROOT, proc_cgroup_text: str | None = None) -> Path:
    """Directory of this process's own v1 memory cgroup; raises CgroupUnavailable."""
    if proc_cgroup_text is None:
        try:
            proc_cgroup_text = Path("/proc/self/cgroup").read_text()
        except OSError as e:
            raise CgroupUnavailable(f"cannot read /proc/self/cgroup: {e}") from None
    rel = parse_proc_cgroup(proc_cgroup_text).get("memory")
    if rel is None:
        raise CgroupUnavailable("no cgroup v1 memory controller in /proc/self/cgroup "
                                "(cgroup v2 only, or no memory controller)")
    d = Path(root) / rel.lstrip("/")
    if not (d / "memory.limit_in_bytes").exists():
        raise CgroupUnavailable(f"{d} is not a cgroup v1 memory directory (not mounted here?)")
    if not os.access(d, os.W_OK):
        raise CgroupUnavailable(f"{d} is not writable (run as root, or delegate the cgroup)")
    return d


def availability(root: Path = V1_MEMORY_ROOT) -> tuple[bool, str]:
    """(True, our cgroup dir) or (False, why not)."""
    try:
        return True, str(own_memory_cgroup(root))
    except CgroupUnavailable as e:
        return False, str(e)


def parse_oom_control(text: str) -> dict[str, int]:
    """memory.oom_control: ``oom_kill_disable 0 / under_oom 0 / oom_kill 3`` as a dict."""
    out = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].isdigit():
            out[parts[0]] = int(parts[1])
    return out


class MemoryCgroup:
    """A child memory cgroup with a limit. Create with `MemoryCgroup.create`, remove with
    `remove()` (or use it as a context manager) once its processes have exited."""

    def __init__(self, path: Path, limit_bytes: int | None):
        self.path = Path(path)
        self.limit_bytes = limit_bytes

    @classmethod
    def create(cls, limit_bytes: int | None, name: str | None = None, parent: Path | None = None) -> MemoryCgroup:
        """limit_bytes None: no limit, the child only accounts (peak, OOM counters)."""
        parent = Path(parent) if parent is not None else own_memory_cgroup()
        name = name or f"leanstream-{os.getpid()}-{next(_counter)}"
        if "/" in name or name in (".", ".."):
            raise ValueError(f"bad cgroup name {name!r}")
        path = parent / name
        try:
            path.mkdir()
        except OSError as e:
            raise CgroupUnavailable(f"cannot create {path}: {e}") from None
        cg = cls(path, None if limit_bytes is None else int(limit_bytes))
        if cg.limit_bytes is None:
            return cg
        try:
            cg._write("memory.limit_in_bytes", cg.limit_bytes)
            if (path / "memory.memsw.limit_in_bytes").exists():
                try:  # must come after memory.limit_in_bytes (memsw >= mem)
                    cg._write("memory.memsw.limit_in_bytes", cg.limit_bytes)
                except OSError:
                    pass  # no swap accounting on this kernel: nothing to stretch the limit with
        except OSError as e:
            cg.remove()
            raise CgroupUnavailable(f"cannot set the limit of {path}: {e}") from None
        return cg

    def _write(self, fname: str, value) -> None:
        with open(self.path / fname, "w") as f:
            f.write(f"{value}\n")

    def _read(self, fname: str) -> str:
        return (self.path / fname).read_text()

    def add_pid(self, pid: int) -> None:
        self._write("cgroup.procs", pid)

    def enter_self(self) -> None:
        """Move the calling process in (used in a forked child before exec)."""
        self._write("cgroup.procs", os.getpid())

    def pids(self) -> list[int]:
        try:
            return [int(x) for x in self._read("cgroup.procs").split()]
        except OSError:
            return []

    def stats(self) -> dict[str, int]:
        """Charged-memory counters of the child: usage and peak (bytes, page cache included),
        how often the limit was hit (failcnt) and how many OOM kills it saw (kernel >= 4.13)."""
        out: dict[str, int] = {}
        for key, fname in (("usage_bytes", "memory.usage_in_bytes"),
                           ("max_usage_bytes", "memory.max_usage_in_bytes"),
                           ("failcnt", "memory.failcnt")):
            try:
                out[key] = int(self._read(fname).strip())
            except (OSError, ValueError):
                pass
        try:
            oc = parse_oom_control(self._read("memory.oom_control"))
            if "oom_kill" in oc:
                out["oom_kill"] = oc["oom_kill"]
        except OSError:
            pass
        return out

    def remove(self, wait_s: float = 5.0) -> None:
        """rmdir the child. Its processes must have exited (their exit is waited for up to
        wait_s); v1 moves its remaining page-cache charges to the parent."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError as e:
                if e.errno != errno.EBUSY or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def __enter__(self) -> MemoryCgroup:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


@dataclass
class CommandResult:
    status: str                 # "ok" | "oom" | "timeout" | "error" (nonzero exit or signal)
    returncode: int | None
    wall_s: float
    stdout: str
    stderr: str
    limit_bytes: int | None     # the limit that bound the command; None if it ran unlimited
    cgroup: dict = field(default_factory=dict)  # MemoryCgroup.stats() at exit

    def to_dict(self, stderr_tail: int = 2000) -> dict:
        return {"status": self.status, "returncode": self.returncode, "wall_s": round(self.wall_s, 3),
                "limit_bytes": self.limit_bytes, "cgroup": self.cgroup,
                "stderr_tail": self.stderr[-stderr_tail:] if self.status != "ok" else ""}


def run_command(cmd: list[str], limit_bytes: int | None = None, timeout_s: float | None = None,
                env: dict | None = None, cwd: str | None = None, parent: Path | None = None,
                account: bool = False) -> CommandResult:
    """Run ``cmd`` to completion in its own child memory cgroup limited to ``limit_bytes``
    (None: no limit; then a cgroup only if ``account``, to measure the charged peak). Never
    hangs: past ``timeout_s`` the command's whole process group is killed and the result says
    "timeout"; a command the kernel OOM-killed says "oom". Raises CgroupUnavailable if a limit
    (or accounting) is asked for and cannot be set."""
    cg = MemoryCgroup.create(limit_bytes, parent=parent) if (limit_bytes is not None or account) else None
    t0 = time.perf_counter()
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=env, cwd=cwd, start_new_session=True,
                                preexec_fn=cg.enter_self if cg is not None else None)
        timed_out = False
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # its own session: only what we started
            except ProcessLookupError:
                pass
            out, err = proc.communicate()
        wall = time.perf_counter() - t0
        stats = cg.stats() if cg is not None else {}
    finally:
        if cg is not None:
            cg.remove()
    rc = proc.returncode
    if timed_out:
        status = "timeout"
    elif rc == 0:
        status = "ok"
    elif rc == -signal.SIGKILL and cg is not None and (stats.get("oom_kill", 0) > 0
                                                       or ("oom_kill" not in stats and stats.get("failcnt", 0) > 0)):
        status = "oom"
    else:
        status = "error"
    return CommandResult(status, rc, wall, out or "", err or "", limit_bytes, stats)
