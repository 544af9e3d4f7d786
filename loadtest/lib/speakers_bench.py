"""The bench's speaker phase: the throughput cost of ``diarize=true``.

The same closed-loop workload is replayed twice on the running service, ``--diarize-clients``
(8) clients for ``--diarize-duration`` (180) seconds each after the warm-up: first plain, then with
``diarize=true`` on every upload. The workload is what diarization is for, multi-speaker
recordings: the diarization corpus (``../shared/corpus-diarization``, 4 recordings, 150 s) and
the main corpus's clips of >= 10 s, in the same replay order both ways. One diarize request is
sent (and not counted) before the diarize run, so the lazy load of the speaker models is not
in it. Reported: both throughputs (audio s / wall s), their ratio, latencies, the speaker time
per job (``batchscribe_diarization_seconds``) and the server's CPU.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from loadtest.lib.common import ROOT
from loadtest.lib.corpus import Clip
from loadtest.lib.probes import histogram_delta
from loadtest.lib.report import log
from loadtest.lib.service import Client, closed_loop

DIARIZATION_CORPUS = Path(os.environ.get("BATCHSCRIBE_DIARIZATION_CORPUS",
                                         ROOT.parent / "shared" / "corpus-diarization"))
MIN_CLIP_S = 10.0  # main-corpus clips long enough to be a conversation's turn or more


def workload(clips: list[Clip], corpus: Path = DIARIZATION_CORPUS) -> list[Clip]:
    manifest = corpus / "manifest.jsonl"
    if not manifest.is_file():
        raise SystemExit(f"no diarization corpus at {corpus} (--diarization-corpus, "
                         "or BATCHSCRIBE_DIARIZATION_CORPUS)")
    meetings = [Clip(m["id"], corpus / m["file"], float(m["duration_s"]), "", "diarization")
                for m in map(json.loads, manifest.read_text().splitlines()) if m]
    return meetings + [c for c in clips if c.duration_s >= MIN_CLIP_S]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--diarize-clients", type=int, default=8,
                   help="speaker phase: closed-loop clients, each way")
    p.add_argument("--diarize-duration", type=float, default=180.0,
                   help="speaker phase: measured seconds without, then with, diarize=true (only "
                        "requests that finish inside count, and a diarize request of this "
                        "workload took ~40 s at 8 clients here: keep it several times that)")
    p.add_argument("--diarization-corpus", type=Path, default=DIARIZATION_CORPUS)


async def phase(args: argparse.Namespace, url: str, clips: list[Clip], pid: int,
                engine_threads: int) -> dict[str, Any]:
    """The phase as the bench runs it, on its running server."""
    log(f"service: speakers, {args.diarize_clients} clients, {args.diarize_duration:.0f}s each "
        "without and with diarize=true")
    d = await run(url, workload(clips, args.diarization_corpus), None,
                  args.diarize_clients, args.warmup, args.diarize_duration, pid, engine_threads)
    log(f"  plain {d['plain']['throughput_x']}x, diarize {d['diarize']['throughput_x']}x, "
        f"ratio {d['ratio']}")
    return d


async def run(url: str, clips: list[Clip], language: str | None, n_clients: int, warmup_s: float,
              duration_s: float, pid: int, engine_threads: int) -> dict[str, Any]:
    out: dict[str, Any] = {"clips": len(clips), "audio_s": round(sum(c.duration_s for c in clips), 1),
                           "clients": n_clients}
    for name, fields in (("plain", {}), ("diarize", {"diarize": "true"})):
        client = Client(url, clips, language, fields=fields)
        try:
            if fields:
                await client.transcribe(clips[0])  # loads the speaker models (lazy): not timed
            before = await client.metrics()
            load = await closed_loop(client, clips, n_clients, warmup_s, duration_s, pid,
                                     engine_threads)
            await client.wait_idle(pid)
            # Every job of the run (warm-up and stragglers included): the speaker time per job.
            load["diarization_s"] = histogram_delta(before, await client.metrics(),
                                                    "batchscribe_diarization_seconds")
        finally:
            await client.close()
        load.pop("_results")
        load.pop("_counted")
        out[name] = load
    plain, diar = out["plain"]["throughput_x"], out["diarize"]["throughput_x"]
    out["ratio"] = round(diar / plain, 3) if plain else None
    return out


def markdown(res: dict[str, Any]) -> str:
    """The phase's rows, appended to the bench's Markdown when it ran."""
    d = res.get("service", {}).get("diarize")
    if not d:
        return ""
    p, q = d["plain"], d["diarize"]

    def part(label: str, x: dict[str, Any]) -> str:
        lat = x.get("latency_all", {})
        return (f"{label} {x['throughput_x']}x (latency p50 {lat.get('p50_s')} s, p95 "
                f"{lat.get('p95_s')} s; server {(x.get('cpu') or {}).get('process_cores')} cores)")

    return "\n".join([
        "",
        f"Speakers: {d['clients']} clients replaying {d['clips']} recordings ({d['audio_s']} s: "
        "the diarization corpus and the corpus clips of >= 10 s), "
        f"{p['duration_s']:.0f} s each way after a {p['warmup_s']:.0f} s warm-up: "
        f"{part('plain', p)}, {part('diarize=true', q)}: {d['ratio']} of plain; speaker time per "
        f"diarized job (batchscribe_diarization_seconds, mean) "
        f"{q.get('diarization_s', {}).get('mean')} s.",
    ]) + "\n"
