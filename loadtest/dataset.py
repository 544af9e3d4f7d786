"""Dataset mode against the engine limit, in one run: does ``batchscribe dataset`` keep the
service full?

    .venv/bin/python -m loadtest.dataset --minutes 20 --out loadtest/results/dataset.json

Phases, never overlapping (tcmalloc preloaded in every process, as scripts/env.sh does):

1. a fresh service (``python -m app``, temp data dir) is started and left idle;
2. the engine limit: the bench's best configuration (``--engine-config``, default 2 workers x 1
   thread, batch 16) on the corpus's windows offline (``loadtest.offline engine``, subprocess);
3. ``batchscribe dataset`` (the real CLI, a subprocess) over the corpus replayed in the bench's
   fixed order to at least ``--minutes`` of audio, as a NeMo manifest, ``--language en``;
4. the engine limit again; the limit is the mean of 2 and 4.

Throughput is audio seconds (whole files) per wall second, as in the bench. Two figures:
*whole run* (all audio over the client's wall time, start-up ramp and the last files'
tail included) and *steady state*, comparable with the bench's steady-state service rows: the
run's progress is the engine's ``audio_processed_seconds_total`` (speech transcribed, window by
window) sampled once a second, as a share of its total at the end; steady state is the share
done between the 10 % and the 90 % marks, times the manifest's audio, over the time between
them. (It was the files finished between the marks, from the checkpoint, still reported as
``steady_files_finished``: a long file finishing on either side of a mark moves a 20-minute
run's figure by ~10 %; 1.064x in one run, 0.853x in the next, the whole run 0.91x in both.)
Also reported: the engine's busy share
(``processing_seconds_total`` over wall time x workers: is the service kept full?), 429s
(``rejected_requests_total``), the largest backlog sampled once a second against the service's
limit, and the client's own CPU (it shares the cores with the service, as the bench's does).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import resource
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from loadtest.lib.common import ROOT, layout_name, machine_info, resolve_model
from loadtest.lib.corpus import Clip, audio_total, load_corpus, replay_order, save_clips
from loadtest.lib.phases import effective_settings, offline_engine, parse_engine_configs
from loadtest.lib.probes import counter_delta, parse_metrics
from loadtest.lib.report import log
from loadtest.lib.service import Server


def write_manifest(clips: list[Clip], minutes: float, path: Path) -> tuple[int, float]:
    """The corpus in the bench's replay order, cycled to >= ``minutes`` of audio; rows, seconds."""
    order, rows, total = replay_order(clips), 0, 0.0
    with path.open("w") as f:
        while total < minutes * 60:
            c = order[rows % len(order)]
            f.write(json.dumps({"audio_filepath": str(c.path), "duration": c.duration_s,
                                "text": c.reference, "id": f"{c.id}#{rows // len(order)}",
                                "set": c.set}) + "\n")
            rows, total = rows + 1, total + c.duration_s
    return rows, total


def steady_state(checkpoint: Path, lo: float = 0.1, hi: float = 0.9) -> dict[str, Any]:
    """Audio finished between the ``lo`` and ``hi`` marks of the run's audio over their time."""
    done = sorted((r["t"], float(r["audio_s"])) for r in map(json.loads, checkpoint.read_text().splitlines())
                  if r.get("type") == "done")
    return marks(done, lo, hi)


def marks(done: list[tuple[float, float]], lo: float, hi: float) -> dict[str, Any]:
    """The throughput between the ``lo`` and ``hi`` marks of the audio in ``done``, sorted
    (time, audio seconds) of finished files."""
    total = sum(a for _, a in done)
    acc, t_lo, t_hi, a_lo, a_hi = 0.0, None, None, 0.0, 0.0
    for t, a in done:
        acc += a
        if t_lo is None and acc >= lo * total:
            t_lo, a_lo = t, acc
        if t_hi is None and acc >= hi * total:
            t_hi, a_hi = t, acc
    if t_lo is None or t_hi is None or t_hi <= t_lo:
        return {"throughput_x": None}
    return {"throughput_x": round((a_hi - a_lo) / (t_hi - t_lo), 3), "audio_s": round(a_hi - a_lo, 1),
            "wall_s": round(t_hi - t_lo, 2), "marks": [lo, hi]}


Samples = list[tuple[float, float, float]]  # (monotonic time, backlog s, audio processed s)
PROCESSED = ("batchscribe_audio_processed_seconds_total", "")


async def sample_metrics(url: str, stop: asyncio.Event, every_s: float = 1.0) -> Samples:
    values: Samples = []
    async with httpx.AsyncClient(timeout=10) as http:
        while not stop.is_set():
            try:
                m = parse_metrics((await http.get(url + "/metrics")).text)
                values.append((time.monotonic(), m.get(("batchscribe_backlog_audio_seconds", ""),
                                                       0.0), m.get(PROCESSED, 0.0)))
            except httpx.HTTPError:
                pass
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), every_s)
    return values


def steady_from_progress(samples: Samples, start: tuple[float, float], end: tuple[float, float],
                         audio_s: float, lo: float = 0.1, hi: float = 0.9) -> dict[str, Any]:
    """Throughput between the ``lo`` and ``hi`` marks of the engine's progress (see above);
    ``start`` and ``end`` are (time, processed) when the client started and ended."""
    points = [start, *((t, a) for t, _, a in samples if start[0] <= t <= end[0]), end]
    total = end[1] - start[1]
    if total <= 0:
        return {"throughput_x": None}

    def when(share: float) -> float:  # linear between the two samples around the mark
        goal = start[1] + share * total
        for (t0, a0), (t1, a1) in itertools.pairwise(points):
            if a1 >= goal:
                return t0 if a1 == a0 else t0 + (t1 - t0) * (goal - a0) / (a1 - a0)
        return end[0]

    t_lo, t_hi = when(lo), when(hi)
    if t_hi <= t_lo:
        return {"throughput_x": None}
    return {"throughput_x": round((hi - lo) * audio_s / (t_hi - t_lo), 3),
            "audio_s": round((hi - lo) * audio_s, 1), "wall_s": round(t_hi - t_lo, 2),
            "marks": [lo, hi], "from": "audio_processed_seconds_total, sampled every 1 s"}


async def run_client(cmd: list[str], url: str, log_path: Path
                     ) -> tuple[int, float, float, Samples]:
    stop = asyncio.Event()
    sampler = asyncio.create_task(sample_metrics(url, stop))
    t0 = time.monotonic()
    with log_path.open("wb") as f:
        proc = await asyncio.create_subprocess_exec(*cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
        code = await proc.wait()
    wall = time.monotonic() - t0
    stop.set()
    return code, t0, wall, await sampler


def metrics(url: str) -> dict[tuple[str, str], float]:
    return parse_metrics(httpx.get(url + "/metrics", timeout=30).text)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.dataset", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=20.0, help="audio in the manifest, at least")
    p.add_argument("--engine-config", default="2x1:16", help="[engines e] workers x threads : batch")
    p.add_argument("--engine-min-seconds", type=float, default=30.0)
    p.add_argument("--client-args", default="", help="extra batchscribe dataset arguments")
    p.add_argument("--server-env", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--model", default="whisper-base")
    p.add_argument("--corpus", type=Path, default=None)
    p.add_argument("--no-tcmalloc", action="store_true")
    p.add_argument("--workdir", type=Path, default=None)
    p.add_argument("--out", type=Path, default=Path("loadtest/results/dataset.json"))
    args = p.parse_args(argv)
    args.language = "en"  # what loadtest.bench.offline_engine reads
    work = args.workdir or Path(tempfile.mkdtemp(prefix="batchscribe-dataset-"))
    work.mkdir(parents=True, exist_ok=True)
    clips = load_corpus(args.corpus) if args.corpus else load_corpus()
    save_clips(clips, work / "clips.json")
    model = resolve_model(args.model)
    [(e, w, t, batches)] = parse_engine_configs(args.engine_config)
    rows, audio = write_manifest(clips, args.minutes, work / "manifest.jsonl")
    log(f"workdir {work}; manifest {rows} files, {audio / 60:.1f} min of audio "
        f"({len(clips)} clips, {audio_total(clips):.0f} s, replayed)")
    env = {"BATCHSCRIBE_MODEL__NAME": args.model, **dict(kv.split("=", 1) for kv in args.server_env)}
    shutil.rmtree(work / "server", ignore_errors=True)  # a fresh service, even in a reused workdir
    server = Server(work / "server", env=env, tcmalloc=not args.no_tcmalloc).start()
    res: dict[str, Any] = {"meta": {"command": "python -m loadtest.dataset " + shlex.join(
        sys.argv[1:] if argv is None else argv), "machine": machine_info(), "workdir": str(work)},
        "manifest": {"files": rows, "audio_s": round(audio, 1)}}
    try:
        limits = []
        for when in ("before", "after"):
            if when == "after":
                out = work / "dataset.jsonl"
                cmd = [sys.executable, "-m", "app.cli", "dataset", str(work / "manifest.jsonl"),
                       "-o", str(out), "--overwrite", "--server", server.url, "--language", "en",
                       "--log-every", "10", *shlex.split(args.client_args)]
                log(f"dataset: {shlex.join(cmd[2:])}")
                before, cpu0 = metrics(server.url), resource.getrusage(resource.RUSAGE_CHILDREN)
                code, t0, wall, samples = asyncio.run(run_client(cmd, server.url,
                                                                 work / "client.log"))
                after, cpu1 = metrics(server.url), resource.getrusage(resource.RUSAGE_CHILDREN)
                backlog = [b for _, b, _ in samples]
                client_cpu = (cpu1.ru_utime + cpu1.ru_stime) - (cpu0.ru_utime + cpu0.ru_stime)
                summary = json.loads(out.with_suffix(".summary.json").read_text())
                served = effective_settings(env)
                workers = served["engines"] * served["num_workers"]
                busy = counter_delta(before, after, "batchscribe_processing_seconds_total")
                rejected = ("batchscribe_rejected_requests_total", '{reason="backlog"}')
                res["dataset"] = {
                    "exit_code": code, "wall_s": round(wall, 2), "done": summary["done"],
                    "failed": summary["failed"],
                    "throughput_x": round(summary["audio_hours"] * 3600 / wall, 3),
                    "steady": steady_from_progress(
                        samples, (t0, before.get(PROCESSED, 0.0)),
                        (t0 + wall, after.get(PROCESSED, 0.0)), summary["audio_hours"] * 3600),
                    "steady_files_finished": steady_state(out.with_name(out.name + ".checkpoint")),
                    "engine_busy_share": round(busy / (wall * workers), 3),
                    # The client shares the cores with the service it feeds (as the bench's does).
                    "client_cpu_s": round(client_cpu, 2),
                    "client_cpu_ms_per_file": round(1000 * client_cpu / max(1, summary["done"]), 2),
                    "rejected_429": after.get(rejected, 0.0) - before.get(rejected, 0.0),
                    "backlog_max_s": round(max(backlog, default=0.0), 1),
                    "backlog_limit_s": float(httpx.get(server.url + "/jobs", params={"ids": "x"})
                                             .headers.get("X-Backlog-Limit-Seconds", "nan")),
                    "scores": summary["scores"]}
                log(f"  {res['dataset']}")
            log(f"engine limit {when}: {layout_name(e, w, t)}, batch {batches[0]} (subprocess)")
            lim = offline_engine(args, work, model, e, w, t, batches[:1], f"engine-{when}.json")
            limits.append(lim["runs"][0]["throughput_x"])
            log(f"  {limits[-1]}x realtime")
    finally:
        server.stop()
    limit = sum(limits) / len(limits)
    d = res["dataset"]
    res["engine_limit"] = {"config": layout_name(e, w, t) + f", batch {batches[0]}",
                           "runs_x": limits, "mean_x": round(limit, 3)}
    res["ratio_whole_run"] = round(d["throughput_x"] / limit, 3)
    steady = d["steady"]["throughput_x"]
    res["ratio_steady"] = round(steady / limit, 3) if steady else None
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1))
    row = (f"| **dataset mode**, `batchscribe dataset`, {rows} files ({audio / 60:.0f} min), steady "
           f"state (whole run) | **{d['steady']['throughput_x']}x** ({d['throughput_x']}x) | "
           f"{res['ratio_steady']}x ({res['ratio_whole_run']}x) of the engine limit {limit:.1f}x | "
           f"≥ 0.95x | {'pass' if (res['ratio_steady'] or 0) >= 0.95 else 'FAIL'} |")
    args.out.with_suffix(".md").write_text(row + "\n")
    print(row)
    log(f"results: {args.out}; engine busy {d['engine_busy_share']}, 429s {d['rejected_429']}, "
        f"backlog max {d['backlog_max_s']} s of {d['backlog_limit_s']:.0f} s")
    return 0 if d["exit_code"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
