"""SQLite specifics of the job store: its one connection on its own thread, and the lock that
keeps a second service process off the same database file."""

from __future__ import annotations

import asyncio
import fcntl
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, Any, TypeVar

import sqlalchemy as sa

T = TypeVar("T")


class SqliteThread:
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
