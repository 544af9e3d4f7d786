"""The feed bench (issue 50): how fast the service's CPU side can feed an engine that answers at
once, against prep alone on the same files, for this tree and (``--base``) the commit before.

Per format (loadtest/lib/feed_audio.py), in one run:

* ``ceiling``: prep alone (decode, Silero, cut), one process per core, the uploads pulled from
  one queue, no service: windows per second. ``one_core``: one process, one upload.
* per tree, the real service (``loadtest/lib/feed_tree.py serve``: HTTP, store, prep, batcher; the
  engine a stand-in answering at once, batch cap ``--batch`` as the GPU's sizing sets it, the
  per-job memory cap off as on a GPU) and three steps:
  - ``many``: ``--uploads`` 20-minute uploads posted at once: windows per second reaching the
    engine (from the first post to the last window) against the ceiling (target >= 0.85x);
  - ``mixed``: the same while ``--clients`` clients post short corpus clips (<= 10 s), each
    at real-time pace (a clip, then the rest of its duration): the long uploads' windows per
    second against the ceiling (target >= 0.8x), and the short requests' latency;
  - ``one``: one upload alone, against ``one_core`` (target >= 1.7x on 2 cores);
  - ``one_long``: one ``--long-minutes`` upload alone (60: the issue's long case), against one
    core's prep of that file (``one_long_core``). A 20-minute WAV is prepared in ~1 s, a quarter
    of which is the request's fixed cost (body, probe, parts starting); 60 minutes amortise it.

Timings are wall clock on whatever else the machine runs: run it on a quiet machine (each step
records the load average it started at). Beside them, windows per CPU second (the service and
its prep processes) against prep alone's, which contention moves far less. The base tree is
``git archive``d into ``--work`` (the repository is not touched).

    python -m loadtest.feed --base 2f89645                      # wav16, wav48s, flac, mp3
    python -m loadtest.feed --formats wav16 --uploads 4 --minutes 2 --clients 4   # a quick check
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

from loadtest.lib.common import ROOT, cpu_count, free_port, machine_info, wait_up
from loadtest.lib.corpus import SHORT_CLIP_S, Clip, load_corpus
from loadtest.lib.feed_audio import FORMATS, uploads
from loadtest.lib.probes import children_cpu, cpu_seconds, stat_cpu_seconds
from loadtest.lib.stats import latency_summary

TREE_SCRIPT = ROOT / "loadtest" / "lib" / "feed_tree.py"
TERMINAL = ("done", "failed", "cancelled")


def tree_env(tree: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHSCRIBE_")}
    env["PYTHONPATH"] = str(tree)
    return {**env, **(extra or {})}


def base_tree(commit: str, work: Path) -> Path:
    """The commit's files (``git archive``), once."""
    rev = subprocess.run(["git", "rev-parse", "--short", commit], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout.strip()
    out = work / f"tree-{rev}"
    if not (out / "app").is_dir():
        out.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "archive", rev], cwd=ROOT, check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(out)], input=archive, check=True)
    return out


def ceiling(tree: Path, files: list[Path], procs: int) -> dict[str, Any]:
    out = subprocess.run([sys.executable, str(TREE_SCRIPT), "ceiling", "--procs", str(procs),
                          *map(str, files)], cwd=tree, env=tree_env(tree), check=True,
                         capture_output=True, text=True)
    return dict(json.loads(out.stdout))


class Service:
    def __init__(self, tree: Path, work: Path, batch: int, workers: int,
                 env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        data = work / f"svc-{tree.name}-{self.port}"
        data.mkdir(parents=True, exist_ok=True)
        self.log = data / "server.log"
        env = tree_env(tree, {
            "BATCHSCRIBE_STORAGE__DATA_DIR": str(data),
            "BATCHSCRIBE_BATCHER__MAX_BATCH_SIZE": str(batch),
            "BATCHSCRIBE_BATCHER__JOB_MEMORY_MB": "0",  # a GPU's sizing lets one job fill it
            "BATCHSCRIBE_LIMITS__MAX_BACKLOG_S": "1000000",
            "BATCHSCRIBE_LIMITS__MAX_UPLOAD_BYTES": str(2**30),  # 20 min at 48 kHz stereo: 230 MB
            "BATCHSCRIBE_LIMITS__MAX_TRANSFERS_PER_KEY": "1000",
            "BATCHSCRIBE_LIMITS__SYNC_TIMEOUT_S": "3600",
            **(env or {}),
        })
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, str(TREE_SCRIPT), "serve", "--port", str(self.port),
                 "--workers", str(workers)], cwd=tree, env=env, stdout=log,
                stderr=subprocess.STDOUT)
        tail = lambda: self.log.read_text(errors="replace")[-3000:]  # noqa: E731
        if not wait_up(self.proc, self.url + "/readyz", 300, "service", tail):
            self.stop()
            raise RuntimeError(f"service not ready:\n{tail()}")

    def cpu_s(self) -> dict[str, float]:
        """CPU seconds of the service process, of its main thread (the event loop's), and of
        its children (prep processes)."""
        pid = self.proc.pid
        try:
            loop = stat_cpu_seconds(Path(f"/proc/{pid}/task/{pid}/stat"))
        except OSError:
            loop = 0.0
        return {"service": round(cpu_seconds(pid), 2), "loop": round(loop, 2),
                "children": round(children_cpu(pid), 2)}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)


async def post(http: aiohttp.ClientSession, path: Path) -> dict[str, Any]:
    """One upload, waited for (a 429 is retried after its Retry-After, a 202 polled). A
    connection the service dropped is the step's error, never retried (the job may exist)."""
    try:
        while True:
            with path.open("rb") as f:
                form = aiohttp.FormData()
                form.add_field("file", f, filename=path.name)
                form.add_field("language", "en")
                async with http.post("/transcribe", params={"wait": "true"}, data=form) as r:
                    status, job = r.status, await r.json()
            if status != 429:
                break
            await asyncio.sleep(float(job.get("error", {}).get("retry_after_s", 1.0)))
        while job.get("status") not in TERMINAL and "id" in job:
            await asyncio.sleep(0.5)
            async with http.get(f"/jobs/{job['id']}") as r:
                job = await r.json()
    except (aiohttp.ClientError, TimeoutError) as exc:
        return {"status": "client_error", "error": f"{type(exc).__name__}: {exc}"}
    return dict(job)


def windows_of(job: dict[str, Any]) -> int:
    return int((job.get("progress") or {}).get("windows_total") or 0)


async def short_client(http: aiohttp.ClientSession, clips: list[Clip], k: int,
                       stop: asyncio.Event, out: list[dict[str, Any]]) -> None:
    i = 5 * k
    while not stop.is_set():
        clip = clips[i % len(clips)]
        i += 1
        t0 = time.monotonic()
        job = await post(http, Path(clip.path))
        t1 = time.monotonic()
        out.append({"latency_s": t1 - t0, "ok": job.get("status") == "done",
                    "windows": windows_of(job)})
        with contextlib.suppress(TimeoutError):  # real-time pace: the next clip once this
            await asyncio.wait_for(stop.wait(), max(0.0, clip.duration_s - (t1 - t0)))  # ends


async def step(svc: Service, files: list[Path], ref: dict[str, Any], clips: list[Clip],
               clients: int) -> dict[str, Any]:
    timeout = aiohttp.ClientTimeout(total=7200)
    async with aiohttp.ClientSession(svc.url, timeout=timeout,
                                     connector=aiohttp.TCPConnector(limit=512,
                                                                    force_close=True)) as http:
        async with http.get("/feed-stats", params={"reset_after": 1}):
            pass
        cpu0 = svc.cpu_s()
        load0 = [round(x, 2) for x in os.getloadavg()]
        t0 = time.time()
        stop = asyncio.Event()
        shorts: list[dict[str, Any]] = []
        users = [asyncio.ensure_future(short_client(http, clips, k, stop, shorts))
                 for k in range(clients)]
        jobs = await asyncio.gather(*(post(http, f) for f in files))
        t_end = time.time()
        stop.set()
        await asyncio.gather(*users)
        async with http.get("/feed-stats") as r:
            stats = await r.json()
    cpu1 = svc.cpu_s()
    ok = [j for j in jobs if j.get("status") == "done"]
    long_windows = sum(windows_of(j) for j in ok)
    first = stats["first"] or t0
    span = max(1e-6, (stats["last"] or t0) - first)
    wall = max(1e-6, max(stats["last"] or t0, t_end) - t0)
    rate = stats["windows"] / wall
    long_rate = long_windows / max(1e-6, t_end - t0)
    cpu = {k: round(cpu1[k] - cpu0[k], 2) for k in cpu0}
    per_cpu = stats["windows"] / max(1e-6, sum(cpu.values()))
    out = {
        "uploads": len(files), "ok": len(ok),
        "errors": sorted({json.dumps(j.get("error")) for j in jobs if j not in ok})[:3],
        "load_average_at_start": load0,
        "windows_engine": stats["windows"], "windows_long": long_windows,
        "audio_s_engine": round(stats["audio_s"], 1), "batches": stats["batches"],
        "mean_batch": round(stats["windows"] / max(1, stats["batches"]), 2),
        "first_window_s": round(first - t0, 3), "wall_s": round(wall, 3),
        # windows reaching the engine per second, from the first post to the last window
        "windows_per_s": round(rate, 2), "long_windows_per_s": round(long_rate, 2),
        "vs_ceiling": round(rate / ref["windows_per_s"], 3),
        "long_vs_ceiling": round(long_rate / ref["windows_per_s"], 3),
        # the same from the first window on (what the engine saw once it was being fed)
        "windows_per_s_engine_span": round(stats["windows"] / span, 2),
        "latency_long": latency_summary([(j.get("finished_at") or t_end) - t0 for j in ok]),
        # CPU seconds of the service and its prep processes: windows per CPU second against
        # prep alone's, which contention on a shared machine moves far less than wall time
        "cpu_s": cpu, "windows_per_cpu_s": round(per_cpu, 2),
        "cpu_vs_ceiling": round(per_cpu / ref["windows_per_cpu_s"], 3),
    }
    if clients:
        out["short"] = {"clients": clients, "requests": len(shorts),
                        "failed": sum(not s["ok"] for s in shorts),
                        "windows": sum(s["windows"] for s in shorts),
                        "latency": latency_summary([s["latency_s"] for s in shorts if s["ok"]])}
    return out


def one_repeats(svc: Service, tree: Path, upload: Path, n: int) -> dict[str, Any]:
    """One core's prep of ``upload`` and the service's one-upload step, ``n`` times in turn (so
    the host's drift falls on both alike): each pair's walls and ratio, and the ratios' spread.
    The one-upload ratio is a ~1 s job's: 0.25-0.3 s of it is fixed cost (body, probe, parts
    starting, the first chunk), and on a shared 2-core host identical posts ran 1.13-1.45 s."""
    pairs = []
    for _ in range(n):
        core = ceiling(tree, [upload], 1)
        one = asyncio.run(step(svc, [upload], core, [], 0))
        pairs.append({"one_core_wall_s": core["wall_s"], "one_wall_s": one["wall_s"],
                      "first_window_s": one["first_window_s"], "vs_core": one["vs_ceiling"],
                      "from_first_window_vs_core": round(
                          core["wall_s"] / max(1e-6, one["wall_s"] - one["first_window_s"]), 3)})
    ratios = sorted(p["vs_core"] for p in pairs)
    return {"pairs": pairs, "vs_core": {"min": ratios[0], "median": ratios[len(ratios) // 2],
                                        "max": ratios[-1]}}


def save(report: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--base", help="also measure this commit (e.g. 2f89645, before issue 50)")
    ap.add_argument("--formats", default="wav16,wav48s,flac,mp3")
    ap.add_argument("--uploads", type=int, default=16)
    ap.add_argument("--minutes", type=float, default=20.0)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--long-minutes", type=float, default=60.0,
                    help="the one_long step's upload (0: skip the step)")
    ap.add_argument("--batch", type=int, default=128, help="the batch cap (the H200's sizing)")
    ap.add_argument("--engine-workers", type=int, default=2)
    ap.add_argument("--procs", type=int, default=cpu_count(), help="ceiling: prep processes")
    ap.add_argument("--steps", default="many,mixed,one,one_long",
                    help="which service steps to run (one_long needs --long-minutes)")
    ap.add_argument("--one-repeats", type=int, default=1,
                    help="run one core's prep and the one-upload step this many times, in turn")
    ap.add_argument("--work", type=Path, default=Path("/tmp/batchscribe-feed"))
    ap.add_argument("--out", type=Path, default=ROOT / "loadtest" / "results" / "feed.json")
    args = ap.parse_args(argv)
    trees = {"this": ROOT}
    if args.base:
        trees = {"base": base_tree(args.base, args.work), **trees}
    report: dict[str, Any] = {
        "command": "python -m loadtest.feed " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": machine_info(), "trees": {k: str(v) for k, v in trees.items()},
        "base_commit": args.base, "uploads": args.uploads, "minutes": args.minutes,
        "clients": args.clients, "batch": args.batch, "engine_workers": args.engine_workers,
        "formats": {}}
    clips = load_corpus()
    shorts = [c for c in clips if c.duration_s <= SHORT_CLIP_S]
    steps = set(args.steps.split(","))
    assert steps <= {"many", "mixed", "one", "one_long"}, steps
    report["steps"], report["one_repeats"] = sorted(steps), args.one_repeats
    for fmt in args.formats.split(","):
        assert fmt in FORMATS, fmt
        files = uploads(clips, args.work / "audio", args.uploads, args.minutes, fmt)
        long = (uploads(clips, args.work / "audio", 1, args.long_minutes, fmt)
                if args.long_minutes and "one_long" in steps else [])
        res: dict[str, Any] = {}
        report["formats"][fmt] = res
        for name, tree in trees.items():
            r = res[name] = {"one_core": ceiling(tree, files[:1], 1)}
            if steps & {"many", "mixed"}:
                r["ceiling"] = ceiling(tree, files, args.procs)
            if long:
                r["one_long_core"] = ceiling(tree, long, 1)
            save(report, args.out)
            svc = Service(tree, args.work, args.batch, args.engine_workers)
            try:
                for k in ("many", "mixed"):
                    if k in steps:
                        r[k] = asyncio.run(step(svc, files, r["ceiling"], shorts,
                                                args.clients if k == "mixed" else 0))
                        save(report, args.out)
                if "one" in steps:
                    r["one"] = asyncio.run(step(svc, files[:1], r["one_core"], shorts, 0))
                    if args.one_repeats > 1:
                        r["one_repeats"] = one_repeats(svc, tree, files[0], args.one_repeats)
                    save(report, args.out)
                if long:
                    r["one_long"] = asyncio.run(step(svc, long, r["one_long_core"], shorts, 0))
            finally:
                svc.stop()
            save(report, args.out)
            print(f"{fmt} {name}: " + ", ".join(
                f"{k} {r[k]['long_vs_ceiling' if k == 'mixed' else 'vs_ceiling']}x"
                for k in ("many", "mixed", "one", "one_long") if k in r), flush=True)
    print(f"feed: wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
