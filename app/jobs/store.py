"""Durable job store (SQLAlchemy Core, an async API): SQLite in WAL mode by default, each
transaction run whole on the store's own thread, or PostgreSQL to share one queue between
replicas (``BATCHSCRIBE_STORAGE__DATABASE_URL=postgresql+psycopg://...``, its async driver).

A job row is committed before the client gets its 202, and the upload is already on disk, so an
accepted job survives any crash. Jobs move queued -> running (claimed under a lease by one
replica) -> done | failed | cancelled. Finishing is conditional on still holding the lease, which
is what makes a result land exactly once even if a crashed replica's job was re-run.
The table is app/jobs/schema.py; its versions (app/jobs/migrations, Alembic) are brought up to
date by :meth:`JobStore.init`.
"""

from __future__ import annotations

import builtins  # JobStore.list shadows list in the class body's annotations
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from app.errors import StoreUnavailable
from app.jobs.migrations import migrate
from app.jobs.schema import holds, jobs, metadata
from app.jobs.sqlite import SqliteThread, StoreInUse, lock_sqlite

__all__ = ["JobRow", "JobStore", "StoreInUse", "StoreUnavailable", "jobs", "lock_sqlite", "metadata"]

TERMINAL = ("done", "failed", "cancelled")
T = TypeVar("T")

WEBHOOK_ON = ("done", "failed")  # final statuses that are delivered to a job's callback_url

# Statements run on every request, built once: building one (coercing each operand, creating
# SQL function objects) cost more of the event loop's CPU than running it on the store thread.
INSERT = jobs.insert()
GET = jobs.select().where(jobs.c.id == sa.bindparam("job_id"))
ACTIVE = jobs.c.status.in_(("queued", "running"))
# A job costs at least its padded window (Settings.min_job_s) in every budget: a 0.1 s clip is
# encoded as a 10 s window, so counting it as 0.1 s let one key fill the queue with them.
COST = sa.case((jobs.c.audio_seconds < sa.bindparam("min_s"), sa.bindparam("min_s")),
               else_=jobs.c.audio_seconds)
QUEUED_AUDIO = sa.select(sa.func.coalesce(sa.func.sum(COST), 0.0)).where(ACTIVE)
OWNER_LOAD = sa.select(sa.func.coalesce(sa.func.sum(COST), 0.0), sa.func.count()).where(
    ACTIVE, jobs.c.owner == sa.bindparam("owner"))
ANON_LOAD = sa.select(sa.func.coalesce(sa.func.sum(COST), 0.0), sa.func.count()).where(
    ACTIVE, jobs.c.owner.is_(None))
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
    idempotency_key: str | None = None
    diarization_s: float | None = None


def _row(r: Any) -> JobRow:
    return JobRow(**dict(r._mapping))


def db_now(conn: sa.Connection) -> sa.ColumnElement[float]:
    """Now, on the database's clock (epoch seconds). Leases are written by one replica and
    judged by another: with each replica's own clock a skew of a few seconds expired live
    leases or kept dead ones. SQLite serves one process, whose clock is the database's."""
    if conn.dialect.name == "postgresql":
        return sa.cast(sa.func.extract("epoch", sa.func.clock_timestamp()), sa.Float)
    return sa.literal(time.time(), sa.Float)


class JobStore:
    """The jobs table. Every method is one transaction, run by :meth:`run`."""

    def __init__(self, url: str, min_job_s: float = 0.0, fair: bool = True) -> None:
        self.url = url
        self.min_job_s = min_job_s  # the least a job costs in the backlog (Settings.min_job_s)
        # Claims round robin across API keys. Without keys every job has the same owner and
        # that order is the oldest-first one, which costs half as much (measured here: a claim
        # took ~5 ms against ~10 ms with 32 queued jobs, 8 against 41 with 2000).
        self.fair = fair
        self.holds_alive: set[str] = set()  # this process's rows of holds (app/jobs/holds.py)
        self._sqlite: SqliteThread | None = None
        self.engine: AsyncEngine | None = None
        if url.startswith("sqlite"):
            self._sqlite = SqliteThread(url)
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

        A database out of reach (a PostgreSQL restart: every request then got 500) raises
        :class:`StoreUnavailable`, a 503 clients retry; a refused statement stays itself.
        """
        try:
            if self._sqlite is not None:
                return await self._sqlite.run(fn)
            assert self.engine is not None
            async with self.engine.begin() as conn:
                return await conn.run_sync(fn)
        except (sa.exc.OperationalError, sa.exc.InterfaceError, sa.exc.TimeoutError) as exc:
            raise StoreUnavailable(type(exc).__name__) from exc
        except sa.exc.DBAPIError as exc:
            if exc.connection_invalidated:
                raise StoreUnavailable(type(exc).__name__) from exc
            raise

    async def init(self) -> None:
        """Create or upgrade the schema (versioned migrations; see app/jobs/migrations)."""
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

    async def get_many(self, ids: builtins.list[str], owner: str | None) -> builtins.list[JobRow]:
        """The caller's jobs among ``ids`` (one query; others' and unknown ids are left out)."""
        if not ids:
            return []
        q = jobs.select().where(jobs.c.id.in_(ids),
                                jobs.c.owner.is_(None) if owner is None else jobs.c.owner == owner)
        return await self.run(lambda c: [_row(r) for r in c.execute(q)])

    async def by_idempotency_key(self, digest: str, since: float) -> JobRow | None:
        """The job created under this key digest at or after ``since``. A holder created before
        gives the key up in the same transaction (its row stays), so the key can be used again."""

        def find(conn: sa.Connection) -> JobRow | None:
            r = conn.execute(jobs.select().where(jobs.c.idempotency_key == digest)).first()
            if r is None or r.created_at >= since:
                return _row(r) if r else None
            conn.execute(jobs.update().where(jobs.c.id == r.id).values(idempotency_key=None))
            return None

        return await self.run(find)

    async def list(self, owner: str | None, limit: int = 100) -> builtins.list[JobRow]:
        q = jobs.select().order_by(jobs.c.created_at.desc()).limit(limit)
        q = q.where(jobs.c.owner.is_(None) if owner is None else jobs.c.owner == owner)
        return await self.run(lambda c: [_row(r) for r in c.execute(q)])

    async def claim(self, replica: str, limit: int, lease_s: float) -> builtins.list[JobRow]:
        """Take up to ``limit`` queued jobs under a lease for ``replica``, round robin across
        API keys: a key's n-th waiting job comes after every other key's (n - 1)-th, counting
        the jobs each key already has running, oldest first within a turn. A key that queued a
        thousand jobs delays another key's first job by at most one turn, not a thousand jobs.
        Attempts are counted when work starts (:meth:`started`), not here."""
        if limit <= 0:
            return []

        def values(conn: sa.Connection) -> dict[str, Any]:
            now = db_now(conn)  # after the select: never earlier than the rows' created_at
            return {"status": "running", "lease_owner": replica, "replica": replica,
                    "lease_expires_at": now + lease_s,
                    "started_at": sa.func.coalesce(jobs.c.started_at, now)}

        def claim(conn: sa.Connection) -> builtins.list[JobRow]:
            queued = (jobs.c.status == "queued",)
            if not self.fair:
                return claim_rows(conn, queued, jobs.c.created_at, limit, values)
            frm, order = round_robin()
            return claim_rows(conn, queued, order, limit, values, frm)

        return await self.run(claim)

    async def started(self, job_id: str, replica: str) -> int:
        """Work on a claimed job begins: count the attempt (``storage.max_attempts`` bounds
        them) and return the new count. A claim alone does not count: jobs claimed ahead and
        given back by a drain before they ran never used one."""
        mine = (jobs.c.id == job_id, jobs.c.lease_owner == replica, jobs.c.status == "running")

        def start(conn: sa.Connection) -> int:
            conn.execute(jobs.update().where(*mine).values(attempts=jobs.c.attempts + 1))
            n = conn.execute(sa.select(jobs.c.attempts).where(jobs.c.id == job_id)).scalar()
            return int(n or 0)

        return await self.run(start)

    async def heartbeat(self, replica: str, progress: dict[str, int], lease_s: float) -> set[str]:
        """Extend this replica's leases and record progress (windows done per job).

        Returns the ids of the jobs it still holds: a job missing here was taken away (its lease
        expired while this replica stalled, and another one may be running it now). Shared
        stores: the leases of ``holds_alive`` too, this replica's other holds deleted.
        """
        mine = (jobs.c.lease_owner == replica, jobs.c.status == "running")
        alive = builtins.list(self.holds_alive) if self.shared else None

        def beat(conn: sa.Connection) -> set[str]:
            conn.execute(jobs.update().where(*mine).values(lease_expires_at=db_now(conn) + lease_s))
            if alive is not None:
                conn.execute(holds.update().where(holds.c.id.in_(alive))
                             .values(expires_at=db_now(conn) + lease_s))
                conn.execute(holds.delete().where(holds.c.replica == replica,
                                                  holds.c.id.notin_(alive)))
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
        def requeue(conn: sa.Connection) -> int:
            stale: sa.ColumnElement[bool] = jobs.c.lease_expires_at < db_now(conn)
            if everyone:
                stale = sa.true()
            elif replica is not None:
                stale = sa.or_(jobs.c.lease_owner == replica, stale)
            q = jobs.update().where(jobs.c.status == "running", stale).values(
                status="queued", lease_owner=None, lease_expires_at=None, windows_done=0)
            return int(conn.execute(q).rowcount or 0)

        return await self.run(requeue)

    async def release(self, job_id: str, replica: str, started: bool = True,
                      counts: bool = False) -> None:
        """Give a claimed job back to the queue (graceful shutdown), and the attempt its start
        took with it unless ``counts``: only runs that died with (or held up) their process
        count against ``max_attempts``; a job that never started took none."""
        back = 1 if started and not counts else 0
        q = (jobs.update().where(jobs.c.id == job_id, jobs.c.lease_owner == replica,
                                 jobs.c.status == "running")
             .values(status="queued", lease_owner=None, lease_expires_at=None, windows_done=0,
                     # floored: a job released before its work started used no attempt
                     attempts=sa.case((jobs.c.attempts >= back, jobs.c.attempts - back),
                                      else_=0)))
        await self.run(lambda c: c.execute(q))

    async def queue_fetched(self, job_id: str, audio_seconds: float) -> bool:
        """An ``audio_url`` job's download is done: ``fetching`` -> ``queued`` (False when it
        was cancelled meanwhile)."""
        q = jobs.update().where(jobs.c.id == job_id, jobs.c.status == "fetching").values(
            status="queued", audio_seconds=audio_seconds)
        return await self.run(lambda c: bool(c.execute(q).rowcount))

    async def stale_fetches(self, before: float) -> builtins.list[str]:
        """Jobs still ``fetching`` that were created before ``before``: their process died."""
        q = sa.select(jobs.c.id).where(jobs.c.status == "fetching", jobs.c.created_at < before)
        return await self.run(lambda c: [str(r[0]) for r in c.execute(q)])

    async def update(self, job_id: str, **values: Any) -> None:
        await self.run(lambda c: c.execute(jobs.update().where(jobs.c.id == job_id).values(**values)))

    async def finish(self, job_id: str, replica: str | None, status: str, ttl_s: float,
                     **values: Any) -> bool:
        """Move a job to a final status once. False if it was already final or not ours."""
        now = time.time()
        cond = [jobs.c.id == job_id, jobs.c.status.notin_(TERMINAL)]
        if replica is not None:
            cond.append(jobs.c.lease_owner == replica)
        def end(conn: sa.Connection) -> bool:
            if status in WEBHOOK_ON:
                has_url = jobs.c.callback_url.is_not(None)
                values.setdefault("webhook_status", sa.case((has_url, "pending"), else_=None))
                # due now on the clock the dispatchers' claims compare with
                values.setdefault("webhook_next_at", sa.case((has_url, db_now(conn)), else_=None))
            q = jobs.update().where(*cond).values(
                status=status, finished_at=now, expires_at=now + ttl_s,
                lease_owner=None, lease_expires_at=None, **values,
            )
            return bool(conn.execute(q).rowcount)

        return await self.run(end)

    async def expired(self, now: float) -> builtins.list[JobRow]:
        q = jobs.select().where(jobs.c.status.in_(TERMINAL), jobs.c.expires_at < now)
        return await self.run(lambda c: [_row(r) for r in c.execute(q)])

    async def delete(self, ids: builtins.list[str]) -> None:
        if ids:
            await self.run(lambda c: c.execute(jobs.delete().where(jobs.c.id.in_(ids))))

    async def counts(self) -> dict[str, int]:
        return await self.run(lambda c: {s: int(n) for s, n in c.execute(COUNTS)})

    async def queued_audio_seconds(self) -> float:
        """Queued and running audio, each job counted at least ``min_job_s``."""
        return await self.run(
            lambda c: float(c.execute(QUEUED_AUDIO, {"min_s": self.min_job_s}).scalar_one()))

    async def owner_load(self, owner: str | None) -> tuple[float, int]:
        """One API key's queued + running audio seconds (each job at least ``min_job_s``) and
        jobs: what the per-key limits look at."""
        q = ANON_LOAD if owner is None else OWNER_LOAD
        params: dict[str, Any] = {"min_s": self.min_job_s, "owner": owner}

        def load(conn: sa.Connection) -> tuple[float, int]:
            seconds, n = conn.execute(q, params).one()
            return float(seconds), int(n)

        return await self.run(load)


def round_robin() -> tuple[sa.FromClause, sa.ColumnElement[Any]]:
    """Claim order (a FROM clause and an ORDER BY): a queued job's turn is its rank among its
    key's queued jobs plus the jobs that key has running. The window function sits in a
    subquery: PostgreSQL allows none beside FOR UPDATE in the query that locks the rows."""
    q, r = jobs.alias("q"), jobs.alias("r")
    # Inline, not a bound parameter: PostgreSQL must see GROUP BY's expression as the select's.
    no_key: sa.ColumnElement[str] = sa.literal_column("''")

    def key(t: sa.FromClause) -> sa.ColumnElement[Any]:
        return sa.func.coalesce(t.c.owner, no_key)

    ranked = (sa.select(q.c.id.label("id"), sa.func.row_number().over(
        partition_by=key(q), order_by=(q.c.created_at, q.c.id)).label("rk"))
        .where(q.c.status == "queued").subquery("ranked"))
    running = (sa.select(key(r).label("k"), sa.func.count().label("n"))
               .where(r.c.status == "running").group_by(key(r)).subquery("running"))
    frm = jobs.join(ranked, ranked.c.id == jobs.c.id).outerjoin(running, running.c.k == key(jobs))
    return frm, ranked.c.rk + sa.func.coalesce(running.c.n, 0)


def claim_rows(conn: sa.Connection, where: tuple[sa.ColumnElement[bool], ...],
               order: sa.ColumnElement[Any], limit: int,
               values: Callable[[sa.Connection], dict[str, Any]],
               frm: sa.FromClause | None = None) -> builtins.list[JobRow]:
    """Take up to ``limit`` rows matching ``where``, in ``order`` (oldest first within it),
    selected from ``frm`` (default: the jobs table): set ``values(conn)`` (called after the
    select) on them and return them, in that order. Jobs and webhooks claim this way.

    On PostgreSQL ``FOR UPDATE OF jobs SKIP LOCKED`` lets replicas claim concurrently without
    taking each other's rows; SQLite serialises writers, which gives the same guarantee.
    """
    q = sa.select(jobs.c.id)
    if frm is not None:
        q = q.select_from(frm)
    q = (q.where(*where).order_by(order, jobs.c.created_at, jobs.c.id).limit(limit)
         .with_for_update(of=jobs, skip_locked=True))
    ids = [r[0] for r in conn.execute(q)]
    if not ids:
        return []
    conn.execute(jobs.update().where(jobs.c.id.in_(ids), *where).values(**values(conn)))
    rows = {r.id: r for r in conn.execute(jobs.select().where(jobs.c.id.in_(ids)))}
    return [_row(rows[i]) for i in ids if i in rows]


def dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"))
