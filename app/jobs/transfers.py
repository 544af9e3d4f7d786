"""Transfers in flight per API key: uploads being received and ``audio_url`` downloads.

A transfer that trickles (a byte a second) costs the service nothing but a connection or an
outbound slot, and it can hold that for minutes; before a job exists it counted nowhere, so one
tenant could hold every slot and shut the door on the others. Each key may run
``limits.max_transfers_per_key`` at once (429 past it, before a body byte is read or a download
starts), and each transfer counts as one job of at least ``min_job_s`` in the key's share of
the backlog (:meth:`app.jobs.admission.Admission.key_load`) until its job is admitted.

Counts are this replica's: a client spread over replicas by a load balancer gets the cap on
each.
"""

from __future__ import annotations

from collections import defaultdict

from app.errors import Overloaded

RETRY_AFTER_S = 2


class Transfers:
    def __init__(self, cap: int) -> None:
        self.cap = cap
        self._held: defaultdict[str | None, int] = defaultdict(int)

    def count(self, owner: str | None) -> int:
        return self._held.get(owner, 0)

    def acquire(self, owner: str | None) -> Hold:
        """One transfer for ``owner``, or 429 when the key already runs ``cap``."""
        if self._held.get(owner, 0) >= self.cap:
            raise Overloaded(
                f"this API key has {self.cap} uploads or audio_url downloads in flight (limit "
                f"{self.cap} per key); retry when one has finished",
                headers={"Retry-After": str(RETRY_AFTER_S)}, retry_after_s=RETRY_AFTER_S,
                limit="max_transfers_per_key", limit_transfers=self.cap)
        self._held[owner] += 1
        return Hold(self, owner)

    def _release(self, owner: str | None) -> None:
        self._held[owner] -= 1
        if self._held[owner] <= 0:
            del self._held[owner]


class Hold:
    """One transfer's place; :meth:`release` is idempotent."""

    def __init__(self, transfers: Transfers, owner: str | None) -> None:
        self._transfers = transfers
        self.owner = owner
        self.held = True

    def release(self) -> None:
        if self.held:
            self.held = False
            self._transfers._release(self.owner)
