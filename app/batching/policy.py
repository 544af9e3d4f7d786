"""The batcher's policy: one pure function from what the owner holds to the next engine call.

``pick(snapshot, now)`` returns a :class:`Take` (the stage, options and windows of the call to
start on a free worker) or a :class:`Wait` (when to look again, if nothing changes before). It
reads the snapshot and writes nothing, so it is unit-tested without an event loop or an engine
(tests/test_scheduler.py), and a discrete-event simulation drives the real owner with it
(tests/simulation.py). The owner (app/batching/owner.py) applies what it returns.

In order, on a free worker:

1. **Live finals**, oldest first wherever they wait: their fallback call, their decode (encoded,
   in the pool), their encode (app/batching/urgency.py: a final's 30 s fallback waited 10-25 s
   behind newer finals under a queued-finals-first rule).
2. **A decode** of an encoded group that is ready (app/batching/pool.py), two stages.
3. **A window's fallback** (``redo``): a short request's on any worker, a long upload's as
   bulk work.
4. **Queued windows**: the first ready group (full, due after ``max_wait_ms``, holding a final,
   holding windows to encode, which need not wait, or a lone client's short request, whom no
   company is coming to join), in fair order
   (app/batching/fairness.py), within each job's memory; beside running work, windows of a job
   with nothing in flight (a short request that just arrived) go in a batch of their own, and
   light windows (a short request's, a live one) never share a call with a long upload's.

**The engine cost of what is in flight** bounds what a latency-critical window (a short
request's, a live final) may wait behind bulk work (a long upload's windows, fallbacks): one
engine call of ``batch_cost_s``. A bulk call that would leave no worker free of bulk calls over
that budget, while short or live work came in the last 30 s, is cut to it (a GPU's or a lone
worker's case; on CPU a worker is reserved instead, which costs nothing there: bulk never takes
it, see urgency.py), and a fallback does not take such a worker while a short request's window
waits. So a critical window finds, at any moment, a worker idle or in a call that ends within
the budget, and goes next on it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from app.batching import pool
from app.batching.fairness import Ledger, fair_order, within_memory
from app.batching.stages import GroupKey, Item, Stage, urgent_first
from app.batching.urgency import Seen, bulk_ok, has_final, heavy, held_until, oldest_final, within_cost
from app.config import BatcherSettings
from app.windows import DecodeOptions, Urgency, Window


@dataclass(frozen=True)
class Running:
    """An engine call in flight, as the policy sees it."""

    stage: Stage
    windows: int
    bulk: bool
    small: bool  # at most a quarter of the cap: the one small batch beside a long upload
    cost_s: float | None  # its estimated engine seconds (None: not measured yet)


@dataclass(frozen=True)
class Snapshot:
    """What the owner holds, read-only; every window in it is still waited for."""

    settings: BatcherSettings
    cap: int  # the batch cap now (halved after an OOM: see the batch cap, below)
    workers: int  # engine workers in rotation
    running: Sequence[Running]
    queued: Mapping[DecodeOptions, Sequence[Item]]  # to encode, or to run in one call
    pool: Mapping[GroupKey, Sequence[Item]]  # encoded, for a decoder batch (two stages)
    encoding: Mapping[GroupKey, int]  # windows inside encoder calls, by the group they join
    redo: Sequence[Item]  # decoded windows waiting for their fallback call
    ledger: Ledger  # per job, what is in flight
    rates: Mapping[Stage, float]  # measured engine seconds per padded second
    seen: Seen
    live: int  # live windows in the batcher: the cost budget is on for short work too
    staged: bool  # two stages (CPU)
    reserved: int  # workers kept free of bulk work (two stages)
    size_class: Callable[[Window], float]
    padded_s: Callable[[Item], float]
    window_mb: Callable[[Item], float]
    base_memory_mb: float = 0.0
    stopping: bool = False

    @property
    def free(self) -> int:
        return self.workers - len(self.running)

    @property
    def small(self) -> int:  # beside a long upload; also the most windows of a short job
        return max(1, self.cap // 4)

    def limit(self, stage: Stage, options: DecodeOptions | None = None) -> int:
        return limit(self.settings, self.cap, stage, sum(r.windows for r in self.running),
                     beams(options) if options else 1, self.base_memory_mb)

    def cost(self, stage: Stage, items: Sequence[Item]) -> float | None:
        rate = self.rates.get(stage)
        return None if rate is None else rate * sum(map(self.padded_s, items))


@dataclass(frozen=True)
class Take:
    stage: Stage
    options: DecodeOptions
    items: tuple[Item, ...]
    bulk: bool = False  # a long job's windows or a redo: kept off the reserved workers
    small: bool = False


@dataclass(frozen=True)
class Wait:
    until: float | None  # None: only a message (a window, a call's end) changes anything


def pick(s: Snapshot, now: float) -> Take | Wait:
    """The call to start on a free worker now, else when to look again (see the module doc)."""
    if s.free < 1:
        return Wait(None)
    if s.stopping:  # windows already encoded are decoded (the encoder was most of their cost)
        group = next(iter(s.pool), None)
        return Wait(None) if group is None else Take("decode", group[0], tuple(
            pool.take_order(s.pool[group], s.limit("decode", group[0]))))
    bulk = bulk_ok(s.seen, now, reserved=s.reserved, workers=s.workers,
                   bulk_running=sum(r.bulk for r in s.running))
    ready, deadline = _ready(s, now, bulk)
    where = oldest_final(s.queued.values(), s.pool.values(), s.redo)
    if where == "redo":
        item = next(i for i in s.redo if i.urgency is Urgency.LIVE_FINAL)
        return Take("redo", item.options, (item,))
    first = where == "queue"  # a final is queued: it goes before the pool
    if s.staged and not first:
        decode, due = _decode(s, now, idle=not ready)
        if decode is not None:
            return decode
        deadline = _earliest(deadline, due)
    redo = None if first else _redo(s, now, bulk)
    if redo is not None:
        return redo
    for key in ready:
        items = _take(s, key, now, bulk)
        if items:
            staged = _to_encode(s, items)
            return Take("encode" if staged else "run", key, tuple(items),
                        bulk=any(heavy(i, s.cap) for i in items), small=len(items) <= s.small)
    if first and s.staged:  # the final's group could not go: decode
        decode, _ = _decode(s, now, idle=True)
        return decode or Wait(deadline)
    return Wait(_earliest(deadline, held_until(s.seen, now)))  # bulk waits out its live share


def chained(s: Snapshot, now: float, among: set[GroupKey]) -> Take | None:
    """After an encode, on the same worker: a decode of its windows' groups, if one is ready
    (a short request then waits for one free worker, not two)."""
    return None if s.stopping else _decode(s, now, idle=False, among=among)[0]


def _earliest(a: float | None, b: float | None) -> float | None:
    return min((t for t in (a, b) if t is not None), default=None)


def _ready(s: Snapshot, now: float, bulk: bool) -> tuple[list[DecodeOptions], float | None]:
    """Queued groups that may go now (full, due, holding a final or windows to encode), the
    finals' and then the oldest first; else when the first falls due. Only windows that may go
    count (``bulk``: a long job's may): a group of an upload's windows held back (from the
    reserved worker, or for the live sessions' share) is not work for an idle worker. Counted,
    it kept the decoder pool's groups from the idle worker (pool.select's ``idle``) until they
    filled: a short request's window waited ``max_decode_wait_ms`` (app/batching/pool.py), and
    simulated at 16 streams beside an upload, interim answers p50 2.7 s against 1.4 s alone with
    the engine 75 % busy (tests/test_simulation.py)."""
    wait_s = s.settings.max_wait_ms / 1000
    ready: list[tuple[bool, float, DecodeOptions]] = []
    deadline: float | None = None
    shorts = s.ledger.short + sum(i.job_windows <= s.small for g in s.queued.values() for i in g)
    for key, whole in s.queued.items():
        group = whole if bulk else [i for i in whole if not heavy(i, s.cap)]
        if not group:
            continue
        oldest = group[0].enqueued
        final = has_final(group)
        if len(group) >= s.limit("run", key) or oldest + wait_s <= now or final \
                or _to_encode(s, group) or _lone(s, group, shorts):
            ready.append((not final, oldest, key))
        elif deadline is None or oldest + wait_s < deadline:
            deadline = oldest + wait_s
    return [key for *_, key in sorted(ready, key=lambda r: r[:2])], deadline


def _lone(s: Snapshot, group: Sequence[Item], shorts: int) -> bool:
    """Short requests' windows with no other short request in the service, queued or in
    flight: a lone client, whom no company is coming to join (the decoder pool's rule,
    app/batching/pool.py). Waiting ``max_wait_ms`` for it only added that much to each of its
    requests (one stage: a GPU, or the stand-in engine of loadtest/feed.py); under a load
    the others in flight say more are coming, and the group waits to fill."""
    return shorts <= len(group) and all(
        i.urgency is Urgency.REQUEST and i.job_windows <= s.small for i in group)


def _to_encode(s: Snapshot, items: Sequence[Item]) -> bool:
    """Two stages: these windows are encoded and pooled, not run in one call (any of them
    from an upload of at most a batch of windows). They need not wait for a fuller batch
    either: the encoder costs the same per window in a batch of one as of eight, and batching
    pays in the decoder groups they join once encoded. An upload of a few windows (say 50 s)
    goes through the pool like a short request: its one-call sub-batches of one or two windows
    per length decode at 1.5-2.3x the cost per window of a pooled batch of six (30 s windows,
    one thread: 461 ms alone, 310 ms in two, 200 ms in six). Under 32 clients decoder batches
    stayed the same without the wait (mean 8.2 both ways)."""
    return s.staged and any(i.job_windows <= s.cap for i in items)


def _spare(s: Snapshot) -> bool:
    """Whether, besides the worker a call is about to take, one is left that runs no bulk
    call over the cost budget: idle, or in a call that ends within the budget."""
    budget = s.settings.batch_cost_s
    big = sum(1 for r in s.running if r.bulk and (r.cost_s is None or r.cost_s > budget))
    return s.workers - 1 - big >= 1


def _bound(s: Snapshot, now: float) -> bool:
    """Whether a bulk call must keep within the cost budget now: short or live work came in
    the last 30 s and no other worker is free of bulk calls over the budget."""
    return bool(s.settings.batch_cost_s) and s.seen.light_recent(now) and not _spare(s)


def _redo(s: Snapshot, now: float, bulk: bool) -> Take | None:
    """A window's fallback. A short request's is its own work: it goes first, on any worker
    (seen in a trace beside an upload: a looping short clip's fallback waited 2.1 s for the
    upload's worker while the reserved one idled). A long upload's is bulk work: it goes where
    bulk may (see :func:`_redo_ok`)."""
    light = [i for i in s.redo if not heavy(i, s.cap)]
    if light:
        return Take("redo", light[0].options, (light[0],))
    if s.redo and bulk and _redo_ok(s, now):
        return Take("redo", s.redo[0].options, (s.redo[0],), bulk=True)
    return None


def _redo_ok(s: Snapshot, now: float) -> bool:
    """A long upload's fallback takes no worker that a short request's window waits for, when
    that worker is the last free of long bulk calls: queued behind it, the window would wait
    for two calls (simulated on one worker: 4.1 s outside its own calls, budget 3 s)."""
    if not _bound(s, now):
        return True
    return not any(not heavy(i, s.cap) and i.urgency is not Urgency.LIVE_INTERIM
                   for g in s.queued.values() for i in g)


def _take(s: Snapshot, key: DecodeOptions, now: float, bulk: bool) -> list[Item]:
    """Up to a batch of one queued group's windows: in fair order, within each job's memory,
    beside a long upload a batch of its own for new requests, and within the cost budgets.
    ``bulk``: a long job's windows may go (not on a reserved worker, nor beyond the live
    sessions' share)."""
    ranked = urgent_first(fair_order(s.queued[key], s.size_class))
    if not bulk:
        ranked = [i for i in ranked if not heavy(i, s.cap)]
    limit = s.limit("run", key)
    if s.running:
        # Keep new requests responsive beside a long upload. Windows of jobs with nothing
        # running yet (a short request that just arrived) go in a batch of their own, not
        # padded to the upload's 30 s windows nor waiting on its full batch. With no such
        # job, the last free worker (the others all running full batches) takes only a
        # small batch, so the next short request waits for a small batch, not a full one
        # on every worker; one small batch at a time keeps the rest full for throughput.
        # Live finals always go (first).
        finals = [i for i in ranked if i.urgency is Urgency.LIVE_FINAL]
        fresh = [i for i in ranked if s.ledger.fresh(i.job_id) and i.urgency is not Urgency.LIVE_FINAL]
        if finals or fresh:
            ranked = finals + fresh
        elif s.free == 1 and not any(r.small for r in s.running):
            limit = min(limit, s.small)
    if any(heavy(i, s.cap) for i in ranked) and not all(heavy(i, s.cap) for i in ranked):
        # Light windows (a short request's, a live one) go in a call of their own: riding in
        # a long upload's batch made the short request's call cost the upload's (on one
        # worker beside a 20-minute upload, simulated: p95 5.3x idle against 1.6x alone).
        ranked = [i for i in ranked if not heavy(i, s.cap)]
    chosen = within_memory(s.ledger, ranked, limit, s.settings.job_memory_mb, s.workers,
                           s.window_mb)
    heavies = any(heavy(i, s.cap) for i in chosen)
    if s.live and _to_encode(s, chosen):
        # One window per encoder call while live windows are in: the encoder costs the same
        # per window in a batch of one as of eight, so a batch only makes its first windows
        # wait for the others. Measured at 16 streams (91694fb): finals waited for encoder
        # calls of 6-8 windows (1.9-2.7 s) before their own decode.
        chosen = chosen[:1]
    elif (s.live and not heavies) or (heavies and _bound(s, now)):
        chosen = within_cost(s.rates.get("run"), s.settings.batch_cost_s, chosen, s.padded_s)
    # Each job's windows in time order inside the batch: cosmetic, but keeps logs readable.
    return sorted(chosen, key=lambda i: (i.job_id, i.rank))


def _decode(s: Snapshot, now: float, idle: bool, among: set[GroupKey] | None = None
            ) -> tuple[Take | None, float | None]:
    """An encoded group to decode, if one is ready (app/batching/pool.py). A group of only long
    uploads' windows, on the last free worker, decodes a small batch, as in :func:`_take`."""
    small = s.small
    key, deadline = pool.select(
        s.pool, s.encoding, now, wait_s=s.settings.max_decode_wait_ms / 1000,
        limit=s.limit("decode"), small=small, idle=idle,
        queued=(i for g in s.queued.values() for i in g), shorts_in_flight=s.ledger.short,
        interim_wait_s=s.settings.interim_max_wait_ms / 1000, among=among)
    if key is None:
        return None, deadline
    limit = s.limit("decode", key[0])
    group = s.pool[key]
    if s.live:  # the cost budget, while live windows are in the service
        limit = max(1, len(within_cost(s.rates.get("decode"), s.settings.batch_cost_s,
                                       group[:limit], s.padded_s)))
    if all(i.job_windows > small for i in group) and s.free == 1 \
            and not any(r.small for r in s.running):
        limit = min(limit, small)
    items = tuple(pool.take_order(group, limit))
    return Take("decode", key[0], items, small=len(items) <= small), None


# ---- the batch cap --------------------------------------------------------------------------------
# How many windows the next batch may take: the batch cap, windows x beam, the memory budget.
#
# The cap starts at ``max_batch_size``: on CPU as configured (8, measured there), on GPU what the
# start-up sizing measured on the device (app/engine/sizing.py resolves it into the settings the
# batcher gets). With ``max_batch_beams`` set (GPU), a batch also holds at most that many windows
# x beam size: beam search keeps ``beam`` decoder states per window, each with its own attention
# caches, so a beam-10 request's windows take ten times the memory of greedy ones.
#
# An out-of-memory error halves the cap (relative to the batch that failed, counted in windows x
# beam, never below what already fits) and ``regrow_after`` clean calls in a row double it
# again, up to where it started, so one oversized moment does not cost throughput for good. On
# CPU, with ``memory_budget_mb`` set, the windows in flight never exceed what the budget left after
# the resident model can hold (``window_memory_mb`` each).
#
# Pure functions of the cap's state, which the batcher's owner (app/batching/owner.py) holds and
# alone changes with what they return.

def scaled(settings: BatcherSettings, cap: int, full: int) -> int:
    """``full`` (a bound stated at the full cap) scaled down with the cap after an OOM."""
    return max(1, full * cap // settings.max_batch_size)


def limit(settings: BatcherSettings, cap: int, stage: Stage, in_flight: int, beam: int = 1,
          base_memory_mb: float = 0.0) -> int:
    """Windows the next batch may take, with ``in_flight`` windows already in engine calls
    and ``beam`` the batch's beam size (1 for greedy and for sampling). A decoder batch's
    cap is ``max_decode_batch_size``, scaled down with the cap."""
    s = settings
    n = cap
    if stage == "decode":
        n = scaled(s, cap, s.max_decode_batch_size)
    if s.max_batch_beams and beam > 1:
        n = max(1, min(n, scaled(s, cap, s.max_batch_beams) // beam))
    if not s.memory_budget_mb:
        return n
    room = int((s.memory_budget_mb - base_memory_mb) / s.window_memory_mb)
    return max(1, min(n, room - in_flight))


def after_success(settings: BatcherSettings, cap: int, streak: int) -> tuple[int, int]:
    """(cap, streak) after a clean call: after ``regrow_after`` in a row a halved cap doubles."""
    streak += 1
    if cap < settings.max_batch_size and streak >= settings.regrow_after:
        return min(settings.max_batch_size, cap * 2), 0
    return cap, streak


def after_oom(settings: BatcherSettings, cap: int, failed: int, beam: int = 1) -> int:
    """The cap after a batch of ``failed`` windows at beam size ``beam`` ran out of memory
    (with windows x beam counted, what failed was ``failed * beam`` of them)."""
    units = failed * beam if settings.max_batch_beams else failed
    return max(1, min(cap, units // 2))


def beams(options: DecodeOptions) -> int:
    """Decoder states per window: the beam, or 1 when sampling. A wider ``other_beam_size`` is
    not counted: on a GPU the engine decodes those windows in parts that fit (``_decode``)."""
    return options.beam_size if options.temperature == 0 else 1
