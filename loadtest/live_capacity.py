"""How many live sessions one service process carries (issue 50 (d): 64 and 256 OpenAI Realtime
sessions on the GPU): the service's own CPU per second of live audio, with an engine that
answers at once, so what is measured is everything but the model.

    python -m loadtest.live_capacity --streams 16,32,64,96 --out loadtest/results/live-capacity.json

The real service (``loadtest/lib/feed_tree.py serve``: HTTP, WebSocket, sessions, Silero turn
detection, the batcher; the engine a stand-in that answers every window at once) and, per N,
``loadtest/live.py``'s sessions (PCM16 at 24 kHz in 100 ms appends at real-time pace, server
VAD 500 ms, corpus speech with pauses, then ``--drain`` s of silence). Per N: the service
process's CPU seconds over the run and per second of session audio, the cores it kept busy,
turn latency from the last chunk sent (p50 / p95 / max), turns never finalised and interim
text on long turns. On a GPU the model's calls are off the CPU, and this is the work left on
it; the clients here share the host's cores with the service (on 2 cores they are ~a third of
the load), so the knee this finds is a lower bound. ``--base`` measures a commit too, in turn.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Protocol

from loadtest.feed import Service, base_tree
from loadtest.lib.common import ROOT, machine_info
from loadtest.lib.live_common import Stream, build_stream, live_clips
from loadtest.live import run_sessions, session_config

SR = 16_000


class Measured(Protocol):
    """What :func:`one` needs of the service: its URL and its CPU seconds so far."""

    url: str

    def cpu_s(self) -> dict[str, float]: ...


async def one(svc: Measured, streams: list[Stream], drain_s: float) -> dict[str, Any]:
    """The ``streams`` as live sessions at once: the service's CPU over them and per second of
    their audio (the drain included: the service reads it too), turn latency and finals."""
    n = len(streams)
    audio_s = sum(s.audio.size / SR + drain_s for s in streams)
    ws_url = svc.url.replace("http", "ws", 1) + "/v1/realtime?intent=transcription"
    load = [round(x, 2) for x in os.getloadavg()]
    cpu0, t0 = svc.cpu_s(), time.monotonic()
    r = await run_sessions(ws_url, streams, {}, drain_s, 0.5, session_config())
    wall, cpu1 = time.monotonic() - t0, svc.cpu_s()
    cpu = round(cpu1["service"] - cpu0["service"], 2)
    return {
        "streams": n, "session_audio_s": round(audio_s, 1), "wall_s": round(wall, 2),
        "load_average_at_start": load,
        "service_cpu_s": cpu, "prep_processes_cpu_s": round(cpu1["children"] - cpu0["children"], 2),
        # the service process's CPU per second of live audio, and the cores it kept busy
        "service_cpu_ms_per_audio_s": round(1000 * cpu / audio_s, 2),
        # of it, the event loop's thread (the WebSocket, the sessions' steps): what one
        # process cannot spread over cores
        "loop_cpu_ms_per_audio_s": round(1000 * (cpu1.get("loop", 0.0) - cpu0.get("loop", 0.0))
                                         / audio_s, 2),
        "service_cores": round(cpu / wall, 3),
        "turn_latency": r["turn_latency"], "utterances": r["utterances"],
        "never_finalised": r["never_finalised"], "not_heard": r["not_heard"],
        "interim_share": r.get("interim_share"), "errors": len(r.get("errors", [])),
        "items_completed": r["items_completed"],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--streams", default="16,32,64,96")
    ap.add_argument("--seconds", type=float, default=30.0, help="speech per stream (about)")
    ap.add_argument("--drain", type=float, default=5.0, help="silence sent after the speech")
    ap.add_argument("--seed", type=int, default=34)
    ap.add_argument("--base", help="also measure this commit, in turn")
    ap.add_argument("--work", type=Path, default=Path("/tmp/batchscribe-live-capacity"))
    ap.add_argument("--out", type=Path, default=ROOT / "loadtest" / "results" /
                    "live-capacity.json")
    args = ap.parse_args(argv)
    trees = {"this": ROOT}
    if args.base:
        trees = {"base": base_tree(args.base, args.work), **trees}
    ns = [int(x) for x in args.streams.split(",")]
    most = str(max(ns))
    env = {"BATCHSCRIBE_LIVE__MAX_SESSIONS": most, "BATCHSCRIBE_LIVE__MAX_SESSIONS_PER_KEY": most}
    report: dict[str, Any] = {
        "command": "python -m loadtest.live_capacity " + " ".join(
            argv if argv is not None else sys.argv[1:]),
        "machine": machine_info(), "base_commit": args.base, "trees": {}}
    cache: dict[str, Any] = {}
    clips = live_clips()
    for name, tree in trees.items():
        rows: list[dict[str, Any]] = []
        report["trees"][name] = rows
        svc = Service(tree, args.work, 32, 2, env)
        try:
            for n in ns:
                streams = [build_stream(clips, args.seconds, args.seed + k, cache=cache)
                           for k in range(n)]
                rows.append(asyncio.run(one(svc, streams, args.drain)))
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps(report, indent=1) + "\n")
                print(json.dumps({"tree": name, **rows[-1]}), flush=True)
        finally:
            svc.stop()
    print(f"live_capacity: wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
