"""Synchronous waits (app/api/waiting.py), shared by /asr, /detect-language and the OpenAI route:
a job that ends on another replica is noticed through the store (the job's feed in the runner's
event hub, :meth:`app.jobs.events.EventHub.wait`, which the door's ``follow`` hands out), a
client that hangs up is noticed at once, and a job that outlives the wait is reported as still
running."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from app.api import waiting
from app.api.errors import status_of
from app.jobs import events as events_mod
from tests import test_jobs
from tests.test_jobs import Rig

rig_factory = test_jobs.rig_factory  # the job-runner rig fixture, shared


@dataclass
class Job:
    status: str = "running"
    result: dict[str, Any] | None = None
    error: dict[str, Any] | None = None

    @property
    def ended(self) -> bool:
        return self.status in ("done", "failed", "cancelled")


class Following:
    """A subscription to a job nothing here changes: waiting for it only times out."""

    def __enter__(self) -> Following:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    async def until_over(self, timeout_s: float) -> None:
        await asyncio.sleep(timeout_s)


@dataclass
class Door:
    """Just what the waits use of the door: the job is not running here, so following it only
    times out."""

    job: Job = field(default_factory=Job)
    stopped: bool = False
    cancelled: int = 0
    settings: Any = field(default_factory=lambda: SimpleNamespace(
        limits=SimpleNamespace(sync_timeout_s=0.1)))

    def follow(self, job_id: str, owner: str | None) -> Following:
        return Following()

    async def get(self, job_id: str, owner: str | None) -> Job:
        return self.job

    async def cancel(self, job_id: str, owner: str | None) -> Job:
        self.cancelled += 1
        self.job.status = "cancelled"
        return self.job


class Request:
    def __init__(self) -> None:
        self.hang_up = asyncio.Event()

    async def receive(self) -> dict[str, Any]:
        await self.hang_up.wait()
        return {"type": "http.disconnect"}


async def test_a_job_ended_on_another_replica_is_seen_through_the_store(
        rig_factory: Callable[..., Awaitable[Rig]], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(events_mod, "RECHECK_S", 0.05)
    rig = await rig_factory(start=False)
    await rig.store.insert(id="j", owner=None, status="running", created_at=time.time(),
                           upload_path="j", options={}, audio_seconds=5.0, windows_done=0,
                           attempts=1, lease_owner="another-replica")
    reads = 0
    get = rig.store.get

    async def counted(job_id: str) -> Any:
        nonlocal reads
        reads += 1
        return await get(job_id)

    rig.store.get = counted  # type: ignore[method-assign]
    finish = rig.store.finish("j", None, "done", 3600, result={"text": ""})
    asyncio.get_running_loop().call_later(0.2, asyncio.ensure_future, finish)
    start = time.monotonic()
    await rig.runner.events.wait("j", 30.0)
    assert await rig.status("j") == "done"
    assert time.monotonic() - start < 10.0  # long before the 30 s wait was over
    assert reads >= 3  # re-read while it ran elsewhere


async def test_a_client_that_hangs_up_ends_the_wait() -> None:
    door, request = Door(), Request()
    asyncio.get_running_loop().call_later(0.05, request.hang_up.set)
    row, left = await waiting.ended_or_gone(request, door, "j", None, 30.0)  # type: ignore[arg-type]
    assert left and row is not None and row.status == "running"


async def test_a_client_that_hangs_up_cancels_the_job() -> None:
    door, request = Door(), Request()
    door.settings.limits.sync_timeout_s = 30.0
    asyncio.get_running_loop().call_later(0.05, request.hang_up.set)
    with pytest.raises(waiting.Conflict, match="disconnected"):
        await waiting.wait_for_job(request, door, "j", None)  # type: ignore[arg-type]
    assert door.cancelled == 1 and door.job.status == "cancelled"


async def test_a_job_still_running_when_the_wait_ends_is_a_504_that_says_where_it_went() -> None:
    with pytest.raises(waiting.StillRunning) as e:
        await waiting.wait_for_job(Request(), Door(), "j", None)  # type: ignore[arg-type]
    assert status_of(e.value) == 504 and "GET /jobs/j" in str(e.value)
