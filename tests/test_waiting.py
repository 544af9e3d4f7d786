"""Synchronous waits (app/api/waiting.py), shared by /asr, /detect-language and the OpenAI route:
a job that ends on another replica is noticed through the store, a client that hangs up is
noticed at once, and a job that outlives the wait is reported as still running."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from app.api import waiting


@dataclass
class Row:
    status: str = "running"


@dataclass
class Store:
    row: Row = field(default_factory=Row)
    reads: int = 0

    async def get(self, job_id: str) -> Row:
        self.reads += 1
        return self.row


class Runner:
    """This replica's runner: the job is not running here, so ``wait`` only times out."""

    stopped = False

    async def wait(self, job_id: str, timeout: float) -> None:
        await asyncio.sleep(timeout)


class Request:
    def __init__(self) -> None:
        self.hang_up = asyncio.Event()

    async def receive(self) -> dict[str, Any]:
        await self.hang_up.wait()
        return {"type": "http.disconnect"}


@dataclass
class State:
    store: Store = field(default_factory=Store)
    runner: Runner = field(default_factory=Runner)
    settings: Any = field(default_factory=lambda: SimpleNamespace(
        limits=SimpleNamespace(sync_timeout_s=0.1)))


async def test_a_job_ended_on_another_replica_is_seen_through_the_store(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(waiting, "RECHECK_S", 0.05)
    st = State()
    asyncio.get_running_loop().call_later(0.2, setattr, st.store.row, "status", "done")
    start = time.monotonic()
    row, left = await waiting.ended_or_gone(Request(), st, "j", 30.0)  # type: ignore[arg-type]
    assert row is not None and row.status == "done" and not left
    assert time.monotonic() - start < 10.0  # long before the 30 s wait was over
    assert st.store.reads >= 3  # re-read while it ran elsewhere


async def test_a_client_that_hangs_up_ends_the_wait() -> None:
    st, request = State(), Request()
    asyncio.get_running_loop().call_later(0.05, request.hang_up.set)
    row, left = await waiting.ended_or_gone(request, st, "j", 30.0)  # type: ignore[arg-type]
    assert left and row is not None and row.status == "running"


async def test_a_job_still_running_when_the_wait_ends_is_a_504_that_says_where_it_went() -> None:
    with pytest.raises(waiting.StillRunning) as e:
        await waiting.wait_for_job(Request(), State(), "j")  # type: ignore[arg-type]
    assert e.value.status_code == 504 and "GET /jobs/j" in str(e.value)
