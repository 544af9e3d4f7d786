"""The batcher's vocabulary: its work items, its two stages (CPU: an engine call may encode
queued windows, or decode encoded ones gathered across encoder calls; app/batching/pool.py says
when), and the messages its owner task hears.

On CPU the encoder costs the same per window at any batch size while the decoder's cost per
window falls steeply with its batch (see app.engine.Encoded). So the batcher can run the two
stages as separate engine calls: queued windows are *encoded* as workers free up, and wait in
the decoder pool, grouped by padded length, until a *decode* takes a whole group, windows from
several encoder calls and many requests together.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
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


def encoded_of(items: Sequence[Item]) -> list[Encoded]:
    out = [i.encoded for i in items if i.encoded is not None]
    if len(out) != len(items):
        raise RuntimeError("a window reached its decoder batch without an encoder output")
    return out


# ---- what the owner task hears (app/batching/owner.py applies each) ----------------------------
# The only way callers, engine calls and the engine pool change its state, as
# text-embeddings-inference's ``QueueCommand`` is the only way into its queue task. Callers post
# Submit (windows and their futures), Demote (a live final that became an interim) and Wake (a
# taken window's caller gave up); each engine call posts one Done with its results or its error;
# the engine pool posts Slots (an engine left or re-entered the rotation); ``stop`` posts Stop.

@dataclass(frozen=True)
class Submit:
    items: tuple[Item, ...]


@dataclass(frozen=True)
class Done:
    """One engine call ended: its results (one per window, encoder outputs for an encode) or
    the error it raised, and how long it took."""

    call: int
    results: Sequence[WindowResult] | Sequence[Encoded] | None
    error: Exception | None
    elapsed: float


@dataclass(frozen=True)
class Demote:
    job_id: str


@dataclass(frozen=True)
class Slots:
    delta: int  # -n: an engine's n workers left the rotation; +n: they are back


@dataclass(frozen=True)
class Stop:
    deadline: float  # monotonic: the grace's end


@dataclass(frozen=True)
class Wake:
    """Nothing to apply: look again (a window taken from the queue was cancelled, which may free
    a job's memory share)."""


Message = Submit | Done | Demote | Slots | Stop | Wake
