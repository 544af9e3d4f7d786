"""The batcher's order and per-job ledger (app/batching/fairness.py), pure functions tested
without an event loop: which windows a batch takes first, and what a job holds until its
results are out."""

from __future__ import annotations

import asyncio

from app.batching.fairness import fair_order, ledger, window_mb, within_memory
from app.batching.stages import Item
from app.config import BatcherSettings
from app.windows import N_SAMPLES, DecodeOptions, Window
from tests.fakes import tagged_window


def _items(loop: asyncio.AbstractEventLoop, spec: list[tuple[str, str | None, float]]
           ) -> list[Item]:
    """(job, owner, seconds) per window, enqueued in this order."""
    ranks: dict[str, int] = {}
    out = []
    for n, (job, owner, seconds) in enumerate(spec):
        r = ranks[job] = ranks.get(job, -1) + 1
        out.append(Item(job, r, tagged_window(n, seconds), DecodeOptions(), loop.create_future(),
                        enqueued=float(n), owner=owner))
    return out


def _by_duration(w: Window) -> float:
    return w.duration // 5.0


def test_every_key_then_every_job_gets_a_window_before_any_gets_a_second() -> None:
    loop = asyncio.new_event_loop()
    try:
        # Key "a" floods the queue first: 4 windows of job a1 and 2 of a2; key "b" comes last.
        items = _items(loop, [("a1", "a", 2), ("a1", "a", 2), ("a1", "a", 2), ("a1", "a", 2),
                              ("a2", "a", 2), ("a2", "a", 2), ("b1", "b", 2)])
        order = [(i.job_id, i.rank) for i in fair_order(items, _by_duration)]
        assert order[:2] == [("a1", 0), ("b1", 0)]  # one place per key per round
        assert order[2] == ("a2", 0)  # then a's other job before a1's second window
        assert order[3:] == [("a1", 1), ("a2", 1), ("a1", 2), ("a1", 3)]
    finally:
        loop.close()


def test_among_equals_windows_near_the_oldest_length_come_first() -> None:
    loop = asyncio.new_event_loop()
    try:
        # One window per job: a 28 s window is oldest, then 3 s, 27 s, 4 s.
        items = _items(loop, [("j0", None, 28), ("j1", None, 3), ("j2", None, 27), ("j3", None, 4)])
        assert [i.job_id for i in fair_order(items, _by_duration)] == ["j0", "j2", "j1", "j3"]
        assert fair_order([], _by_duration) == []
    finally:
        loop.close()


def test_the_ledger_caps_a_jobs_memory_and_frees_it_as_results_come_out() -> None:
    """The ledger is derived from what is in flight: a window whose result is out is simply
    no longer in it, and its job's memory is free again."""
    loop = asyncio.new_event_loop()
    try:
        mb = window_mb(BatcherSettings(window_memory_mb=100.0), lambda w: N_SAMPLES)
        long_job = _items(loop, [("long", None, 30)] * 6)
        assert ledger([], small=2, window_mb=mb).fresh("long")

        def fit(in_flight: list[Item], ranked: list[Item]) -> list[Item]:
            held = ledger(in_flight, small=2, window_mb=mb)
            return within_memory(held, ranked, limit=8, budget_mb=400.0, workers=2, window_mb=mb)

        # A fresh job's first batch: at most its share per batch (400 MB / 2 workers = 2 windows).
        first = fit([], long_job)
        assert len(first) == 2
        assert not ledger(first, small=2, window_mb=mb).fresh("long")
        second = fit(first, long_job[2:])
        assert len(second) == 2
        assert fit([*first, *second], long_job[4:]) == []  # 400 MB held: it waits
        other = _items(loop, [("short", None, 2)])  # another job is not held by this one's budget
        assert fit([*first, *second], other) == other
        assert len(fit([*first[1:], *second], long_job[4:])) == 1  # one result out: one more
        half = window_mb(BatcherSettings(window_memory_mb=100.0), lambda w: N_SAMPLES // 2)
        assert half(long_job[0]) == 50.0  # in proportion to its padding
    finally:
        loop.close()


def test_short_requests_are_counted_until_their_results_are_out() -> None:
    loop = asyncio.new_event_loop()
    try:
        items = _items(loop, [("s", None, 2), ("s", None, 2)])
        items[0].job_windows = items[1].job_windows = 2
        long = _items(loop, [("l", None, 30)])
        long[0].job_windows = 40
        mb = window_mb(BatcherSettings(), lambda w: N_SAMPLES)
        assert ledger([*items, *long], small=2, window_mb=mb).short == 2
        assert ledger(items[1:], small=2, window_mb=mb).short == 1  # one answered
    finally:
        loop.close()
