"""The owner of the batcher's queue state: its only writer, as text-embeddings-inference's queue
task is of its entries (``core/src/queue.rs``).

Everything the speech batcher knows lives here: the windows queued by decode options, the
decoder pool (two stages), the fallbacks waiting, the engine calls in flight, the batch cap,
the measured cost rates, when light and live work was last seen. It changes only through
:meth:`Owner.apply` (a message: windows submitted, an engine call done, a live final demoted,
an engine's slots retired or restored, a stop) and :meth:`Owner.next` (the policy's choice,
app/batching/policy.py, applied). The asyncio task of app/batching/batcher.py is the only
caller of both; callers and engine calls talk to it by message. It takes its clock as an
argument and runs no task, so tests drive it on a simulated clock (tests/simulation.py).

A call is one engine call. One that fails is split in halves, each run in turn on the same
worker, until the failure is pinned on its window (the primitive's rule, app/batching/primitive.py):
the halves wait in the call's ``rest``. An encode is followed on its worker by a decode of its
windows' group when one is ready (policy.chained).
"""

from __future__ import annotations

import itertools
import logging
from collections import Counter, deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from app.batching.fairness import ledger, window_mb
from app.batching.policy import (
    Running,
    Snapshot,
    Take,
    Wait,
    after_oom,
    after_success,
    beams,
    chained,
    pick,
)
from app.batching.primitive import answer
from app.batching.stages import Demote, Done, GroupKey, Item, Message, Slots, Stage, Stop, Submit, Wake
from app.batching.urgency import Seen, ewma, stale, superseded
from app.config import BatcherSettings
from app.engine.device import is_oom
from app.errors import ShuttingDown, TranscriptionFailed
from app.metrics import Metrics
from app.windows import SAMPLE_RATE, WINDOW_S, DecodeOptions, Encoded, Shed, Urgency, Window, WindowResult

log = logging.getLogger("app.batching.batcher")
STOPPING = "service stopping; the job stays queued"


@dataclass(eq=False)
class Call:
    """An engine call the owner started, on one worker."""

    id: int
    stage: Stage
    options: DecodeOptions
    items: list[Item]
    bulk: bool
    small: bool
    started: float
    cost_s: float | None
    since: float  # when this worker's run of calls began (a split's halves, a chained decode)
    rest: deque[list[Item]] = field(default_factory=deque)  # a failed call's halves to run


class Owner:
    def __init__(self, settings: BatcherSettings, workers: int, metrics: Metrics, *,
                 staged: bool, size_class: Callable[[Window], float],
                 padded: Callable[[Window], int], base_memory_mb: float = 0.0) -> None:
        self.settings, self.workers, self.metrics = settings, workers, metrics
        self.staged, self.size_class, self.padded = staged, size_class, padded
        self.base_memory_mb = base_memory_mb
        self.queued: dict[DecodeOptions, list[Item]] = {}
        self.pool: dict[GroupKey, list[Item]] = {}
        self.encoding: Counter[GroupKey] = Counter()
        self.redo: list[Item] = []
        self.calls: dict[int, Call] = {}
        self.retired = 0
        self.cap, self.streak = settings.max_batch_size, 0
        self.rates: dict[Stage, float] = {}
        self.seen = Seen()
        self.stopping: float | None = None  # the stop's deadline
        self._ids = itertools.count()
        self._window_mb = window_mb(settings, padded)
        metrics.batch_cap.set(self.cap)

    # ---- what others read --------------------------------------------------------------------
    def waiting(self) -> Iterator[Item]:
        """Windows not in an engine call: queued, encoded in the pool, waiting for a redo."""
        for g in (*self.queued.values(), *self.pool.values(), self.redo):
            yield from g

    def pending(self) -> int:
        return sum(1 for i in self.waiting() if not i.future.done())

    def in_flight(self) -> int:
        return sum(len(c.items) for c in self.calls.values())

    def oldest_call_s(self, now: float) -> float:
        return now - min(c.started for c in self.calls.values()) if self.calls else 0.0

    def finished(self, now: float) -> bool:
        """Stopping, and nothing left to finish (or the grace is over)."""
        return self.stopping is not None and (now >= self.stopping or not (
            self.calls or any(not i.future.done() for g in self.pool.values() for i in g)))

    # ---- messages ----------------------------------------------------------------------------
    def apply(self, msg: Message, now: float) -> Call | None:
        """Apply one message; a call to start at once on a worker it freed, if any."""
        if isinstance(msg, Submit):
            self._submit(msg.items)
        elif isinstance(msg, Done):
            return self._done(msg, now)
        elif isinstance(msg, Demote):
            for i in self.waiting():
                if i.job_id == msg.job_id and i.urgency is Urgency.LIVE_FINAL:
                    i.urgency, i.refresh = Urgency.LIVE_INTERIM, (0, i.enqueued)
        elif isinstance(msg, Slots):
            self.retired = max(0, min(self.workers, self.retired - msg.delta))
        elif isinstance(msg, Stop):
            self.stopping = msg.deadline
            for i in [*(i for g in self.queued.values() for i in g), *self.redo]:
                i.fail(ShuttingDown(STOPPING))
            self.queued.clear()
            self.redo.clear()
        elif not isinstance(msg, Wake):  # Wake: a taken window was cancelled; look again
            raise TypeError(f"not a batcher message: {msg!r}")
        return None

    def _submit(self, items: Sequence[Item]) -> None:
        if self.stopping is not None:
            for i in items:
                i.fail(ShuttingDown("batcher is stopping"))
            return
        for i in items:
            if i.urgency is Urgency.LIVE_INTERIM:
                for old in superseded(self.waiting(), i.job_id):
                    self._shed(old, "superseded by a newer interim")
            if i.urgency is not Urgency.REQUEST or i.job_windows <= self.cap:
                self.seen = self.seen.saw(i.enqueued, live=i.urgency is not Urgency.REQUEST)
            self.queued.setdefault(i.options, []).append(i)

    def _shed(self, item: Item, why: str) -> None:
        if not item.future.done():
            item.future.set_exception(Shed(f"interim decode shed: {why}"))
            self.metrics.interim_shed.inc()

    # ---- choosing the next call --------------------------------------------------------------
    def next(self, now: float) -> Call | Wait:
        """The next call to start on a free worker (the policy's choice, applied), else when
        to look again. Nothing is looked at while every worker is busy: a call's end wakes it."""
        if self.workers - self.retired - len(self.calls) < 1:
            return Wait(None)
        for i in stale(self.waiting(), now, self.settings.interim_max_wait_ms / 1000):
            self._shed(i, f"waited over {self.settings.interim_max_wait_ms / 1000:.1f} s")
        self._prune()
        choice = pick(self.snapshot(), now)
        return choice if isinstance(choice, Wait) else self._start(choice, now, now)

    def snapshot(self) -> Snapshot:
        """The policy's view (after :meth:`_prune`: every window in it is still waited for)."""
        small = max(1, self.cap // 4)
        flying = [i for c in self.calls.values() for i in (*c.items, *(j for r in c.rest for j in r))]
        held = [i for i in (*flying, *(i for g in self.pool.values() for i in g), *self.redo)
                if not i.future.done()]
        live = sum(i.urgency is not Urgency.REQUEST for i in (*flying, *self.waiting())
                   if not i.future.done())
        return Snapshot(
            settings=self.settings, cap=self.cap, workers=self.workers - self.retired,
            running=[Running(c.stage, len(c.items), c.bulk, c.small, c.cost_s)
                     for c in self.calls.values()],
            queued=self.queued, pool=self.pool, encoding=self.encoding, redo=self.redo,
            ledger=ledger(held, small, self._window_mb), rates=self.rates, seen=self.seen,
            live=live, staged=self.staged,
            reserved=self.settings.reserved_slots if self.staged else 0,
            size_class=self.size_class, padded_s=self.padded_s, window_mb=self._window_mb,
            base_memory_mb=self.base_memory_mb, stopping=self.stopping is not None)

    def padded_s(self, item: Item) -> float:
        return (item.padded or self.padded(item.window)) / SAMPLE_RATE

    def _prune(self) -> None:
        """Windows whose callers stopped waiting (cancelled, shed, failed) cost nothing."""
        self.queued = {k: g for k, g in ((k, alive(g)) for k, g in self.queued.items()) if g}
        self.pool = {k: g for k, g in ((k, alive(g)) for k, g in self.pool.items()) if g}
        self.redo = alive(self.redo)

    def _start(self, take: Take, now: float, since: float) -> Call:
        taken = set(take.items)
        if take.stage in ("run", "encode"):
            group = self.queued[take.options]
            group[:] = [i for i in group if i not in taken]
            if not group:
                del self.queued[take.options]
            for i in take.items:  # once per window: a split's halves do not count again
                self.metrics.queue_wait.observe(now - i.enqueued)
        elif take.stage == "decode":
            key = (take.options, take.items[0].padded)
            group = self.pool[key]
            group[:] = [i for i in group if i not in taken]
            if not group:
                del self.pool[key]
        else:
            self.redo = [i for i in self.redo if i not in taken]
        if take.stage == "encode":
            self.encoding.update((i.options, i.padded) for i in take.items)
        items = list(take.items)
        call = Call(next(self._ids), take.stage, take.options, items, take.bulk, take.small,
                    now, self._cost(take.stage, items), since)
        self.calls[call.id] = call
        return call

    def _cost(self, stage: Stage, items: Sequence[Item]) -> float | None:
        rate = self.rates.get(stage)
        return None if rate is None else rate * sum(map(self.padded_s, items))

    # ---- a call's end ------------------------------------------------------------------------
    def _done(self, msg: Done, now: float) -> Call | None:
        call = self.calls.pop(msg.call)
        m, items, cap = self.metrics, call.items, self.cap
        m.processing.inc(msg.elapsed)  # engine time spent, even if wasted
        if call.stage == "encode":
            self.encoding.subtract((i.options, i.padded) for i in items)
            self.encoding = +self.encoding  # drop the zeros
        if msg.error is None:
            m.batch_duration.observe(msg.elapsed)
            padded = sum(map(self.padded_s, items))
            if padded > 0:
                self.rates[call.stage] = ewma(self.rates.get(call.stage), msg.elapsed / padded)
            self._results(call, msg.results or [], now)
            self.cap, self.streak = after_success(self.settings, self.cap, self.streak)
        else:
            self._failed(call, msg.error)
        if self.cap != cap:
            m.batch_cap.set(self.cap)
            if self.cap > cap:
                log.info("batch cap regrown to %d", self.cap)
        while call.rest:  # the next half of a failed call, on this worker
            half = [i for i in call.rest.popleft() if not i.future.done()]
            if half:
                nxt = Call(next(self._ids), call.stage, call.options, half, call.bulk,
                           call.small, now, self._cost(call.stage, half), call.since, call.rest)
                if call.stage == "encode":
                    self.encoding.update((i.options, i.padded) for i in half)
                self.calls[nxt.id] = nxt
                return nxt
        if call.bulk:
            self.seen = self.seen.bulk_done(call.since, now, self.settings.bulk_share_beside_live)
        if call.stage == "encode" and self.stopping is None:
            self._prune()
            take = chained(self.snapshot(), now, {(i.options, i.padded) for i in items})
            if take is not None:
                return self._start(take, now, call.since)
        return None

    def _results(self, call: Call, results: Sequence[WindowResult | Encoded], now: float) -> None:
        items = call.items
        if call.stage == "encode":
            for i, e in zip(items, results, strict=True):
                assert isinstance(e, Encoded)
                if call.options.detect_only:  # the language was all it asked for
                    answer(i, WindowResult.detection(e.language, e.language_probability))
                else:
                    i.encoded, i.pooled = e, now
                    self.pool.setdefault((i.options, i.padded), []).append(i)
            return
        if call.stage != "redo":  # a redo's window was counted in its decoder batch
            self.metrics.batch_done(len(items), sum(i.window.duration for i in items), WINDOW_S)
        for i, r in zip(items, results, strict=True):
            assert isinstance(r, WindowResult)
            if r.redo and i.urgency is not Urgency.LIVE_INTERIM and self.stopping is None:
                self.redo.append(i)  # its fallback: a call of its own (policy.pick)
                continue
            r.redo = False  # an interim keeps its first pass: the final supersedes it
            i.encoded = None
            answer(i, r)

    def _failed(self, call: Call, exc: Exception) -> None:
        """A failed call: on OOM the cap halves too; split until the failure is pinned."""
        oom = is_oom(exc)
        self.metrics.batches.labels("oom" if oom else "error").inc()
        if oom:
            self.metrics.oom_events.inc()
            self.cap = after_oom(self.settings, self.cap, len(call.items),
                                          beams(call.options))
            self.streak = 0
            log.warning("engine OOM on %d windows (beam %d); cap now %d", len(call.items),
                        beams(call.options), self.cap)
        items = [i for i in call.items if not i.future.done()]
        if len(items) > 1:
            half = len(items) // 2
            call.rest.extendleft([items[half:], items[:half]])  # the first half next
        elif items:
            log.error("window of job %s failed: %s", items[0].job_id, exc)
            # The exception's text stays in the log: it may name paths, devices or data.
            items[0].fail(TranscriptionFailed(
                f"inference failed for the window at {items[0].window.start:.1f}s",
                cause="out_of_memory" if oom else "engine_error"))

    def abort(self, exc: BaseException) -> None:
        """The end: every window still waiting fails with ``exc`` (its job stays queued). One
        inside an engine call that outlived the grace is left to its job: the runner cancels
        that job's task, and such a run counts as an attempt (a stalled engine must not be
        retried by every restart forever: app/jobs/runner.py)."""
        for c in self.calls.values():
            for i in (j for r in c.rest for j in r):
                i.fail(exc)
            c.rest.clear()
        for i in self.waiting():
            i.fail(exc)
        self.queued.clear()
        self.pool.clear()
        self.redo.clear()


def alive(items: Sequence[Item]) -> list[Item]:
    return [i for i in items if not i.future.done()]
