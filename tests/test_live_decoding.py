"""The live decode adapters (app/live/decoding.py) on today's batcher and engine runner, with
the fake engine: what phase B plugs a session into."""

from __future__ import annotations

import asyncio

import pytest

from app.batching.batcher import Batcher
from app.engine.placement import EngineRunner
from app.engine.whisper import WhisperEngine
from app.live.decoding import LiveOptions, batcher_decoder, engine_decoder
from app.windows import SAMPLE_RATE, DecodeOptions
from tests.fakes import BOUND, FakeStagedEngine, Rigs, tagged_window


@pytest.fixture
async def staged(rigs: Rigs) -> tuple[FakeStagedEngine, Batcher]:
    rig = rigs.make(FakeStagedEngine(workers=1), max_batch_size=4)
    return rig.fake, rig.batcher


async def test_engine_decoder_is_one_engine_call() -> None:
    fake = FakeStagedEngine()
    decode = engine_decoder(EngineRunner(fake).run)
    got = await decode(tagged_window(7).audio, LiveOptions(language="en"), "final")
    assert got.text == "w7" and got.language == "en" and fake.calls == [("run", [7])]


async def test_batcher_decoder_rides_the_shared_batcher(
        staged: tuple[FakeStagedEngine, Batcher]) -> None:
    fake, batcher = staged
    decode = batcher_decoder(batcher, "sess_1")
    got = await asyncio.wait_for(decode(tagged_window(5).audio, LiveOptions(language="de"),
                                        "interim"), BOUND)
    assert got.text == "w5" and got.language == "de"
    assert [stage for stage, _ in fake.calls] == ["encode", "decode"]  # a short job: pooled


async def test_a_cancelled_decode_never_reaches_the_engine(
        staged: tuple[FakeStagedEngine, Batcher]) -> None:
    """An interim decode the session gives up on (its turn ended) frees its queued window."""
    fake, batcher = staged
    decode = batcher_decoder(batcher, "sess_2")
    fake.gate.clear()
    first = asyncio.create_task(decode(tagged_window(1).audio, LiveOptions(), "final"))
    await asyncio.to_thread(fake.entered.acquire, True, BOUND)  # in the engine, held
    dropped = asyncio.create_task(decode(tagged_window(2).audio, LiveOptions(), "interim"))
    await asyncio.sleep(0)  # submitted, queued behind the held call
    assert batcher.pending() == 1
    dropped.cancel()
    fake.gate.set()
    assert (await asyncio.wait_for(first, BOUND)).text == "w1"
    with pytest.raises(asyncio.CancelledError):
        await dropped
    # a later decode finishes after anything queued before it would have run
    assert (await asyncio.wait_for(decode(tagged_window(3).audio, LiveOptions(), "final"),
                                   BOUND)).text == "w3"
    assert all(2 not in tags for _, tags in fake.calls) and any(3 in t for _, t in fake.calls)


async def test_interim_windows_carry_their_own_pad_margin(
        staged: tuple[FakeStagedEngine, Batcher], monkeypatch: pytest.MonkeyPatch) -> None:
    """Interims are padded with ``interim_pad_margin_s``, finals with ``final_pad_margin_s``
    (None: the engine's margin); the engine pads a window by its own margin where it has one
    (app/engine/whisper.py)."""
    _, batcher = staged
    margins: list[float | None] = []
    submit = batcher.submit

    def spy(job_id, windows, options, **kw):  # type: ignore[no-untyped-def]
        margins.extend(w.pad_margin_s for w in windows)
        return submit(job_id, windows, options, **kw)

    monkeypatch.setattr(batcher, "submit", spy)
    for final in (None, 4.0):
        decode = batcher_decoder(batcher, "sess_3", interim_pad_margin_s=3.0,
                                 final_pad_margin_s=final)
        for kind in ("interim", "final"):
            await asyncio.wait_for(decode(tagged_window(4).audio, LiveOptions(), kind), BOUND)
    assert margins == [3.0, None, 3.0, 4.0]


@pytest.mark.model
def test_the_engine_pads_a_window_by_its_own_margin(engine: WhisperEngine) -> None:
    """2 s of audio: padded to 5 s at a 3 s margin, to 10 s at the engine's default 8 s."""
    w = tagged_window(1, 2.0)
    assert engine.padded_samples(w) == 10 * SAMPLE_RATE
    w.pad_margin_s = 3.0
    assert engine.padded_samples(w) == 5 * SAMPLE_RATE


@pytest.mark.model
def test_a_live_finals_redo_stays_at_the_engines_margin(
        engine: WhisperEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    """2 s of audio padded 3 s (5 s): its redo is encoded at the engine's own 10 s, and
    Whisper's fallbacks (the wider beam, the repetition penalty) run there, never at 30 s; a
    window at the engine's margin goes to 30 s as an upload's does."""
    encoded_at: list[int] = []
    fallbacks_at: list[int] = []
    encode, widen = engine._encode, engine._decoder.widen

    def spy_encode(windows, n, languages=None):  # type: ignore[no-untyped-def]
        encoded_at.append(n)
        return encode(windows, n, languages)

    def spy_widen(*args):  # type: ignore[no-untyped-def]
        fallbacks_at.append(encoded_at[-1])
        return widen(*args)

    monkeypatch.setattr(engine, "_encode", spy_encode)
    monkeypatch.setattr(engine._decoder, "widen", spy_widen)
    live = tagged_window(1, 2.0)
    live.pad_margin_s = 3.0
    [encoded] = engine.encode([live], DecodeOptions())
    encoded_at.clear()
    [r] = engine.redo([live], [encoded], DecodeOptions())
    assert r.text is not None
    assert encoded_at == [10 * SAMPLE_RATE] and fallbacks_at == [10 * SAMPLE_RATE], \
        (encoded_at, fallbacks_at)
    plain = tagged_window(2, 2.0)
    [encoded] = engine.encode([plain], DecodeOptions())
    encoded_at.clear()
    engine.redo([plain], [encoded], DecodeOptions())
    assert encoded_at == [30 * SAMPLE_RATE] and fallbacks_at[-1] == 30 * SAMPLE_RATE, \
        (encoded_at, fallbacks_at)
