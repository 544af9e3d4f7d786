"""Real traffic (issue 17): what the bench measures beyond the friendly closed loop.

* **A long upload beside short requests, counted from its POST.** The long file is posted (202)
  and kept in flight (posted again when it ends); one client sends short clips one at a time from
  the moment of that first POST. Every short request counts: none is left out for having been
  sent while the long upload was still being uploaded, decoded or cut.
* **A long upload alone:** wall time from its POST to its transcript (upload, prep, every batch).
* **Memory with a 4-hour upload in flight:** a fresh server, its idle peak RSS after a few short
  requests, then a 4-hour upload (FLAC), RSS sampled while it is transcribed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from loadtest.lib.common import proc_status_kb
from loadtest.lib.corpus import Clip
from loadtest.lib.service import TERMINAL, Client, Cycle, Result, Server, histogram_delta, sequential
from loadtest.lib.stats import latency_summary

POLL_S = 0.25


async def _finish(client: Client, job_id: str) -> dict[str, Any]:
    while True:
        job = await client.job(job_id)
        if job["status"] in TERMINAL:
            return job
        await asyncio.sleep(POLL_S)


async def long_alone(client: Client, path: Path, audio_s: float) -> dict[str, Any]:
    """One long upload on an otherwise idle server: throughput from its POST."""
    t0 = time.monotonic()
    job = await _finish(client, await client.submit(path.name, path.read_bytes()))
    wall = time.monotonic() - t0
    return {"audio_s": round(audio_s, 3), "status": job["status"], "wall_s": round(wall, 3),
            "throughput_x": round(audio_s / wall, 3), "windows": job["progress"]["windows_total"],
            "processing_s": job.get("processing_s"), "error": job.get("error")}


async def beside_long(client: Client, path: Path, audio_s: float, short: Sequence[Clip],
                      min_requests: int, min_s: float) -> dict[str, Any]:
    """Short clips one at a time from the long upload's POST, the long file always in flight;
    runs until ``min_requests`` short requests and ``min_s`` seconds have passed."""
    blob = path.read_bytes()
    stop = asyncio.Event()
    long_jobs: list[dict[str, Any]] = []

    async def keep_long() -> None:
        while not stop.is_set():
            t0 = time.monotonic()
            job_id = await client.submit(path.name, blob)
            while True:
                job = await client.job(job_id)
                if job["status"] in TERMINAL:
                    break
                if stop.is_set():
                    await client.cancel(job_id)
                await asyncio.sleep(POLL_S)
            long_jobs.append({"status": job["status"], "wall_s": round(time.monotonic() - t0, 3),
                              "windows": job["progress"].get("windows_total")})

    before = await client.metrics()
    long_task = asyncio.create_task(keep_long())
    cycle = Cycle(short)
    results: list[Result] = []
    t0 = time.monotonic()
    try:
        while len(results) < min_requests or time.monotonic() - t0 < min_s:
            if long_task.done():
                long_task.result()  # the long upload failed: say why
                break
            results.append(await client.transcribe(cycle.next()))
    finally:
        stop.set()
        await long_task
    after = await client.metrics()
    ok = [r for r in results if r.ok]
    done = [j for j in long_jobs if j["status"] == "done"]
    return {
        "long_audio_s": round(audio_s, 3), "counted_from": "the long upload's POST",
        "latency_short": latency_summary([r.latency for r in ok]),
        "short_failed": len(results) - len(ok),
        "long_jobs": long_jobs,
        "long_throughput_x": (round(audio_s / (sum(j["wall_s"] for j in done) / len(done)), 3)
                              if done else None),
        "batch_size": histogram_delta(before, after, "batchscribe_batch_size_windows"),
    }


async def rss_during(server: Server, client: Client, path: Path, audio_s: float,
                     warm: Sequence[Clip]) -> dict[str, Any]:
    """Idle peak RSS (after a few short requests), then the RSS while ``path`` is transcribed."""
    assert server.proc is not None
    pid = server.proc.pid
    await sequential(client, warm, len(warm))
    idle_hwm = (proc_status_kb(pid, "VmHWM") or 0) / 1024
    peak = 0.0
    t0 = time.monotonic()
    job_id = await client.submit(path.name, path.read_bytes())
    while True:
        peak = max(peak, (proc_status_kb(pid, "VmRSS") or 0) / 1024)
        job = await client.job(job_id)
        if job["status"] in TERMINAL:
            break
        await asyncio.sleep(0.5)
    wall = time.monotonic() - t0
    hwm = (proc_status_kb(pid, "VmHWM") or 0) / 1024
    return {"audio_s": round(audio_s, 3), "status": job["status"], "error": job.get("error"),
            "idle_peak_rss_mb": round(idle_hwm, 1), "peak_rss_mb": round(max(peak, hwm), 1),
            "growth_mb": round(max(peak, hwm) - idle_hwm, 1), "wall_s": round(wall, 3),
            "throughput_x": round(audio_s / wall, 3),
            "windows": job["progress"].get("windows_total")}


def write_long_flac(clips: Sequence[Clip], path: Path, min_s: float, gap_s: float = 0.8) -> float:
    """Corpus clips and 0.8 s gaps, repeated to >= ``min_s``, as 16 kHz mono FLAC written one
    clip at a time (nothing here holds more than one clip decoded). A 4-hour WAV would be 460 MB;
    this FLAC is ~210 MB, so the bench raises the upload limit for it (the default is 200 MiB).
    Returns the audio seconds written."""
    import av
    import numpy as np

    from app.audio import decode
    from app.windows import SAMPLE_RATE

    decoded = [decode(c.path, 4 * 3600.0) for c in sorted(clips, key=lambda c: c.id)]
    gap = np.zeros(int(gap_s * SAMPLE_RATE), np.float32)
    total = 0
    with av.open(str(path), "w", format="flac") as out:
        stream = out.add_stream("flac", rate=SAMPLE_RATE)
        stream.layout = "mono"
        stream.format = "s16"

        def put(samples: np.ndarray) -> None:
            pcm = (np.clip(samples, -1, 1) * 32767).astype(np.int16)[None]
            frame = av.AudioFrame.from_ndarray(pcm, format="s16", layout="mono")
            frame.sample_rate = SAMPLE_RATE
            for packet in stream.encode(frame):
                out.mux(packet)

        while total < min_s * SAMPLE_RATE:
            for a in decoded:
                put(np.concatenate([a, gap]))
                total += a.size + gap.size
                if total >= min_s * SAMPLE_RATE:
                    break
        for packet in stream.encode(None):
            out.mux(packet)
    return total / SAMPLE_RATE
