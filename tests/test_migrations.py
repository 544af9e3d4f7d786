"""Versioned schema migrations (app/jobs/migrations) and the single-process SQLite restart rule.

PostgreSQL gets the same checks, with two replicas migrating at once, in tests/test_postgres.py.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import sqlalchemy as sa
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

from app.config import Settings
from app.jobs.migrations import config, head
from app.jobs.store import JobStore, metadata


def sync_url(path: Path) -> str:
    return f"sqlite:///{path}"


def schema_diff(path: Path) -> list[object]:
    eng = sa.create_engine(sync_url(path))
    try:
        with eng.connect() as c:
            return list(compare_metadata(MigrationContext.configure(c), metadata))
    finally:
        eng.dispose()


def version(path: Path) -> str | None:
    eng = sa.create_engine(sync_url(path))
    try:
        with eng.connect() as c:
            return MigrationContext.configure(c).get_current_revision()
    finally:
        eng.dispose()


async def test_fresh_database_is_migrated_to_the_model(tmp_path: Path) -> None:
    db = tmp_path / "jobs.db"
    store = JobStore(f"sqlite+aiosqlite:///{db}")
    await store.init()
    await store.init()  # idempotent: a restart runs no migration twice
    await store.close()
    assert version(db) == head()
    # A column added to app.jobs.store.jobs without a migration fails here, not in production.
    assert schema_diff(db) == []


def legacy_table(with_webhooks: bool) -> sa.MetaData:
    """The jobs table as metadata.create_all made it before migrations existed."""
    md = sa.MetaData()
    later = {"replica", "idempotency_key", "diarization_s"}  # columns of migrations 0003-0005
    skip = later | (set() if with_webhooks else {c.name for c in metadata.tables["jobs"].c
                                                 if c.name.startswith(("webhook", "callback"))})
    sa.Table("jobs", md, *(c._copy() for c in metadata.tables["jobs"].c if c.name not in skip))
    return md


@pytest.mark.parametrize("with_webhooks", [False, True])
async def test_database_from_before_migrations_is_adopted(tmp_path: Path, with_webhooks: bool) -> None:
    db = tmp_path / "jobs.db"
    eng = sa.create_engine(sync_url(db))
    md = legacy_table(with_webhooks)
    md.create_all(eng)
    with eng.begin() as c:
        c.execute(md.tables["jobs"].insert().values(
            id="old", status="queued", created_at=1.0, upload_path="/data/uploads/old",
            options={}, audio_seconds=2.0, windows_done=0, attempts=0))
    eng.dispose()

    store = JobStore(f"sqlite+aiosqlite:///{db}")
    await store.init()
    job = await store.get("old")
    await store.close()
    assert job is not None and job.upload_path == "/data/uploads/old" and job.replica is None
    assert version(db) == head() and schema_diff(db) == []


def test_every_migration_downgrades_and_upgrades_again(tmp_path: Path) -> None:
    db = tmp_path / "jobs.db"
    eng = sa.create_engine(sync_url(db))
    with eng.begin() as c:
        command.upgrade(config(c), "head")
    with eng.begin() as c:
        command.downgrade(config(c), "base")
        assert not sa.inspect(c).has_table("jobs")
    with eng.begin() as c:
        command.upgrade(config(c), "head")
    eng.dispose()
    assert schema_diff(db) == []


async def test_sqlite_restart_requeues_every_running_job(tmp_path: Path) -> None:
    """SQLite has one process: on start it takes back every running job, whatever replica id
    the previous process had (ids default to hostname-pid and change across restarts)."""
    store = JobStore(Settings(storage={"data_dir": tmp_path}).database_url())  # type: ignore[arg-type]
    await store.init()
    assert not store.shared
    for k, owner in enumerate(["local", "old-host-123", None]):
        await store.insert(id=f"j{k}", status="queued", created_at=float(k), upload_path=f"j{k}",
                           options={}, audio_seconds=1.0, windows_done=0, attempts=0)
        if owner:
            await store.claim(owner, 1, 3600.0)
            await store.started(f"j{k}", owner)  # its work began: an attempt counts
    assert (await store.counts()) == {"running": 2, "queued": 1}
    assert await store.requeue_stale("new-host-456", everyone=False) == 0  # leases still valid
    assert await store.requeue_stale("new-host-456", everyone=True) == 2
    assert (await store.counts()) == {"queued": 3}
    again = await store.claim("new-host-456", 10, 30.0)
    assert [j.id for j in again] == ["j0", "j1", "j2"]
    # Claiming counts no attempt (a drain may give the job back before it starts).
    assert all(j.attempts == (1 if j.id != "j2" else 0) and j.replica == "new-host-456"
               for j in again)
    await store.close()


def test_replica_id_and_database_url_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    s = Settings()
    assert s.storage.replica().endswith(f"-{os.getpid()}")
    monkeypatch.setenv("BATCHSCRIBE_STORAGE__REPLICA_ID", "pod-7")
    monkeypatch.setenv("BATCHSCRIBE_STORAGE__LEASE_S", "5")
    monkeypatch.setenv("BATCHSCRIBE_STORAGE__DATABASE_URL", "postgresql://u:p@db:5432/bs")
    s = Settings()
    assert s.storage.replica() == "pod-7" and s.storage.lease_s == 5
    assert s.database_url() == "postgresql+psycopg://u:p@db:5432/bs"  # psycopg 3, not psycopg2
