"""Which queued windows the next batch takes, and what each job holds while they run.

Both belong to the batcher's owner task (app/batching/batcher.py): nothing here is shared with
another task, so nothing is locked. The order is fair across API keys and jobs; the ledger
counts each job's windows taken and not yet answered, and the engine memory they hold, which is
what the job-memory budget (``BatcherSettings.job_memory_mb``) and the "fresh job" rule for a
short request beside a long upload are decided from.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from functools import partial

from app.batching.stages import Item
from app.config import BatcherSettings
from app.windows import N_SAMPLES, Window


def fair_order(group: Sequence[Item], size_class: Callable[[Window], float]) -> list[Item]:
    """The windows of one group in the order a batch takes them.

    Sort key: (rank among its API key's windows, rank within its job, size-class distance
    from the oldest window, age). Key first: a key flooding the queue gets one place per
    round like every other key. Job rank next: every waiting job gets its next window in
    before any job gets a second one, so an hour-long upload cannot starve a 5 s request;
    among equals, windows of similar length share a batch so their decodes finish together.
    """
    if not group:
        return []
    seed_class = size_class(group[0].window)
    job_rank: dict[str, int] = {}
    per_owner: dict[str | None, list[tuple[int, float, float, Item]]] = {}
    for i in group:
        r = job_rank.get(i.job_id, 0)
        job_rank[i.job_id] = r + 1
        per_owner.setdefault(i.owner, []).append(
            (r, abs(size_class(i.window) - seed_class), i.enqueued, i))
    keyed: list[tuple[int, int, float, float, Item]] = []
    for windows in per_owner.values():
        windows.sort(key=lambda t: t[:3])
        keyed += [(k, *t) for k, t in enumerate(windows)]
    keyed.sort(key=lambda t: t[:4])
    return [t[4] for t in keyed]


class JobLedger:
    """Per job: windows taken from the queue whose result is not out yet (encoded ones
    included), and the engine memory they hold; and how many of them belong to short requests.
    A job with none in flight is "fresh"."""

    def __init__(self, settings: BatcherSettings, workers: int,
                 padded: Callable[[Window], int], wake: asyncio.Event) -> None:
        self.settings = settings
        self.workers = workers
        self._padded = padded
        self._wake = wake
        self._in_flight: dict[str, int] = {}
        self._mb: dict[str, float] = {}
        self.short_in_flight = 0  # windows of short requests (see Item.job_windows)

    def fresh(self, job_id: str) -> bool:
        return not self._in_flight.get(job_id)

    def window_mb(self, w: Window) -> float:
        return self.settings.window_memory_mb * self._padded(w) / N_SAMPLES

    def within_memory(self, ranked: list[Item], limit: int) -> list[Item]:
        """The first ``limit`` windows whose job stays within ``job_memory_mb``, and takes at
        most its share of it per batch (budget / workers), so a long upload alone keeps every
        worker busy with small batches rather than one with its whole share. A job with
        nothing in flight always gets one window."""
        budget = self.settings.job_memory_mb
        if not budget:
            return ranked[:limit]
        share = budget / self.workers
        chosen: list[Item] = []
        held = dict(self._mb)
        batch: dict[str, float] = {}
        for i in ranked:
            if len(chosen) >= limit:
                break
            mb = self.window_mb(i.window)
            in_batch = batch.get(i.job_id, 0.0)
            if i.job_id in held and (held[i.job_id] + mb > budget or in_batch + mb > share):
                continue
            held[i.job_id] = held.get(i.job_id, 0.0) + mb
            batch[i.job_id] = in_batch + mb
            chosen.append(i)
        return chosen

    def taken(self, items: Sequence[Item], small: int) -> None:
        """These windows left the queue; each is counted until its future is done."""
        for i in items:
            self._in_flight[i.job_id] = self._in_flight.get(i.job_id, 0) + 1
            short = i.job_windows <= small
            self.short_in_flight += short
            mb = self.window_mb(i.window)
            self._mb[i.job_id] = self._mb.get(i.job_id, 0.0) + mb
            i.future.add_done_callback(partial(self._out, i.job_id, short, mb))

    def _out(self, job_id: str, short: bool, mb: float, _: object) -> None:
        """A taken window's result is out (or it failed, or was cancelled while encoded)."""
        self.short_in_flight -= short
        left_mb = self._mb.get(job_id, 0.0) - mb
        if left_mb > 1e-6:
            self._mb[job_id] = left_mb
        else:
            self._mb.pop(job_id, None)
        self._wake.set()  # a job held at its memory share may send its next window
        left = self._in_flight.get(job_id, 1) - 1
        if left:
            self._in_flight[job_id] = left
        else:
            self._in_flight.pop(job_id, None)
