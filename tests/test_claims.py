"""The job store's side of fairness and retries (SQLite here; tests/test_postgres.py runs the same
claims on PostgreSQL): round-robin claims across API keys, attempts counted when work starts,
per-key load with every job costing at least one padded window, leases on the database clock.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from app.config import Settings
from app.jobs.store import JobStore

MIN_JOB_S = 10.0


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[JobStore]:
    s = JobStore(f"sqlite:///{tmp_path / 'jobs.db'}", min_job_s=MIN_JOB_S)
    await s.init()
    yield s
    await s.close()


async def add(store: JobStore, job_id: str, owner: str | None, created: float,
              audio_s: float = 0.5, status: str = "queued") -> None:
    await store.insert(id=job_id, owner=owner, status=status, created_at=created,
                       upload_path=job_id, options={}, audio_seconds=audio_s, windows_done=0,
                       attempts=0)


async def round_robin_order(store: JobStore) -> None:
    """Shared with tests/test_postgres.py."""
    for k in range(5):
        await add(store, f"a{k}", "key-a", 100.0 + k)  # A queued first, and five of them
    for k in range(2):
        await add(store, f"b{k}", "key-b", 200.0 + k)
    await add(store, "n0", None, 300.0)  # keyless jobs are one more tenant
    await add(store, "a-run", "key-a", 50.0, status="running")  # A already has one running
    got = [j.id for j in await store.claim("r1", 6, 30.0)]
    # Turns: b0 and n0 are their keys' first; a0 is A's second (one running); ties go oldest.
    assert got == ["b0", "n0", "a0", "b1", "a1", "a2"], got
    assert [j.id for j in await store.claim("r1", 10, 30.0)] == ["a3", "a4"]


async def test_claims_go_round_robin_across_keys(store: JobStore) -> None:
    await round_robin_order(store)


async def test_without_keys_claims_are_oldest_first(tmp_path: Path) -> None:
    """The cheaper order, for a store whose jobs all have one owner: the same order."""
    s = JobStore(f"sqlite:///{tmp_path / 'one.db'}", fair=False)
    await s.init()
    for k in (3, 1, 2):
        await add(s, f"j{k}", None, float(k))
    assert [j.id for j in await s.claim("r1", 3, 30.0)] == ["j1", "j2", "j3"]
    await s.close()


async def test_a_flood_delays_another_key_by_one_turn_at_most(store: JobStore) -> None:
    for k in range(300):
        await add(store, f"a{k:03d}", "key-a", float(k))
    await add(store, "b", "key-b", 1000.0)  # arrives last
    assert [j.id for j in await store.claim("r1", 2, 30.0)] == ["a000", "b"]


async def test_attempts_count_when_work_starts(store: JobStore) -> None:
    await add(store, "j", None, 1.0)
    [job] = await store.claim("r1", 1, 30.0)
    assert job.attempts == 0  # claimed ahead, not started: no attempt used
    assert await store.started("j", "r1") == 1
    assert await store.started("j", "someone-else") == 1  # not theirs: nothing counted
    await store.release("j", "r1")  # a drain gives the started attempt back
    assert (await store.get("j")).attempts == 0  # type: ignore[union-attr]
    [job] = await store.claim("r1", 1, 30.0)
    await store.release("j", "r1")  # released before its work started: never below zero
    assert (await store.get("j")).attempts == 0  # type: ignore[union-attr]
    [job] = await store.claim("r1", 1, 30.0)
    assert await store.started("j", "r1") == 1
    await store.release("j", "r1", counts=True)  # a run that held the engine past the grace
    assert (await store.get("j")).attempts == 1  # type: ignore[union-attr]


async def test_every_job_costs_at_least_a_padded_window(store: JobStore) -> None:
    await add(store, "tiny1", "key-a", 1.0, audio_s=0.1)
    await add(store, "tiny2", "key-a", 2.0, audio_s=0.1, status="running")
    await add(store, "long", "key-b", 3.0, audio_s=600.0)
    await add(store, "anon", None, 4.0, audio_s=2.0)
    await add(store, "old", "key-a", 0.5, audio_s=0.1, status="done")  # ended: not counted
    assert await store.owner_load("key-a") == (2 * MIN_JOB_S, 2)
    assert await store.owner_load("key-b") == (600.0, 1)
    assert await store.owner_load(None) == (MIN_JOB_S, 1)
    assert await store.queued_audio_seconds() == 3 * MIN_JOB_S + 600.0


def test_min_job_cost_follows_the_time_axis() -> None:
    assert Settings().min_job_s() == 10.0  # 0.1 s + 8 s margin, in 5 s classes
    assert Settings(model={"pad_margin_s": 12}).min_job_s() == 15.0  # type: ignore[arg-type]
    assert Settings(model={"time_axis": "full"}).min_job_s() == 30.0  # type: ignore[arg-type]


async def test_leases_expire_on_the_store_clock(store: JobStore) -> None:
    await add(store, "j", None, 1.0)
    before = time.time()
    [job] = await store.claim("r1", 1, 30.0)
    assert job.lease_expires_at is not None and before + 30 <= job.lease_expires_at <= time.time() + 30
    assert await store.requeue_stale(None) == 0  # valid for 30 s more
    assert await store.heartbeat("r1", {"j": 3}, 0.01) == {"j"}
    await asyncio.sleep(0.05)
    assert await store.requeue_stale(None) == 1
