"""The live sessions' threads (app/live/offload.py): every call's own result or exception, in
each caller's order, results handed back to the loop in batches, nothing left hanging by a
cancelled caller or a close. No timings: the batching is counted in wake-ups of the loop."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from app.live import offload
from app.live.offload import HAND_BACK, Offload, default_threads, run_on


def test_every_caller_gets_its_own_results_in_its_own_order() -> None:
    async def main(pool: Offload) -> list[list[tuple[int, int]]]:
        async def caller(k: int) -> list[tuple[int, int]]:
            return [await pool.run(lambda a, b: (a, b), k, i) for i in range(25)]

        return await asyncio.gather(*(caller(k) for k in range(200)))

    pool = Offload(3)
    try:
        got = asyncio.run(main(pool))
    finally:
        pool.close()
    assert got == [[(k, i) for i in range(25)] for k in range(200)]


def test_an_exception_reaches_its_caller_and_the_threads_go_on() -> None:
    def boom(x: int) -> int:
        raise ValueError(f"bad {x}")

    def stop() -> None:
        raise StopIteration  # cannot be set on a Future as it is

    async def main(pool: Offload) -> None:
        with pytest.raises(ValueError, match="bad 7"):
            await pool.run(boom, 7)
        with pytest.raises(RuntimeError, match="StopIteration"):
            await pool.run(stop)
        assert await pool.run(lambda: 42) == 42

    pool = Offload(2)
    try:
        asyncio.run(main(pool))
    finally:
        pool.close()


def test_results_go_back_to_the_loop_in_batches() -> None:
    """One thread, held while 40 calls queue: their results come back in at most
    ceil(40 / HAND_BACK) + 1 wake-ups of the loop, not 40."""
    gate = threading.Event()
    wakeups = 0

    async def main(pool: Offload) -> list[int]:
        nonlocal wakeups
        loop = asyncio.get_running_loop()
        real = loop.call_soon_threadsafe

        def counted(*args: Any, **kw: Any) -> Any:
            nonlocal wakeups
            wakeups += 1
            return real(*args, **kw)

        loop.call_soon_threadsafe = counted  # type: ignore[method-assign,assignment]
        first = pool.run(gate.wait)  # the thread sits in this one while the rest queue
        rest = [pool.run(lambda i=i: i) for i in range(40)]
        await asyncio.sleep(0)
        gate.set()
        await first
        return list(await asyncio.gather(*rest))

    pool = Offload(1)
    try:
        assert asyncio.run(main(pool)) == list(range(40))
    finally:
        pool.close()
    assert wakeups <= -(-41 // HAND_BACK) + 1, wakeups


def test_a_cancelled_caller_leaves_nothing_hanging() -> None:
    gate = threading.Event()

    async def main(pool: Offload) -> int:
        slow = asyncio.ensure_future(pool.run(gate.wait))
        await asyncio.sleep(0)
        slow.cancel()  # the session went away while its append was being decoded
        gate.set()
        with pytest.raises(asyncio.CancelledError):
            await slow
        return await pool.run(lambda: 5)  # the result of the cancelled call was dropped

    pool = Offload(1)
    try:
        assert asyncio.run(main(pool)) == 5
    finally:
        pool.close()


def test_close_cancels_what_has_not_started_and_refuses_more() -> None:
    gate, started = threading.Event(), threading.Event()

    def first() -> bool:
        started.set()
        return gate.wait()

    async def main() -> None:
        pool = Offload(1)
        running = pool.run(first)
        queued = [pool.run(lambda: 1) for _ in range(3)]
        assert await asyncio.to_thread(started.wait, 60)  # the thread is inside ``first``
        pool.close()
        gate.set()
        assert await running is True  # a started call finishes
        for fut in queued:
            with pytest.raises(asyncio.CancelledError):
                await fut
        with pytest.raises(RuntimeError, match="closed"):
            pool.run(lambda: 1)

    asyncio.run(main())


def test_run_on_takes_an_executor_or_none_as_well() -> None:
    async def main(pool: Offload) -> tuple[int, int]:
        return await run_on(None, lambda: 1), await run_on(pool, lambda: 2)

    pool = Offload(1)
    try:
        assert asyncio.run(main(pool)) == (1, 2)
    finally:
        pool.close()


@pytest.mark.parametrize(("cores", "threads"), [(1, 2), (2, 2), (4, 2), (8, 4), (16, 8), (64, 8)])
def test_threads_follow_the_cores(monkeypatch: pytest.MonkeyPatch, cores: int,
                                  threads: int) -> None:
    monkeypatch.setattr(offload.os, "sched_getaffinity", lambda pid: set(range(cores)))
    assert default_threads() == threads


def test_callers_on_two_event_loops_each_get_theirs() -> None:
    """Each result goes back to the loop its Future belongs to."""
    pool = Offload(2)
    got: dict[int, list[int]] = {}

    def loop_thread(k: int) -> None:
        async def main() -> list[int]:
            return list(await asyncio.gather(*(pool.run(lambda i=i: k * 1000 + i)
                                               for i in range(50))))
        got[k] = asyncio.run(main())

    threads = [threading.Thread(target=loop_thread, args=(k,)) for k in (1, 2)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        pool.close()
    assert got == {k: [k * 1000 + i for i in range(50)] for k in (1, 2)}
