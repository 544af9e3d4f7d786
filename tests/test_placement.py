"""Several engines behind one batcher (app/engine/placement.py): spread, least loaded, failures.

Fake engines for placement and fault injection (no timing thresholds: gates decide what is in
flight); one test on two real CPU WhisperEngines of one thread each checks that batches spread
and every transcript is right.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

import pytest

from app.batching.batcher import Batcher
from app.config import BatcherSettings, Settings
from app.engine.placement import EnginePool, EngineRunner, NoEngineLeft, engine_count
from app.engine.startup import load_engines
from app.errors import TranscriptionFailed
from app.metrics import Metrics
from app.windows import DecodeOptions, Window
from models.registry import ModelUnavailable
from tests.fakes import BOUND, FakeEngine, Rig, Rigs, tag_of, tagged_window

EN = DecodeOptions()


def broken(windows: Sequence[Window]) -> None:
    raise RuntimeError("CUDA error: an illegal memory access was encountered")


@pytest.fixture
def rig(rigs: Rigs) -> Callable[..., Rig[FakeEngine]]:
    """This file's batcher: on the given fake engines, one pool."""

    def make(*fakes: FakeEngine, cap: int = 4, wait_ms: int = 5) -> Rig[FakeEngine]:
        return rigs.make(*fakes, max_batch_size=cap, max_wait_ms=wait_ms, job_memory_mb=0)

    return make


async def test_batches_spread_across_engines(rig: Callable[..., Rig[FakeEngine]]) -> None:
    r = rig(FakeEngine(), FakeEngine(), cap=4)
    results = await r.run(32)
    assert [x.text for x in results] == [f"w{i}" for i in range(32)]  # type: ignore[attr-defined]
    a, b = r.tags(0), r.tags(1)
    assert sorted(a + b) == list(range(32))  # every window ran exactly once
    # Idle engines take turns (the one idle longest goes next): neither is left out.
    assert len(r.fakes[0].batches) >= 2 and len(r.fakes[1].batches) >= 2
    assert r.pool.workers == 2 and all(s.in_rotation for s in r.pool.slots)


async def test_busy_engine_is_passed_over() -> None:
    a, b = FakeEngine(), FakeEngine()
    pool = EnginePool([EngineRunner(a), EngineRunner(b)])
    a.gate.clear()
    first = asyncio.ensure_future(pool.run([tagged_window(1)], EN))
    assert await asyncio.to_thread(a.entered.acquire, True, BOUND)  # engine 0 holds batch 1
    assert pool.pick() is pool.slots[1]
    second = await asyncio.wait_for(pool.run([tagged_window(2)], EN), BOUND)
    assert second[0].text == "w2" and b.batches == [(EN, [2])]
    a.gate.set()
    assert (await asyncio.wait_for(first, BOUND))[0].text == "w1"
    pool.close()


async def test_workers_and_utilisation_count_in_the_load() -> None:
    big, small = FakeEngine(workers=2), FakeEngine(workers=1)
    util = {0: 0.0, 1: 0.0}
    pool = EnginePool([EngineRunner(big), EngineRunner(small)], utilisation=util.get)
    s0, s1 = pool.slots
    s0.batches = 1  # half of its two threads busy vs none of the other's: the idle one wins
    assert pool.pick() is s1
    s1.batches = 1  # 1/2 vs 1/1 busy: the two-thread engine still has a free thread
    assert pool.pick() is s0
    s0.batches = s1.batches = 0
    util[0] = 0.9  # another process keeps GPU 0 busy: place on GPU 1
    assert pool.pick() is s1
    util[0], util[1] = 0.31, 0.34  # within a 10 % reading: windows in flight decide
    s1.windows = 0
    s0.windows = 5
    assert pool.pick() is s1
    pool.close()


async def test_failing_engine_is_removed_and_nothing_is_lost(rig: Callable[..., Rig[FakeEngine]]) -> None:
    bad, good = FakeEngine(fail=broken), FakeEngine()
    r = rig(bad, good, cap=4)
    results = await r.run(40)
    assert [getattr(x, "text", x) for x in results] == [f"w{i}" for i in range(40)]
    assert sorted(r.tags(1)) == list(range(40))  # the healthy engine ran every window once
    s_bad, s_good = r.pool.slots
    assert not s_bad.in_rotation and "illegal memory access" in (s_bad.error or "")
    assert s_good.in_rotation and r.pool.live() == [s_good]
    assert r.retired == [1] and r.pool.workers == 1  # its worker slot left the batcher too
    n_bad = len(bad.batches)
    assert (await r.run(8, job="after"))[7].text == "w7"  # type: ignore[attr-defined]
    assert len(bad.batches) == n_bad  # out of rotation: it gets nothing more


async def test_engine_breaking_mid_run_hands_its_work_over(rig: Callable[..., Rig[FakeEngine]]) -> None:
    state = {"broken": False}

    def sometimes(windows: Sequence[Window]) -> None:
        if state["broken"]:
            broken(windows)

    flaky, good = FakeEngine(fail=sometimes), FakeEngine()
    r = rig(flaky, good, cap=2)
    first = await r.run(8, job="before")
    assert all(getattr(x, "text", None) == f"w{i}" for i, x in enumerate(first))
    assert flaky.batches  # it did its share while healthy
    state["broken"] = True
    second = await r.run(16, job="after")
    assert [getattr(x, "text", x) for x in second] == [f"w{i}" for i in range(16)]
    assert r.pool.live() == [r.pool.slots[1]]


async def test_poison_batch_fails_alone_and_keeps_every_engine(rig: Callable[..., Rig[FakeEngine]]) -> None:
    def poison(windows: Sequence[Window]) -> None:
        if any(tag_of(w) == 13 for w in windows):
            raise ValueError("cannot decode window 13")

    r = rig(FakeEngine(fail=poison), FakeEngine(fail=poison), cap=8)
    results = await r.run(20)
    assert isinstance(results[13], TranscriptionFailed)
    assert [getattr(x, "text", None) for k, x in enumerate(results) if k != 13] == \
        [f"w{i}" for i in range(20) if i != 13]
    # Both engines failed the same windows: the input is at fault, not an engine.
    assert len(r.pool.live()) == 2 and r.retired == []


async def test_out_of_memory_is_the_batchers_business(rig: Callable[..., Rig[FakeEngine]]) -> None:
    def small_memory(windows: Sequence[Window]) -> None:
        if len(windows) > 2:
            raise RuntimeError("CUDA failed with error out of memory")

    r = rig(FakeEngine(), FakeEngine(fail=small_memory), cap=8, wait_ms=50)
    r.fakes[0].gate.clear()  # engine 0 busy: the next full batch goes to engine 1 and OOMs
    blocker = r.batcher.submit("blocker", [tagged_window(99)], EN)
    assert await asyncio.to_thread(r.fakes[0].entered.acquire, True, BOUND)
    futs = r.batcher.submit("j", [tagged_window(i) for i in range(8)], EN)
    assert await asyncio.to_thread(r.fakes[1].entered.acquire, True, BOUND)
    r.fakes[0].gate.set()
    results = await asyncio.wait_for(asyncio.gather(*futs, *blocker), BOUND)
    assert [x.text for x in results] == [*(f"w{i}" for i in range(8)), "w99"]
    assert r.batcher.cap < 8  # halved by the batcher
    assert len(r.pool.live()) == 2  # and no engine was blamed for it


async def test_last_engine_is_never_removed(rig: Callable[..., Rig[FakeEngine]]) -> None:
    r = rig(FakeEngine(fail=broken), cap=4)
    results = await r.run(3)
    assert all(isinstance(x, TranscriptionFailed) for x in results)
    assert len(r.pool.live()) == 1


async def test_no_engine_left() -> None:
    pool = EnginePool([EngineRunner(FakeEngine())])
    pool.slots[0].in_rotation = False
    with pytest.raises(NoEngineLeft):
        await pool.run([tagged_window(1)], EN)
    pool.close()


def test_engine_count_and_loading(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = Settings(model={"device": "cpu"})  # type: ignore[arg-type]
    assert engine_count(cpu) == 1
    monkeypatch.setattr("app.engine.placement.cuda_device_count", lambda: 3)
    assert engine_count(Settings(model={"device": "cuda"})) == 3  # type: ignore[arg-type]
    assert engine_count(Settings(model={"device": "cuda", "engines": 2})) == 2  # type: ignore[arg-type]

    seen: list[int] = []

    def factory(s: Settings) -> FakeEngine:
        seen.append(s.model.device_index)
        if s.model.device_index == 1:
            raise RuntimeError("CUDA error: no CUDA-capable device is detected")
        return FakeEngine()

    three = Settings(model={"device": "cpu", "engines": 3})  # type: ignore[arg-type]
    engines, failed = load_engines(three, factory)
    assert seen == [0, 1, 2] and len(engines) == 2  # GPU 1 is dead: start on the others
    assert [(f.engine, f.stage) for f in failed] == [("cpu:1", "load")]
    assert "no CUDA-capable device" in failed[0].error

    def none(s: Settings) -> FakeEngine:
        raise ModelUnavailable("model files are corrupt")

    with pytest.raises(ModelUnavailable, match="corrupt"):
        load_engines(three, none)  # the model, not a device: the service fails at once
    # (every engine failing for its device refuses the start too: tests/test_gpu_faults.py)


@pytest.mark.model
async def test_two_real_engines_share_the_batches(clips: list) -> None:
    """Two WhisperEngines (one CTranslate2 thread each) on CPU: batches spread, text right."""
    from app.audio import prepare
    from app.audio.vad import make_vad
    from app.main import load_whisper
    from tests.wer import wer

    settings = Settings(model={"device": "cpu", "engines": 2, "num_workers": 1,  # type: ignore[arg-type]
                               "cpu_threads": 1, "vad": "silero"})
    engines, failed = await asyncio.to_thread(load_engines, settings, load_whisper)
    assert len(engines) == 2 and not failed
    vad = make_vad("silero", "cpu")
    chosen = [c for c in clips if c.set in ("librispeech", "ljspeech") and 4 <= c.duration_s <= 20
              and c.id != "librispeech-1272-128104-0000"][:8]  # that one's reference is mislabelled
    assert len(chosen) == 8
    pool = EnginePool([EngineRunner(e) for e in engines])
    batcher = Batcher(pool.run, BatcherSettings(max_batch_size=2, max_wait_ms=20, job_memory_mb=0),
                      pool.workers, Metrics())
    batcher.start()
    try:
        jobs = []
        for c in chosen:
            _, windows = await asyncio.to_thread(prepare, c.path, vad, 3600.0)
            jobs.append((c, batcher.submit(c.id, windows, EN)))
        for c, futs in jobs:
            hyp = " ".join(r.text for r in await asyncio.wait_for(asyncio.gather(*futs), 600))
            assert wer([c.reference], [hyp]) < 0.2, (c.id, hyp)
    finally:
        await batcher.stop(30)
    done = [s.done for s in pool.slots]
    assert all(d >= 1 for d in done), done  # both engines transcribed batches
    assert sum(done) >= 4  # 8 clips in batches of at most 2
    pool.close()


# ---- rotation, retry and health (issue 19) ---------------------------------------------------
async def test_engine_leaves_after_repeated_failures_and_is_retried_later() -> None:
    state = {"broken": True}

    def flaky(windows: Sequence[Window]) -> None:
        if state["broken"]:  # not sticky, not out of memory: a strike each time
            raise RuntimeError("cuBLAS failed with status CUBLAS_STATUS_EXECUTION_FAILED")

    bad, good = FakeEngine(fail=flaky), FakeEngine()
    pool = EnginePool([EngineRunner(bad), EngineRunner(good)], strikes=3, retry_s=0.2)
    back = asyncio.Event()
    pool.on_restore = lambda n: back.set()
    s_bad = pool.slots[0]
    for k in range(3):  # each batch fails on the bad engine first (idle longest), then runs
        assert s_bad.in_rotation, k
        good.gate.clear()  # keep the good engine busy so the next batch tries the bad one
        results = await asyncio.gather(pool.run([tagged_window(k)], EN),
                                       _release_later(good))
        assert results[0][0].text == f"w{k}"
    assert not s_bad.in_rotation and s_bad.removals == 1 and "EXECUTION_FAILED" in (s_bad.error or "")
    state["broken"] = False
    await asyncio.wait_for(back.wait(), BOUND)  # retried after retry_s, on probation
    assert s_bad.in_rotation and s_bad.strikes == 2
    assert pool.pick() is s_bad  # idle longest: the next batch goes there
    assert (await pool.run([tagged_window(9)], EN))[0].text == "w9"
    assert s_bad.strikes == 0 and s_bad.done == 1  # healthy again: its record is cleared
    pool.close()


async def _release_later(fake: FakeEngine) -> None:
    """Opens a fake's gate once a batch has entered it (so placement saw it busy)."""
    await asyncio.to_thread(fake.entered.acquire, True, BOUND)
    fake.gate.set()


async def test_a_sticky_error_takes_an_engine_out_at_once(rig: Callable[..., Rig[FakeEngine]]) -> None:
    def sticky(windows: Sequence[Window]) -> None:
        raise RuntimeError("CUDA failed with error an illegal memory access was encountered")

    r = rig(FakeEngine(fail=sticky), FakeEngine(), cap=4)
    results = await r.run(4)
    assert [getattr(x, "text", x) for x in results] == [f"w{i}" for i in range(4)]
    assert not r.pool.slots[0].in_rotation and r.pool.slots[0].removals == 1
    assert r.pool.unhealthy() is None  # the other engine carries on


async def test_the_last_engine_failing_in_a_row_turns_unhealthy() -> None:
    state = {"fail": True}

    def failing(windows: Sequence[Window]) -> None:
        if state["fail"]:
            raise ValueError("cannot decode")

    pool = EnginePool([EngineRunner(FakeEngine(fail=failing))], unhealthy_after=4)
    for k in range(4):
        assert pool.unhealthy() is None, k
        with pytest.raises(ValueError):
            await pool.run([tagged_window(k)], EN)
    assert "4 engine calls in a row failed: ValueError: cannot decode" in (pool.unhealthy() or "")
    state["fail"] = False
    await pool.run([tagged_window(5)], EN)
    assert pool.unhealthy() is None and pool.failing == 0
    pool.close()


async def test_one_window_out_of_memory_beside_others_waits_and_runs() -> None:
    import threading

    engine = FakeEngine(workers=2)
    busy = {"n": 0}
    oomed = threading.Event()
    orig = engine.transcribe_batch

    def metered(windows: Sequence[Window], options: DecodeOptions) -> list:
        busy["n"] += 1
        try:
            if tag_of(windows[0]) != 1 and busy["n"] > 1:  # room for one batch at a time
                oomed.set()
                raise RuntimeError("cuBLAS failed with status CUBLAS_STATUS_ALLOC_FAILED")
            return orig(windows, options)
        finally:
            busy["n"] -= 1

    engine.transcribe_batch = metered  # type: ignore[method-assign]
    pool = EnginePool([EngineRunner(engine)])
    engine.gate.clear()
    blocker = asyncio.ensure_future(pool.run([tagged_window(1)], EN))  # holds the device
    assert await asyncio.to_thread(engine.entered.acquire, True, BOUND)
    single = asyncio.ensure_future(pool.run([tagged_window(2)], EN))
    assert await asyncio.to_thread(oomed.wait, BOUND)  # it ran out of memory beside the blocker
    engine.gate.set()  # the blocker ends; the window runs again
    assert (await asyncio.wait_for(single, BOUND))[0].text == "w2"
    assert (await blocker)[0].text == "w1"
    assert pool.slots[0].in_rotation and pool.unhealthy() is None
    pool.close()
