"""The job runner's graceful stop, in process: a stop at an awkward moment never leaves a job
"running" with nothing behind it, nor fails it. Fake engine and VAD; a real SQLite store."""

from __future__ import annotations

import asyncio
import shutil
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from app.batching.batcher import Batcher
from app.config import Settings, StorageSettings
from app.engine.placement import make_pool
from app.jobs.blobs import LocalBlobs
from app.jobs.pipeline import make_batcher, make_prep
from app.jobs.runner import JobRunner
from app.jobs.store import JobRow, JobStore
from app.metrics import Metrics
from app.windows import JobOptions
from loadtest.lib.corpus import Clip
from tests.fakes import BOUND, FakeEngine

EN = JobOptions(language="en")


class WholeClip:
    """A VAD that calls the whole clip speech: the windows do not matter here."""

    def stream(self) -> WholeClip:
        self.samples = 0
        return self

    def feed(self, samples: np.ndarray) -> list[tuple[int, int]]:
        self.samples += samples.size
        return []

    def finish(self) -> list[tuple[int, int]]:
        return [(0, self.samples)]

    def frontier(self) -> int:
        return 0

    def keep_from(self) -> int:
        return 0

    def speech(self, audio: np.ndarray) -> list[tuple[float, float]]:
        return [(0.0, len(audio) / 16000)]


class StallingStore(JobStore):
    """Commits a claim, then stalls before handing the rows back: where a stop used to land
    and leave the claimed jobs "running" with no task to finish or release them."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.claimed, self.proceed = asyncio.Event(), asyncio.Event()

    async def claim(self, replica: str, limit: int, lease_s: float) -> list[JobRow]:
        rows = await super().claim(replica, limit, lease_s)
        if rows:
            self.claimed.set()
            await self.proceed.wait()
        return rows


class GatedBlobs(LocalBlobs):
    """Holds a fetch (in the prep thread) until the test lets it go."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.entered, self.gate = threading.Event(), threading.Event()

    def fetch(self, key: str) -> Path:
        self.entered.set()
        self.gate.wait(BOUND)
        return super().fetch(key)


class SignallingBatcher(Batcher):
    """Says when the runner has got as far as stopping the batcher (its prep pool is shut)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.stopping = asyncio.Event()

    async def stop(self, grace_s: float) -> None:
        self.stopping.set()
        await super().stop(grace_s)


class Rig:
    def __init__(self, tmp: Path, store: JobStore, blobs: LocalBlobs) -> None:
        self.tmp, self.store, self.blobs = tmp, store, blobs
        settings = Settings(storage=StorageSettings(data_dir=tmp))
        self.fake = FakeEngine()
        # The builder's parts, with a fake engine and VAD and a batcher that says when it stops.
        pool = make_pool([self.fake], settings)
        batcher = make_batcher(settings, pool, Metrics(), cls=SignallingBatcher)
        assert isinstance(batcher, SignallingBatcher)
        self.batcher = batcher
        self.runner = JobRunner(settings, store, self.batcher, WholeClip(), Metrics(),
                                make_prep(settings), blobs=blobs)

    async def submit(self, job_id: str, clip: Clip) -> None:
        upload = self.tmp / job_id
        shutil.copy(clip.path, upload)
        await self.runner.submit(job_id, upload, clip.path.name, EN, clip.duration_s, None)

    async def start(self) -> None:
        self.batcher.start()
        await self.runner.start()

    async def status(self, job_id: str) -> str:
        row = await self.store.get(job_id)
        assert row is not None
        return row.status


@pytest.fixture
async def rig_factory(tmp_path: Path) -> AsyncIterator[Callable[..., Awaitable[Rig]]]:
    rigs: list[Rig] = []

    async def make(store_cls: type[JobStore] = JobStore, blobs_cls: type[LocalBlobs] = LocalBlobs,
                   start: bool = True) -> Rig:
        store = store_cls(f"sqlite+aiosqlite:///{tmp_path / 'jobs.db'}")
        await store.init()
        r = Rig(tmp_path, store, blobs_cls(tmp_path / "uploads"))
        rigs.append(r)
        if start:
            await r.start()
        return r

    yield make
    for r in rigs:
        r.fake.gate.set()
        if isinstance(r.blobs, GatedBlobs):
            r.blobs.gate.set()
        if not r.runner.stopped:
            await r.runner.stop(1.0)
        await r.store.close()


async def test_stop_while_a_claim_commits_leaves_the_job_queued(
        rig_factory: Callable[..., Awaitable[Rig]], clips: list[Clip]) -> None:
    rig = await rig_factory(StallingStore)
    store = rig.store
    assert isinstance(store, StallingStore)
    await rig.submit("j1", clips[0])
    await asyncio.wait_for(store.claimed.wait(), BOUND)
    assert await rig.status("j1") == "running"  # committed; the claim has not returned yet
    stopping = asyncio.create_task(rig.runner.stop(5.0))
    await asyncio.sleep(0)  # the stop begins while the claim is parked
    store.proceed.set()
    await asyncio.wait_for(stopping, BOUND)
    assert await rig.status("j1") == "queued"
    row = await rig.store.get("j1")
    assert row is not None and row.attempts == 0  # a drain gives the attempt back


async def test_stop_during_prep_leaves_the_job_queued(
        rig_factory: Callable[..., Awaitable[Rig]], clips: list[Clip]) -> None:
    """The prep pool shuts down while a job's upload is being fetched: the job must come back
    queued, not fail because its next step found the pool closed."""
    rig = await rig_factory(blobs_cls=GatedBlobs)
    blobs = rig.blobs
    assert isinstance(blobs, GatedBlobs)
    await rig.submit("j1", clips[0])
    assert await asyncio.to_thread(blobs.entered.wait, BOUND)
    stopping = asyncio.create_task(rig.runner.stop(5.0))
    await asyncio.wait_for(rig.batcher.stopping.wait(), BOUND)
    blobs.gate.set()
    await asyncio.wait_for(stopping, BOUND)
    row = await rig.store.get("j1")
    assert row is not None and row.status == "queued" and row.attempts == 0, row



async def test_a_job_whose_runs_keep_dying_fails_instead_of_running_again(
        rig_factory: Callable[..., Awaitable[Rig]], clips: list[Clip]) -> None:
    """Two queued jobs whose earlier runs died with their process (a crash, a stalled engine):
    the one under the limit runs; the one that used up ``storage.max_attempts`` fails, saying
    why, instead of taking the next process down too."""
    rig = await rig_factory(start=False)
    limit = rig.runner.settings.storage.max_attempts
    for job_id, died in (("again", limit - 1), ("poison", limit)):
        await rig.submit(job_id, clips[0])
        await rig.store.update(job_id, attempts=died)
    await rig.start()
    for job_id in ("again", "poison"):
        await rig.runner.events.wait(job_id, BOUND)
    again, poison = await rig.store.get("again"), await rig.store.get("poison")
    assert again is not None and again.status == "done" and again.attempts == limit, again
    assert poison is not None and poison.status == "failed", poison
    assert poison.error is not None and poison.error["cause"] == "too_many_attempts", poison.error


async def test_a_run_held_in_a_stalled_engine_call_counts_as_an_attempt(
        rig_factory: Callable[..., Awaitable[Rig]], clips: list[Clip]) -> None:
    """A drain gives a job its attempt back, except when the job was inside an engine call that
    outlived the grace (a stalled engine): that run counts, or a job that hangs the engine
    would be retried by every restart forever."""
    rig = await rig_factory()
    rig.fake.gate.clear()
    await rig.submit("stuck", clips[0])
    assert await asyncio.to_thread(rig.fake.entered.acquire, True, BOUND)
    await asyncio.wait_for(rig.runner.stop(0.5), BOUND)
    row = await rig.store.get("stuck")
    assert row is not None and row.status == "queued" and row.attempts == 1, row
