"""The bench's speaker phase: the throughput cost of ``diarize=true``.

The same closed-loop workload is replayed twice on the running service, ``--diarize-clients``
clients for ``--diarize-duration`` seconds each after the warm-up: first plain, then with
``diarize=true`` on every upload. The workload is what diarization is for, multi-speaker
recordings: the diarization corpus (``../shared/corpus-diarization``, 4 recordings, 150 s) and
the main corpus's clips of >= 10 s, in the same replay order both ways. One diarize request is
sent (and not counted) before the diarize run, so the lazy load of the speaker models is not
in it. Reported: both throughputs (audio s / wall s), their ratio, latencies, the speaker time
per job (``batchscribe_diarization_seconds``) and the server's CPU.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from loadtest.common import ROOT, Clip
from loadtest.probes import histogram_delta
from loadtest.service import Client, closed_loop

DIARIZATION_CORPUS = Path(os.environ.get("BATCHSCRIBE_DIARIZATION_CORPUS",
                                         ROOT.parent / "shared" / "corpus-diarization"))
MIN_CLIP_S = 10.0  # main-corpus clips long enough to be a conversation's turn or more


def workload(clips: list[Clip], corpus: Path = DIARIZATION_CORPUS) -> list[Clip]:
    manifest = corpus / "manifest.jsonl"
    if not manifest.is_file():
        raise SystemExit(f"no diarization corpus at {corpus} (--diarization-corpus, "
                         "or BATCHSCRIBE_DIARIZATION_CORPUS)")
    meetings = [Clip(m["id"], str(corpus / m["file"]), float(m["duration_s"]), "", "diarization")
                for m in map(json.loads, manifest.read_text().splitlines()) if m]
    return meetings + [c for c in clips if c.duration_s >= MIN_CLIP_S]


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

    def row(label: str, x: dict[str, Any], ratio: str) -> str:
        lat = x.get("latency_all", {})
        cpu = (x.get("cpu") or {}).get("process_cores")
        return (f"| {label} | {x['throughput_x']}x | {ratio} | {lat.get('p50_s')} s | "
                f"{lat.get('p95_s')} s | {cpu} |")

    return "\n".join([
        "",
        f"Speakers: {d['clients']} clients replaying {d['clips']} recordings ({d['audio_s']} s: "
        "the diarization corpus and the corpus clips of >= 10 s), "
        f"{p['duration_s']:.0f} s each way after a {p['warmup_s']:.0f} s warm-up.",
        "",
        "| same workload | throughput | ÷ plain | latency p50 | p95 | server cores |",
        "| --- | --- | --- | --- | --- | --- |",
        row("plain", p, ""),
        row("diarize=true", q, f"{d['ratio']}"),
        "",
        f"Speaker time per diarized job (batchscribe_diarization_seconds, mean): "
        f"{q.get('diarization_s', {}).get('mean')} s.",
    ]) + "\n"
