"""What may hold a latency-critical window back, and by how much (issue 34 item 3).

Measured beside a 20-minute upload on this 2-core host (branch live, commit 150570f,
``loadtest/results/stall.json`` there): short clips took 0.05-2.1 s, except one per run that
waited ~8 s against 0.5 s idle. Two kinds of engine call held a worker for seconds:

* **A looping or unsure window's fallback inside its decoder batch.** A decoder batch of 8 plain
  windows took 1.25 s; 7 plain windows and one looping clip took 8.23 s (its 30 s re-encode,
  beam-5 ``_widen`` and repetition-penalty ``_unloop`` ran in the same call). Now the engine's
  decode leaves the fallbacks out and marks such windows; the batcher answers the others at once
  and runs the fallback as a call of its own, one window (stage ``redo``): a loop delays only
  itself. A live interim decode never gets one: the turn's final supersedes it.
* **A long upload's calls on every worker.** Its windows run one per call per worker, so a new
  request waited for one of them to end (queue p50 2.1-3.5 s at load 6.5-9.7). Now *bulk* work
  (a long job's windows and their fallbacks) takes at most ``workers - reserved_slots`` workers
  (:func:`bulk_ok`): the reserved worker is always free of it for short requests and live
  windows, while such work has come in the last 30 s; a long upload alone still takes every
  worker.

What is left on the reserved worker is short work, and :func:`within_cost` bounds each such batch
by its estimated engine seconds (``batch_cost_s``), not only by its count: a final that arrives
while every worker is busy waits at most about one budget. Smaller batches cost throughput, so
the budget is on while live windows are in the batcher (the finals it protects): beside uploads
alone, batches are sized as before. Bulk batches are budgeted only where no worker is left free
of long bulk calls (one worker, or a GPU's workers with no reserve): there the bulk call on the
last such worker is cut to ``batch_cost_s`` while short or live work is recent
(app/batching/policy.py), and elsewhere a GPU's long-upload batches still fill.

Measured again at 16 live streams (engine trace at 91694fb): finals waited 1.9-2.7 s inside
encoder calls of 6-8 windows, and a final whose decode asked for the 30 s fallback waited 10-25 s
behind newer finals. So while live windows are in, an encoder call takes one window (it costs
the same per window at any batch size on CPU), and finals run in arrival order wherever they
wait (:func:`oldest_final`): to encode, to decode, or for their fallback, which for a final is
not bulk work; nor is a short request's (app/batching/policy.py). The batcher's part of a final
then read p50 0.69 s, max 2.4 s.

Urgency (app/windows.Urgency): live finals go first in every choice (the queue, the decoder pool,
inside a batch); REQUEST windows keep the batcher's own fairness; live interim decodes are shed
(their futures raise :class:`~app.windows.Shed`, never a final's) when the batcher falls behind:

* **superseded**: a newer interim of the same job is submitted while an older one still waits.
  The newer one decodes the same turn's audio and more, so the older text is useless by then.
* **stale**: an interim not yet encoded waited longer than ``interim_max_wait_ms`` (1 s, the
  issue's interim interval): by then the session's next interim is due, and the worker is better
  spent on finals. One already encoded is decoded (its encoder call was most of its cost).

Interims wait in :data:`~app.windows.Refresh` order (:func:`~app.batching.stages.urgent_first`):
a turn showing no text yet first, then the turn whose text is oldest. At 16 streams, arrival
order with a back-off that outlived its turn left 25 of 39 long turns without interim text at
91694fb; with this order, the back-off per turn, encoded interims kept and interims padded by
``LIVE__INTERIM_PAD_MARGIN_S`` (3 s, not 8), 30-36 of 39 got it. A final decode started at a
pause that speech then resumed after is the turn's next interim (app/live/session.py), and the
batcher demotes what of it still waits (:meth:`Batcher.demote`): at final priority it held the
place of true finals (p95 at 16 streams 1.76-1.88 s in probe runs; demoted, 1.46-1.59 s).
  Checked when the batcher next forms a batch (a worker freed or a window arrived), not on a
  timer of its own: the session learns of it then, and its next interim supersedes it anyway.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from app.batching.stages import Item
from app.windows import Urgency

EWMA = 0.3  # weight of the newest call in the measured cost per padded second
LIGHT_RECENT_S = 30.0  # a short request or live window this recent keeps the reserve in force
LIVE_RECENT_S = 5.0  # a live window this recent: live sessions are speaking


def has_final(items: Iterable[Item]) -> bool:
    return any(i.urgency is Urgency.LIVE_FINAL for i in items)


def oldest_final(queued: Iterable[Iterable[Item]], pooled: Iterable[Iterable[Item]],
                 redo: Iterable[Item]) -> str | None:
    """Where the live final that came first waits: ``"queue"`` (to encode), ``"pool"``
    (encoded, for its decoder batch), ``"redo"`` (for its fallback call); None: no final."""
    best: tuple[float, str] | None = None
    for where, items in (("redo", redo), ("pool", (i for g in pooled for i in g)),
                         ("queue", (i for g in queued for i in g))):
        for i in items:
            if i.urgency is Urgency.LIVE_FINAL and (best is None or i.enqueued < best[0]):
                best = (i.enqueued, where)
    return None if best is None else best[1]


def stale(items: Iterable[Item], now: float, max_wait_s: float) -> list[Item]:
    """Interim decodes not yet encoded that waited longer than ``max_wait_s`` (see the module
    doc): to shed. One already encoded is kept: its encoder call, most of its cost, is spent (at
    16 streams 27 of 71 stale sheds were of encoded interims, work thrown away)."""
    return [i for i in items if i.urgency is Urgency.LIVE_INTERIM and i.encoded is None
            and now - i.enqueued > max_wait_s and not i.future.done()]


def superseded(items: Iterable[Item], job_id: str) -> list[Item]:
    """Earlier interim decodes of ``job_id`` still waiting: a newer one replaces them."""
    return [i for i in items if i.job_id == job_id and i.urgency is Urgency.LIVE_INTERIM
            and not i.future.done()]


def ewma(old: float | None, rate: float) -> float:
    """The cost per padded second after a call measured at ``rate``: an EWMA, so a loaded
    host's slower calls count within a few calls."""
    return rate if old is None else (1 - EWMA) * old + EWMA * rate


def within_cost(rate: float | None, budget_s: float, items: Sequence[Item],
                padded_s: Callable[[Item], float]) -> list[Item]:
    """The longest prefix of ``items`` whose estimated engine seconds (padded seconds x the
    stage's measured ``rate``) fit ``budget_s``, one window at least. Unmeasured (no rate) or
    no budget: all of them."""
    if not budget_s or rate is None:
        return list(items)
    total = 0.0
    for n, i in enumerate(items):
        total += rate * padded_s(i)
        if n and total > budget_s:
            return list(items[:n])
    return list(items)


@dataclass(frozen=True)
class Seen:
    """When light work (a short request or a live window) and live work last came in
    (monotonic), and, beside live sessions, when the next bulk call may start."""

    light: float = float("-inf")
    live: float = float("-inf")
    bulk_next: float = float("-inf")

    def saw(self, now: float, live: bool) -> Seen:
        return Seen(max(self.light, now), max(self.live, now) if live else self.live,
                    self.bulk_next)

    def bulk_done(self, started: float, ended: float, share: float) -> Seen:
        """A bulk call ran from ``started`` to ``ended``: the next waits its share out."""
        if not 0 < share < 1:
            return self
        return Seen(self.light, self.live,
                    max(self.bulk_next, ended + (ended - started) * (1 / share - 1)))

    def light_recent(self, now: float) -> bool:
        return now - self.light <= LIGHT_RECENT_S


def held_until(seen: Seen, now: float) -> float | None:
    """When bulk may start again, if the live share holds it back now (see :func:`bulk_ok`)."""
    if now - seen.live <= LIVE_RECENT_S and now < seen.bulk_next:
        return min(seen.bulk_next, seen.live + LIVE_RECENT_S)
    return None


def bulk_ok(seen: Seen, now: float, *, reserved: int, workers: int, bulk_running: int) -> bool:
    """Whether a bulk call (a long job's windows, a redo) may start now.

    It takes at most ``workers - reserved`` engine workers, at least one, while short requests
    or live windows have come in the last ``LIGHT_RECENT_S``: the rest stay free for them. With
    none that recent (a long upload or a batch of them alone), bulk takes every worker: on 2
    CPU cores a long upload on one worker of two ran at 0.33 windows/s against 0.57 on both
    (loadtest/results/stall.json), a cost worth paying only while someone is waiting for a
    quick answer. The first short request after such a quiet spell waits at most for one bulk
    call to end.

    While live sessions speak (a live window in the last ``LIVE_RECENT_S``), bulk work also
    keeps to ``live_share`` of one worker's time (:meth:`Seen.bulk_done`): after a bulk call of
    d seconds the next starts d x (1/share - 1) later at the earliest. An engine trace at 16
    streams beside a 20-minute upload (3b597ce) had the upload's calls (1.38 s each) on one of
    the two workers 76 % of the time: live work had 1.24 workers, and its turn p95 read 1.8-2.0 s
    against 1.36-1.43 s with no upload. Holding bulk back only while a live window waits did not
    help (p95 1.61-2.74 s in seven runs): a bulk call starts in any gap and holds its worker for
    its whole window."""
    if now - seen.light > LIGHT_RECENT_S:
        return bulk_running < workers
    if held_until(seen, now) is not None:
        return False
    return bulk_running < max(1, workers - reserved)


def heavy(item: Item, cap: int) -> bool:
    """A long job's window (more windows than a batch holds), not a live one: bulk work."""
    return item.urgency is Urgency.REQUEST and item.job_windows > cap
