"""Urgency in the batcher (issue 34 item 3; app/batching/urgency.py): live finals first, interim
decodes shed when behind (never finals), a window's fallback decode out of its batch, and a
worker kept free of a long upload's calls. A fake staged engine records every call; no model,
no timing thresholds."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Sequence
from functools import partial

import pytest

from app.batching.stages import Item
from app.batching.urgency import Seen, bulk_ok, held_until, stale
from app.windows import DecodeOptions, Shed, Urgency, Window
from tests.fakes import BOUND, FakeStagedEngine, Rig, Rigs, gather, tag_of, tagged_window

EN = DecodeOptions()
MakeRig = Callable[..., Rig[FakeStagedEngine]]
LONG = 1000  # tags from here on: a long upload's windows


class HeldLong(FakeStagedEngine):
    """Calls holding a long upload's windows wait for ``long_gate``; the others do not."""

    def __init__(self, workers: int) -> None:
        super().__init__(workers)
        self.long_gate = threading.Event()
        self.long_entered = threading.Semaphore(0)

    def _enter(self, stage: str, windows: Sequence[Window]) -> None:
        if any(tag_of(w) >= LONG for w in windows):
            self.long_entered.release()
            self.long_gate.wait(60)
        super()._enter(stage, windows)


@pytest.fixture
def rig_factory(rigs: Rigs) -> MakeRig:
    """This file's batcher: on one staged fake engine (``fake``, else a new one)."""

    def make(cap: int = 2, workers: int = 1, fake: FakeStagedEngine | None = None,
             **settings: int) -> Rig[FakeStagedEngine]:
        return rigs.make(fake or FakeStagedEngine(workers=workers), max_batch_size=cap,
                         job_memory_mb=0, max_wait_ms=10, max_decode_wait_ms=60_000, **settings)

    return make


async def test_finals_go_before_request_windows_queued_earlier(rig_factory: MakeRig) -> None:
    rig = rig_factory(cap=2)
    blocker = await rig.blocker(22)  # another padded length: it decodes apart
    early = [f for i in range(4) for f in rig.batcher.submit(f"j{i}", [tagged_window(i, 3)], EN)]
    final = rig.batcher.submit("live", [tagged_window(100, 3)], EN, urgency=Urgency.LIVE_FINAL)
    rig.fake.gate.set()
    results = await gather([*blocker, *early, *final])
    assert [r.text for r in results] == ["w999", "w0", "w1", "w2", "w3", "w100"]
    after = [tags for tags in rig.calls() if 999 not in tags]
    # The first call after the blocker: the final's encode, alone (one window per encoder call
    # while live windows are in: batching the encoder saves nothing on CPU, see _take).
    assert after[0] == [100]
    decodes = [tags for tags in rig.calls("decode") if 999 not in tags]
    assert 100 in decodes[0]


async def test_interims_are_shed_when_superseded_never_finals(rig_factory: MakeRig) -> None:
    rig = rig_factory()
    blocker = await rig.blocker(3)
    old = rig.batcher.submit("live", [tagged_window(1, 2)], EN, urgency=Urgency.LIVE_INTERIM)
    final = rig.batcher.submit("live", [tagged_window(2, 4)], EN, urgency=Urgency.LIVE_FINAL)
    new = rig.batcher.submit("live", [tagged_window(3, 2)], EN, urgency=Urgency.LIVE_INTERIM)
    with pytest.raises(Shed):  # while the engine is still held: never sent to it
        await asyncio.wait_for(old[0], BOUND)
    assert not final[0].done()
    rig.fake.gate.set()
    results = await gather([*blocker, *old, *final, *new])
    assert isinstance(results[1], Shed)
    assert [r.text for r in (results[2], results[3])] == ["w2", "w3"]
    assert rig.shed() == 1
    assert all(1 not in tags for tags in rig.calls())  # the shed window never reached the engine


async def test_interims_are_shed_when_behind_never_finals(rig_factory: MakeRig) -> None:
    rig = rig_factory(interim_max_wait_ms=20)
    blocker = await rig.blocker(3)
    interim = rig.batcher.submit("a", [tagged_window(1, 2)], EN, urgency=Urgency.LIVE_INTERIM)
    final = rig.batcher.submit("b", [tagged_window(2, 2)], EN, urgency=Urgency.LIVE_FINAL)
    await asyncio.sleep(0.05)  # both wait longer than the interim bound behind the blocker
    rig.fake.gate.set()
    results = await gather([*blocker, *interim, *final])
    assert isinstance(results[1], Shed)
    assert results[2].text == "w2"
    assert rig.shed() == 1


async def test_interims_go_to_turns_without_text_first_then_the_longest_waiting(
        rig_factory: MakeRig) -> None:
    """Interim decodes wait in :data:`~app.windows.Refresh` order, not their arrival: behind,
    the batcher first serves turns that have had fewer interims answered (a turn showing nothing
    yet), then the turn whose text was refreshed longest ago (at 16 streams, arrival order and a
    session-wide back-off left 14 of 39 long turns without interim text)."""
    rig = rig_factory(cap=1, interim_max_wait_ms=60_000)
    blocker = await rig.blocker(3)
    sub = partial(rig.batcher.submit, options=EN, urgency=Urgency.LIVE_INTERIM)
    fresh = sub("a", [tagged_window(1, 2)], refresh=(2, 30.0))
    stale = sub("b", [tagged_window(2, 2)], refresh=(2, 10.0))
    textless = sub("c", [tagged_window(3, 2)], refresh=(0, 40.0))
    once = sub("d", [tagged_window(4, 2)], refresh=(1, 35.0))
    final = rig.batcher.submit("e", [tagged_window(5, 2)], EN, urgency=Urgency.LIVE_FINAL)
    rig.fake.gate.set()
    await gather([*blocker, *fresh, *stale, *textless, *once, *final])
    encoded = [tags[0] for tags in rig.calls("encode") if 999 not in tags]
    assert encoded == [5, 3, 4, 2, 1]
    assert rig.shed() == 0


async def test_a_demoted_final_waits_behind_the_true_finals(rig_factory: MakeRig) -> None:
    """A final decode started at a pause that speech resumed after is demoted: it waits as an
    interim, behind finals that came after it (it held their place at final priority: at 16
    streams p95 1.76-1.88 s with it, 1.46-1.59 s demoted)."""
    rig = rig_factory(cap=1, interim_max_wait_ms=60_000)
    blocker = await rig.blocker(3)
    early = rig.batcher.submit("early", [tagged_window(1, 2)], EN, urgency=Urgency.LIVE_FINAL)
    final = rig.batcher.submit("final", [tagged_window(2, 2)], EN, urgency=Urgency.LIVE_FINAL)
    rig.batcher.demote("early")
    rig.fake.gate.set()
    results = await gather([*blocker, *early, *final])
    assert [r.text for r in results] == ["w999", "w1", "w2"]  # still answered
    assert [tags[0] for tags in rig.calls("encode") if 999 not in tags] == [2, 1]


async def test_an_interim_already_encoded_is_not_shed_as_stale() -> None:
    """Past the wait bound, an interim still to encode is shed; one already encoded is kept:
    its encoder call, most of its cost, is spent (at 16 streams 27 of 71 stale sheds were)."""
    loop = asyncio.get_running_loop()
    waiting, encoded = (Item(f"live-{k}", 0, tagged_window(k), EN, loop.create_future(),
                             enqueued=0.0, urgency=Urgency.LIVE_INTERIM) for k in (1, 2))
    encoded.encoded = object()  # type: ignore[assignment]
    assert stale([waiting, encoded], now=5.0, max_wait_s=1.0) == [waiting]


async def test_a_redo_does_not_delay_the_other_windows_of_its_batch(rig_factory: MakeRig) -> None:
    """A looping window's 30 s fallback runs as a call of its own, after its decoder batch has
    answered every other window; an interim that loops keeps its first pass."""
    rig = rig_factory(cap=8, workers=2, fake=FakeStagedEngine(workers=2))
    rig.fake.loops = {5, 7}
    rig.fake.redo_gate.clear()
    futs = [f for i in (1, 2, 3, 5) for f in rig.batcher.submit(f"j{i}", [tagged_window(i, 3)], EN)]
    others = await gather(futs[:3])  # answered while the redo is held
    assert [r.text for r in others] == ["w1", "w2", "w3"]
    assert not futs[3].done()
    assert rig.calls("decode") == [[1, 2, 3, 5]]
    rig.fake.redo_gate.set()
    [looped] = await gather(futs[3:])
    assert looped.text == "redo5" and not looped.redo
    assert rig.calls("redo") == [[5]]
    [interim] = await gather(rig.batcher.submit("live", [tagged_window(7, 3)], EN,
                                                urgency=Urgency.LIVE_INTERIM))
    assert interim.text == "w7" and not interim.redo
    assert rig.calls("redo") == [[5]]
    assert rig.batcher.pending() == 0


async def test_a_finals_fallback_goes_before_newer_finals(rig_factory: MakeRig) -> None:
    """Live finals run in arrival order wherever they wait: a final's 30 s fallback is not left
    behind finals that came after it (at 16 streams it waited 10-25 s behind them)."""
    rig = rig_factory(cap=2)
    rig.fake.loops = {5}
    blocker = await rig.blocker(22)
    finals = [f for t in (5, 6, 7) for f in rig.batcher.submit(
        f"live-{t}", [tagged_window(t, 3)], EN, urgency=Urgency.LIVE_FINAL)]
    rig.fake.gate.set()
    results = await gather([*blocker, *finals])
    assert [r.text for r in results] == ["w999", "redo5", "w6", "w7"]
    after = [(s, tags) for s, tags in rig.fake.calls if 999 not in tags]
    assert after[:3] == [("encode", [5]), ("decode", [5]), ("redo", [5])]  # then the newer ones
    assert rig.batcher.pending() == 0


@pytest.mark.parametrize("reserved", [1, 0])
async def test_a_short_request_gets_a_worker_beside_a_long_upload(rig_factory: MakeRig,
                                                               reserved: int) -> None:
    """Two workers, short requests coming in, a long upload whose calls do not end: with a
    worker reserved, the upload holds one and a short request runs on the other; without, it
    holds both."""
    fake = HeldLong(workers=2)
    rig = rig_factory(cap=8, workers=2, fake=fake, reserved_slots=reserved)
    await gather(rig.batcher.submit("earlier", [tagged_window(2, 3)], EN))  # short work, recent
    long = rig.batcher.submit("long", [tagged_window(LONG + k, 30, start=30.0 * k)
                                       for k in range(12)], EN, job_windows=40)
    for _ in range(1 if reserved else 2):  # without a reserved worker the upload takes both
        await asyncio.to_thread(fake.long_entered.acquire, True, BOUND)
    assert rig.batcher.busy()[1] == (1 if reserved else 2)
    short = rig.batcher.submit("short", [tagged_window(1, 3)], EN)
    if reserved:
        [result] = await gather(short)  # while the long upload's call still runs
        assert result.text == "w1"
        assert rig.batcher.busy()[1] == 1  # and the upload still holds one worker
    fake.long_gate.set()
    results = await gather([*long, *short])
    assert [r.text for r in results] == [*(f"w{LONG + k}" for k in range(12)), "w1"]
    # Calls are recorded once past the gate: the short request's first only after a long
    # one had ended, unless a worker was kept for it.
    after = [c for c in rig.calls() if c != [2]]  # past the earlier request's own calls
    assert (after[0] == [1]) == bool(reserved)


async def test_a_long_upload_alone_takes_every_worker(rig_factory: MakeRig) -> None:
    """No short or live work in the last 30 s: the reserve is not kept, the upload runs on both
    workers (on one of two it ran at 0.33 windows/s against 0.57)."""
    fake = HeldLong(workers=2)
    rig = rig_factory(cap=8, workers=2, fake=fake, reserved_slots=1)
    long = rig.batcher.submit("long", [tagged_window(LONG + k, 30, start=30.0 * k)
                                       for k in range(12)], EN, job_windows=40)
    for _ in range(2):
        await asyncio.to_thread(fake.long_entered.acquire, True, BOUND)
    assert rig.batcher.busy()[1] == 2
    fake.long_gate.set()
    assert len(await gather(long)) == 12


def test_beside_live_sessions_bulk_keeps_to_its_share_of_a_worker() -> None:
    """A quarter of one worker: after a bulk call of 1 s, the next starts 3 s after it ended,
    while live windows keep coming; once they stop for 5 s, bulk goes as before."""
    def ok(seen: Seen, now: float) -> bool:
        return bulk_ok(seen, now, reserved=1, workers=2, bulk_running=0)

    seen = Seen().saw(100.0, live=True)
    assert ok(seen, 100.0)  # no bulk call yet
    seen = seen.bulk_done(100.0, 101.0, share=0.25)
    assert held_until(seen, 101.5) == 104.0 and not ok(seen, 101.5)
    seen = seen.saw(103.5, live=True)
    assert not ok(seen, 103.9)
    assert ok(seen, 104.0)  # its share waited out
    seen = seen.bulk_done(104.0, 106.0, share=0.25)  # 2 s: the next 6 s later, unless live stops
    assert held_until(seen, 106.5) == 108.5  # 5 s after the last live window
    assert ok(seen, 108.6)
    whole = Seen().saw(100.0, live=True).bulk_done(100.0, 101.0, share=1.0)
    assert held_until(whole, 100.5) is None  # share 1: never held
    short = Seen().saw(100.0, live=False).bulk_done(100.0, 101.0, share=0.25)
    assert ok(short, 101.5)  # a short request is not a live session


class SlowLong(HeldLong):
    """A long upload's calls take 20 ms (its gate open): a bulk call with a duration."""

    def _enter(self, stage: str, windows: Sequence[Window]) -> None:
        if any(tag_of(w) >= LONG for w in windows):
            time.sleep(0.02)
        super()._enter(stage, windows)


async def test_bulk_held_for_its_share_resumes_once_live_sessions_stop(
        rig_factory: MakeRig, monkeypatch: pytest.MonkeyPatch) -> None:
    """A bulk call of 20 ms beside a live session, at a share that would hold the next for 40 s
    (beyond the test's bound): live windows stop, and the batcher wakes by itself once the
    sessions count as quiet (no other event comes), so the upload's windows finish."""
    import app.batching.urgency as urgency_module

    monkeypatch.setattr(urgency_module, "LIVE_RECENT_S", 0.3)
    fake = SlowLong(workers=2)
    fake.long_gate.set()
    rig = rig_factory(cap=2, workers=2, fake=fake, reserved_slots=1,
                      bulk_share_beside_live=0.0005)
    await gather(rig.batcher.submit("live", [tagged_window(1, 3)], EN, urgency=Urgency.LIVE_FINAL))
    spoke = rig.batcher.seen.live
    long = rig.batcher.submit("long", [tagged_window(LONG + k, 30, start=30.0 * k)
                                       for k in range(3)], EN, job_windows=40)
    results = await gather(long)
    assert [r.text for r in results] == [f"w{LONG + k}" for k in range(3)]
    assert len([c for c in rig.calls() if c[0] >= LONG]) >= 2  # a batch holds 2: two calls
    assert time.monotonic() >= spoke + 0.3  # the second held until the session went quiet
    assert rig.batcher.seen.bulk_next > spoke + 30  # the share alone would have held it on
