"""The batcher's two stages (CPU): encoder calls as windows arrive, decoder batches per padded
length gathered across calls. A fake staged engine records every call; no model, no timings."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

import pytest

from app.audio import prepare
from app.audio.vad import SileroVad
from app.engine.whisper import WhisperEngine
from app.errors import ShuttingDown
from app.windows import DecodeOptions, Encoded, Prompt, Window
from loadtest.lib.corpus import Clip
from tests.fakes import BOUND, FakeStagedEngine, Rig, Rigs, gather, tag_of, tagged_window

EN = DecodeOptions()
MakeRig = Callable[..., Rig[FakeStagedEngine]]


@pytest.fixture
def rig_factory(rigs: Rigs) -> MakeRig:
    """This file's batcher: on one fake engine whose encoder and decoder are separate calls."""

    def make(cap: int = 2, decode_cap: int = 16, workers: int = 1, decode_wait_ms: int = 60_000,
             fail: Callable[[str, Sequence[Window]], None] | None = None,
             wait_ms: int = 10) -> Rig[FakeStagedEngine]:
        return rigs.make(FakeStagedEngine(workers=workers, fail=fail), max_batch_size=cap,
                         max_decode_batch_size=decode_cap, job_memory_mb=0, max_wait_ms=wait_ms,
                         max_decode_wait_ms=decode_wait_ms)

    return make


async def test_decoder_batches_gather_windows_encoded_by_several_calls(
        rig_factory: MakeRig) -> None:
    """Twelve short requests, two lengths, encoded two at a time: each length decodes as one
    batch of six (a single-call batcher would have decoded pairs)."""
    rig = rig_factory(cap=2)
    rig.fake.gate.clear()
    blocker = rig.batcher.submit("blocker", [tagged_window(999, 22)], EN)
    await rig.hold()
    futs = [f for i in range(12)
            for f in rig.batcher.submit(f"j{i}", [tagged_window(i, 3 if i % 2 else 12)], EN)]
    rig.fake.gate.set()
    results = await gather([*blocker, *futs])
    assert [r.text for r in results[1:]] == [f"w{i}" for i in range(12)]
    assert all(len(tags) <= 2 for tags in rig.calls("encode"))
    decodes = sorted(sorted(tags) for tags in rig.calls("decode"))
    assert decodes == [[0, 2, 4, 6, 8, 10], [1, 3, 5, 7, 9, 11], [999]]
    assert rig.calls("run") == []
    # Metrics count a window once as a batch member: decoder batches are the batches.
    assert rig.metrics.batch_size._sum.get() == 13
    assert rig.batcher.pending() == 0


async def test_decoder_batches_respect_their_own_cap(rig_factory: MakeRig) -> None:
    rig = rig_factory(cap=4, decode_cap=3)
    rig.fake.gate.clear()
    blocker = rig.batcher.submit("blocker", [tagged_window(999, 22)], EN)
    await rig.hold()
    futs = [f for i in range(8) for f in rig.batcher.submit(f"j{i}", [tagged_window(i, 3)], EN)]
    rig.fake.gate.set()
    await gather([*blocker, *futs])
    sizes = sorted(len(tags) for tags in rig.calls("decode"))
    assert sizes == [1, 2, 3, 3]  # the blocker; eight windows in batches of at most three


async def test_a_lone_request_is_decoded_right_after_its_encode(rig_factory: MakeRig) -> None:
    rig = rig_factory(cap=2)
    [res] = await gather(rig.batcher.submit("j", [tagged_window(5, 4)], EN))
    assert res.text == "w5"
    assert rig.fake.calls == [("encode", [5]), ("decode", [5])]


async def test_windows_to_encode_do_not_wait_for_a_fuller_batch(rig_factory: MakeRig) -> None:
    """max_wait_ms buys a fuller batch for one-call batches only: an encoder batch costs the
    same per window at any size. With a one-minute max_wait a lone request still runs at once
    (``gather`` gives up after BOUND, half that)."""
    rig = rig_factory(cap=8, wait_ms=60_000)
    [res] = await gather(rig.batcher.submit("j", [tagged_window(5, 4)], EN))
    assert res.text == "w5"
    assert rig.fake.calls == [("encode", [5]), ("decode", [5])]


async def test_a_long_upload_runs_both_stages_in_one_call(rig_factory: MakeRig) -> None:
    """An upload with more windows than a batch holds fills batches by itself: it skips the
    pool, so a short request beside it is not held behind its decodes. It takes one worker of
    two (``reserved_slots``, app/batching/urgency.py) while short requests come in: the other is
    kept for the short one."""
    rig = rig_factory(cap=8, workers=2)
    await gather(rig.batcher.submit("earlier", [tagged_window(9, 4)], EN))  # short work, recent
    rig.fake.gate.clear()
    long_futs = rig.batcher.submit("long", [tagged_window(100 + i, 30) for i in range(10)], EN)
    await rig.hold(1)
    assert rig.batcher.pending() == 2  # a full batch on one worker; the other kept free of it
    short = rig.batcher.submit("short", [tagged_window(7, 4)], EN)
    rig.fake.gate.set()
    results = await gather([*long_futs, *short])
    assert all(not isinstance(r, BaseException) for r in results)
    assert sorted(len(tags) for tags in rig.calls("run")) == [2, 8]
    assert sorted(t for tags in rig.calls("run") for t in tags) == list(range(100, 110))
    stages = [(s, tags) for s, tags in rig.fake.calls if 7 in tags]
    assert stages == [("encode", [7]), ("decode", [7])]  # alone with its length: no wait


async def test_an_upload_of_a_few_windows_goes_through_the_pool(rig_factory: MakeRig) -> None:
    """An upload of more windows than a short request but no more than a batch (three, cap 8)
    does not fill decoder batches by itself: even encoded in a call of its own, its windows
    wait in the pool (where other requests' windows of their length join them), not decoded
    as one-call sub-batches of one or two."""
    rig = rig_factory(cap=8, workers=2)
    rig.fake.gate.clear()
    blocker = rig.batcher.submit("blocker", [tagged_window(999, 4)], EN)
    await rig.hold()
    few = rig.batcher.submit("few", [tagged_window(10 + i, s) for i, s in enumerate((12, 29, 29))],
                             EN)
    await rig.hold()  # its batch holds its windows only
    rig.fake.gate.set()
    results = await gather([*blocker, *few])
    assert [r.text for r in results] == ["w999", "w10", "w11", "w12"]
    assert ("encode", [10, 11, 12]) in rig.fake.calls
    assert rig.calls("run") == []
    assert sorted(sorted(tags) for tags in rig.calls("decode")) == [[10], [11, 12], [999]]


@pytest.mark.parametrize("decode_wait_ms", [0, 60_000])
async def test_an_encoded_window_waits_for_company_at_most_its_deadline(
        rig_factory: MakeRig, decode_wait_ms: int) -> None:
    """While other short requests are queued, an encoded window waits to be decoded with
    windows of its length, until max_decode_wait_ms (or until nothing else is left to do)."""
    rig = rig_factory(cap=1, decode_wait_ms=decode_wait_ms)
    rig.fake.gate.clear()
    first = rig.batcher.submit("a", [tagged_window(1, 3)], EN)
    await rig.hold()
    others = [f for i in range(2, 5) for f in rig.batcher.submit(f"j{i}", [tagged_window(i, 12)], EN)]
    rig.fake.gate.set()
    results = await gather([*first, *others])
    assert [r.text for r in results] == ["w1", "w2", "w3", "w4"]
    order = rig.fake.calls
    decoded_1, encoded_4 = order.index(("decode", [1])), order.index(("encode", [4]))
    if decode_wait_ms == 0:
        assert decoded_1 < encoded_4  # due at once: decoded before the queue was worked off
    else:
        assert decoded_1 > encoded_4  # kept for company until the workers had nothing else


async def test_cancelled_while_encoded_is_never_decoded(rig_factory: MakeRig) -> None:
    rig = rig_factory(cap=4)
    loop = asyncio.get_running_loop()
    gone: list[asyncio.Future] = []

    def cancel_during_encode(stage: str, windows: Sequence[Window]) -> None:
        if stage == "encode" and any(tag_of(w) == 50 for w in windows):
            loop.call_soon_threadsafe(gone[0].cancel)  # runs before the encode's result lands

    rig.fake.stage_fail = cancel_during_encode
    rig.fake.gate.clear()
    blocker = rig.batcher.submit("blocker", [tagged_window(999, 22)], EN)
    await rig.hold()
    gone += rig.batcher.submit("gone", [tagged_window(50, 3)], EN)
    kept = [f for i in range(3) for f in rig.batcher.submit(f"k{i}", [tagged_window(i, 3)], EN)]
    rig.fake.gate.set()
    results = await gather([*blocker, *kept])
    assert [r.text for r in results] == ["w999", "w0", "w1", "w2"]
    assert any(50 in tags for tags in rig.calls("encode"))
    assert not any(50 in tags for tags in rig.calls("decode"))
    assert rig.batcher.pending() == 0


async def test_stop_decodes_encoded_windows_and_fails_queued_ones(rig_factory: MakeRig) -> None:
    """At shutdown the windows already encoded are decoded within the grace (the encoder was
    most of their cost); windows still queued fail with ShuttingDown (their jobs stay queued)."""
    rig = rig_factory(cap=4)
    rig.fake.gate.clear()
    encoding = rig.batcher.submit("blocker", [tagged_window(999, 22)], EN)
    await rig.hold()
    queued = [f for i in range(3) for f in rig.batcher.submit(f"j{i}", [tagged_window(i, 3)], EN)]
    stop = asyncio.create_task(rig.batcher.stop(grace_s=BOUND))
    await asyncio.sleep(0)
    rig.fake.gate.set()  # the encode in flight finishes within the grace
    await asyncio.wait_for(stop, BOUND)
    [done] = await gather(encoding)
    assert done.text == "w999"
    assert all(isinstance(r, ShuttingDown) for r in await gather(queued))
    assert rig.calls("encode") == [[999]] and rig.calls("decode") == [[999]]
    assert rig.batcher.pending() == 0


async def test_decoder_oom_splits_the_decoder_batch(rig_factory: MakeRig) -> None:
    def oom(stage: str, windows: Sequence[Window]) -> None:
        if stage == "decode" and len(windows) > 2:
            raise RuntimeError("CUDA failed with error out of memory")

    rig = rig_factory(cap=4, decode_cap=8, fail=oom)
    rig.fake.gate.clear()
    blocker = rig.batcher.submit("blocker", [tagged_window(999, 22)], EN)
    await rig.hold()
    futs = [f for i in range(4) for f in rig.batcher.submit(f"j{i}", [tagged_window(i, 3)], EN)]
    rig.fake.gate.set()
    results = await gather([*blocker, *futs])
    assert [r.text for r in results[1:]] == ["w0", "w1", "w2", "w3"]  # nothing lost
    assert rig.metrics.oom_events._value.get() == 1
    assert sorted(len(t) for t in rig.calls("decode")) == [1, 2, 2, 4]


@pytest.mark.model
@pytest.mark.parametrize("language", ["en", None])
def test_real_engine_two_stages_give_the_single_call_transcripts(
        engine: WhisperEngine, clips: list[Clip], language: str | None) -> None:
    """Windows encoded two at a time in arrival order, then decoded per padded length across
    those calls, come out exactly as each window transcribed alone (language detected or not)."""
    vad = SileroVad()
    picked = sorted(clips, key=lambda c: c.id)[::7][:8]
    windows = [w for c in picked for w in prepare(c.path, vad, 3600)[1]]
    for w in windows:
        w.prompt = Prompt(language=language)
    opts = DecodeOptions()
    alone = [engine.transcribe_batch([w], opts)[0] for w in windows]
    encoded: list[Encoded] = []
    for k in range(0, len(windows), 2):
        encoded += engine.encode(windows[k:k + 2], opts)
    groups: dict[int, list[int]] = {}
    for k, e in enumerate(encoded):
        groups.setdefault(e.samples, []).append(k)
    assert max(map(len, groups.values())) >= 3  # decoder batches across encoder calls
    assert len(groups) >= 2  # detection uses the same dynamic lengths
    staged: dict[int, str] = {}
    for idx in groups.values():
        out = engine.decode([windows[k] for k in idx], [encoded[k] for k in idx], opts)
        staged.update({k: r.text for k, r in zip(idx, out, strict=True)})
    assert [staged[k] for k in range(len(windows))] == [r.text for r in alone]
    assert [e.language for e in encoded] == [r.language for r in alone]


class EncodeSpy:
    """CTranslate2's Whisper with each encoder call's batch size recorded."""

    def __init__(self, model: Any) -> None:
        self.model, self.sizes = model, list[int]()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)

    def encode(self, features: Any, *args: Any, **kwargs: Any) -> Any:
        self.sizes.append(int(features.shape[0]))
        return self.model.encode(features, *args, **kwargs)


@pytest.mark.model
def test_real_engine_on_cpu_encodes_each_window_of_a_call_alone(
        engine: WhisperEngine, clips: list[Clip]) -> None:
    """A call's windows go through the encoder one at a time and its decoder batch together
    (app/engine/whisper.py: the encoder's memory grows with its batch, its cost per window
    does not), and read as each window alone."""
    vad = SileroVad()
    read = [c for c in sorted(clips, key=lambda c: c.id) if c.duration_s > 8][:4]
    windows = [prepare(c.path, vad, 3600)[1][0] for c in read]
    for w in windows:
        w.prompt = Prompt(language="en")
    opts = DecodeOptions()
    spy = EncodeSpy(engine.model.model)
    engine.model.model = spy
    try:
        together = engine.transcribe_batch(windows, opts)
        calls = list(spy.sizes)
        alone = [engine.transcribe_batch([w], opts)[0].text for w in windows]
    finally:
        engine.model.model = spy.model
    assert len(calls) >= len(windows) and set(calls) == {1}, calls
    assert [r.text for r in together] == alone


@pytest.mark.model
def test_real_engine_fallback_apart_gives_the_same_transcripts(
        engine: WhisperEngine, clips: list[Clip]) -> None:
    """``decode(redo=False)`` marks the windows Whisper's fallbacks would decode again (on this
    host three MFA clips loop or are unsure: loadtest/results/stall.json) and ``redo`` of each
    gives what ``decode`` with its fallbacks gives: the batcher runs the fallback as a call of
    its own (app/batching/urgency.py), and no transcript changes."""
    vad = SileroVad()
    loops = ("mfa-mfa_uhuh", "mfa-mfa_whatscalled", "mfa-mfa_breathy")
    picked = [c for c in clips if c.id in loops] + sorted(clips, key=lambda c: c.id)[::19][:3]
    opts = DecodeOptions()
    redone = 0
    for w in [w for c in picked for w in prepare(c.path, vad, 3600)[1]]:
        w.prompt = Prompt(language="en")
        [e] = engine.encode([w], opts)
        [whole] = engine.decode([w], [e], opts)
        [first] = engine.decode([w], [e], opts, redo=False)
        if first.redo:
            redone += 1
            [first] = engine.redo([w], [e], opts)
        assert (first.text, first.redo) == (whole.text, False)
    assert redone >= 1
