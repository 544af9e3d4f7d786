"""The service's own CPU per request, without the model: what HTTP, the job store, decode and VAD
cost beside the engine.

    .venv/bin/python -m loadtest.overhead --passes 4

Starts the real app (``create_app``) in a subprocess with a null engine that answers every window
at once, sends the corpus ``--passes`` times with ``--clients`` uploads in flight, and reports the
server's CPU milliseconds per request, split by thread (``prep``: fetch, decode, VAD; the event
loop; the job store's thread; AnyIO's pool: spooling and probing). Thread names come from
``py-spy dump`` when py-spy is installed, else the split is by thread id only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from loadtest.common import load_corpus
from loadtest.probes import cpu_seconds, thread_cpu
from loadtest.service import Client, Server, all_at_once

SERVE = """
import os, sys
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import uvicorn
from app.config import Settings
from app.engine import EngineInfo
from app.windows import WindowResult
from app.main import create_app, setup_logging

class NullEngine:
    info = EngineInfo("null", "cpu", "int8", 2)

    def transcribe_batch(self, windows, options):
        return [WindowResult(text="x", language=options.language or "en",
                             language_probability=None, avg_logprob=-0.1, no_speech_prob=0.0,
                             compression_ratio=1.0) for _ in windows]

    def close(self):
        pass

settings = Settings()
setup_logging("WARNING")
uvicorn.run(create_app(settings, engine_factory=lambda s: NullEngine()), host="127.0.0.1",
            port=settings.port, log_config=None)
"""


def thread_names(pid: int) -> dict[str, str]:
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    try:
        dump = subprocess.run([spy, "dump", "--pid", str(pid)], capture_output=True, text=True,
                              timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    names = dict(re.findall(r'Thread (\d+) \([a-z]+\): "([^"]+)"', dump))
    # Pool threads are numbered (prep_0, Thread-12 (...)): one line per kind.
    return {tid: re.sub(r"Thread-\d+ ", "", re.sub(r"_\d+$", "", n)) for tid, n in names.items()}


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    clips = load_corpus(args.corpus) if args.corpus else load_corpus()
    with tempfile.TemporaryDirectory() as data:
        server = Server(Path(data), argv=["-c", SERVE]).start()
        assert server.proc is not None
        pid = server.proc.pid
        client = Client(server.url, clips, args.language or None)
        try:
            await all_at_once(client, clips[:16], args.clients)  # warm-up
            before = (cpu_seconds(pid), thread_cpu(pid))
            t0 = time.monotonic()
            results = await all_at_once(client, list(clips) * args.passes, args.clients)
            wall = time.monotonic() - t0
            after = (cpu_seconds(pid), thread_cpu(pid))
            names = thread_names(pid)
        finally:
            await client.close()
            server.stop()
    n = len(results)
    by: dict[str, float] = {}
    for tid, t in after[1].items():
        name = names.get(tid, f"thread {tid}")
        by[name] = by.get(name, 0.0) + t - before[1].get(tid, 0.0)
    audio = sum(c.duration_s for c in clips) * args.passes
    return {
        "requests": n, "failed": sum(not r.ok for r in results), "wall_s": round(wall, 2),
        "audio_s": round(audio, 1),
        "server_cpu_ms_per_request": round(1000 * (after[0] - before[0]) / n, 2),
        "server_cpu_ms_per_audio_s": round(1000 * (after[0] - before[0]) / audio, 3),
        "by_thread_ms_per_request": {k: round(1000 * v / n, 2) for k, v in
                                     sorted(by.items(), key=lambda kv: -kv[1]) if v > 0},
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.overhead", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--passes", type=int, default=4, help="times the corpus is sent")
    p.add_argument("--clients", type=int, default=32, help="uploads in flight")
    p.add_argument("--language", default="en")
    p.add_argument("--corpus", type=Path, default=None)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    res = asyncio.run(measure(args))
    text = json.dumps(res, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0 if res["failed"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
