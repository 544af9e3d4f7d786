"""The batcher's work items, and its second stage: encoded windows waiting for a decoder batch.

On CPU the encoder costs the same per window at any batch size while the decoder's cost per
window falls steeply with its batch (see app.engine.Encoded). So the batcher can run the two
stages as separate engine calls: queued windows are *encoded* as workers free up, and wait here,
grouped by padded length, until a *decode* takes a whole group, windows from several encoder calls
and many requests together. A queue under load is too shallow to sort by length; this pool is
what an offline run over sorted windows gets for free.

A group is decoded when it is full; when its oldest has waited ``max_decode_wait_ms``; when it is
alone (nothing queued or being encoded could join it and no other short request is in the
service: a lone client gains nothing by waiting); or, failing all that, when a worker would
otherwise idle (the largest group). Groups holding a short request's window go first, and with
several API keys a key's lone waiting window beside another key's flood (>= 4 waiting) makes its
group ready at once: it does not wait for the flood's windows to fill the group. A group holding
a live final (app/windows.Urgency) is ready at once and goes first, its finals first in it.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from app.windows import DecodeOptions, Encoded, Refresh, Urgency, Window, WindowResult

# run: both stages in one engine call; redo: Whisper's 30 s fallback for one decoded window
Stage = Literal["run", "encode", "decode", "redo"]
GroupKey = tuple[DecodeOptions, int]  # options, padded length
FLOOD = 4  # windows waiting from one API key that make another key's lone window go first


@dataclass(frozen=True)
class Stages:
    """The engine's encoder and decoder as separate calls (app.engine.placement.EnginePool's)."""

    encode: Callable[[Sequence[Window], DecodeOptions], Awaitable[list[Encoded]]]
    decode: Callable[[Sequence[Window], Sequence[Encoded], DecodeOptions],
                     Awaitable[list[WindowResult]]]
    padded: Callable[[Window], int]  # the encoder length: decode groups by it
    # Set: ``decode`` leaves Whisper's fallbacks out and marks the windows that need them
    # (WindowResult.redo), and the batcher runs them here, one window a call (batcher.py).
    redo: Callable[[Sequence[Window], Sequence[Encoded], DecodeOptions],
                   Awaitable[list[WindowResult]]] | None = None


@dataclass(eq=False)
class Item:
    job_id: str
    rank: int  # position of this window among its job's windows: fairness key
    window: Window
    options: DecodeOptions
    future: asyncio.Future[WindowResult]
    enqueued: float = field(default_factory=time.monotonic)
    job_windows: int = 1  # windows its job submitted with it: few means a short request
    padded: int = 0  # two stages: the encoder length, the decode group it will join
    encoded: Encoded | None = None
    pooled: float = 0.0  # when it was encoded
    owner: str | None = None  # the job's API key: batches take windows round robin across keys
    urgency: Urgency = Urgency.REQUEST  # live finals first, interim decodes droppable
    refresh: Refresh = (0, 0.0)  # a live interim's place among interims (app/windows.Refresh)

    def fail(self, exc: BaseException) -> None:
        if not self.future.done():
            self.future.set_exception(exc)


def urgent_first(ranked: Sequence[Item]) -> list[Item]:
    """Live finals first (oldest first), then the rest in the order given, except that the
    interim decodes among them take their places in :data:`~app.windows.Refresh` order: a turn
    with no text yet first, then the turn whose text has waited longest."""
    finals = sorted((i for i in ranked if i.urgency is Urgency.LIVE_FINAL), key=lambda i: i.enqueued)
    rest = [i for i in ranked if i.urgency is not Urgency.LIVE_FINAL]
    interims = iter(sorted((i for i in rest if i.urgency is Urgency.LIVE_INTERIM),
                           key=lambda i: i.refresh))
    return finals + [next(interims) if i.urgency is Urgency.LIVE_INTERIM else i for i in rest]


@dataclass(eq=False)
class Batch:
    stage: Stage
    options: DecodeOptions
    items: list[Item]
    bulk: bool = False  # a long job's windows or a redo: kept off the reserved workers


def encoded_of(items: Sequence[Item]) -> list[Encoded]:
    out = [i.encoded for i in items if i.encoded is not None]
    if len(out) != len(items):
        raise RuntimeError("a window reached its decoder batch without an encoder output")
    return out


class DecodePool:
    """Encoded windows by (options, padded length). Owned by the batcher's task: no locks."""

    def __init__(self) -> None:
        self.groups: dict[GroupKey, list[Item]] = {}
        self._encoding: dict[GroupKey, int] = {}  # windows inside encoder calls right now

    def pending(self) -> int:
        return sum(1 for g in self.groups.values() for i in g if not i.future.done())

    def encoding(self, items: Iterable[Item], delta: int) -> None:
        for i in items:
            k = (i.options, i.padded)
            n = self._encoding.get(k, 0) + delta
            if n:
                self._encoding[k] = n
            else:
                self._encoding.pop(k, None)

    def add(self, items: Sequence[Item], encoded: Sequence[Encoded]) -> None:
        now = time.monotonic()
        for i, e in zip(items, encoded, strict=True):
            i.encoded, i.pooled = e, now
            self.groups.setdefault((i.options, i.padded), []).append(i)

    def drain(self) -> list[Item]:
        items = [i for g in self.groups.values() for i in g]
        self.groups.clear()
        return items

    def select(self, now: float, *, wait_s: float, limit: int, small: int, idle: bool,
               queued: Iterable[Item], shorts_in_flight: int,
               among: Iterable[GroupKey] | None = None) -> tuple[GroupKey | None, float | None]:
        """The group to decode now (see the module doc), else when one falls due.

        ``queued``: windows waiting to be encoded; ``shorts_in_flight``: short requests'
        windows taken from the queue and not finished (these groups' own included).
        """
        joining = {k for k, n in self._encoding.items() if n}
        shorts = shorts_in_flight
        waiting: Counter[str | None] = Counter()  # windows waiting, by API key
        for i in queued:
            if not i.future.done():
                joining.add((i.options, i.padded))
                shorts += i.job_windows <= small
                waiting[i.owner] += 1
        for g in self.groups.values():
            waiting.update(i.owner for i in g)
        # A key with one window waiting beside a key flooding the service does not wait for its
        # group to fill with the flood's windows: its group goes to the next free worker.
        flood = len(waiting) > 1 and max(waiting.values()) >= FLOOD
        ready: tuple[tuple[bool, bool, float], GroupKey] | None = None
        largest: tuple[int, float, GroupKey] | None = None
        deadline: float | None = None
        keys = list(self.groups) if among is None else [k for k in among if k in self.groups]
        for key in keys:
            live = [i for i in self.groups[key] if not i.future.done()]  # cancelled: dropped
            if not live:
                del self.groups[key]
                continue
            self.groups[key] = live
            at = live[0].pooled + wait_s
            # Other short requests in the service mean more are coming (a load, not a lone
            # client): then a group waits to fill.
            alone = key not in joining and shorts <= len(live)
            minority = flood and any(waiting[i.owner] <= 1 for i in live)
            final = any(i.urgency is Urgency.LIVE_FINAL for i in live)  # never waits to fill
            if len(live) >= limit or at <= now or alone or minority or final:
                order = (not final, all(i.job_windows > small for i in live), live[0].enqueued)
                if ready is None or order < ready[0]:
                    ready = (order, key)
            elif deadline is None or at < deadline:
                deadline = at
            if largest is None or (len(live), -live[0].enqueued) > largest[:2]:
                largest = (len(live), -live[0].enqueued, key)
        if ready is not None:
            return ready[1], None
        if idle and largest is not None:
            return largest[2], None
        return None, deadline

    def take(self, key: GroupKey, limit: int) -> list[Item]:
        """Up to ``limit`` windows of a group, round robin across API keys (oldest first within
        a key): a key flooding the pool gets one place per round, like every other key."""
        group = self.groups[key]
        if len({i.owner for i in group}) > 1:
            seen: dict[str | None, int] = {}
            ranked = []
            for n, i in enumerate(group):
                seen[i.owner] = seen.get(i.owner, -1) + 1
                ranked.append((seen[i.owner], n))
            order = [group[n] for _, n in sorted(ranked)]
        else:
            order = group
        order = urgent_first(order)
        items = order[:limit]
        taken = set(map(id, items))
        group[:] = [i for i in group if id(i) not in taken]
        if not group:
            del self.groups[key]
        return items
