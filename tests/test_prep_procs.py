# ruff: noqa: F811  (the fixtures from tests/test_parts.py are parameters by the same names)
"""Prep in processes (issue 50 item 1, 2 and 5), on real prep processes and a fake-free path:

* A stream prepared in a process gives exactly the windows of one pass in this process (the
  samples through shared memory bit for bit; separate channels too); a split upload gives
  exactly the windows of its parts run side by side here.
* A prep process SIGKILLed mid-run: every feed finishes with exactly the windows of an
  undisturbed run (none twice, none missing), the process is replaced, every slot comes back.
* An upload that kills the decoder twice fails its own job (DecoderCrashed, a 4xx that says a
  retry cannot help) while a job beside it on the same process finishes whole.
* Credits: a job that holds its windows never holds more than its share, and another job's
  windows still come; on shutdown a waiting feed gets ShuttingDown (its job stays queued).
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from app.api.errors import headers_of, status_of
from app.audio import AudioStream
from app.audio.feeding import Credits, Request
from app.audio.parts import plan, splittable
from app.audio.procs import ProcFeed, ProcPool
from app.audio.vad import SileroVad
from app.errors import DecoderCrashed, ShuttingDown, UnsupportedMedia
from app.windows import SAMPLE_RATE, as_float
from loadtest.lib.feed_audio import encode
from loadtest.lib.split import side_by_side
from tests.conftest import Clip
from tests.fakes import BOUND
from tests.prep_faults import crashing_main
from tests.test_parts import speech, upload, vad  # noqa: F401  (fixtures)
from tests.test_prep import write_wav

Seen = list[tuple[int, float, float, int, float]]  # (part, start, end, channel, checksum)


@pytest.fixture
async def pools() -> AsyncIterator[Callable[..., Any]]:
    made: list[ProcPool] = []

    async def make(vad: SileroVad, n: int = 2, slots: int = 64, credits: Credits | None = None,
                   **kw: Any) -> ProcPool:
        pool = ProcPool(n, slots, vad.model(), credits or Credits.sized(8, 2, 24), **kw)
        made.append(pool)
        await pool.start()
        await asyncio.wait_for(pool.ready(), BOUND)
        return pool

    yield make
    for p in made:
        await p.stop()


async def drain(feed: ProcFeed, hold: bool = False,
                on_delivery: Callable[[int], None] | None = None) -> Seen:
    """Every window of a feed; released at once unless ``hold``."""
    await feed.start()
    seen: Seen = []
    n = 0
    try:
        while (d := await asyncio.wait_for(feed.next(), BOUND)) is not None:
            for w, c, t in zip(d.windows, d.channels, d.tokens, strict=True):
                seen.append((d.part, w.start, w.end, c, float(np.abs(as_float(w.audio)).sum())))
                if not hold:
                    feed.release(t)
            n += 1
            if on_delivery is not None:
                on_delivery(n)
    finally:
        await feed.close()
    return seen


async def all_slots_back(pool: ProcPool) -> None:
    """Slots granted as the last windows were made come back with the process's reply, a
    moment later: bounded wait, never a timing claim."""
    for _ in range(200):
        if pool.arena.free == pool.arena.count and not pool.streams:
            return
        await asyncio.sleep(0.05)
    assert pool.arena.free == pool.arena.count, (pool.arena.free, pool.streams)


def by_part(seen: Seen) -> Seen:
    return sorted(seen, key=lambda w: w[0])  # stable: a part's windows keep their order


def request(path: Path, job: str = "j", **kw: Any) -> Request:
    return Request(job, str(path), 7200.0, 60.0, **kw)


async def test_a_process_gives_the_windows_of_one_pass(pools: Callable[..., Any], upload: Path,
                                                       vad: SileroVad, tmp_path: Path) -> None:
    stereo = decode_pair(upload, tmp_path)
    pool = await pools(vad)
    for path, separate in ((upload, False), (stereo, True)):
        got = await drain(ProcFeed(pool, request(path, separate=separate, split=False), 2, 300))
        stream = AudioStream(path, vad, 7200.0, 60.0, separate)
        want: Seen = []
        while not stream.done:
            c = stream.read_chunk()
            want += [(0, w.start, w.end, ch, float(np.abs(as_float(w.audio)).sum()))
                     for w, ch in zip(c.windows, c.channels, strict=True)]
        assert got == want and len(want) > 15
    await all_slots_back(pool)


def decode_pair(upload: Path, tmp_path: Path) -> Path:
    """A two-channel WAV: the upload on the left, its second half first on the right."""
    import wave

    from app.audio import decode

    a = decode(upload, 7200.0)
    b = np.roll(a, a.size // 2)
    pcm = (np.stack([a, b], axis=1) * 32767).astype("<i2")
    path = tmp_path / "stereo.wav"
    with wave.open(str(path), "wb") as w:
        w.setnchannels(2)
        w.setsampwidth(2)
        w.setframerate(SAMPLE_RATE)
        w.writeframes(pcm.tobytes())
    return path


@pytest.fixture(scope="module")
def upload_mp3(speech: np.ndarray, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same ~11 minutes as a 44.1 kHz VBR MP3 (split by demuxing to each part's start)."""
    path = tmp_path_factory.mktemp("mp3") / "long.mp3"
    encode(speech, path, "mp3vbr")
    return path


@pytest.mark.parametrize("fmt", ["wav", "mp3"])
async def test_a_split_upload_comes_back_whole(pools: Callable[..., Any], upload: Path,
                                               upload_mp3: Path, vad: SileroVad,
                                               fmt: str) -> None:
    if fmt == "mp3":
        upload = upload_mp3
    pool = await pools(vad, 3)
    feed = ProcFeed(pool, request(upload), 3, 120)
    got = await drain(feed)
    assert feed.parts == 3
    duration = splittable(upload)
    assert duration is not None
    windows, _ = side_by_side(upload, vad, plan(duration, 3))
    want = sorted((w.start, w.end, float(np.abs(as_float(w.audio)).sum())) for w in windows)
    assert sorted((s, e, a) for _, s, e, _, a in got) == want
    by_part = [[g for g in got if g[0] == k] for k in range(3)]
    assert [g[1] for g in by_part[0] + by_part[1] + by_part[2]] == [w[0] for w in want]
    await all_slots_back(pool)


async def test_a_killed_process_loses_nothing(pools: Callable[..., Any], upload: Path,
                                              vad: SileroVad) -> None:
    pool = await pools(vad, 2)
    reqs = [request(upload, f"j{k}", split=k % 2 == 0) for k in range(4)]
    undisturbed = await asyncio.gather(*(drain(ProcFeed(pool, r, 2, 120)) for r in reqs))
    killed: list[int] = []

    def kill(n: int) -> None:
        if n == 3 and not killed:
            pid = pool.procs[0].process.pid
            assert pid is not None
            killed.append(pid)
            os.kill(pid, signal.SIGKILL)

    got = await asyncio.gather(*(drain(ProcFeed(pool, r, 2, 120), on_delivery=kill if k == 0
                                       else None) for k, r in enumerate(reqs)))
    assert killed and pool.deaths == 1
    # Every window once, none missing, each part's in order (parts interleave as they run).
    assert [by_part(g) for g in got] == [by_part(u) for u in undisturbed]
    assert any(len({w[0] for w in g}) == 2 for g in got)  # split uploads among them
    await asyncio.wait_for(pool.ready(), BOUND)  # the process was replaced
    assert pool.procs[0].process.pid not in killed and pool.procs[0].ready
    await all_slots_back(pool)


async def test_an_upload_that_kills_the_decoder_twice_fails_alone(
        pools: Callable[..., Any], upload: Path, vad: SileroVad, tmp_path: Path) -> None:
    poison = tmp_path / "poison.wav"
    poison.write_bytes(upload.read_bytes())
    pool = await pools(vad, 1, target=crashing_main)
    good = asyncio.ensure_future(drain(ProcFeed(pool, request(upload, "good", split=False),
                                                1, 300)))
    with pytest.raises(DecoderCrashed) as err:
        await drain(ProcFeed(pool, request(poison, "bad", split=False), 1, 300))
    # The client's input, and no retry helps: what the edge answers (app/api/errors.py).
    assert err.value.no_retry and err.value.error_type == "decoder_crashed"
    assert status_of(err.value) == 422 and headers_of(err.value) == {"x-should-retry": "false"}
    assert status_of("decoder_crashed") == 422  # a stored job error's type, as GET /jobs reads
    assert "cannot be transcribed" in err.value.message
    want = await drain(ProcFeed(pool, request(upload, "again", split=False), 1, 300))
    assert await good == want and len(want) > 15
    assert pool.deaths == 2
    await all_slots_back(pool)


async def test_credits_bound_what_a_job_holds(pools: Callable[..., Any], upload: Path,
                                              vad: SileroVad, clips: list[Clip]) -> None:
    pool = await pools(vad, 2, slots=24, credits=Credits(feed=8, floor=4))
    long = ProcFeed(pool, request(upload, "long", split=False), 1, 300)
    await long.start()
    held: list[int] = []
    while len(held) < 8:
        d = await asyncio.wait_for(long.next(), BOUND)
        assert d is not None
        held += d.tokens
    await asyncio.sleep(0.5)  # it would go on if it could
    assert pool.held <= 8  # alone, its share is the whole feed: 8
    other = next(c for c in clips if c.duration_s > 45)  # a minute of speech: two windows
    got = await drain(ProcFeed(pool, request(other.path, "other", split=False), 1, 300))
    assert len(got) >= 2  # the short job's windows came while the long one held its share
    for t in held:
        long.release(t)
    rest = await drain_started(long)
    assert len(held) + len(rest) > 15
    await all_slots_back(pool)


async def drain_started(feed: ProcFeed) -> Seen:
    seen: Seen = []
    while (d := await asyncio.wait_for(feed.next(), BOUND)) is not None:
        seen += [(d.part, w.start, w.end, 0, 0.0) for w in d.windows]
        for t in d.tokens:
            feed.release(t)
    await feed.close()
    return seen


async def test_shutdown_releases_a_waiting_feed(pools: Callable[..., Any], upload: Path,
                                                vad: SileroVad) -> None:
    pool = await pools(vad, 1)
    feed = ProcFeed(pool, request(upload, split=False), 1, 300)
    await feed.start()
    d = await asyncio.wait_for(feed.next(), BOUND)
    assert d is not None and d.windows
    pool.shutdown()
    with pytest.raises(ShuttingDown):
        while await asyncio.wait_for(feed.next(), BOUND) is not None:
            pass
    await feed.close()


async def test_an_upload_that_is_not_audio_fails_with_its_own_error(
        pools: Callable[..., Any], vad: SileroVad, tmp_path: Path) -> None:
    """A job whose file does not decode (what the upload probe did not catch, or a file
    changed in the blob store) gets the 415 the thread path gave, not an internal error, and
    the process lives on."""
    junk = tmp_path / "junk.wav"
    junk.write_bytes(b"RIFF\x00\x00\x00\x00WAVEnot really" * 512)
    pool = await pools(vad, 1)
    with pytest.raises(UnsupportedMedia):
        await drain(ProcFeed(pool, request(junk), 1, 300))
    assert pool.deaths == 0
    await all_slots_back(pool)


async def test_later_parts_wait_for_the_first_parts_window(pools: Callable[..., Any],
                                                           speech: np.ndarray, vad: SileroVad,
                                                           tmp_path: Path) -> None:
    """An upload whose language is detected once, from its first speech window: its later
    parts make no window (they get no slot) until the first part has made one, so the first
    window the batcher gets, and detects the language from, is the upload's first. Here the
    upload opens with 150 s of silence: its first part's first window needs three chunks, the
    later parts' first windows only their warm-up and seam (~30 s of audio)."""
    quiet = np.concatenate([np.zeros(150 * SAMPLE_RATE, np.float32), speech])
    path = write_wav(tmp_path / "late.wav", quiet)
    pool = await pools(vad, 3)
    feed = ProcFeed(pool, request(path, first_part_first=True), 3, 120)
    got = await drain(feed)
    assert feed.parts == 3 and got[0][0] == 0 and got[0][1] >= 140.0, got[:2]
    assert {w[0] for w in got} == {0, 1, 2}


def test_a_small_dev_shm_cuts_the_slots_and_a_tiny_one_means_threads(
        monkeypatch: pytest.MonkeyPatch, vad: SileroVad) -> None:
    """A container's /dev/shm is 64 MB unless given more: the GPU's 1024 slots (0.94 GB) do not
    fit, so the read-ahead is cut to half of what is free; under 8 slots prep runs in threads."""
    import app.jobs.prep as prep_mod
    from app.config import Settings
    from app.jobs.prep import make_prep

    monkeypatch.setattr(prep_mod, "shm_room", lambda: None)
    roomy = make_prep(Settings(), 1, batch=128, workers=2, vad=vad)
    assert roomy.procs is not None and roomy.procs.arena.count == 1024
    roomy.shutdown()
    monkeypatch.setattr(prep_mod, "shm_room", lambda: 64 * 2**20)
    small = make_prep(Settings(), 1, batch=128, workers=2, vad=vad)
    assert small.procs is not None and small.procs.arena.count == 34
    small.shutdown()
    monkeypatch.setattr(prep_mod, "shm_room", lambda: 8 * 2**20)
    assert make_prep(Settings(), 1, batch=128, workers=2, vad=vad).procs is None
