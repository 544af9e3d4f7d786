"""The short-request bench on the batcher alone: the real ``Batcher`` (asyncio, threads) with an
engine whose calls sleep for what this host's costs say, 10x faster (tests/simulation.py's cost
model; its timers scaled alike). Sleeping calls use no CPU, so a contended host changes little:
a check of the batcher's order that any tree can run, side by side.

    PYTHONPATH=/work/main .venv/bin/python -m loadtest.batcher_stall --clips long   # main
    PYTHONPATH=$PWD .venv/bin/python -m loadtest.batcher_stall --clips long         # this tree

One client sends short clips one at a time, ``--requests`` on the idle batcher, then the same
beside a kept 20-minute meeting-like upload (windows of 26-29.5 s, cut two at a time as prep
hands them over, at most 24 ahead). ``--clips long`` includes clips of 12-25 s, in the upload's
padded class. Latency in host seconds (scaled back), plus 0.3 s for what is outside the batcher.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Sequence
from functools import partial

import numpy as np

from app.batching.batcher import Batcher
from app.batching.stages import Stages
from app.config import BatcherSettings
from app.engine import EngineInfo
from app.engine.placement import EngineRunner
from app.engine.whisper import padded_length
from app.metrics import Metrics
from app.windows import SAMPLE_RATE, DecodeOptions, Encoded, Prompt, Window, WindowResult

SCALE = 0.1
SHORT = (2.1, 3.4, 5.0, 7.2, 9.5, 1.5, 4.4, 6.1, 8.3, 2.9)
LONG = (12.0, 18.5, 22.0, 4.0, 9.0, 21.0, 16.0, 25.0)


def padded(w: Window) -> int:
    return padded_length(len(w.audio), 8 * SAMPLE_RATE)


class SleepingEngine:
    """Two stages; each call sleeps its cost (encoder 0.0154 s per padded second, decoder
    0.024 s per second of speech at batch 1, less per window in a batch)."""

    staged = True

    def __init__(self) -> None:
        self.info = EngineInfo("sleeping", "cpu", "int8", 2)

    def padded_samples(self, w: Window) -> int:
        return padded(w)

    def encode(self, ws: Sequence[Window], o: DecodeOptions) -> list[Encoded]:
        time.sleep(SCALE * (0.01 + sum(padded(w) for w in ws) / SAMPLE_RATE * 0.0154))
        return [Encoded(padded(w), np.zeros(1, np.float32), "en", None) for w in ws]

    def decode(self, ws: Sequence[Window], enc: object, o: DecodeOptions,
               redo: bool = True) -> list[WindowResult]:
        n = len(ws)
        time.sleep(SCALE * (0.01 + sum(w.duration for w in ws) * 0.024 * max(0.35, n ** -0.47)))
        return [WindowResult("w", "en", None, -0.1, 0.0, 1.0) for _ in ws]

    def redo(self, ws: Sequence[Window], enc: object, o: DecodeOptions) -> list[WindowResult]:
        return self.decode(ws, enc, o)

    def transcribe_batch(self, ws: Sequence[Window], o: DecodeOptions) -> list[WindowResult]:
        self.encode(ws, o)
        return self.decode(ws, None, o)

    def close(self) -> None:
        pass


def window(seconds: float) -> Window:
    return Window(np.zeros(int(seconds * SAMPLE_RATE), np.float32), 0.0, seconds, Prompt("en"))


def p(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


async def run(requests: int, clips: Sequence[float], minutes: float) -> dict[str, float]:
    runner = EngineRunner(SleepingEngine())
    settings = BatcherSettings(max_decode_wait_ms=600, max_wait_ms=5, interim_max_wait_ms=100)
    b = Batcher(runner.run, settings, 2, Metrics(), size_class=padded, padded=padded,
                stages=Stages(runner.encode, partial(runner.decode, redo=False), padded,
                              redo=runner.redo))
    b.start()
    rng = np.random.default_rng(48)
    wins: list[float] = []
    while sum(wins) < minutes * 60:
        wins.append(float(rng.uniform(26.0, 29.5)))

    async def short(k: int) -> float:
        t = time.monotonic()
        await asyncio.gather(*b.submit(f"s{k}", [window(clips[k % len(clips)])], DecodeOptions()))
        return (time.monotonic() - t) / SCALE + 0.3

    idle = [await short(k) for k in range(requests)]
    stop = asyncio.Event()

    async def upload() -> None:
        u = 0
        while not stop.is_set():
            futs: list[asyncio.Future[WindowResult]] = []
            cut = 0
            while cut < len(wins) and not stop.is_set():
                while sum(not f.done() for f in futs) >= 24:
                    await asyncio.sleep(0.005)
                chunk = wins[cut:cut + 2]
                futs += b.submit(f"u{u}", [window(s) for s in chunk], DecodeOptions(),
                                 first_rank=cut, job_windows=len(wins))
                cut += len(chunk)
                await asyncio.sleep(0.057)  # prep at ~105x real time, scaled
            await asyncio.gather(*futs, return_exceptions=True)
            u += 1

    kept = asyncio.create_task(upload())
    await asyncio.sleep(1.0)
    beside = [await short(k) for k in range(requests)]
    stop.set()
    await kept
    await b.stop(5)
    ip = p(idle, 0.95)
    return {"idle_p95_s": round(ip, 2), "beside_p50_s": round(p(beside, 0.5), 2),
            "beside_p95_s": round(p(beside, 0.95), 2), "beside_max_s": round(max(beside), 2),
            "p95_over_idle_p95": round(p(beside, 0.95) / ip, 2),
            "max_over_idle_p95": round(max(beside) / ip, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=100)
    ap.add_argument("--clips", choices=("short", "long"), default="long")
    ap.add_argument("--long-minutes", type=float, default=20.0)
    args = ap.parse_args()
    clips = LONG if args.clips == "long" else SHORT
    print(asyncio.run(run(args.requests, clips, args.long_minutes)))


if __name__ == "__main__":
    main()
