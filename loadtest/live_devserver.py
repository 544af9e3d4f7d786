"""A stand-in for phase B's ``/v1/realtime`` route, so loadtest/live.py can measure the live path
before the service serves it: a bare WebSocket server (no API keys, no job store, no uploads)
running :class:`app.live.session.LiveSession` on the service's own engine, VAD and batcher.

    PYTHONPATH=$PWD .venv/bin/python -m loadtest.live_devserver --port 8765 --decoder batcher
    PYTHONPATH=$PWD .venv/bin/python -m loadtest.live --url http://127.0.0.1:8765 ...

``--decoder batcher``: every decode a one-window job of today's shared batcher
(:func:`app.live.decoding.batcher_decoder`, the service's settings: split stages, the decoder
pool's ``max_decode_wait_ms``), interim and final alike: no priority classes yet, which is what
phase B adds. ``--decoder engine``: every decode its own engine call, no batching
(:func:`app.live.decoding.engine_decoder`). Audio work runs in a pool of ``--prep`` threads.
Prints ``ready <port>`` once it listens. Not part of the service: a measuring tool.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from app.batching.batcher import Batcher
from app.batching.stages import Stages
from app.config import Settings
from app.live.config import LiveLimits
from app.live.decoding import Decode, batcher_decoder, engine_decoder
from app.live.events import new_id
from app.live.session import LiveSession, serve
from app.metrics import Metrics

log = logging.getLogger("live_devserver")


async def main_async(args: argparse.Namespace) -> None:
    from websockets.asyncio.server import ServerConnection
    from websockets.asyncio.server import serve as ws_serve
    from websockets.exceptions import ConnectionClosed

    from app.audio.vad import SileroVad
    from app.engine.loading import load_whisper
    from app.engine.placement import make_pool
    from app.engine.whisper import size_class

    settings = Settings()
    engine = await asyncio.to_thread(load_whisper, settings)
    pool = make_pool([engine], settings)
    vad = await asyncio.to_thread(SileroVad)
    stages = (Stages(pool.encode, pool.decode, engine.padded_samples)  # type: ignore[attr-defined]
              if settings.batcher.split_stages and pool.staged else None)
    batcher = Batcher(pool.run, settings.batcher, pool.workers, Metrics(),
                      size_class=size_class(settings.model, engine.info.device), stages=stages,
                      padded=getattr(engine, "padded_samples", None))
    batcher.start()
    prep = ThreadPoolExecutor(args.prep, thread_name_prefix="live-prep")
    limits = LiveLimits(model=settings.model.name)
    counts: dict[str, int] = {}

    async def handler(ws: ServerConnection) -> None:
        if not ws.request or not ws.request.path.startswith("/v1/realtime"):
            await ws.close(4404, "not found")
            return
        sid = new_id("sess")
        decode: Decode = (batcher_decoder(batcher, sid) if args.decoder == "batcher"
                          else engine_decoder(pool.run))
        session = LiveSession(decode, vad, limits, prep, session_id=sid)

        async def receive() -> str | bytes | None:
            try:
                return await ws.recv()
            except ConnectionClosed:
                return None

        async def send(event: dict[str, Any]) -> None:
            await ws.send(json.dumps(event))

        await serve(session, receive, send)
        for k, v in session.counts.items():
            counts[k] = counts.get(k, 0) + v
        log.warning("session %s done: %s (all sessions: %s)", session.id, session.counts, counts)

    async with ws_serve(handler, "127.0.0.1", args.port, max_size=None):
        print(f"ready {args.port}", flush=True)
        await asyncio.Event().wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("--decoder", choices=("batcher", "engine"), default="batcher")
    ap.add_argument("--prep", type=int, default=2, help="threads for audio and VAD")
    ap.add_argument("--trace", help="write the batcher's trace here (loadtest/batch_trace.py)")
    args = ap.parse_args()
    if args.trace:
        from loadtest.batch_trace import install

        install(args.trace)
    logging.basicConfig(level=logging.WARNING)
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
