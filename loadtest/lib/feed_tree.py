"""The feed bench's side inside one source tree (``loadtest/feed.py`` runs it with
``PYTHONPATH=<tree>``, so the same code measures this commit and the one before the change):

* ``serve``: the real service (HTTP, store, prep, batcher) with an engine stand-in that answers
  at once and counts the windows reaching it (``GET /feed-stats``, ``?reset=1``);
* ``ceiling``: prep alone (decode, Silero VAD, cut: ``app.audio.prepare``) on the given files,
  ``--procs`` processes pulling files from one queue, no service: the feed ceiling.

Only APIs both trees have are used (``create_app``'s ``engine_factory``, ``EngineInfo``,
``WindowResult``, ``app.audio.prepare``). Run as a script, never imported by the service.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any


def serve(args: argparse.Namespace) -> None:
    import uvicorn

    from app.config import Settings
    from app.engine import EngineInfo
    from app.main import create_app, setup_logging
    from app.windows import WindowResult

    setup_logging("INFO")  # the service's JSON log lines, into the step's server.log
    lock = threading.Lock()
    stats: dict[str, Any] = {}

    def reset() -> None:
        stats.update(windows=0, audio_s=0.0, batches=0, first=None, last=None, times=[])

    reset()

    class Instant:
        """Answers every window at once: what reaches it is what the service could feed."""

        def __init__(self, settings: Settings) -> None:
            self.info = EngineInfo("instant", "cpu", "int8", args.workers)

        def transcribe_batch(self, windows: Any, options: Any) -> list[Any]:
            now = time.time()
            with lock:
                stats["windows"] += len(windows)
                stats["audio_s"] += sum(len(w.audio) for w in windows) / 16000
                stats["batches"] += 1
                stats["first"] = stats["first"] or now
                stats["last"] = now
                stats["times"].append((round(now, 4), len(windows)))
            out = []
            for w in windows:
                lang: str = "en"
                p: float | None = 0.99
                if w.prompt.language:
                    lang, p = w.prompt.language, None
                elif w.prompt.choice is not None:
                    lang, p = w.prompt.choice.decide("en", 0.99)
                out.append(WindowResult(text="w", language=lang, language_probability=p,
                                        avg_logprob=-0.1, no_speech_prob=0.0,
                                        compression_ratio=1.0))
            return out

        def close(self) -> None:
            pass

    settings = Settings()
    app = create_app(settings, engine_factory=Instant)

    @app.get("/feed-stats")
    def feed_stats(reset_after: int = 0) -> dict[str, Any]:
        with lock:
            out = dict(stats)
            if reset_after:
                reset()
        return out

    here = {"host": "127.0.0.1", "port": args.port, "log_level": "warning"}
    try:  # uvicorn as `python -m app` runs it (its WebSocket protocol and settings)
        from app.__main__ import server_config
    except ImportError:  # a tree from before 64a16d2 (a --base): uvicorn's defaults, as then
        uvicorn.run(app, log_config=None, **here)
        return
    uvicorn.Server(server_config(app, settings, **here)).run()


def _worker(ready: Any, start: Any, todo: Any, done: Any) -> None:
    from app.audio import prepare
    from app.audio.vad import SileroVad

    vad = SileroVad()
    ready.put(os.getpid())
    start.wait()
    while True:
        path = todo.get()
        if path is None:
            return
        c0 = time.process_time()
        seconds, windows = prepare(Path(path), vad, 4 * 3600.0)
        done.put({"file": Path(path).name, "audio_s": round(seconds, 3),
                  "windows": len(windows), "cpu_s": round(time.process_time() - c0, 3),
                  "end": time.time()})


def ceiling(args: argparse.Namespace) -> None:
    ctx = mp.get_context("spawn")
    ready, todo, done = ctx.Queue(), ctx.Queue(), ctx.Queue()
    start = ctx.Event()
    procs = [ctx.Process(target=_worker, args=(ready, start, todo, done))
             for _ in range(args.procs)]
    for p in procs:
        p.start()
    for _ in procs:
        ready.get(timeout=300)  # every process has built its VAD: only prep is timed
    for f in args.files:
        todo.put(f)
    for _ in procs:
        todo.put(None)
    t0 = time.time()
    start.set()
    files = [done.get(timeout=3600) for _ in args.files]
    for p in procs:
        p.join()
    wall = max(f["end"] for f in files) - t0
    windows = sum(f["windows"] for f in files)
    audio = sum(f["audio_s"] for f in files)
    cpu = sum(f["cpu_s"] for f in files)
    json.dump({"procs": args.procs, "files": len(files), "wall_s": round(wall, 3),
               "windows": windows, "audio_s": round(audio, 1),
               "windows_per_s": round(windows / wall, 2), "realtime_x": round(audio / wall, 1),
               "cpu_s": round(cpu, 2), "windows_per_cpu_s": round(windows / cpu, 2),
               "per_file": [{k: v for k, v in f.items() if k != "end"} for f in files]},
              sys.stdout)


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve")
    s.add_argument("--port", type=int, required=True)
    s.add_argument("--workers", type=int, default=2, help="the stand-in engine's workers")
    c = sub.add_parser("ceiling")
    c.add_argument("--procs", type=int, required=True)
    c.add_argument("files", nargs="+")
    args = ap.parse_args()
    serve(args) if args.cmd == "serve" else ceiling(args)


if __name__ == "__main__":
    main()
