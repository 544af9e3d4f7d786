"""Cross-request micro-batcher: pools windows from every pending job into engine batches.

Shaped as text-embeddings-inference's queue (``core/src/queue.rs``, ``infer.rs``): one owner
task is the only writer of the queue state (app/batching/owner.py); everything else talks to it
by message (app/batching/stages.py). :meth:`Batcher.submit` creates one future per window and
posts the windows; each engine call runs in a task of its own and posts one ``Done`` with its
results or its error; the owner applies each message, then asks the policy, a pure function
(app/batching/policy.py), for the next call on a free worker, and starts it. It wakes on a
message or on the deadline the policy gave, never on a polling sleep. Callers' futures are
answered only if still pending, so a cancelled caller's windows cost nothing.

A batch leaves when a group of compatible windows reaches the cap, or its oldest window has
waited ``max_wait_ms``, and an engine worker is free. Because batches form only when a worker is
free, windows pile up while the engine is busy and the next batch is full: under load the
engine runs full batches; a lone client's short request (no other in the service) and, with two
stages, windows to encode do not wait. Two stages (CPU): a call may instead encode queued
windows or decode encoded ones gathered across calls (app/batching/stages.py, pool.py). Urgency
(live finals first, interim decodes shed), the workers kept free of bulk work, the cost budget
and the fallback decode run apart from its batch: app/batching/urgency.py and policy.py, with
the measurements.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence

from app.batching.owner import Call, Owner
from app.batching.policy import beams
from app.batching.policy import limit as batch_limit
from app.batching.stages import (
    Demote,
    Done,
    Item,
    Message,
    Slots,
    Stage,
    Stages,
    Stop,
    Submit,
    Wake,
    encoded_of,
)
from app.batching.urgency import Seen
from app.config import BatcherSettings
from app.errors import ShuttingDown
from app.metrics import Metrics
from app.windows import N_SAMPLES, DecodeOptions, Encoded, Refresh, Urgency, Window, WindowResult

log = logging.getLogger(__name__)
RunBatch = Callable[[Sequence[Window], DecodeOptions], Awaitable[list[WindowResult]]]
STOPPING = "service stopping; the job stays queued"


class Batcher:
    def __init__(
        self, run_batch: RunBatch, settings: BatcherSettings, workers: int, metrics: Metrics,
        size_class: Callable[[Window], float] | None = None, base_memory_mb: float = 0.0,
        stages: Stages | None = None, padded: Callable[[Window], int] | None = None,
    ) -> None:
        self.settings = settings
        self.workers = workers
        self._run_batch = run_batch
        self._stages = stages
        self._metrics = metrics
        # Windows of one size class batch best together: with the engine's dynamic time axis,
        # its padded-length class (one encoder shape); otherwise duration buckets.
        bucket = settings.duration_bucket_s
        self._owner = Owner(settings, workers, metrics, staged=stages is not None,
                            size_class=size_class or (lambda w: w.duration // bucket),
                            padded=padded or (stages.padded if stages else (lambda w: N_SAMPLES)),
                            base_memory_mb=base_memory_mb)
        self._inbox = Inbox()
        self._task: asyncio.Task[None] | None = None
        self._calls: dict[int, asyncio.Task[None]] = {}  # the owner task's engine-call tasks
        self._stopping = False

    # ---- caller side: messages to the owner --------------------------------------------------
    def submit(
        self, job_id: str, windows: Sequence[Window], options: DecodeOptions, *,
        first_rank: int = 0, job_windows: int | None = None, owner: str | None = None,
        urgency: Urgency = Urgency.REQUEST, refresh: Refresh = (0, 0.0),
    ) -> list[asyncio.Future[WindowResult]]:
        """Queue windows of a job; returns one future per window, in the same order.

        A long upload arrives in several calls as its audio is prepared: ``first_rank`` is the
        first window's index in the job, and ``job_windows`` the job's size (estimated from its
        duration until it is all cut), which tells a short request from a long one.
        ``urgency``: live finals go first; a live interim's future may raise ``Shed`` (see
        app/batching/urgency.py), and a newer interim of the job sheds the older ones waiting;
        ``refresh``: an interim's place among the interims waiting (app/windows.Refresh)."""
        if self._stopping:
            raise ShuttingDown("batcher is stopping")
        loop = asyncio.get_running_loop()
        size = max(job_windows or 0, first_rank + len(windows))
        now = time.monotonic()
        items: list[Item] = []
        for k, w in enumerate(windows):
            fut: asyncio.Future[WindowResult] = loop.create_future()
            fut.add_done_callback(self._gone)
            items.append(Item(job_id, first_rank + k, w, options, fut, now, job_windows=size,
                              padded=self._stages.padded(w) if self._stages else 0,
                              owner=owner, urgency=urgency, refresh=refresh))
        self._inbox.put_nowait(Submit(tuple(items)))
        return [i.future for i in items]

    def demote(self, job_id: str) -> None:
        """A live final that became an interim (its turn went on after the pause it was
        started at, app/live/session.py): its windows not yet in an engine call wait as
        interims from now on, behind every true final (and may be shed like one)."""
        self._inbox.put_nowait(Demote(job_id))

    def retire_slots(self, n: int) -> None:
        """An engine left the rotation (app/engine/placement.py): its ``n`` workers take no
        batches until :meth:`restore_slots`, so batches form only for threads that can run
        them instead of waiting behind the others."""
        self._inbox.put_nowait(Slots(-n))

    def restore_slots(self, n: int) -> None:
        self._inbox.put_nowait(Slots(n))

    def _gone(self, fut: asyncio.Future[WindowResult]) -> None:
        if fut.cancelled():  # a window taken from the queue may have held its job's share
            self._inbox.put_nowait(Wake())

    # ---- what others read --------------------------------------------------------------------
    def oldest_call_s(self) -> float:
        """How long the oldest engine call still running has run (0.0: none). A call the
        engine never returns from keeps growing this: /healthz reports it as a stall."""
        return self._owner.oldest_call_s(time.monotonic())

    def pending(self) -> int:
        """Windows waiting: for an engine call, or (two stages) between encode and decode."""
        return self._owner.pending() + self._inbox.windows()

    @property
    def cap(self) -> int:  # the batch cap now (halved after an OOM, see app/batching/capacity.py)
        return self._owner.cap

    @property
    def small_batch(self) -> int:  # beside a long upload; also the most windows of a short job
        return max(1, self.cap // 4)

    def limit(self, stage: Stage = "run", options: DecodeOptions | None = None) -> int:
        """Windows the next batch may take now (app/batching/capacity.py)."""
        return batch_limit(self.settings, self.cap, stage, self._owner.in_flight(),
                              beams(options) if options else 1,
                              self._owner.base_memory_mb)

    @property
    def seen(self) -> Seen:
        """When light and live work last came in, and when bulk may next start beside live."""
        return self._owner.seen

    def busy(self) -> tuple[int, int]:
        """(engine calls running, of them bulk): for tests and traces."""
        calls = self._owner.calls.values()
        return len(calls), sum(c.bulk for c in calls)

    # ---- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.create_task(self._own(), name="batcher")

    async def stop(self, grace_s: float) -> None:
        """Stop forming batches, let calls in flight finish (up to ``grace_s``), fail the rest.
        Windows already encoded are decoded within the grace too (the encoder was most of their
        cost); windows still queued fail at once with ``ShuttingDown`` (their jobs stay queued)."""
        self._stopping = True
        if self._task is None:  # never started: what was submitted fails here
            while not self._inbox.empty():
                msg = self._inbox.get_nowait()
                for i in msg.items if isinstance(msg, Submit) else ():
                    i.fail(ShuttingDown(STOPPING))
            return
        self._inbox.put_nowait(Stop(time.monotonic() + grace_s))
        await asyncio.gather(self._task, return_exceptions=True)

    # ---- the owner task ----------------------------------------------------------------------
    async def _own(self) -> None:
        """Apply every message waiting, start what the policy picks on the free workers, and
        sleep until the next message or the policy's deadline."""
        owner, inbox = self._owner, self._inbox
        until: float | None = None
        try:
            while True:
                msg: Message | None = None
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout_at(_loop_time(until)):
                        msg = await inbox.get()
                now = time.monotonic()
                while msg is not None:
                    if isinstance(msg, Done):
                        self._calls.pop(msg.call, None)
                    self._run(owner.apply(msg, now))
                    msg = None if inbox.empty() else inbox.get_nowait()
                if owner.finished(now):
                    return
                while isinstance(choice := owner.next(now), Call):
                    self._run(choice)
                until = choice.until
                if owner.stopping is not None:
                    until = owner.stopping if until is None else min(until, owner.stopping)
                self._metrics.pending_windows.set(owner.pending())
        finally:
            # Calls still running are not cancelled: the engine's thread cannot be stopped, and
            # their windows stay with their jobs (Owner.abort).
            owner.abort(ShuttingDown(STOPPING))
            self._metrics.pending_windows.set(0)

    def _run(self, call: Call | None) -> None:
        if call is not None:
            self._calls[call.id] = asyncio.create_task(self._engine(call), name=f"call-{call.id}")

    async def _engine(self, call: Call) -> None:
        """One engine call; its end goes back to the owner as a message."""
        windows = [i.window for i in call.items]
        start = time.monotonic()
        out: Sequence[WindowResult] | Sequence[Encoded] | None = None
        error: Exception | None = None
        try:
            if call.stage == "encode":
                assert self._stages is not None
                out = await self._stages.encode(windows, call.options)
            elif call.stage in ("decode", "redo"):
                assert self._stages is not None
                run = self._stages.redo if call.stage == "redo" else self._stages.decode
                assert run is not None
                out = await run(windows, encoded_of(call.items), call.options)
            else:
                out = await self._run_batch(windows, call.options)
            if len(out) != len(windows):
                raise RuntimeError(f"{len(out)} results for {len(windows)} windows")
        except Exception as exc:  # split, retried or failed by the owner
            out, error = None, exc
        self._inbox.put_nowait(Done(call.id, out, error, time.monotonic() - start))


class Inbox(asyncio.Queue[Message]):
    """The owner's messages, first in first out; it can count the windows still in transit."""

    def _init(self, maxsize: int) -> None:
        self._queue: deque[Message] = deque()

    def windows(self) -> int:
        return sum(len(m.items) for m in self._queue if isinstance(m, Submit))


def _loop_time(until: float | None) -> float | None:
    """A ``time.monotonic()`` deadline on the event loop's clock (None: none)."""
    if until is None:
        return None
    return asyncio.get_running_loop().time() + max(0.0, until - time.monotonic())
