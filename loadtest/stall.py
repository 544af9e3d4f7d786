"""Short requests beside a 20-minute upload (issues 34 and 48): does a short clip wait behind it?

    PYTHONPATH=$PWD .venv/bin/python -m loadtest.stall --requests 100 --idle 100 \
        --out loadtest/results/stall.json

A real server (``loadtest.lib.batch_trace`` as its entry point: every engine call and submit is
traced), a long WAV kept in flight (posted again when it ends, as ``loadtest.lib.traffic``), and one
client sending short clips (<= 10 s) one at a time, latency from each POST; first ``--idle`` of
them on the idle server, then ``--requests`` beside the upload, the same clips in the same order.
The upload (``--upload meeting``, the default) is long continuous speech as a meeting recording
gives: the corpus's read speech (LibriSpeech, LJ Speech, LibriVox, Earnings-22) joined with
0.25 s pauses and repeated to 20 minutes, which the service cuts into windows of ~28 s (45
windows: p10 25.6 s, median 28.5 s, p90 29.6 s); ``--upload clips`` is every corpus clip with
0.8 s gaps (windows of all lengths), the earlier bench's upload.

The targets (issue 48): p95 <= 3x idle p95 and max <= 5x idle p95 (``targets``). The results
show the latencies over the upload's progress too (``by_progress``: each request placed at the
fraction of the upload then answered), not only the percentiles. While a short request has been
out for ``--spy-after`` seconds, ``py-spy dump`` samples the server's threads once a second.
Each slow request is then explained from the trace: when its windows were queued, encoded, put
in the decoder pool and decoded, and what the engine ran meanwhile (see :func:`explain`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from loadtest.lib.common import machine_info, write_wav16
from loadtest.lib.corpus import SHORT_CLIP_S, Clip, load_corpus
from loadtest.lib.service import TERMINAL, Client, Cycle, Server, write_long_wav
from loadtest.lib.stats import latency_summary

READ_SPEECH = ("librispeech", "ljspeech", "librivox", "librivox_long", "earnings22_long")


def write_meeting_wav(clips: list[Clip], path: Path, min_s: float, gap_s: float = 0.25) -> float:
    """Long continuous speech: the corpus's read speech joined with ``gap_s`` pauses (shorter
    than the VAD's silence, so its spans run on), repeated until ``min_s``; returns seconds."""
    import numpy as np

    from app.audio import decode
    from app.windows import SAMPLE_RATE

    gap = np.zeros(int(gap_s * SAMPLE_RATE), np.float32)
    decoded = [decode(c.path, 3600.0)
               for c in sorted((c for c in clips if c.set in READ_SPEECH), key=lambda c: c.id)]
    parts: list[Any] = []
    total = 0
    while total < min_s * SAMPLE_RATE:
        for a in decoded:
            parts += [a, gap]
            total += len(a) + len(gap)
            if total >= min_s * SAMPLE_RATE:
                break
    return write_wav16(path, np.concatenate(parts), SAMPLE_RATE)


async def _spy(pid: int, out: list[dict[str, Any]], since: float, stop: asyncio.Event,
               every_s: float) -> None:
    """``py-spy dump`` of the server every ``every_s`` until ``stop``."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(spy).is_file():  # not installed (pip install py-spy): the latencies still count
        out.append({"t": time.monotonic(), "out_for_s": None, "dump": "py-spy is not installed"})
        await stop.wait()
        return
    while not stop.is_set():
        t = time.monotonic()
        proc = await asyncio.create_subprocess_exec(
            spy, "dump", "--pid", str(pid), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        text, _ = await proc.communicate()
        out.append({"t": t, "out_for_s": round(t - since, 3), "dump": text.decode(errors="replace")})
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), every_s)


async def _short(client: Client, clip: Clip, pid: int, spy_after: float,
                 dumps: list[dict[str, Any]]) -> dict[str, Any]:
    form = client._form(clip.path.name, client.blobs[clip.id])
    sent = time.monotonic()
    stop = asyncio.Event()

    async def watch() -> None:
        try:
            await asyncio.wait_for(stop.wait(), spy_after)
        except TimeoutError:
            await _spy(pid, dumps, sent, stop, 1.0)

    watcher = asyncio.create_task(watch())
    try:
        async with client.http.post("/transcribe", params={"wait": "true"}, data=form) as r:
            body = await r.json()
    finally:
        stop.set()
        await watcher
    done = time.monotonic()
    return {"clip": clip.id, "clip_s": clip.duration_s, "job": body.get("id"),
            "status": body.get("status"), "sent": sent, "done": done,
            "latency_s": round(done - sent, 3)}


async def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    started = time.monotonic()
    load_before = os.getloadavg()
    clips = load_corpus()
    short = [c for c in clips if c.duration_s <= SHORT_CLIP_S and c.id not in args.exclude]
    long_path = work / "long.wav"
    write = write_meeting_wav if args.upload == "meeting" else write_long_wav
    audio_s = write(clips, long_path, args.long_minutes * 60)
    trace = work / "trace.jsonl"
    server = Server(work / "server", env={"BATCHSCRIBE_BATCH_TRACE": str(trace),
                                          "BATCHSCRIBE_MODEL__NAME": args.model},
                    argv=["-m", "loadtest.lib.batch_trace"]).start()
    assert server.proc is not None
    pid = server.proc.pid
    client = Client(server.url, clips, "en")
    dumps: list[dict[str, Any]] = []
    try:
        cycle = Cycle(short)
        idle = [await _short(client, cycle.next(), pid, 1e9, dumps) for _ in range(args.idle)]
        cycle = Cycle(short)  # beside the upload: the same clips in the same order as idle
        blob = long_path.read_bytes()
        stop = asyncio.Event()
        long_jobs: list[dict[str, Any]] = []
        seen: list[tuple[float, int, int, int | None]] = []  # (t, upload, windows done, total)

        async def keep_long() -> None:
            while not stop.is_set():
                t0 = time.monotonic()
                job_id = await client.submit(long_path.name, blob)
                while True:
                    job = await client.job(job_id)
                    done = job.get("progress") or {}
                    seen.append((time.monotonic(), len(long_jobs), done.get("windows_done", 0),
                                 done.get("windows_total")))
                    if job["status"] in TERMINAL:
                        break
                    if stop.is_set():
                        await client.cancel(job_id)
                    await asyncio.sleep(0.25)
                long_jobs.append({"job": job_id, "posted": t0, "ended": time.monotonic(),
                                  "status": job["status"]})

        long_task = asyncio.create_task(keep_long())
        beside: list[dict[str, Any]] = []
        until = started + args.max_minutes * 60
        try:
            while len(beside) < args.requests and time.monotonic() < until:
                beside.append(await _short(client, cycle.next(), pid, args.spy_after, dumps))
        finally:
            stop.set()
            await long_task
    finally:
        await client.close()
        server.stop()
    calls = [json.loads(x) for x in trace.read_text().splitlines()] if trace.exists() else []
    t_base = long_jobs[0]["posted"] if long_jobs else 0.0
    slow = [r for r in beside if r["latency_s"] >= args.slow]
    parts = [p for p in (decompose(r, calls) for r in beside) if p is not None]
    machine = machine_info()
    placed = [{**r, "upload": upload_at(seen, r["sent"])} for r in beside]
    return {
        "commit": machine["git"], "clean_tree": machine["git_clean"], "machine": machine,
        "args": {k: str(v) for k, v in vars(args).items()},
        "requested": args.requests, "long_audio_s": round(audio_s, 1),
        "upload_windows": upload_windows(calls, {j["job"] for j in long_jobs}),
        "load_before": load_before,
        "idle": latency_summary([r["latency_s"] for r in idle]),
        "beside_long": latency_summary([r["latency_s"] for r in beside]),
        "targets": targets(idle, beside),
        "by_progress": by_progress(placed),
        "long_jobs": [{**j, "posted": round(j["posted"] - t_base, 3),
                       "ended": round(j["ended"] - t_base, 3)} for j in long_jobs],
        "parts": sorted(parts, key=lambda p: -p["latency_s"]),
        "parts_summary": {k: latency_summary([p[k] for p in parts])
                          for k in ("queue_s", "encode_s", "pool_s", "decode_s", "other_s")},
        "slow": [explain(r, calls, t_base) for r in slow],
        "requests": [{**r, "sent": round(r["sent"] - t_base, 3), "done": round(r["done"] - t_base, 3)}
                     for r in placed],
        "spy": spy_summary(dumps),
        "dumps": [{**d, "t": round(d["t"] - t_base, 3)} for d in dumps[:3]],
        "trace": str(trace),
    }


def targets(idle: list[dict[str, Any]], beside: list[dict[str, Any]]) -> dict[str, Any]:
    """Issue 48's check: p95 <= 3x idle p95 and max <= 5x idle p95 (``met``), on the same clips
    idle and beside the upload (both runs take the cycle from its start); also read against the
    idle run's max (like for like: a clip that loops is slow idle too) and its p50 (issue 34's
    "0.5 s idle")."""
    i = latency_summary([r["latency_s"] for r in idle])
    b = latency_summary([r["latency_s"] for r in beside])
    if not i.get("n") or not b.get("n"):
        return {}
    same = [r["clip"] for r in idle] == [r["clip"] for r in beside[:len(idle)]]
    return {"same_clips": same,
            "met": b["p95_s"] <= 3 * i["p95_s"] and b["max_s"] <= 5 * i["p95_s"],
            "p95_over_idle_p95": round(b["p95_s"] / i["p95_s"], 2),
            "max_over_idle_p95": round(b["max_s"] / i["p95_s"], 2),
            "max_over_idle_max": round(b["max_s"] / i["max_s"], 2),
            "p95_over_idle_p50": round(b["p95_s"] / i["p50_s"], 2),
            "max_over_idle_p50": round(b["max_s"] / i["p50_s"], 2),
            "slowest_beside": sorted(((r["latency_s"], r["clip"]) for r in beside),
                                     reverse=True)[:5],
            "slowest_idle": sorted(((r["latency_s"], r["clip"]) for r in idle), reverse=True)[:5]}


def upload_at(seen: list[tuple[float, int, int, int | None]], t: float) -> dict[str, Any] | None:
    """The upload in flight when a request was sent: which one (0: the first posted), its
    windows answered then, and the fraction of it done (of its windows once known, else of
    the 45 a 20-minute meeting upload is cut into)."""
    before = [s for s in seen if s[0] <= t]
    if not before:
        return None
    _, k, done, total = before[-1]
    return {"upload": k, "windows_done": done, "windows_total": total,
            "fraction": round(min(1.0, done / (total or max(done, 45))), 3)}


def by_progress(placed: list[dict[str, Any]], bins: int = 10) -> list[dict[str, Any]]:
    """Latency by how far the upload in flight was when each request was sent (tenths)."""
    out = []
    for b in range(bins):
        lat = [r["latency_s"] for r in placed if r["upload"] is not None
               and min(bins - 1, int(r["upload"]["fraction"] * bins)) == b]
        out.append({"upload_done": f"{b / bins:.1f}-{(b + 1) / bins:.1f}",
                    **latency_summary(lat)})
    return out


def upload_windows(calls: list[dict[str, Any]], jobs: set[str]) -> dict[str, Any]:
    """The long uploads' windows as the service cut them (from the trace's submits)."""
    d = sorted(x for c in calls if c["ev"] == "submit" and c["job"] in jobs for x in c["dur"])
    if not d:
        return {}
    return {"n": len(d), "p10_s": d[len(d) // 10], "p50_s": d[len(d) // 2],
            "p90_s": d[9 * len(d) // 10], "min_s": d[0], "max_s": d[-1]}


def spy_summary(dumps: list[dict[str, Any]]) -> dict[str, Any]:
    """What the threads were doing in the py-spy dumps taken while a request was slow: the
    event loop's thread (idle: waiting in the loop) and each engine worker's call."""
    engine: dict[str, int] = {}
    main: dict[str, int] = {}
    both_long = 0
    for d in dumps:
        states = []
        for block in d["dump"].split("\nThread ")[1:]:
            lines = block.strip().splitlines()
            stack = " > ".join(line.strip().split(" (")[0] for line in lines[1:])
            if "MainThread" in lines[0]:
                top = lines[1].strip().split(" (")[0] if len(lines) > 1 else ""
                main[top] = main.get(top, 0) + 1
            elif "engine_" in lines[0]:
                if "transcribe_batch" in stack:
                    state = "run call (both stages, one call)"
                elif "WhisperEngine.redo" in stack:
                    state = "redo call (a fallback, apart from its decoder batch)"
                elif "_redo_axis" in stack:
                    state = "decode call, redoing a looping/unsure window at 30 s"
                elif "WhisperEngine.decode" in stack:
                    state = "decode call"
                elif "WhisperEngine.encode" in stack:
                    state = "encode call"
                else:
                    state = "idle"
                states.append(state)
                engine[state] = engine.get(state, 0) + 1
        both_long += sum(st.startswith("run call") for st in states) >= 2
    return {"dumps": len(dumps), "main_thread_top": main, "engine_threads": engine,
            "dumps_with_every_worker_in_a_run_call": both_long}


def decompose(req: dict[str, Any], trace: list[dict[str, Any]]) -> dict[str, Any] | None:
    """A request's latency in parts, from the trace: queued until its encode (or run) call
    began (waiting for a worker), that call, waiting in the decoder pool, its decode call(s),
    and the rest (HTTP, upload, prep, job store)."""
    calls = sorted(((c["stage"], c["t0"], c["t1"], i) for c in trace if c["ev"] == "call"
                    for i in c["items"] if i["job"] == req["job"]), key=lambda c: c[1])
    if not calls:
        return None
    first = [c for c in calls if c[0] in ("encode", "run")]
    dec = [c for c in calls if c[0] in ("decode", "redo")]  # redo: its fallback, apart
    queue = first[0][1] - calls[0][3]["enq"] if first else 0.0
    enc = sum(c[2] - c[1] for c in first)
    pool = dec[0][1] - first[-1][2] if dec and first else 0.0
    decode = sum(c[2] - c[1] for c in dec)
    parts = {"queue_s": queue, "encode_s": enc, "pool_s": pool, "decode_s": decode}
    parts["other_s"] = req["done"] - req["sent"] - sum(parts.values())
    return {"clip": req["clip"], "latency_s": req["latency_s"],
            **{k: round(v, 3) for k, v in parts.items()}}


def explain(req: dict[str, Any], trace: list[dict[str, Any]], t0: float) -> dict[str, Any]:
    """A slow request's windows through the batcher, and every engine call while it was out."""
    def rel(t: float | None) -> float | None:
        return None if t is None else round(t - t0, 3)

    mine = []
    during = []
    for c in trace:
        if c["ev"] != "call" or c["t1"] < req["sent"] or c["t0"] > req["done"]:
            continue
        jobs = sorted({i["job"] for i in c["items"]})
        row = {"stage": c["stage"], "t0": rel(c["t0"]), "t1": rel(c["t1"]),
               "took_s": round(c["t1"] - c["t0"], 3), "n": len(c["items"]),
               "jobs": jobs, "padded": sorted({i["padded"] for i in c["items"]})}
        during.append(row)
        for i in c["items"]:
            if i["job"] == req["job"]:
                mine.append({**row, "rank": i["rank"], "queued": rel(i["enq"]),
                             "pooled": rel(i["pooled"]), "window_s": i["dur"]})
    submits = [{"t": rel(s["t"]), "job": s["job"], "n": s["n"], "padded": s["padded"],
                "job_windows": s["job_windows"]}
               for s in trace if s["ev"] == "submit" and req["sent"] <= s["t"] <= req["done"]]
    return {"job": req["job"], "clip": req["clip"], "latency_s": req["latency_s"],
            "sent": rel(req["sent"]), "done": rel(req["done"]), "its_calls": mine,
            "engine_calls_meanwhile": during, "submits_meanwhile": submits}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--long-minutes", type=float, default=20.0)
    ap.add_argument("--requests", type=int, default=100)
    ap.add_argument("--idle", type=int, default=100, help="short requests on the idle server")
    ap.add_argument("--upload", choices=("meeting", "clips"), default="meeting",
                    help="the long upload: continuous read speech (~28 s windows) or every "
                    "corpus clip with gaps")
    ap.add_argument("--spy-after", type=float, default=3.0)
    ap.add_argument("--slow", type=float, default=3.0, help="explain requests at least this slow")
    ap.add_argument("--model", default="whisper-base")
    ap.add_argument("--exclude", nargs="*", default=[], help="short clips left out of the cycle")
    ap.add_argument("--max-minutes", type=float, default=12.0,
                    help="stop sending short clips after this long (fewer than --requests "
                         "on a loaded host), so a run ends within 15 minutes with its results")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--engine-costs", action="store_true",
                    help="only the engine's cost of each short clip (no server)")
    args = ap.parse_args()
    if args.engine_costs:
        from loadtest.lib.stall_costs import engine_costs

        load = os.getloadavg()
        rows = engine_costs(args.model)
        args.out.write_text(json.dumps({"load_before": load, "load_after": os.getloadavg(),
                                        "clips": rows}, indent=1))
        for r in rows[:4] + rows[-1:]:
            print(json.dumps(r))
        return
    with tempfile.TemporaryDirectory(prefix="stall-") as tmp:
        out = asyncio.run(run(args, Path(tmp)))
        trace = Path(out["trace"])
        kept = args.out.with_suffix(".trace.jsonl")
        if trace.exists():
            shutil.copy(trace, kept)
            out["trace"] = str(kept)
        out["load_after"] = os.getloadavg()
    args.out.write_text(json.dumps(out, indent=1))
    print(json.dumps({k: out[k] for k in ("commit", "load_before", "idle", "beside_long", "load_after",
                                          "parts_summary")}))
    for p in out["parts"][:10]:
        print(json.dumps(p))


if __name__ == "__main__":
    main()
