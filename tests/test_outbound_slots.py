"""The outbound slots' policy (app/net/slots.py): four caps, fair grants between keys, waits
that end by a grant, a timeout or a cancel without leaking a slot. Real HTTP shows the same
through the service: tests/test_fetch_limits.py."""

from __future__ import annotations

import asyncio

import pytest

from app.net.slots import Slots


async def test_caps_per_key_and_per_key_at_one_destination() -> None:
    s = Slots(total=10, per_dest=6, per_key=5, per_key_dest=3)
    got = [await s.acquire("a", "x") for _ in range(4)]
    assert got == [True, True, True, False]  # a's share at x
    assert [await s.acquire("a", "y") for _ in range(3)] == [True, True, False]  # a's in all
    assert [await s.acquire("b", "x") for _ in range(4)] == [True, True, True, False]  # x's cap
    assert s.by_key() == {"a": 5, "b": 3} and s.free() == 2


async def test_a_freed_slot_goes_to_the_key_holding_fewest() -> None:
    s = Slots(total=2, per_dest=2, per_key=2, per_key_dest=2)
    assert await s.acquire("a", "x") and await s.acquire("a", "x")
    order: list[str] = []

    async def want(key: str) -> None:
        assert await s.acquire(key, "x", wait_s=5)
        order.append(key)

    waiters = [asyncio.create_task(want(k)) for k in ("a", "a", "b")]
    await asyncio.sleep(0.01)
    assert s.waiting() == 3
    s.release("a", "x")  # b holds none: it goes first, though it asked last
    await asyncio.sleep(0.01)
    assert order == ["b"]
    s.release("a", "x")
    await asyncio.sleep(0.01)
    assert order == ["b", "a"]
    s.release("b", "x")
    await asyncio.gather(*waiters)
    assert order == ["b", "a", "a"] and s.waiting() == 0


async def test_waits_end_without_leaking_a_slot() -> None:
    s = Slots(total=1, per_dest=1, per_key=1, per_key_dest=1)
    assert await s.acquire("a", "x")
    assert await s.acquire("b", "x", wait_s=0.05) is False  # timed out: holds nothing
    task = asyncio.create_task(s.acquire("b", "x", wait_s=5))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert s.waiting() == 0 and s.by_key() == {"a": 1}
    # Granted, then cancelled before the waiter ran: the slot goes back.
    task = asyncio.create_task(s.acquire("b", "x", wait_s=5))
    await asyncio.sleep(0.01)
    s.release("a", "x")  # granted to b here...
    task.cancel()  # ...and b cancelled before it resumed
    with pytest.raises(asyncio.CancelledError):
        await task
    assert s.by_key() == {} and s.free() == 1
    assert s.by_kind() == {}
