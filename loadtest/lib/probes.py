"""Reading the server from outside: its Prometheus metrics (/metrics) and its per-thread CPU
from /proc.
"""

from __future__ import annotations

import contextlib
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# ---- /metrics ---------------------------------------------------------------------------------
_SAMPLE = re.compile(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)")


def parse_metrics(text: str) -> dict[tuple[str, str], float]:
    out: dict[tuple[str, str], float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m:
            with contextlib.suppress(ValueError):
                out[(m.group(1), m.group(2) or "")] = float(m.group(3))
    return out


def histogram_delta(before: dict[tuple[str, str], float], after: dict[tuple[str, str], float],
                    name: str) -> dict[str, Any]:
    """Non-cumulative bucket counts of a histogram between two scrapes, plus count and mean."""
    buckets: list[tuple[float, float]] = []
    for (metric, labels), v in after.items():
        if metric == name + "_bucket":
            le = re.search(r'le="([^"]+)"', labels)
            if le:
                bound = float("inf") if le.group(1) == "+Inf" else float(le.group(1))
                buckets.append((bound, v - before.get((metric, labels), 0.0)))
    buckets.sort()
    integral = all(b == float("inf") or b == int(b) for b, _ in buckets)
    dist: dict[str, int] = {}
    prev_bound, prev_cum = 0.0, 0.0
    for bound, cum in buckets:
        n = round(cum - prev_cum)
        if n:
            hi = "inf" if bound == float("inf") else (str(int(bound)) if integral else str(bound))
            if integral:  # windows per batch: "5-6" means 5 or 6 windows
                lo = str(int(prev_bound) + 1)
                dist[lo if lo == hi else f"{lo}-{hi}"] = n
            else:  # seconds or ratios: "<=0.5"
                dist[f"<={hi}"] = n
        prev_bound, prev_cum = bound, cum
    count = after.get((name + "_count", ""), 0.0) - before.get((name + "_count", ""), 0.0)
    total = after.get((name + "_sum", ""), 0.0) - before.get((name + "_sum", ""), 0.0)
    return {"count": round(count), "mean": round(total / count, 3) if count else None,
            "distribution": dist}


def counter_delta(before: dict[tuple[str, str], float], after: dict[tuple[str, str], float],
                  name: str) -> float:
    return round(after.get((name, ""), 0.0) - before.get((name, ""), 0.0), 3)


# ---- CPU from /proc ---------------------------------------------------------------------------
def stat_cpu_seconds(stat: Path) -> float:
    """utime + stime from a /proc ``stat`` file (a process's or one thread's), in seconds."""
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def thread_cpu(pid: int) -> dict[str, float]:
    """utime + stime per live thread of a process, in seconds, by thread id."""
    out: dict[str, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            out[task.name] = stat_cpu_seconds(task / "stat")
    return out


def children_cpu(pid: int) -> float:
    """utime + stime of every live descendant of a process (the prep processes), in seconds."""
    parent: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                parent[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
    kids, frontier = [], [pid]
    while frontier:
        frontier = [c for c, p in parent.items() if p in frontier]
        kids += frontier
    return sum(cpu_seconds(k) for k in kids)


def involuntary_switches(pid: int) -> dict[str, int]:
    """Times each thread of a process was taken off a CPU it still wanted, by thread id."""
    out: dict[str, int] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError, StopIteration):
            line = next(x for x in (task / "status").read_text().splitlines()
                        if x.startswith("nonvoluntary_ctxt_switches"))
            out[task.name] = int(line.split()[1])
    return out


@dataclass(frozen=True)
class CpuSnap:
    """One reading of a server's CPU: the process, its threads, its descendants, and how often
    each thread was preempted."""
    process_s: float
    threads: dict[str, float]
    children_s: float
    preempted: dict[str, int]


def cpu_snap(pid: int) -> CpuSnap:
    return CpuSnap(cpu_seconds(pid), thread_cpu(pid), children_cpu(pid), involuntary_switches(pid))


def cpu_split(before: CpuSnap, after: CpuSnap, wall_s: float, engine_threads: int) -> dict[str, Any]:
    """Where the server's CPU went: its ``engine_threads`` busiest threads (CTranslate2's
    workers, which run the whole encode and decode) against everything else in the process
    (HTTP, store, batching, result assembly), and its child processes (prep: decode, VAD,
    cut), in cores; and how often per second the engine threads were preempted (another
    process or thread taking their core mid-batch costs them their caches)."""
    per = sorted(((after.threads[t] - before.threads.get(t, 0.0), t) for t in after.threads),
                 reverse=True)
    total = (after.process_s - before.process_s) / wall_s
    engine = sum(c for c, _ in per[:engine_threads]) / wall_s
    switches = sum(after.preempted.get(t, 0) - before.preempted.get(t, 0)
                   for _, t in per[:engine_threads])
    return {"process_cores": round(total, 3), "engine_thread_cores": round(engine, 3),
            "other_cores": round(total - engine, 3), "engine_threads": engine_threads,
            "children_cores": round((after.children_s - before.children_s) / wall_s, 3),
            "engine_preempted_per_s": round(switches / wall_s, 1)}


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, in seconds (0 once it is gone)."""
    try:
        return stat_cpu_seconds(Path(f"/proc/{pid}/stat"))
    except OSError:
        return 0.0
