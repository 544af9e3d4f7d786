"""Durable job store (SQLAlchemy Core, an async API): SQLite in WAL mode by default, each
transaction run whole on the store's own thread, or PostgreSQL to share one queue between
replicas (``BATCHSCRIBE_STORAGE__DATABASE_URL=postgresql+psycopg://...``, its async driver).

A job row is committed before the client gets its 202, and the upload is already on disk, so an
accepted job survives any crash. Jobs move queued -> running (claimed under a lease by one
replica) -> done | failed | cancelled. Finishing is conditional on still holding the lease, which
is what makes a result land exactly once even if a crashed replica's job was re-run.
The schema is versioned (app/migrations, Alembic) and brought up to date by :meth:`JobStore.init`.
"""

from __future__ import annotations

import asyncio
import builtins  # JobStore.list shadows list in the class body's annotations
import fcntl
import json
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, TypeVar

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from app.migrations import migrate

TERMINAL = ("done", "failed", "cancelled")
T = TypeVar("T")

metadata = sa.MetaData()
jobs = sa.Table(
    "jobs",
    metadata,
    sa.Column("id", sa.String(64), primary_key=True),
    sa.Column("owner", sa.String(128), nullable=True, index=True),
    sa.Column("status", sa.String(16), nullable=False, index=True),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("started_at", sa.Float),
    sa.Column("finished_at", sa.Float),
    sa.Column("expires_at", sa.Float, index=True),
    sa.Column("filename", sa.String(512)),
    sa.Column("upload_path", sa.String(1024), nullable=False),
    sa.Column("options", sa.JSON, nullable=False),
    sa.Column("audio_seconds", sa.Float, nullable=False, default=0.0),
    sa.Column("windows_total", sa.Integer),
    sa.Column("windows_done", sa.Integer, nullable=False, default=0),
    sa.Column("queue_wait_s", sa.Float),
    sa.Column("processing_s", sa.Float),
    sa.Column("diarization_s", sa.Float),  # diarize jobs: wall seconds of their speaker work
    sa.Column("result", sa.JSON),
    sa.Column("error", sa.JSON),
    sa.Column("attempts", sa.Integer, nullable=False, default=0),
    sa.Column("lease_owner", sa.String(128)),
    sa.Column("lease_expires_at", sa.Float),
    sa.Column("replica", sa.String(128)),  # who claimed it last; unlike lease_owner, kept at the end
    # Webhook delivery (app/jobs/webhooks.py). The state becomes "pending" in the same UPDATE that
    # finishes the job, so a crash between the two can never lose a delivery.
    sa.Column("callback_url", sa.String(2048)),
    sa.Column("webhook_status", sa.String(16), index=True),  # pending | delivered | failed
    sa.Column("webhook_attempts", sa.Integer),
    sa.Column("webhook_next_at", sa.Float),  # next attempt due (also the lease of one in flight)
    sa.Column("webhook_last_error", sa.String(512)),
    sa.Column("webhook_delivered_at", sa.Float),
)
WEBHOOK_ON = ("done", "failed")  # final statuses that are delivered to a job's callback_url

# Statements run on every request, built once: building one (coercing each operand, creating
# SQL function objects) cost more of the event loop's CPU than running it on the store thread.
INSERT = jobs.insert()
GET = jobs.select().where(jobs.c.id == sa.bindparam("job_id"))
QUEUED_AUDIO = sa.select(sa.func.coalesce(sa.func.sum(jobs.c.audio_seconds), 0.0)).where(
    jobs.c.status.in_(("queued", "running")))
COUNTS = sa.select(jobs.c.status, sa.func.count()).group_by(jobs.c.status)


@dataclass
class JobRow:
    id: str
    owner: str | None
    status: str
    created_at: float
    started_at: float | None
    finished_at: float | None
    expires_at: float | None
    filename: str | None
    upload_path: str
    options: dict[str, Any]
    audio_seconds: float
    windows_total: int | None
    windows_done: int
    queue_wait_s: float | None
    processing_s: float | None
    result: dict[str, Any] | None
    error: dict[str, Any] | None
    attempts: int
    lease_owner: str | None
    lease_expires_at: float | None
    callback_url: str | None = None
    webhook_status: str | None = None
    webhook_attempts: int | None = None
    webhook_next_at: float | None = None
    webhook_last_error: str | None = None
    webhook_delivered_at: float | None = None
    replica: str | None = None
    diarization_s: float | None = None


def _row(r: Any) -> JobRow:
    return JobRow(**dict(r._mapping))


class JobStore:
    """The jobs table. Every method is one transaction, run by :meth:`run`."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._sqlite: _SqliteThread | None = None
        self.engine: AsyncEngine | None = None
        if url.startswith("sqlite"):
            self._sqlite = _SqliteThread(url)
        else:
            # pre_ping: a pooled connection that a database restart or failover closed is
            # replaced instead of failing the next claim or heartbeat.
            self.engine = create_async_engine(url, pool_pre_ping=True)

    @property
    def shared(self) -> bool:
        """Several processes may use this database (PostgreSQL); SQLite has exactly one."""
        return self._sqlite is None

    async def run(self, fn: Callable[[sa.Connection], T]) -> T:
        """``fn(conn)`` in one transaction, committed if it returns, rolled back if it raises.

        ``fn`` is plain synchronous SQLAlchemy and must read its rows before returning. SQLite:
        it runs whole on the store's own thread, one hop from the event loop per transaction
        (aiosqlite hopped threads for every cursor, execute, fetch, commit and pool reset:
        ~5 ms of CPU per request against ~2 ms). Others: on the async driver, as ``run_sync``.
        """
        if self._sqlite is not None:
            return await self._sqlite.run(fn)
        assert self.engine is not None
        async with self.engine.begin() as conn:
            return await conn.run_sync(fn)

    async def init(self) -> None:
        """Create or upgrade the schema (versioned migrations; see app/migrations)."""
        await self.run(migrate)

    async def close(self) -> None:
        if self._sqlite is not None:
            await self._sqlite.close()
        if self.engine is not None:
            await self.engine.dispose()

    async def insert(self, **values: Any) -> None:
        await self.run(lambda c: c.execute(INSERT, values))

    async def get(self, job_id: str) -> JobRow | None:
        r = await self.run(lambda c: c.execute(GET, {"job_id": job_id}).first())
        return _row(r) if r else None

    async def list(self, owner: str | None, limit: int = 100) -> builtins.list[JobRow]:
        q = jobs.select().order_by(jobs.c.created_at.desc()).limit(limit)
        q = q.where(jobs.c.owner.is_(None) if owner is None else jobs.c.owner == owner)
        return await self.run(lambda c: [_row(r) for r in c.execute(q)])

    async def claim(self, replica: str, limit: int, lease_s: float) -> builtins.list[JobRow]:
        """Take up to ``limit`` queued jobs, oldest first, under a lease for ``replica``. An
        attempt is counted when the job's work starts (:meth:`started`), not here: a claimed
        job that a drain gives back before it started has cost nothing."""
        if limit <= 0:
            return []

        def values() -> dict[str, Any]:
            now = time.time()  # after the select: never earlier than the rows' created_at
            return {"status": "running", "lease_owner": replica, "replica": replica,
                    "lease_expires_at": now + lease_s,
                    "started_at": sa.func.coalesce(jobs.c.started_at, now)}

        def claim(conn: sa.Connection) -> builtins.list[JobRow]:
            return claim_rows(conn, (jobs.c.status == "queued",), jobs.c.created_at, limit, values)

        return await self.run(claim)

    async def heartbeat(self, replica: str, progress: dict[str, int], lease_s: float) -> set[str]:
        """Extend this replica's leases and record progress (windows done per job).

        Returns the ids of the jobs it still holds: a job missing here was taken away (its lease
        expired while this replica stalled, and another one may be running it now).
        """
        now = time.time()
        mine = (jobs.c.lease_owner == replica, jobs.c.status == "running")

        def beat(conn: sa.Connection) -> set[str]:
            conn.execute(jobs.update().where(*mine).values(lease_expires_at=now + lease_s))
            for job_id, done in progress.items():
                conn.execute(
                    jobs.update().where(jobs.c.id == job_id, *mine).values(windows_done=done)
                )
            return {r[0] for r in conn.execute(sa.select(jobs.c.id).where(*mine))}

        return await self.run(beat)

    async def requeue_stale(self, replica: str | None, everyone: bool = False) -> int:
        """Put back jobs whose lease expired, and jobs ``replica`` held before a restart (None:
        only expired ones). ``everyone``: every running job (SQLite at start-up: no other
        process can hold one)."""
        now = time.time()
        stale: sa.ColumnElement[bool] = jobs.c.lease_expires_at < now
        if everyone:
            stale = sa.true()
        elif replica is not None:
            stale = sa.or_(jobs.c.lease_owner == replica, stale)
        q = jobs.update().where(jobs.c.status == "running", stale).values(
            status="queued", lease_owner=None, lease_expires_at=None, windows_done=0)
        return await self.run(lambda c: int(c.execute(q).rowcount or 0))

    async def started(self, job_id: str, replica: str) -> None:
        """The job's work begins: one more attempt (see ``StorageSettings.max_attempts``)."""
        q = (jobs.update().where(jobs.c.id == job_id, jobs.c.lease_owner == replica)
             .values(attempts=jobs.c.attempts + 1))
        await self.run(lambda c: c.execute(q))

    async def release(self, job_id: str, replica: str, started: bool = True,
                      counts: bool = False) -> None:
        """Give a claimed job back to the queue (graceful shutdown), and the attempt its start
        took with it unless ``counts``: only runs that died with (or held up) their process
        count against ``max_attempts``; a job that never started took none."""
        back = 1 if started and not counts else 0
        q = (jobs.update().where(jobs.c.id == job_id, jobs.c.lease_owner == replica,
                                 jobs.c.status == "running")
             .values(status="queued", lease_owner=None, lease_expires_at=None, windows_done=0,
                     attempts=jobs.c.attempts - back))
        await self.run(lambda c: c.execute(q))

    async def update(self, job_id: str, **values: Any) -> None:
        await self.run(lambda c: c.execute(jobs.update().where(jobs.c.id == job_id).values(**values)))

    async def finish(self, job_id: str, replica: str | None, status: str, ttl_s: float,
                     **values: Any) -> bool:
        """Move a job to a final status once. False if it was already final or not ours."""
        now = time.time()
        cond = [jobs.c.id == job_id, jobs.c.status.notin_(TERMINAL)]
        if replica is not None:
            cond.append(jobs.c.lease_owner == replica)
        if status in WEBHOOK_ON:
            has_url = jobs.c.callback_url.is_not(None)
            values.setdefault("webhook_status", sa.case((has_url, "pending"), else_=None))
            values.setdefault("webhook_next_at", sa.case((has_url, now), else_=None))
        q = jobs.update().where(*cond).values(
            status=status, finished_at=now, expires_at=now + ttl_s,
            lease_owner=None, lease_expires_at=None, **values,
        )
        return await self.run(lambda c: bool(c.execute(q).rowcount))

    async def expired(self, now: float) -> builtins.list[JobRow]:
        q = jobs.select().where(jobs.c.status.in_(TERMINAL), jobs.c.expires_at < now)
        return await self.run(lambda c: [_row(r) for r in c.execute(q)])

    async def delete(self, ids: builtins.list[str]) -> None:
        if ids:
            await self.run(lambda c: c.execute(jobs.delete().where(jobs.c.id.in_(ids))))

    async def counts(self) -> dict[str, int]:
        return await self.run(lambda c: {s: int(n) for s, n in c.execute(COUNTS)})

    async def queued_audio_seconds(self) -> float:
        return await self.run(lambda c: float(c.execute(QUEUED_AUDIO).scalar_one()))


def claim_rows(conn: sa.Connection, where: tuple[sa.ColumnElement[bool], ...],
               order: sa.ColumnElement[Any], limit: int,
               values: Callable[[], dict[str, Any]]) -> builtins.list[JobRow]:
    """Take up to ``limit`` rows matching ``where``, in ``order``: set ``values()`` (called
    after the select) on them and return them, in that order. Jobs and webhooks claim this way.

    On PostgreSQL ``FOR UPDATE SKIP LOCKED`` lets replicas claim concurrently without taking
    each other's rows; SQLite serialises writers, which gives the same guarantee.
    """
    q = (sa.select(jobs.c.id).where(*where).order_by(order).limit(limit)
         .with_for_update(skip_locked=True))
    ids = [r[0] for r in conn.execute(q)]
    if not ids:
        return []
    conn.execute(jobs.update().where(jobs.c.id.in_(ids), *where).values(**values()))
    return [_row(r) for r in conn.execute(jobs.select().where(jobs.c.id.in_(ids)).order_by(order))]


class _SqliteThread:
    """A SQLite job store's one connection, used only from its one thread.

    SQLite has a single writer, so one connection loses nothing, and a transaction is one
    hop to this thread. The URL's async driver (``sqlite+aiosqlite``) is swapped for the
    standard library's ``sqlite3``; an in-memory database lives as long as the store.
    """

    def __init__(self, url: str) -> None:
        sync_url = sa.engine.make_url(url).set(drivername="sqlite")
        # StaticPool: the one connection, created (and closed) on this thread.
        self.engine = sa.create_engine(sync_url, poolclass=sa.pool.StaticPool)
        sa.event.listen(self.engine, "connect", _sqlite_pragmas)
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="store")

    def _transaction(self, fn: Callable[[sa.Connection], T]) -> T:
        with self.engine.begin() as conn:
            return fn(conn)

    async def run(self, fn: Callable[[sa.Connection], T]) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._thread, self._transaction, fn)

    async def close(self) -> None:
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._thread, self.engine.dispose)
        self._thread.shutdown(wait=False)


def sqlite_file(url: str) -> str | None:
    """The database file of a SQLite URL; None for in-memory SQLite and other databases."""
    u = sa.engine.make_url(url)
    if not u.drivername.startswith("sqlite") or u.database in (None, "", ":memory:"):
        return None
    return u.database


class StoreInUse(RuntimeError):
    """Another process holds this SQLite job store."""


def lock_sqlite(url: str) -> IO[bytes] | None:
    """Hold ``<database>.lock`` exclusively for this process's life (SQLite only; else None).

    SQLite serves one service process: two would each claim and run the same queued jobs and
    race on spool files. A second process on the same data dir refuses to start instead. The
    lock is a flock on an open file, so the kernel drops it when the holder dies (kill -9
    included): a restart never finds a stale lock.
    """
    database = sqlite_file(url)
    if database is None:
        return None
    path = Path(f"{database}.lock")
    path.parent.mkdir(parents=True, exist_ok=True)
    handle = path.open("a+b")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        raise StoreInUse(
            f"another batchscribe process is using {database}: a SQLite job store serves one "
            "process. Stop it, give this one its own BATCHSCRIBE_STORAGE__DATA_DIR, or share a "
            "PostgreSQL BATCHSCRIBE_STORAGE__DATABASE_URL between replicas."
        ) from None
    return handle


def _sqlite_pragmas(dbapi_conn: Any, _: Any) -> None:
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")  # readers never block the writer
    cur.execute("PRAGMA synchronous=FULL")  # a committed job survives power loss, not just a crash
    cur.execute("PRAGMA busy_timeout=5000")
    cur.close()


def dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"))
