"""Transfers in flight per API key: uploads being received and ``audio_url`` downloads.

A transfer that trickles (a byte a second) costs the service nothing but a connection or an
outbound slot, and it can hold that for minutes; before a job exists it counted nowhere, so one
tenant could hold every slot and shut the door on the others. Each key may run
``limits.max_transfers_per_key`` at once (429 past it, before a body byte is read or a download
starts), and each transfer counts as one job of at least ``min_job_s`` in the key's share of
the backlog (:meth:`app.jobs.admission.Admission.key_load`) until its job is admitted.

The count is the deployment's: on replicas sharing PostgreSQL each transfer is a leased hold
(app/jobs/holds.py), so a key spread over replicas by a load balancer gets its cap once, and a
replica that dies gives its transfers back within ``storage.lease_s``.
"""

from __future__ import annotations

from app.errors import Overloaded
from app.jobs.holds import Holds, LocalHolds

RETRY_AFTER_S = 2
KIND = "transfer"


class Transfers:
    def __init__(self, cap: int, holds: Holds | None = None) -> None:
        self.cap = cap
        self.holds = holds or LocalHolds()

    async def count(self, owner: str | None, max_age_s: float = 0.0) -> int:
        return await self.holds.count(KIND, owner, max_age_s)

    async def acquire(self, owner: str | None) -> Hold:
        """One transfer for ``owner``, or 429 when the key already runs ``cap``."""
        hold = await self.holds.take(KIND, owner, self.cap)
        if hold is None:
            raise Overloaded(
                f"this API key has {self.cap} uploads or audio_url downloads in flight (limit "
                f"{self.cap} per key); retry when one has finished",
                retry_after=RETRY_AFTER_S, retry_after_s=RETRY_AFTER_S,
                limit="max_transfers_per_key", limit_transfers=self.cap)
        return Hold(self.holds, hold, owner)


class Hold:
    """One transfer's place; :meth:`release` is idempotent."""

    def __init__(self, holds: Holds, hold: str, owner: str | None) -> None:
        self._holds = holds
        self._hold = hold
        self.owner = owner
        self.held = True

    def release(self) -> None:
        if self.held:
            self.held = False
            self._holds.give_back(self._hold)
