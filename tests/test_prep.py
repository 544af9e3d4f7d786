"""Streaming prep (issue 17): uploads decoded, VAD-cut and handed over a chunk at a time.

* Chunk edges change nothing: the windows equal those of one pass over the whole upload.
* Memory is bounded by design: windows own their samples (never views into the upload), and
  the stream holds about a chunk of audio, whatever the upload's length.
* The prep threads are shared fairly: a short upload's chunk goes before a long one's later
  chunks; jobs are claimed only as fast as prep starts them, and a drain gives claimed but
  unstarted jobs back at no cost.
"""

from __future__ import annotations

import asyncio
import threading
import tracemalloc
import wave
from collections.abc import Awaitable, Callable
from pathlib import Path

import numpy as np
import pytest

from app.audio import AudioStream, cut_windows, decode
from app.audio.vad import SileroVad
from app.jobs.prep import PrepPool
from app.windows import N_SAMPLES, SAMPLE_RATE, Window
from loadtest.lib.corpus import Clip
from tests.fakes import BOUND
from tests.test_jobs import GatedBlobs, Rig, rig_factory  # noqa: F401  (the fixture)


def write_wav(path: Path, audio: np.ndarray) -> Path:
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(SAMPLE_RATE)
        w.writeframes((np.clip(audio, -1, 1) * 32767).astype("<i2").tobytes())
    return path


@pytest.fixture(scope="module")
def long_upload(clips: list[Clip], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """~12 minutes: every corpus clip, 0.8 s of silence between them (more than one VAD
    onnxruntime block; windows that straddle chunk edges)."""
    gap = np.zeros(int(0.8 * SAMPLE_RATE), np.float32)
    audio = np.concatenate([x for c in clips for x in (decode(c.path, 3600.0), gap)])
    assert audio.size > 600 * SAMPLE_RATE
    return write_wav(tmp_path_factory.mktemp("prep") / "long.wav", audio)


@pytest.fixture(scope="module")
def vad() -> SileroVad:
    return SileroVad()


def streamed(path: Path, vad: SileroVad, chunk_s: float) -> tuple[list[Window], int]:
    stream = AudioStream(path, vad, 7200.0, chunk_s)
    out: list[Window] = []
    held = 0
    while not stream.done:
        out += stream.next_chunk()
        held = max(held, stream._tracks[0].buf.size)
    return out, held


@pytest.mark.parametrize("chunk_s", [7.3, 31.0, 60.0])
def test_streamed_windows_equal_one_pass_over_the_whole_upload(long_upload: Path, vad: SileroVad,
                                                               chunk_s: float) -> None:
    audio = decode(long_upload, 7200.0)
    whole = cut_windows(audio, vad.speech(audio))
    windows, _ = streamed(long_upload, vad, chunk_s)
    assert len(windows) == len(whole) > 15
    for a, b in zip(windows, whole, strict=True):
        assert (a.start, a.end) == (b.start, b.end)
        assert np.array_equal(a.audio, b.audio)


def stream_peak(path: Path, vad: SileroVad) -> tuple[int, int, int]:
    """(windows, largest buffer in samples, Python-side peak bytes: tracemalloc counts numpy's
    buffers) while streaming ``path`` in 60 s chunks, every window checked to own its samples."""
    tracemalloc.start()
    try:
        stream = AudioStream(path, vad, 7200.0, 60.0)
        n = held = 0
        while not stream.done:
            for w in stream.next_chunk():
                assert w.audio.base is None and w.audio.size <= N_SAMPLES  # its own array
                n += 1
            held = max(held, stream._tracks[0].buf.size)
        return n, held, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_long_upload_is_never_held_whole(long_upload: Path, vad: SileroVad,
                                           tmp_path: Path) -> None:
    """Windows own their samples, the stream's buffer stays about a chunk plus one window, and
    the memory peak while streaming does not grow with the upload's length: the same for the
    whole ~12 min upload as for its first 3 min, and far below the decoded upload."""
    audio = decode(long_upload, 7200.0)
    short = write_wav(tmp_path / "short.wav", audio[: 180 * SAMPLE_RATE])
    n_long, held, peak_long = stream_peak(long_upload, vad)
    n_short, _, peak_short = stream_peak(short, vad)
    assert n_long > 15 and n_long > 3 * n_short
    assert held <= (60 + 30 + 2) * SAMPLE_RATE  # a chunk, an open window, the VAD's lookahead
    assert peak_long <= 1.25 * peak_short + 2**20, (peak_long, peak_short)
    assert peak_long < 0.75 * audio.nbytes, (peak_long, audio.nbytes)


async def test_a_short_uploads_chunk_goes_before_a_long_uploads_later_chunks() -> None:
    pool = PrepPool(1)
    gate = threading.Event()
    order: list[str] = []

    def work(name: str) -> str:
        if name == "blocker":
            gate.wait(BOUND)
        order.append(name)
        return name

    blocker = asyncio.ensure_future(pool.run(0, work, "blocker"))
    await asyncio.sleep(0.05)  # the blocker holds the only thread
    later = [asyncio.ensure_future(pool.run(k, work, f"long-{k}")) for k in (3, 1, 2)]
    short = asyncio.ensure_future(pool.run(0, work, "short"))
    await asyncio.sleep(0.05)
    gate.set()
    await asyncio.wait_for(asyncio.gather(blocker, *later, short), BOUND)
    assert order == ["blocker", "short", "long-1", "long-2", "long-3"]
    pool.shutdown()


async def test_claims_ahead_are_bounded_and_a_drain_gives_unstarted_jobs_back_free(
        rig_factory: Callable[..., Awaitable[Rig]], clips: list[Clip]) -> None:  # noqa: F811
    """Fetches parked in both prep threads: the runner claims prep workers + 1 jobs, not its
    whole max_active_jobs (64), and a stop returns them all queued with no attempt spent."""
    rig = await rig_factory(blobs_cls=GatedBlobs)
    blobs = rig.blobs
    assert isinstance(blobs, GatedBlobs)
    for k in range(8):
        await rig.submit(f"j{k}", clips[k])
    assert await asyncio.to_thread(blobs.entered.wait, BOUND)
    ahead = rig.runner.prep.workers + 1
    for _ in range(50):  # let the claim loop settle (it is woken by each submit)
        await asyncio.sleep(0.02)
    counts = await rig.store.counts()
    assert counts == {"running": ahead, "queued": 8 - ahead}, counts
    assert not any(a.started for a in rig.runner.active.values())
    stopping = asyncio.create_task(rig.runner.stop(2.0))
    await asyncio.wait_for(rig.batcher.stopping.wait(), BOUND)
    blobs.gate.set()
    await asyncio.wait_for(stopping, BOUND)
    for k in range(8):
        row = await rig.store.get(f"j{k}")
        assert row is not None and row.status == "queued" and row.attempts == 0, row
