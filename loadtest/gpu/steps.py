"""The steps of ``scripts/gpu-check`` (loadtest/gpu/check.py runs them in order and records each).

Traffic against the running service (:func:`measured` wraps each step: throughput, WER,
latency, batches, GPU utilisation), the live sessions, and the measurements made with the
service stopped: the engine alone on a step's own windows, the bare encoder, the peer
(loadtest/gpu/peer.py) and the time axes (loadtest/dynamic_axis.py), each in a child process.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from app.client.scoring import wer_percent
from loadtest.gpu.watch import MetricsSampler, NvmlSampler
from loadtest.lib.common import ROOT, write_wav16
from loadtest.lib.corpus import Clip, save_clips
from loadtest.lib.probes import counter_delta, histogram_delta
from loadtest.lib.service import Client, Result, Server, all_at_once
from loadtest.lib.stats import latency_summary, wer_by_group

Traffic = Callable[[Client], Awaitable[list[Result]]]


def write_upload(clips: list[Clip], path: Path, minutes: float, gap_s: float = 0.8,
                 name: str = "long") -> Clip:
    """One long upload: the corpus clips in id order (cycled), ``gap_s`` apart, to at least
    ``minutes``; its reference is the clips' references in that order (so its WER counts)."""
    import numpy as np

    from app.audio import decode
    from app.windows import SAMPLE_RATE

    gap = np.zeros(int(gap_s * SAMPLE_RATE), np.float32)
    ordered = sorted(clips, key=lambda c: c.id)
    decoded = {c.id: decode(c.path, 4 * 3600.0) for c in ordered}
    parts: list[np.ndarray] = []
    refs: list[str] = []
    total = 0
    while total < minutes * 60 * SAMPLE_RATE:
        for c in ordered:
            parts += [decoded[c.id], gap]
            refs.append(c.reference)
            total += len(decoded[c.id]) + len(gap)
            if total >= minutes * 60 * SAMPLE_RATE:
                break
    seconds = write_wav16(path, np.concatenate(parts), SAMPLE_RATE)
    return Clip(name, path, seconds, " ".join(refs), "long")


# ---- one step's traffic ----------------------------------------------------------------------
async def measured(srv: Server, clips: list[Clip], language: str | None,
                   traffic: Traffic) -> dict[str, Any]:
    client = Client(srv.url, clips, language)
    try:
        before = await client.metrics()
        t0 = time.monotonic()
        with NvmlSampler() as nvml:
            async with MetricsSampler(client) as gauges:
                results = await traffic(client)
        wall = time.monotonic() - t0
        after = await client.metrics()
    finally:
        await client.close()
    ok = [r for r in results if r.ok]
    short = [r for r in ok if r.clip.set != "long"]
    long = [r for r in ok if r.clip.set == "long" and r.clip.reference]
    audio = sum(r.clip.duration_s for r in ok)
    wer = (wer_by_group([r.clip for r in short], {r.clip.id: r.text or "" for r in short})
           if short else {})
    batches = histogram_delta(before, after, "batchscribe_batch_size_windows")
    gpu = nvml.summary()
    return {
        "requests": len(results), "ok": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r.error or "" for r in results if not r.ok})[:5],
        "wall_s": round(wall, 2), "audio_s": round(audio, 1),
        "throughput_x": round(audio / wall, 1) if wall else None,
        "wer_read_percent": wer.get("read_speech", {}).get("wer_percent"), "wer": wer,
        "wer_long_percent": (wer_percent([r.clip.reference for r in long],
                                         [r.text or "" for r in long]) if long else None),
        "latency_short": latency_summary([r.latency for r in short]),
        "latency_long": [round(r.latency, 2) for r in ok if r.clip.set == "long"],
        "batch_size": batches, "mean_batch": batches.get("mean"),
        "gpu_busy_percent": round(100 * gpu["gpu_busy_fraction"], 1) if gpu else None,
        "oom_events": counter_delta(before, after, "batchscribe_oom_events_total"),
        "cap_after": after.get(("batchscribe_batch_cap_windows", "")),
        **gauges.summary(), "gpu": gpu, "server_peak_rss_mb": srv.peak_rss_mb(),
    }


def corpus(clips: list[Clip], concurrency: int) -> Traffic:
    return lambda client: all_at_once(client, clips, concurrency)


def long_and(long: Clip, clips: list[Clip], concurrency: int) -> Traffic:
    async def run(client: Client) -> list[Result]:
        client.blobs[long.id] = long.path.read_bytes()
        first = asyncio.create_task(client.transcribe(long))
        await asyncio.sleep(1.0)  # the long upload's windows are queued first
        rest = await all_at_once(client, clips, concurrency) if clips else []
        return [await first, *rest]
    return run


def many_long(long: Clip, n: int) -> Traffic:
    """``n`` copies of a long upload at once, each its own job: the engine, not one job's
    prep, should be what limits. A 429 (the backlog limit) is retried after its
    ``retry_after_s``, as a client would."""
    async def one(client: Client, clip: Clip) -> Result:
        while True:
            r = await client.transcribe(clip)
            if r.status != 429:
                return r
            try:
                wait = float(json.loads(r.error or "{}")["error"]["retry_after_s"])
            except (ValueError, KeyError, TypeError):
                wait = 1.0
            await asyncio.sleep(wait)

    async def run(client: Client) -> list[Result]:
        blob = long.path.read_bytes()
        copies = [Clip(f"{long.id}-{k}", long.path, long.duration_s, long.reference, "long")
                  for k in range(n)]
        for c in copies:
            client.blobs[c.id] = blob
        return list(await asyncio.gather(*(one(client, c) for c in copies)))
    return run


# ---- live sessions ---------------------------------------------------------------------------
async def live_sessions(srv: Server, clips: list[Clip], n: int, seconds: float,
                        seed: int = 50) -> dict[str, Any]:
    """``n`` OpenAI Realtime transcription sessions at once, each streaming corpus speech at
    real-time pace (loadtest/live.py's sessions and scoring: server VAD 500 ms, language en),
    started ``min(0.2, 5 / n)`` s apart: turn latency from each utterance's last chunk, every
    turn completed or not."""
    from loadtest.lib.live_common import build_stream, live_clips, score
    from loadtest.live import one_session

    pool = live_clips(clips)
    cache: dict[str, Any] = {}
    streams = [build_stream(pool, seconds, seed + k, cache=cache) for k in range(n)]
    url = srv.url.replace("http", "ws", 1) + "/v1/realtime?intent=transcription"
    stagger = min(0.2, 5.0 / n)
    t0 = time.monotonic()
    with NvmlSampler() as nvml:
        got = await asyncio.gather(*(one_session(url, s, {}, 5.0, 0.5, stagger * k)
                                     for k, s in enumerate(streams)))
    outcomes = [o for o, _ in got]
    out = {"sessions": n, "stream_s": seconds, "stagger_s": stagger,
           "wall_s": round(time.monotonic() - t0, 1), **score(streams, outcomes),
           "items_completed": sum(len(i.done) for _, i in got), "gpu": nvml.summary()}
    out["every_turn_completed"] = out["never_finalised"] == 0 and out["not_heard"] == 0
    return out


# ---- with the service stopped ----------------------------------------------------------------
def child(cmd: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *cmd], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def engine_alone(args: argparse.Namespace, clips: list[Clip], compute_type: str, name: str,
                 repeat: int = 1) -> dict[str, Any]:
    """The service's engine on a step's own windows (``loadtest.offline engine``: app.audio's
    cut, then ``WhisperEngine`` at several batch sizes; ``repeat`` copies of the uploads, as
    the step posted them), no HTTP, prep or batcher: what the step's rate is measured
    against. ``best_throughput_x``: its best batch size."""
    path = args.work / f"{name}-clips.json"
    save_clips(clips, path)
    out = args.work / f"{name}.json"
    out.unlink(missing_ok=True)
    gpu = args.device == "cuda"
    got = child(["loadtest.offline", "engine", "--clips", str(path), "--model", args.model_dir,
                 "--device", args.device, "--compute-type", compute_type, "--language", "en",
                 "--batches", args.engine_batches or ("8,32,128" if gpu else "8"),
                 "--min-seconds", "3" if gpu else "0", "--repeat", str(repeat),
                 "--time-axis", args.time_axis, "--out", str(out)], timeout=600)
    if not out.exists():
        return {"error": f"exit {got.returncode}: {got.stderr[-1500:]}"}
    result: dict[str, Any] = json.loads(out.read_text())
    result["best_throughput_x"] = max(r["throughput_x"] for r in result["runs"])
    return result


def bare_encode(args: argparse.Namespace, compute_type: str) -> dict[str, Any]:
    """The encoder alone; on GPU once more with CTranslate2's flash attention (64 windows)."""
    gpu = args.device == "cuda"
    batches = args.bare_batches or ("1,16,64,128" if gpu else "1,4")
    runs: list[tuple[str, list[str]]] = [("default", ["--batches", batches])]
    if gpu:
        runs.append(("flash_attention", ["--batches", "64", "--flash-attention"]))
    out: dict[str, Any] = {}
    for name, extra in runs:
        got = child(["loadtest.gpu.bare", "--model", args.model_dir, "--device", args.device,
                     "--compute-type", compute_type, "--corpus", str(args.corpus), "--reps",
                     "5" if gpu else "2", *extra], timeout=300)
        line = [x for x in got.stdout.splitlines() if x.startswith("RESULT ")]
        out[name] = (json.loads(line[0][7:]) if line
                     else {"error": f"exit {got.returncode}: {got.stderr[-1500:]}"})
    return out


def peer(args: argparse.Namespace, upload: Clip, copies: int, compute_type: str) -> dict[str, Any]:
    """faster-whisper's BatchedInferencePipeline on the saturate step's files, one after
    another (loadtest/gpu/peer.py); the service's saturate figures beside it."""
    files = []
    for k in range(copies):  # the same bytes under as many names, as the step posted them
        f = args.work / f"peer-{k}.wav"
        if not f.exists():
            f.symlink_to(upload.path.resolve())
        files.append(str(f))
    refs = args.work / "peer-refs.json"
    refs.write_text(json.dumps([upload.reference] * copies))
    out = args.work / "peer.json"
    out.unlink(missing_ok=True)
    got = child(["loadtest.gpu.peer", "--model", args.model_dir, "--device", args.device,
                 "--compute-type", compute_type, "--files", ",".join(files), "--references",
                 str(refs), "--sweep", args.peer_sweep, "--out", str(out)], timeout=900)
    if not out.exists():
        return {"error": f"exit {got.returncode}: {got.stderr[-1500:]}"}
    result: dict[str, Any] = json.loads(out.read_text())
    if got.returncode:
        result["error"] = f"exit {got.returncode}: {got.stderr[-1500:]}"
    return result


def time_axes(args: argparse.Namespace, compute_type: str) -> dict[str, Any]:
    """WER of the corpus on Whisper's 30 s axis and on the dynamic one, on this device
    (loadtest/dynamic_axis.py): the measurement behind ``time_axis: auto``."""
    out = args.work / "dynamic-axis.json"
    out.unlink(missing_ok=True)
    got = child(["loadtest.dynamic_axis", "--corpus", str(args.corpus), "--device", args.device,
                 "--compute-type", compute_type, "--batch", "32" if args.device == "cuda"
                 else "8", "--model", args.model_dir, "--out", str(out),
                 *(["--clips", str(args.clips)] if args.clips else [])], timeout=600)
    if not out.exists():
        return {"error": f"exit {got.returncode}: {got.stderr[-1500:]}"}
    result: dict[str, Any] = json.loads(out.read_text())
    result["wer_all_percent"] = {k: v["wer_all_percent"] for k, v in result["settings"].items()}
    return result
