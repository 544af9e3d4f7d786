"""The outbound slots (``audio_url`` downloads and webhook deliveries in flight), shared fairly
between API keys.

Measured from outside (issue 51): key A posted 64 ``audio_url`` jobs at a server answering 200
with a 50 MB ``Content-Length`` and then a byte a second; key B's ``audio_url`` job, pointing
at a normal file server on the same machine, sat in ``fetching`` for the 90 s the probe waited.
The caps were per host *name* and first come first served: A's trickles held every slot of
``127.0.0.1`` and B's download retried a busy slot once a second until its deadline. So a slot
is granted only while four caps allow it:

* ``total``: requests in flight from this replica (``outbound.max_in_flight``);
* ``per_dest``: to one destination, the *address* a host resolved to (or an S3 bucket), so
  ``a.evil.example`` and ``b.evil.example`` on one address share its slots
  (``outbound.max_per_host``);
* ``per_key``: held by one API key, all destinations together (``outbound.max_per_key``);
* ``per_key_dest``: held by one key at one destination (``outbound.max_per_host_per_key``),
  so one key's stalled downloads leave room at a destination another key also uses.

A request that does not fit waits (no polling: its future is resolved when a slot frees) up to
the time its caller allows. Freed slots go first to the key holding the fewest, oldest waiter
first within a key, so a key with many waiting requests cannot starve one with a single request.

Counts are this replica's: they bound this process's connections, which is what they protect.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter
from dataclasses import dataclass, field
from typing import TypeVar

Key = str | None  # an API key's tenant id (None: keyless, one tenant)
T = TypeVar("T")


@dataclass
class _Waiter:
    key: Key
    dest: str
    seq: int
    fut: asyncio.Future[None] = field(repr=False)
    kind: str = "fetch"


class Slots:
    """Fair slot grants under four caps; one instance per outbound guard."""

    def __init__(self, total: int, per_dest: int, per_key: int, per_key_dest: int) -> None:
        self.total, self.per_dest = total, per_dest
        self.per_key, self.per_key_dest = per_key, per_key_dest
        self.held = 0
        self._by_dest: Counter[str] = Counter()
        self._by_key: Counter[Key] = Counter()
        self._by_pair: Counter[tuple[Key, str]] = Counter()
        self._by_kind: Counter[tuple[str, Key]] = Counter()  # what the metrics show
        self._waiters: list[_Waiter] = []
        self._seq = itertools.count()

    # ---- reading ------------------------------------------------------------------------------
    def free(self) -> int:
        return max(0, self.total - self.held)

    def by_key(self) -> dict[Key, int]:
        """Slots held now per key (those holding none are left out)."""
        return {k: n for k, n in self._by_key.items() if n > 0}

    def by_kind(self) -> dict[tuple[str, Key], int]:
        """Slots held now per (kind, key): ``fetch`` (audio_url) or ``webhook``."""
        return {k: n for k, n in self._by_kind.items() if n > 0}

    def key_full(self, key: Key) -> bool:
        return self._by_key[key] >= self.per_key

    def waiting(self) -> int:
        return len(self._waiters)

    def fits(self, key: Key, dest: str) -> bool:
        return (self.held < self.total and self._by_dest[dest] < self.per_dest
                and self._by_key[key] < self.per_key
                and self._by_pair[(key, dest)] < self.per_key_dest)

    # ---- taking and giving back -----------------------------------------------------------------
    async def acquire(self, key: Key, dest: str, wait_s: float = 0.0, kind: str = "fetch") -> bool:
        """Take a slot for ``key`` at ``dest``, waiting up to ``wait_s`` for one; False (and
        nothing held) when none came. A caller cancelled while waiting holds nothing either."""
        w = _Waiter(key, dest, next(self._seq), asyncio.get_running_loop().create_future(), kind)
        self._waiters.append(w)
        try:
            self._grant()
            if not w.fut.done() and wait_s > 0:
                try:
                    async with asyncio.timeout(wait_s):
                        await asyncio.shield(w.fut)
                except TimeoutError:
                    pass
        except BaseException:  # cancelled while waiting: a slot granted meanwhile goes back
            if w.fut.done() and not w.fut.cancelled():
                self.release(key, dest, kind)
            raise
        finally:
            self._waiters.remove(w)
        if w.fut.done() and not w.fut.cancelled():
            return True
        w.fut.cancel()
        return False

    def release(self, key: Key, dest: str, kind: str = "fetch") -> None:
        self._count(key, dest, kind, -1)
        self._grant()

    def _count(self, key: Key, dest: str, kind: str, step: int) -> None:
        self.held += step
        _step(self._by_kind, (kind, key), step)
        _step(self._by_dest, dest, step)
        _step(self._by_key, key, step)
        _step(self._by_pair, (key, dest), step)

    def _grant(self) -> None:
        """Grant waiting requests that fit, the key holding fewest first, oldest first."""
        while self.held < self.total:
            ready = [w for w in self._waiters if not w.fut.done() and self.fits(w.key, w.dest)]
            if not ready:
                return
            w = min(ready, key=lambda w: (self._by_key[w.key], w.seq))
            self._count(w.key, w.dest, w.kind, +1)
            w.fut.set_result(None)


def _step(counter: Counter[T], key: T, step: int) -> None:
    counter[key] += step
    if counter[key] <= 0:
        del counter[key]
