"""Which queued windows the next batch takes, and what each job holds while they run.

Pure functions of what the batcher's owner (app/batching/owner.py) holds. The order is fair
across API keys and jobs; the ledger counts each job's windows taken and not yet answered, and
the engine memory they hold, which is what the job-memory budget
(``BatcherSettings.job_memory_mb``) and the "fresh job" rule for a short request beside a long
upload are decided from.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

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
        keyed += [(k, *t) for k, t in enumerate(sorted(windows, key=lambda t: t[:3]))]
    keyed.sort(key=lambda t: t[:4])
    return [t[4] for t in keyed]


@dataclass(frozen=True)
class Ledger:
    """Per job: windows taken from the queue whose result is not out yet (encoded ones
    included), and the engine memory they hold; and how many belong to short requests. A job
    with none in flight is "fresh". Derived from what the owner holds in flight
    (:func:`ledger`), so nothing has to be counted up and down as windows come and go."""

    windows: Mapping[str, int]
    mb: Mapping[str, float]
    short: int  # windows of short requests (see Item.job_windows)

    def fresh(self, job_id: str) -> bool:
        return not self.windows.get(job_id)


def ledger(in_flight: Iterable[Item], small: int, window_mb: Callable[[Item], float]) -> Ledger:
    """The ledger of ``in_flight``: windows taken and still waited for (in engine calls, in the
    decoder pool, waiting for their fallback)."""
    windows: dict[str, int] = {}
    mb: dict[str, float] = {}
    short = 0
    for i in in_flight:
        windows[i.job_id] = windows.get(i.job_id, 0) + 1
        mb[i.job_id] = mb.get(i.job_id, 0.0) + window_mb(i)
        short += i.job_windows <= small
    return Ledger(windows, mb, short)


def within_memory(held: Ledger, ranked: Sequence[Item], limit: int, budget_mb: float,
                  workers: int, window_mb: Callable[[Item], float]) -> list[Item]:
    """The first ``limit`` windows whose job stays within ``budget_mb`` (``job_memory_mb``),
    and takes at most its share of it per batch (budget / workers), so a long upload alone
    keeps every worker busy with small batches rather than one with its whole share. A job
    with nothing in flight always gets one window."""
    if not budget_mb:
        return list(ranked[:limit])
    share = budget_mb / max(1, workers)
    chosen: list[Item] = []
    mb = dict(held.mb)
    batch: dict[str, float] = {}
    for i in ranked:
        if len(chosen) >= limit:
            break
        w = window_mb(i)
        in_batch = batch.get(i.job_id, 0.0)
        if i.job_id in mb and (mb[i.job_id] + w > budget_mb or in_batch + w > share):
            continue
        mb[i.job_id] = mb.get(i.job_id, 0.0) + w
        batch[i.job_id] = in_batch + w
        chosen.append(i)
    return chosen


def window_mb(settings: BatcherSettings, padded: Callable[[Window], int]
              ) -> Callable[[Item], float]:
    """A window's engine memory: ``window_memory_mb`` in proportion to its padded length."""
    return lambda i: settings.window_memory_mb * padded(i.window) / N_SAMPLES
