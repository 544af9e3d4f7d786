"""app.batching.primitive.ModelBatcher, the speaker models' batcher: callers share a model call,
items pile up while the model works, round robin across callers, a bad item fails only its caller,
a cancelled caller's items never reach the model."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from app.batching.primitive import ModelBatcher

BOUND = 120  # seconds: a broken batcher fails the test instead of hanging it


class Counting:
    """A model call that records each batch; it can be held to make callers pile up."""

    def __init__(self) -> None:
        self.batches: list[list[Any]] = []
        self.gate = threading.Event()
        self.gate.set()

    def __call__(self, items: list[Any]) -> list[Any]:
        self.gate.wait(BOUND)
        self.batches.append(list(items))
        if any(i == "bad" for i in items):
            raise ValueError("bad item")
        return [f"out:{i}" for i in items]


@pytest.fixture
def pool() -> Iterator[Any]:
    from concurrent.futures import ThreadPoolExecutor

    ex = ThreadPoolExecutor(1)
    yield ex
    ex.shutdown(wait=False, cancel_futures=True)


async def test_several_callers_share_one_model_call(pool: Any) -> None:
    model = Counting()
    b: ModelBatcher[str, str] = ModelBatcher(model, pool, max_batch=16)
    b.start()
    try:
        outs = await asyncio.wait_for(asyncio.gather(
            *(b.run(f"job{j}", [f"{j}.{i}" for i in range(3)]) for j in range(5))), BOUND)
    finally:
        await b.stop()
    assert b.calls == 1 and len(model.batches[0]) == 15
    assert outs == [[f"out:{j}.{i}" for i in range(3)] for j in range(5)]


async def test_items_pile_up_while_the_model_works_and_go_together(pool: Any) -> None:
    model = Counting()
    model.gate.clear()
    b: ModelBatcher[str, str] = ModelBatcher(model, pool, max_batch=16)
    b.start()
    try:
        first = asyncio.ensure_future(b.run("a", ["a0"]))
        await asyncio.sleep(0.05)  # let the first call start and block in the model
        later = [asyncio.ensure_future(b.run(j, [f"{j}0", f"{j}1"])) for j in "bcd"]
        await asyncio.sleep(0.05)
        model.gate.set()
        await asyncio.wait_for(asyncio.gather(first, *later), BOUND)
    finally:
        await b.stop()
    assert model.batches == [["a0"], ["b0", "c0", "d0", "b1", "c1", "d1"]]


async def test_round_robin_and_a_bad_item_fails_only_its_caller(pool: Any) -> None:
    model = Counting()
    b: ModelBatcher[str, str] = ModelBatcher(model, pool, max_batch=4)
    b.start()
    try:
        long = asyncio.ensure_future(b.run("long", [f"l{i}" for i in range(6)]))
        short = asyncio.ensure_future(b.run("short", ["s0", "bad"]))
        done = await asyncio.wait_for(asyncio.gather(long, short, return_exceptions=True), BOUND)
    finally:
        await b.stop()
    assert model.batches[0] == ["l0", "s0", "l1", "bad"]  # every job's next before any second
    assert done[0] == [f"out:l{i}" for i in range(6)]
    assert isinstance(done[1], ValueError)


async def test_cancelled_callers_items_never_reach_the_model(pool: Any) -> None:
    model = Counting()
    model.gate.clear()
    b: ModelBatcher[str, str] = ModelBatcher(model, pool, max_batch=16)
    b.start()
    try:
        first = asyncio.ensure_future(b.run("a", ["a0"]))
        await asyncio.sleep(0.05)
        gone = asyncio.ensure_future(b.run("b", ["b0", "b1"]))
        kept = asyncio.ensure_future(b.run("c", ["c0"]))
        await asyncio.sleep(0.01)
        gone.cancel()
        model.gate.set()
        await asyncio.wait_for(asyncio.gather(first, kept), BOUND)
    finally:
        await b.stop()
    assert model.batches == [["a0"], ["c0"]]
