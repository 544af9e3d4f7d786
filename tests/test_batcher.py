"""Unit tests of the micro-batcher with a fake engine (no model, no timing thresholds)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

import pytest

from app.batching.batcher import Batcher
from app.config import BatcherSettings
from app.engine.placement import EngineRunner
from app.errors import ShuttingDown, TranscriptionFailed
from app.metrics import Metrics
from app.windows import DecodeOptions, Prompt, Window
from tests.fakes import BOUND, FakeEngine, Rig, Rigs, gather, tag_of, tagged_window

EN = DecodeOptions()


@pytest.fixture
def rig_factory(rigs: Rigs) -> Callable[..., Rig]:
    """This file's batcher: on one fake engine that runs whole windows (no stages)."""

    def make(cap: int = 4, wait_ms: int = 20, workers: int = 1, regrow_after: int = 8,
             fail: Callable[[Sequence[Window]], None] | None = None,
             job_memory_mb: float = 0) -> Rig:
        return rigs.make(FakeEngine(workers=workers, fail=fail), max_batch_size=cap,
                         max_wait_ms=wait_ms, regrow_after=regrow_after, job_memory_mb=job_memory_mb)

    return make


async def test_lone_window_leaves_after_max_wait(rig_factory: Callable[..., Rig]) -> None:
    rig = rig_factory(cap=8, wait_ms=30)
    [res] = await gather(rig.batcher.submit("j", [tagged_window(1)], EN))
    assert res.text == "w1"
    assert rig.sizes() == [1]


async def test_cap_bounds_batches_and_fills_them(rig_factory: Callable[..., Rig]) -> None:
    rig = rig_factory(cap=4)
    [blocker] = await rig.blocker()
    futs = rig.batcher.submit("j", [tagged_window(i) for i in range(10)], EN)
    rig.release()
    results = await gather([blocker, *futs])
    assert [r.text for r in results[1:]] == [f"w{i}" for i in range(10)]
    assert rig.sizes() == [1, 4, 4, 2]


async def test_windows_with_different_options_never_share_a_batch(rig_factory: Callable[..., Rig]) -> None:
    rig = rig_factory(cap=8)
    [blocker] = await rig.blocker()
    tr = DecodeOptions(task="translate")
    b5 = DecodeOptions(beam_size=5)
    hot = DecodeOptions(temperature=0.5)
    words = DecodeOptions(word_timestamps=True)
    keys = (EN, tr, b5, hot, words)
    futs = []
    for k, opts in enumerate(keys):
        futs += rig.batcher.submit(f"j{k}", [tagged_window(10 * k + i) for i in range(3)], opts)
    rig.release()
    await gather([blocker, *futs])
    for opts, tags in rig.fake.batches[1:]:
        assert {t // 10 for t in tags} == {keys.index(opts)}
    assert sorted(rig.sizes()[1:]) == [3, 3, 3, 3, 3]


async def test_languages_and_prompts_share_a_batch(rig_factory: Callable[..., Rig]) -> None:
    """A window's language, initial prompt and hotwords are its own prompt: not batch keys."""
    rig = rig_factory(cap=8)
    [blocker] = await rig.blocker()
    prompts = [Prompt(language="en"), Prompt(language="fr"), Prompt(language="de"),
               Prompt(language="en", initial_prompt="Glossary: batchscribe"),
               Prompt(language="en", hotwords="CTranslate2"), Prompt()]
    futs = []
    for k, p in enumerate(prompts):
        futs += rig.batcher.submit(f"j{k}", [tagged_window(k, prompt=p)], EN)
    rig.release()
    results = await gather([blocker, *futs])
    assert rig.sizes() == [1, 6]
    assert [r.language for r in results[1:]] == ["en", "fr", "de", "en", "en", "en"]


async def test_similar_durations_batch_together(rig_factory: Callable[..., Rig]) -> None:
    rig = rig_factory(cap=4)
    [blocker] = await rig.blocker()
    futs = []
    for i in range(8):  # single-window jobs, alternating 3 s and 28 s
        seconds = 3.0 if i % 2 == 0 else 28.0
        futs += rig.batcher.submit(f"j{i}", [tagged_window(i, seconds)], EN)
    rig.release()
    await gather([blocker, *futs])
    batches = [set(tags) for _, tags in rig.fake.batches[1:]]
    assert batches == [{0, 2, 4, 6}, {1, 3, 5, 7}]


async def test_short_request_is_not_starved_by_a_long_job(rig_factory: Callable[..., Rig]) -> None:
    rig = rig_factory(cap=4)
    [blocker] = await rig.blocker()
    long_futs = rig.batcher.submit("long", [tagged_window(100 + i, 30) for i in range(40)], EN)
    short = rig.batcher.submit("short", [tagged_window(7, 5)], EN)[0]
    rig.release()
    done, _ = await asyncio.wait([short, long_futs[-1]], return_when=asyncio.FIRST_COMPLETED,
                                 timeout=BOUND)
    assert short in done and not long_futs[-1].done()
    # It rode in the very next batch, beside the long job's first windows.
    assert 7 in rig.fake.batches[1][1]
    await gather([blocker, *long_futs])


async def test_oom_splits_halves_cap_and_regrows(rig_factory: Callable[..., Rig]) -> None:
    def oom_over_two(windows: Sequence[Window]) -> None:
        if len(windows) > 2 and not allow_big.is_set():
            raise RuntimeError("CUDA failed with error out of memory")

    import threading

    allow_big = threading.Event()
    rig = rig_factory(cap=8, regrow_after=2, fail=oom_over_two)
    caps: list[float] = []
    real_set = rig.metrics.batch_cap.set
    def record(v: float) -> None:
        caps.append(v)
        real_set(v)

    rig.metrics.batch_cap.set = record  # type: ignore[method-assign,assignment]
    [blocker] = await rig.blocker()
    futs = rig.batcher.submit("j", [tagged_window(i) for i in range(8)], EN)
    rig.release()
    results = await gather([blocker, *futs])
    assert [r.text for r in results[1:]] == [f"w{i}" for i in range(8)]  # nothing lost
    assert caps[:2] == [4, 2]  # halved on each OOM, relative to the batch that failed
    assert rig.metrics.oom_events._value.get() == 3  # 8, then both halves of 4
    assert rig.sizes()[1:] == [8, 4, 2, 2, 4, 2, 2]  # split until each half fits
    allow_big.set()  # memory is back: successes must grow the cap again
    for round_ in range(6):
        await gather(rig.batcher.submit(f"r{round_}", [tagged_window(i) for i in range(8)], EN))
    assert rig.batcher.cap == 8


async def test_a_failing_window_fails_only_its_own_job(rig_factory: Callable[..., Rig]) -> None:
    def poison(windows: Sequence[Window]) -> None:
        if any(tag_of(w) == 13 for w in windows):
            raise ValueError("bad window")

    rig = rig_factory(cap=8, fail=poison)
    [blocker] = await rig.blocker()
    a = rig.batcher.submit("A", [tagged_window(t) for t in (11, 12, 13, 14)], EN)
    b = rig.batcher.submit("B", [tagged_window(t) for t in (21, 22)], EN)
    rig.release()
    res_a = await gather(a)
    res_b = await gather(b)
    await gather([blocker])
    assert isinstance(res_a[2], TranscriptionFailed)
    assert "bad window" not in res_a[2].message  # the exception's text stays in the log
    assert res_a[2].details["cause"] == "engine_error"
    assert [r.text for k, r in enumerate(res_a) if k != 2] == ["w11", "w12", "w14"]
    assert [r.text for r in res_b] == ["w21", "w22"]
    assert rig.metrics.oom_events._value.get() == 0  # an ordinary error is not an OOM


async def test_cancelled_windows_cost_no_compute(rig_factory: Callable[..., Rig]) -> None:
    rig = rig_factory(cap=4)
    [blocker] = await rig.blocker()
    gone = rig.batcher.submit("gone", [tagged_window(500 + i) for i in range(6)], EN)
    kept = rig.batcher.submit("kept", [tagged_window(1)], EN)
    for f in gone:
        f.cancel()
    rig.release()
    await gather([blocker, *kept])
    seen = {t for _, tags in rig.fake.batches for t in tags}
    assert not seen & {500 + i for i in range(6)}
    assert rig.batcher.pending() == 0


async def test_engine_errors_never_hang_callers(rig_factory: Callable[..., Rig]) -> None:
    def always(_: Sequence[Window]) -> None:
        raise RuntimeError("engine exploded")

    rig = rig_factory(cap=4, fail=always)
    results = await gather(rig.batcher.submit("j", [tagged_window(i) for i in range(5)], EN))
    assert all(isinstance(r, TranscriptionFailed) for r in results)


async def test_stop_fails_pending_work_with_shutting_down(rig_factory: Callable[..., Rig]) -> None:
    rig = rig_factory(cap=2)
    [blocker] = await rig.blocker()
    waiting = rig.batcher.submit("j", [tagged_window(i) for i in range(4)], EN)
    stop = asyncio.create_task(rig.batcher.stop(grace_s=BOUND))
    await asyncio.sleep(0)
    rig.release()  # the batch in flight finishes within the grace period
    await asyncio.wait_for(stop, BOUND)
    assert (await gather([blocker]))[0].text == "w999"
    results = await gather(waiting)
    assert all(isinstance(r, ShuttingDown) for r in results)
    with pytest.raises(ShuttingDown):
        rig.batcher.submit("late", [tagged_window(1)], EN)


async def test_memory_budget_bounds_windows_in_flight(rig_factory: Callable[..., Rig]) -> None:
    """Budget 1000 MB, model holds 700, 50 MB per window: at most 6 windows in flight."""
    fake = FakeEngine(workers=2)
    settings = BatcherSettings(max_batch_size=8, max_wait_ms=20, memory_budget_mb=1000, job_memory_mb=0,
                               window_memory_mb=50)
    batcher = Batcher(EngineRunner(fake).run, settings, 2, Metrics(), base_memory_mb=700)
    batcher.start()
    try:
        fake.gate.clear()
        futs = batcher.submit("j", [tagged_window(i) for i in range(20)], EN)
        await asyncio.to_thread(fake.entered.acquire, True, BOUND)
        await asyncio.to_thread(fake.entered.acquire, True, BOUND)
        assert batcher.limit() == 1  # 6 windows in flight: the floor of one, never zero
        fake.gate.set()
        results = await gather(futs)
        assert [r.text for r in results] == [f"w{i}" for i in range(20)]
        sizes = [len(t) for _, t in fake.batches]
        assert max(sizes) == 6  # a batch took the whole room, and never more
    finally:
        fake.gate.set()
        await batcher.stop(5)


async def test_a_long_upload_leaves_the_last_worker_small_batches(rig_factory: Callable[..., Rig]) -> None:
    """Two workers: a long job fills one with a full batch, the other gets cap/4 at a time, so
    a short request that arrives meanwhile waits one small batch, then runs on its own."""
    rig = rig_factory(cap=8, workers=2)
    rig.fake.gate.clear()
    long_futs = rig.batcher.submit("long", [tagged_window(100 + i, 30) for i in range(40)], EN)
    await asyncio.to_thread(rig.fake.entered.acquire, True, BOUND)
    await asyncio.to_thread(rig.fake.entered.acquire, True, BOUND)
    short = rig.batcher.submit("short", [tagged_window(7, 5)], EN)[0]
    rig.release()
    await gather([short, *long_futs])
    sizes = rig.sizes()
    # The two batches holding both workers before the release, in the order they entered
    # (``sizes`` is the order they passed the gate in: a race once three pytest workers loaded
    # the host, the full batch's thread recorded after two small ones).
    assert sorted(rig.fake.started[:2]) in ([2, 8], [8, 8]) and 2 in sizes  # small beside full
    short_batch = next(k for k, (_, tags) in enumerate(rig.fake.batches) if 7 in tags)
    assert short_batch <= 3  # it rode in one of the next batches, not after the long job


async def test_a_new_request_beside_a_running_upload_batches_alone(rig_factory: Callable[..., Rig]) -> None:
    rig = rig_factory(cap=8, workers=2)
    rig.fake.gate.clear()
    first = rig.batcher.submit("long", [tagged_window(100 + i, 30) for i in range(8)], EN)
    await asyncio.to_thread(rig.fake.entered.acquire, True, BOUND)  # one worker busy
    more = rig.batcher.submit("long", [tagged_window(200 + i, 30) for i in range(8)], EN)
    short = rig.batcher.submit("short", [tagged_window(7, 5)], EN)
    await asyncio.to_thread(rig.fake.entered.acquire, True, BOUND)  # the other worker took...
    rig.release()
    await gather([*first, *more, *short])
    assert [7] in [tags for _, tags in rig.fake.batches]  # ...the new request alone


async def test_short_requests_alone_keep_full_batches(rig_factory: Callable[..., Rig]) -> None:
    rig = rig_factory(cap=4, workers=2)
    [blocker] = await rig.blocker()
    futs = [f for i in range(8) for f in rig.batcher.submit(f"j{i}", [tagged_window(i)], EN)]
    rig.release()
    await gather([blocker, *futs])
    assert sorted(rig.sizes()) == [1, 4, 4]  # fresh jobs: the last worker is not held back


async def test_a_long_jobs_engine_memory_is_capped_and_spread_over_the_workers() -> None:
    """job_memory_mb: a 16-window upload of 30 s windows (100 MB each) with a 400 MB share
    never has more than 4 windows in engine calls, at most 2 per call with 2 workers (both
    busy, not one with all 4); another job's short request still goes at once."""
    fake = FakeEngine(workers=2)
    in_calls = 0
    most = 0
    lock = asyncio.Lock()

    async def run(windows: Sequence[Window], options: DecodeOptions) -> list:
        nonlocal in_calls, most
        long = sum(1 for w in windows if w.duration > 20)
        async with lock:
            in_calls += long
            most = max(most, in_calls)
        try:
            await asyncio.sleep(0.01)
            return fake.transcribe_batch(windows, options)
        finally:
            async with lock:
                in_calls -= long

    settings = BatcherSettings(max_batch_size=8, max_wait_ms=5, job_memory_mb=400,
                               window_memory_mb=100)
    b = Batcher(run, settings, 2, Metrics())
    b.start()
    try:
        futs = b.submit("long", [tagged_window(i, 29.5) for i in range(16)], EN, job_windows=16)
        short = b.submit("short", [tagged_window(100, 3.0)], EN)
        results = await gather([*futs, *short])
    finally:
        await b.stop(5)
    assert [r.text for r in results] == [f"w{i}" for i in range(16)] + ["w100"]
    assert most == 4
    assert max(sum(1 for t in tags if t < 100) for _, tags in fake.batches) == 2


async def test_the_primitive_pins_a_failure_on_its_item_in_halves() -> None:
    """app/batching/primitive.isolate, the rule both batchers follow: a bad item among eight costs five
    more calls (not eight), fails alone, and every other caller gets its result."""
    from dataclasses import dataclass

    from app.batching.primitive import answer, fail, isolate

    @dataclass
    class It:
        n: int
        future: asyncio.Future[int]

    loop = asyncio.get_running_loop()
    items = [It(n, loop.create_future()) for n in range(8)]
    calls: list[list[int]] = []
    failures: list[int] = []

    async def call(batch: list[It]) -> None:
        calls.append([i.n for i in batch])
        if any(i.n == 5 for i in batch):
            raise ValueError("bad item")
        for i in batch:
            answer(i, i.n * 10)

    await isolate(items, call, fail, lambda batch, exc: failures.append(len(batch)))
    assert calls == [list(range(8)), [0, 1, 2, 3], [4, 5, 6, 7], [4, 5], [4], [5], [6, 7]]
    assert failures == [8, 4, 2, 1]
    assert [i.future.result() for i in items if i.n != 5] == [0, 10, 20, 30, 40, 60, 70]
    with pytest.raises(ValueError):
        items[5].future.result()

