"""Per-key caps that hold for the deployment, not per replica: leased slots.

The per-key caps on things in flight (``limits.max_transfers_per_key``: uploads being received
and ``audio_url`` downloads; ``live.max_sessions_per_key``) were counters in each process, so a
key spread over N replicas by a load balancer got N times its limit (issue 51). A slot is now
a *hold*:

* **One process (SQLite).** :class:`LocalHolds`: counters in memory, as before; SQLite serves
  exactly one process (app/jobs/sqlite.py), so they are the deployment's.
* **Replicas on PostgreSQL.** :class:`SharedHolds`: one row per slot in the ``holds`` table
  (migration 0006). Taking one counts the key's live rows and inserts one in a transaction that
  holds a transaction-scoped advisory lock on (kind, key), so two replicas cannot both see the
  last free slot. A row carries its replica and a lease (``storage.lease_s``, on the database's
  clock) that the replica's heartbeat extends (:meth:`app.jobs.store.JobStore.heartbeat`, every
  ``lease_s / 6``) for the slots it still holds, deleting its rows for any it does not: a
  replica killed while holding slots gives them back when their lease expires, and one that
  restarts under the same name (a pod) drops its previous life's rows at its first heartbeat.

Giving a slot back is synchronous for the caller (its ``finally`` blocks); the row's DELETE
runs in the background and, if it fails, the heartbeat deletes the row instead.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections import Counter

import sqlalchemy as sa

from app.jobs.schema import holds
from app.jobs.store import JobStore, db_now

log = logging.getLogger(__name__)
Owner = str | None


class LocalHolds:
    """This process's slots (one replica: SQLite)."""

    def __init__(self) -> None:
        self._held: Counter[tuple[str, Owner]] = Counter()
        self._ids: dict[str, tuple[str, Owner]] = {}

    async def take(self, kind: str, owner: Owner, cap: int) -> str | None:
        """A slot of ``kind`` for ``owner`` while it holds fewer than ``cap``; None at the cap."""
        if self._held[(kind, owner)] >= cap:
            return None
        self._held[(kind, owner)] += 1
        hold = secrets.token_hex(16)
        self._ids[hold] = (kind, owner)
        return hold

    def give_back(self, hold: str) -> None:
        which = self._ids.pop(hold, None)
        if which is not None:
            self._held[which] -= 1
            if self._held[which] <= 0:
                del self._held[which]

    async def count(self, kind: str, owner: Owner, max_age_s: float = 0.0) -> int:
        return self._held.get((kind, owner), 0)


class SharedHolds:
    """The deployment's slots, rows of the shared store's ``holds`` table (PostgreSQL)."""

    def __init__(self, store: JobStore, replica: str, lease_s: float) -> None:
        self.store, self.replica, self.lease_s = store, replica, lease_s
        self._counts: dict[tuple[str, Owner], tuple[float, int]] = {}  # (monotonic, count)
        self._deleting: set[asyncio.Task[None]] = set()

    async def take(self, kind: str, owner: Owner, cap: int) -> str | None:
        hold = secrets.token_hex(16)
        key = owner or ""
        # Alive before the row exists: a heartbeat running meanwhile must not delete it.
        self.store.holds_alive.add(hold)

        def take(conn: sa.Connection) -> bool:
            now = db_now(conn)
            if conn.dialect.name == "postgresql":
                conn.execute(sa.select(sa.func.pg_advisory_xact_lock(
                    sa.func.hashtextextended(f"batchscribe hold {kind} {key}", 0))))
            mine = (holds.c.kind == kind, holds.c.owner == key)
            conn.execute(holds.delete().where(*mine, holds.c.expires_at < now))
            held = conn.execute(sa.select(sa.func.count()).where(*mine)).scalar_one()
            if held >= cap:
                return False
            conn.execute(holds.insert().values(id=hold, kind=kind, owner=key,
                                               replica=self.replica,
                                               expires_at=now + self.lease_s))
            return True

        try:
            taken = await self.store.run(take)
        except BaseException:
            self.store.holds_alive.discard(hold)
            raise
        self._counts.pop((kind, owner), None)
        if not taken:
            self.store.holds_alive.discard(hold)
            return None
        return hold

    def give_back(self, hold: str) -> None:
        self.store.holds_alive.discard(hold)
        self._counts.clear()
        task = asyncio.get_running_loop().create_task(self._delete(hold))
        self._deleting.add(task)
        task.add_done_callback(self._deleting.discard)

    async def _delete(self, hold: str) -> None:
        try:
            await self.store.run(lambda c: c.execute(holds.delete().where(holds.c.id == hold)))
        except Exception as exc:  # the heartbeat deletes it (this replica no longer holds it)
            log.warning("hold %s not deleted now (%s); the next heartbeat will", hold,
                        type(exc).__name__)

    async def count(self, kind: str, owner: Owner, max_age_s: float = 0.0) -> int:
        """Slots of ``kind`` ``owner`` holds in the deployment; an answer up to ``max_age_s``
        old may do (the pre-body gate's reading of the key's share)."""
        now = time.monotonic()
        cached = self._counts.get((kind, owner))
        if max_age_s > 0 and cached is not None and now - cached[0] <= max_age_s:
            return cached[1]

        def count(conn: sa.Connection) -> int:
            return int(conn.execute(sa.select(sa.func.count()).where(
                holds.c.kind == kind, holds.c.owner == (owner or ""),
                holds.c.expires_at >= db_now(conn))).scalar_one())

        n = await self.store.run(count)
        self._counts[(kind, owner)] = (now, n)
        return n


Holds = LocalHolds | SharedHolds


def make_holds(store: JobStore, replica: str, lease_s: float) -> Holds:
    """Shared on a store several replicas use (PostgreSQL), this process's on SQLite."""
    return SharedHolds(store, replica, lease_s) if store.shared else LocalHolds()
