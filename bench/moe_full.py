"""The full-depth synthetic Qwen3-30B-A3B shape (bench/moe_synth.py --layers 48, ~19 GB): its
conversion inside a memory cgroup, then decoding under whole-process limits, plugin against stock.

    python bench/moe_full.py convert --gguf /tmp/qwen3moe-48l.gguf --model-dir /tmp/qwen3moe-48l.lsm \
        --limit 4000MB --out bench/results/moe-qwen3moe48-convert-4000MB-2026-12-06.json
    python bench/moe_full.py decode --gguf /tmp/qwen3moe-48l.gguf --model-dir /tmp/qwen3moe-48l.lsm \
        --limits 4000MB,8000MB --systems plugin,stock --stock-timeout 480 \
        --out-pattern bench/results/moe-qwen3moe48-{limit}-2026-12-06.json
    python bench/moe_full.py decode ... --systems stock-norepack --append   # another system, same documents

convert: `leanstream convert GGUF DIR --memory-limit LIMIT --force` as a child in a memory cgroup of
exactly LIMIT's bytes (leanstream_tools/cgroup.py run_command), after the GGUF's page cache was
dropped. Every 0.5 s a thread samples the cgroup's charged usage (page cache included) and the
child tree's RSS. Recorded: the wall time, the cgroup's peak (memory.max_usage_in_bytes), failcnt
and OOM kills, the converter's own stage records (manifest "conversion": seconds and peak RSS per
stage), the disk's bytes read/written and busy share, and the converter's CPU.

decode: bench/moe_side_by_side.py's runs (its one_run / summary: a fresh process per run in a
cgroup of the limit's bytes, page cache of the GGUF and the model directory dropped first; decode
tok/s, disk bytes per token, busy and CPU share, the plugin's hits / misses / bytes_read against the
routed misses' bytes), one run per system and limit, in the order the flags give. Each document is
rewritten after every run, so a run cut short leaves the earlier ones; --append adds runs (another
round, another system) to the documents already written. Systems: moe_side_by_side's (plugin,
stock, stock-fa) and stock-norepack: stock with use_extra_bufts off (no CPU_REPACK copy of the
Q4_K weights in anonymous memory, which alone outgrows 8 GB on this model), run by this script's
own child.

Timing discipline (2 shared cores): every timed step (the conversion, each decode run) waits until
--lock (default /tmp/quiet.lock) does not exist, creates it, and removes it when the step ends;
the lock is not held between steps.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import benchkit
import moe_side_by_side as msbs
from leanstream_tools import cgroup, measure

LOCK = "/tmp/quiet.lock"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _take(lock: str, tag: str) -> None:
    while True:
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            break
        except FileExistsError:
            time.sleep(2)
    os.write(fd, (tag + "\n").encode())
    os.close(fd)


def _release(lock: str) -> None:
    try:
        os.unlink(lock)
    except FileNotFoundError:
        pass


def machine_busy_share(seconds: float = 2.0) -> float:
    """The whole machine's busy share (all cores) over ``seconds``."""
    b0, t0 = msbs.machine_busy_s(), time.perf_counter()
    time.sleep(seconds)
    return (msbs.machine_busy_s() - b0) / (time.perf_counter() - t0) / (os.cpu_count() or 1)


QUIET = {"max_busy": None, "max_wait_s": 0.0}   # --quiet-cpu / --quiet-wait


@contextmanager
def quiet(lock: str, tag: str = "moe48"):
    """Wait for ``lock`` to be absent, create it (O_EXCL), remove it when the block ends. With
    --quiet-cpu: once the lock is ours, the machine's busy share over 2 s must be below it (work
    that does not take the lock, e.g. a test suite); if not, the lock is given back and taken
    again 15 s later, for at most --quiet-wait s, then the step runs anyway. Yields
    {"lock_waited_s", "machine_busy_before"}."""
    t0 = time.monotonic()
    while True:
        _take(lock, tag)
        busy = machine_busy_share() if QUIET["max_busy"] is not None else None
        if busy is None or busy <= QUIET["max_busy"] or time.monotonic() - t0 > QUIET["max_wait_s"]:
            break
        _release(lock)
        log(f"machine busy {busy:.2f} with the lock ours: given back, again in 15 s")
        time.sleep(15)
    waited = time.monotonic() - t0
    log(f"lock taken (waited {waited:.0f} s, machine busy before {busy})")
    try:
        yield {"lock_waited_s": round(waited, 1), "machine_busy_before": busy}
    finally:
        _release(lock)
        log("lock released")


# ---------------------------------------------------------------------------------------------
# conversion

def _children(pid: int) -> list[int]:
    out = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                out += [int(k) for k in Path(f"/proc/{pid}/task/{tid}/children").read_text().split()]
            except OSError:
                pass
    except OSError:
        pass
    return out


def _tree(pid: int) -> list[int]:
    seen, todo = [], [pid]
    while todo:
        p = todo.pop()
        seen.append(p)
        todo += _children(p)
    return seen


def _rss(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _cpu_s(pid: int) -> float:
    """user+sys of ``pid``, all its threads (/proc/pid/stat fields 14-15)."""
    try:
        f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return sum(int(x) for x in f[11:13]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError):
        return 0.0


def diskstats_rw(name: str) -> dict:
    for line in Path("/proc/diskstats").read_text().splitlines():
        f = line.split()
        if len(f) >= 14 and f[2] == name:
            return {"read_bytes": int(f[5]) * 512, "write_bytes": int(f[9]) * 512, "io_ticks_ms": int(f[12])}
    raise RuntimeError(f"disk {name} not in /proc/diskstats")


def convert(a) -> int:
    doc, _ = run_convert(a)
    return benchkit.emit(doc, a.out)


def run_convert(a, benchmark: str = "moe_full convert", extra: tuple[str, ...] = (), tag: str = "moe48"):
    """The conversion of a.gguf into a.model_dir in a cgroup of a.limit's bytes (a.timeout,
    a.lock, ``tag`` written in it), ``extra`` more arguments to `leanstream convert`: (its
    document, the cgroup.run_command result, whose stdout and stderr are whole)."""
    gguf, out_dir = Path(a.gguf), Path(a.model_dir)
    limit = benchkit.regime_limit(a.limit)
    ok, where = cgroup.availability()
    if not ok:
        raise SystemExit(f"cgroups not writable ({where}): this bench needs real limits")
    own = Path(where)
    cmd = [str(benchkit.REPO / ".venv" / "bin" / "leanstream"), "convert", str(gguf), str(out_dir),
           "--memory-limit", a.limit, "--force", *extra]
    disk = msbs.disk_of(str(gguf))
    samples: list[dict] = []
    done = threading.Event()
    me = os.getpid()
    cpu_by_pid: dict[int, float] = {}

    def sample():
        t0 = time.perf_counter()
        while not done.is_set():
            kids = _children(me)
            pids = [p for k in kids for p in _tree(k)]
            for p in pids:
                cpu_by_pid[p] = max(cpu_by_pid.get(p, 0.0), _cpu_s(p))
            usage = None
            for d in own.glob(f"leanstream-{me}-*"):
                try:
                    usage = int((d / "memory.usage_in_bytes").read_text())
                except (OSError, ValueError):
                    pass
            samples.append({"t": round(time.perf_counter() - t0, 2), "rss": sum(_rss(p) for p in pids), "cg": usage})
            time.sleep(0.5)

    with quiet(a.lock, tag) as waited:
        measure.drop_page_cache([gguf])
        resident = measure.resident_bytes(gguf)
        d0, busy0 = diskstats_rw(disk), msbs.machine_busy_s()
        th = threading.Thread(target=sample, daemon=True)
        th.start()
        r = cgroup.run_command(cmd, limit_bytes=limit, timeout_s=a.timeout, account=True)
        done.set()
        th.join()
        d1, busy1 = diskstats_rw(disk), msbs.machine_busy_s()
    wall = r.wall_s
    conv = None
    try:
        m = json.loads((out_dir / "manifest.json").read_text())
        conv = m.get("conversion") or (m.get("extra") or {}).get("conversion")
    except (OSError, ValueError):
        pass
    cpu = sum(cpu_by_pid.values())
    disk_d = {k: d1[k] - d0[k] for k in d0}
    lsm_bytes = sum(f.stat().st_size for f in out_dir.rglob("*") if f.is_file()) if out_dir.exists() else None
    doc = {"benchmark": benchmark, "gguf": gguf.name, "gguf_bytes": gguf.stat().st_size,
           "model_dir": out_dir.name, "model_dir_bytes": lsm_bytes, "command": cmd,
           "limit": a.limit, "limit_bytes": limit, "status": r.status, "returncode": r.returncode,
           "seconds": round(wall, 1), "within_20_min": r.status == "ok" and wall <= 1200,
           "cgroup": r.cgroup,
           "cgroup_peak_bytes": r.cgroup.get("max_usage_bytes"),
           "peak_rss_sampled_bytes": max((s["rss"] for s in samples), default=None),
           "cgroup_usage_sampled_max_bytes": max((s["cg"] or 0 for s in samples), default=None),
           "converter_stages": conv,
           "disk": {"name": disk, "read_bytes": disk_d["read_bytes"], "write_bytes": disk_d["write_bytes"],
                    "busy_share": disk_d["io_ticks_ms"] / 1e3 / wall},
           "cpu_s": round(cpu, 1), "cpu_share_of_one_core": round(cpu / wall, 3),
           "cpu_share_of_machine": round(cpu / wall / (os.cpu_count() or 1), 3),
           "others_cpu_share_of_machine": round(max(busy1 - busy0 - cpu, 0) / wall / (os.cpu_count() or 1), 3),
           "gguf_page_cache_resident_at_start_bytes": resident, **waited,
           "stdout_tail": r.stdout.splitlines()[-10:], "stderr_tail": r.stderr[-3000:],
           "samples_every_2s": samples[::4], "machine": measure.machine_info()}
    log(f"convert: {r.status} {wall:.0f} s, cgroup peak {doc['cgroup_peak_bytes']}, "
        f"rss peak {doc['peak_rss_sampled_bytes']}")
    return doc, r


# ---------------------------------------------------------------------------------------------
# decode

STAT = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def stat_fields() -> dict:
    f = Path("/proc/stat").read_text().splitlines()[0].split()
    return {"t": time.perf_counter(), **{k: int(v) / os.sysconf("SC_CLK_TCK") for k, v in zip(STAT, f[1:])}}


def stat_delta(a: dict, b: dict) -> dict:
    """The whole machine's CPU time by kind over a run (child start to end, load included), as
    shares of all cores' time: where a run's "others" share went (kernel, iowait, steal)."""
    wall = (b["t"] - a["t"]) * (os.cpu_count() or 1)
    return {k: round((b[k] - a[k]) / wall, 3) for k in STAT}

NOREPACK = "stock-norepack"


def norepack_child(a: dict) -> dict:
    """bench/moe_side_by_side.py's stock run with llama_model_params.use_extra_bufts = False: no
    CPU_REPACK buffer, so llama.cpp computes on the mmap'd GGUF itself instead of copying its
    Q4_K rows into anonymous memory (llama-cpp-python's Llama has no argument for it)."""
    import llama_cpp.llama_cpp as lc

    base = lc.llama_model_default_params

    def params():
        p = base()
        p.use_extra_bufts = False
        return p

    lc.llama_model_default_params = params   # llama.py looks it up on the module at each Llama()
    out = msbs.child({**a, "system": "stock"})
    return out | {"system": NOREPACK, "use_extra_bufts": False}


def one_run(a: dict, system: str, limit: int | None, files: list[str], timeout: float) -> dict:
    """msbs.one_run, with stock-norepack run by this script's own child."""
    return msbs.one_run(a, system, limit, files, timeout, script=__file__ if system == NOREPACK else None)


def decode(a) -> int:
    from leanstream_ggml.model import manifest as mf

    model_dir = Path(a.model_dir)
    m = mf.load(model_dir)
    stride = max(e.expert_stride for e in m.moe.layers)
    expert_files = [str(m.resolve(model_dir, e.file)) for e in m.moe.layers]
    files = [a.gguf] + [str(f) for f in measure.model_files(model_dir)]
    ok, where = cgroup.availability()
    if not ok:
        raise SystemExit(f"cgroups not writable ({where}): this bench needs real limits")
    spec = {"gguf": str(Path(a.gguf).resolve()), "model_dir": str(model_dir.resolve()), "n_gen": a.n_gen,
            "threads": a.threads, "n_ctx": 512, "prompt": msbs.PROMPT, "decode": a.decode,
            "text": str(msbs.TEXT), "n_prompt": a.n_prompt}
    systems = [s.strip() for s in a.systems.split(",") if s.strip()]
    limits = [s.strip() for s in a.limits.split(",") if s.strip()]
    rows: dict[str, list] = {lim: [] for lim in limits}
    if a.append:   # another round: the runs already in each document stay, the summary covers all
        for lim in limits:
            f = Path(a.out_pattern.format(limit=lim))
            if f.exists():
                rows[lim] = json.loads(f.read_text())["runs"]
    order = [(lim, s) for lim in limits for s in systems] if a.order == "limit" else \
            [(lim, s) for s in systems for lim in limits]

    def write(lim: str) -> None:
        limit = benchkit.regime_limit(lim)
        doc = {"benchmark": "moe_full decode (bench/moe_side_by_side.py runs)", "gguf": Path(a.gguf).name,
               "model_dir": model_dir.name, "gguf_bytes": os.path.getsize(a.gguf),
               "expert_bytes": measure.files_size(expert_files), "expert_stride": stride,
               "n_expert": m.moe.n_expert, "n_expert_used": m.moe.n_expert_used, "n_layer": m.n_layer,
               "limit": lim, "limit_bytes": limit,
               "settings": {"systems": sorted({r["system"] for r in rows[lim]}),
                            "rounds": max((r.get("round", 0) + 1 for r in rows[lim]), default=0),
                            "n_gen": a.n_gen, "decode": a.decode,
                            "n_prompt_forced": a.n_prompt if a.decode == "forced" else None,
                            "text": msbs.TEXT.name if a.decode == "forced" else None,
                            "threads": a.threads, "n_ctx": 512, "prompt": msbs.PROMPT,
                            "timeout_s": a.timeout, "stock_timeout_s": a.stock_timeout,
                            "page_cache_dropped": True, "disk": msbs.disk_of(a.gguf),
                            "quiet_lock": a.lock},
               "routing": "synthetic: random weights (bench/moe_synth.py), near-uniform routing; hit rates are a "
                          "lower bound of a real model's skewed routing",
               "machine": measure.machine_info(), "stock": msbs._stock_description(),
               "summary": msbs.summary(rows[lim], []), "runs": rows[lim]}
        out = a.out_pattern.format(limit=lim)
        Path(out).write_text(json.dumps(doc, indent=1) + "\n")
        log(f"wrote {out}")

    for lim, system in order:
        limit = benchkit.regime_limit(lim)
        timeout = a.stock_timeout if system.startswith("stock") else a.timeout
        with quiet(a.lock) as waited:
            stat0 = stat_fields()
            row = one_run(spec, system, limit, files, timeout)
        row |= waited
        row["round"] = sum(r["system"] == system for r in rows[lim])
        row["stat_breakdown"] = stat_delta(stat0, stat_fields())
        rows[lim].append(row)
        write(lim)
    return 0


def main() -> int:
    ap = benchkit.parser(__doc__, child=True)
    ap.add_argument("what", nargs="?", choices=("convert", "decode"))
    ap.add_argument("--gguf")
    ap.add_argument("--model-dir")
    ap.add_argument("--limit", default="4000MB", help="convert: the cgroup's limit and --memory-limit")
    ap.add_argument("--limits", default="4000MB,8000MB", help="decode: whole-process limits")
    ap.add_argument("--systems", default="plugin,stock")
    ap.add_argument("--order", choices=("limit", "system"), default="system",
                    help="system: every limit of the first system, then the next system's")
    ap.add_argument("-n", "--n-gen", type=int, default=32)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--decode", choices=("greedy", "forced"), default="greedy",
                    help="moe_side_by_side's: greedy (the model's own continuation) or forced (the held-out "
                         "text's tokens fed one per step after its first --n-prompt: routing that follows text)")
    ap.add_argument("--n-prompt", type=int, default=16, help="forced decoding's prompt tokens")
    ap.add_argument("--timeout", type=float, default=1500, help="s (convert; decode: per plugin run)")
    ap.add_argument("--stock-timeout", type=float, default=480, help="s per stock run")
    ap.add_argument("--lock", default=LOCK)
    ap.add_argument("--quiet-cpu", type=float, default=None,
                    help="run a step only while the machine's busy share (2 s, all cores) is below this")
    ap.add_argument("--quiet-wait", type=float, default=600, help="s to wait for --quiet-cpu, then run anyway")
    ap.add_argument("--append", action="store_true", help="decode: keep the runs already in the documents")
    ap.add_argument("--out", default=None, help="convert: the JSON document")
    ap.add_argument("--out-pattern", default="bench/results/moe-qwen3moe48-{limit}-2026-12-06.json")
    a = ap.parse_args()
    if a.child:
        return benchkit.answer_child(a.child, norepack_child)
    if not (a.what and a.gguf and a.model_dir):
        ap.error("convert or decode, --gguf and --model-dir are required")
    QUIET.update(max_busy=a.quiet_cpu, max_wait_s=a.quiet_wait)
    return convert(a) if a.what == "convert" else decode(a)


if __name__ == "__main__":
    sys.exit(main())
