"""``scripts/gpu-check``: one command for whoever has a GPU. The service on the device, measured.

    scripts/gpu-check                                  # cuda:0, whisper-base
    scripts/gpu-check --model large-v3-turbo           # a provisioned name, or a model folder
    scripts/gpu-check --device cpu                     # the same run on CPU

Each phase is a real ``python -m app`` on the device, driven over HTTP with the corpus
(``../shared/corpus`` or ``--corpus``), every clip sent at once (``--concurrency`` in flight):

1. ``default``: the service as it starts (its warm-up and the cap it measured, from /readyz),
   then three passes: language given (``en``), language detected, word timestamps.
2. ``forced_oom``: no warm-up and a cap far above what the device holds (``--oom-cap``), so
   batches run out of memory and the OOM backoff has to recover: OOM events, failed jobs.
3. ``sweep``: one service per cap in ``--sweep`` (an explicit ``max_batch_size``), one pass each.

Per pass: throughput (audio s / wall s), RTF (wall s / audio s), WER (read speech, other sets),
latency, OOM events, batch sizes, peak device memory (sampled from /metrics every 0.5 s: NVML
per GPU; on CPU the server's peak RSS). Written to ``loadtest/results/gpu-<device>.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from loadtest.common import DEFAULT_CORPUS, ROOT, Clip, load_corpus, machine_info, select_clips
from loadtest.probes import counter_delta, histogram_delta
from loadtest.scoring import latency_summary, normaliser_name, wer_by_group
from loadtest.service import Client, Server, all_at_once

PASSES: dict[str, tuple[str | None, dict[str, str]]] = {
    "language_en": ("en", {}),
    "language_detected": (None, {}),
    "word_timestamps": ("en", {"word_timestamps": "true"}),
}


class MemoryPeaks:
    """Peak device memory during a pass, from the server's own gauges (scraped every 0.5 s)."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self.peak: dict[str, float] = {}
        self._stop = asyncio.Event()

    async def run(self) -> None:
        while not self._stop.is_set():
            for (name, labels), v in (await self.client.metrics()).items():
                if name in ("batchscribe_device_memory_used_bytes", "batchscribe_engine_memory_bytes"):
                    key = f"{name.removeprefix('batchscribe_').removesuffix('_bytes')}{labels}"
                    self.peak[key] = max(self.peak.get(key, 0.0), v)
            with contextlib.suppress(TimeoutError):  # a sample every 0.5 s until stopped
                await asyncio.wait_for(self._stop.wait(), 0.5)

    def stop(self) -> dict[str, float]:
        self._stop.set()
        return {k: round(v / 2**20, 1) for k, v in sorted(self.peak.items())}


async def run_pass(srv: Server, clips: list[Clip], concurrency: int, language: str | None,
                   fields: dict[str, str]) -> dict[str, Any]:
    client = Client(srv.url, clips, language, fields=fields)
    try:
        before = await client.metrics()
        peaks = MemoryPeaks(client)
        sampler = asyncio.create_task(peaks.run())
        t0 = time.monotonic()
        results = await all_at_once(client, clips, concurrency)
        wall = time.monotonic() - t0
        memory = peaks.stop()
        await sampler
        after = await client.metrics()
    finally:
        await client.close()
    ok = [r for r in results if r.ok]
    audio = sum(r.clip.duration_s for r in ok)
    return {
        "clips": len(clips), "ok": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r.error or "" for r in results if not r.ok})[:5],
        "wall_s": round(wall, 2), "audio_s": round(audio, 2),
        "throughput_x": round(audio / wall, 2) if wall else None,
        "rtf": round(wall / audio, 4) if audio else None,
        "wer": wer_by_group(clips, {r.clip.id: r.text or "" for r in ok}),
        "latency": latency_summary([r.latency for r in ok]),
        "words_per_clip": (round(sum(r.words or 0 for r in ok) / len(ok), 1)
                           if fields.get("word_timestamps") and ok else None),
        "oom_events": counter_delta(before, after, "batchscribe_oom_events_total"),
        "batch_size": histogram_delta(before, after, "batchscribe_batch_size_windows"),
        "batch_cap_after": after.get(("batchscribe_batch_cap_windows", "")),
        "peak_memory_mb": memory, "server_peak_rss_mb": srv.peak_rss_mb(),
    }


def server(args: argparse.Namespace, name: str, env: dict[str, str]) -> Server:
    base = {"BATCHSCRIBE_MODEL__DEVICE": args.device, "BATCHSCRIBE_MODEL__NAME": args.model,
            "BATCHSCRIBE_STORAGE__DATA_DIR": str(args.work / name)}
    return Server(args.work / name, env={**base, **env}).start(timeout=args.start_timeout)


def phase(args: argparse.Namespace, clips: list[Clip], name: str, env: dict[str, str],
          passes: dict[str, tuple[str | None, dict[str, str]]]) -> dict[str, Any]:
    print(f"gpu-check: {name}: starting the service ({env or 'defaults'})", flush=True)
    t0 = time.monotonic()
    srv = server(args, name, env)
    out: dict[str, Any] = {"env": env, "start_s": round(time.monotonic() - t0, 1)}
    try:
        out["readyz"] = httpx.get(srv.url + "/readyz", timeout=10).json()
        for label, (language, fields) in passes.items():
            print(f"gpu-check: {name}: pass {label} ({len(clips)} clips)", flush=True)
            out[label] = asyncio.run(run_pass(srv, clips, args.concurrency, language, fields))
            print(f"gpu-check: {name}: {label}: {summary(out[label])}", flush=True)
    finally:
        srv.stop()
    return out


def summary(p: dict[str, Any]) -> str:
    return (f"{p['throughput_x']}x, WER read {p['wer']['read_speech']['wer_percent']}%, "
            f"{p['failed']} failed, {p['oom_events']:.0f} OOM events")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--model", default="whisper-base",
                    help="a provisioned model name or a CTranslate2 Whisper folder")
    ap.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS)
    ap.add_argument("--clips", type=int, default=None, help="a subset of the corpus (all: 83)")
    ap.add_argument("--concurrency", type=int, default=32, help="requests in flight")
    ap.add_argument("--sweep", default="4,8,16,32,64", help="caps to sweep (empty: none)")
    ap.add_argument("--oom-cap", type=int, default=256, help="the forced-OOM phase's cap")
    ap.add_argument("--start-timeout", type=float, default=900.0)
    ap.add_argument("--work", type=Path, default=Path("/tmp/batchscribe-gpu-check"))
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    out_path = args.out or ROOT / "loadtest" / "results" / f"gpu-{args.device}.json"
    clips = select_clips(load_corpus(args.corpus), args.clips)
    t0 = time.monotonic()
    report: dict[str, Any] = {
        "command": "scripts/gpu-check " + " ".join(sys.argv[1:] if argv is None else argv),
        "device": args.device, "model": args.model, "machine": machine_info(),
        "clips": len(clips), "audio_s": round(sum(c.duration_s for c in clips), 1),
        "concurrency": args.concurrency, "normaliser": normaliser_name(),
    }
    report["default"] = phase(args, clips, "default", {}, PASSES)
    report["forced_oom"] = phase(
        args, clips, "forced_oom",
        {"BATCHSCRIBE_MODEL__WARMUP": "false", "BATCHSCRIBE_BATCHER__MAX_BATCH_SIZE": str(args.oom_cap)},
        {"language_en": PASSES["language_en"]})
    report["sweep"] = []
    for cap in [int(c) for c in args.sweep.split(",") if c.strip()]:
        p = phase(args, clips, f"cap-{cap}", {"BATCHSCRIBE_BATCHER__MAX_BATCH_SIZE": str(cap)},
                  {"language_en": PASSES["language_en"]})
        row = p["language_en"]
        report["sweep"].append({"cap": cap, "throughput_x": row["throughput_x"], "rtf": row["rtf"],
                                "oom_events": row["oom_events"], "failed": row["failed"],
                                "peak_memory_mb": row["peak_memory_mb"],
                                "server_peak_rss_mb": row["server_peak_rss_mb"],
                                "batch_size_mean": row["batch_size"]["mean"]})
    report["minutes"] = round((time.monotonic() - t0) / 60, 1)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(report, indent=1) + "\n")
    print(f"gpu-check: wrote {out_path} ({report['minutes']} min)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
