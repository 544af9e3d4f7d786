"""How a live session gets text for its audio: one awaitable, so the transport and the engine
stay out of the state machine.

    async def decode(audio, options, kind) -> Decoded      # kind: "interim" | "final"

``audio`` is at most one Whisper window (30 s) of 16 kHz float32. A *final* decode is the turn's
transcript and latency-critical; an *interim* one only refreshes the text shown while the turn
is open, and may be dropped: raising :class:`Shed` tells the session it was (nothing is sent,
the next interim or the final catches up). The decoder must never run inference on the event
loop: both adapters below await the engine's own thread pool.

Adapters:

* :func:`engine_decoder`: straight to an engine runner (``EngineRunner.run`` /
  ``EnginePool.run``): no batching; tests and the single-stream bench.
* :func:`batcher_decoder`: through the service's shared cross-request batcher, each decode a
  one-window job, so live turns share batches with uploads. Today's batcher has no priorities:
  phase B gives finals a class of their own (first in a batch, never shed) and interim decodes a
  droppable one (shed, by raising :class:`Shed`, when the batcher falls behind).
"""

from __future__ import annotations

import itertools
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

import numpy as np

import app.windows as windows
from app.windows import SAMPLE_RATE, DecodeOptions, Prompt, Window, WindowResult

if TYPE_CHECKING:
    from app.batching.batcher import Batcher

Kind = Literal["interim", "final"]
RunWindows = Callable[[Sequence[Window], DecodeOptions], Awaitable[list[WindowResult]]]


class _Shed(Exception):
    """An interim decode the decoder chose not to run (it fell behind): skipped, not an error."""


# The batcher's priority classes (branch ``batchprio``) bring ``app.windows.Shed``: the exception
# a shed interim window's future gets. Once it exists it *is* this module's Shed, so the session
# catches what the batcher raises; until then a local class stands in (nothing raises it).
Shed: type[Exception] = getattr(windows, "Shed", None) or _Shed


def urgency(kind: Kind) -> dict[str, Any]:
    """THE ONE PLACE the live path states a decode's urgency to the batcher (``batchprio``):
    ``submit(..., urgency=Urgency.LIVE_FINAL)`` for a turn's final, ``LIVE_INTERIM`` (droppable)
    for an interim. Today's batcher has no ``Urgency`` and takes no such argument: nothing."""
    classes = getattr(windows, "Urgency", None)
    if classes is None:
        return {}
    return {"urgency": classes.LIVE_FINAL if kind == "final" else classes.LIVE_INTERIM}


@dataclass(frozen=True)
class LiveOptions:
    """What the session's ``audio.input.transcription`` asks of every decode."""

    language: str | None = None  # None: detected by the turn's own window
    prompt: str | None = None
    hotwords: str | None = None  # ``keywords``, space-joined

    def window(self, audio: np.ndarray) -> Window:
        return Window(audio, 0.0, audio.size / SAMPLE_RATE,
                      Prompt(language=self.language, initial_prompt=self.prompt,
                             hotwords=self.hotwords))


@dataclass(frozen=True)
class Decoded:
    text: str
    language: str | None = None


class Decode(Protocol):
    async def __call__(self, audio: np.ndarray, options: LiveOptions, kind: Kind) -> Decoded: ...


def _decoded(r: WindowResult) -> Decoded:
    return Decoded(r.text, r.language)


def engine_decoder(run: RunWindows, options: DecodeOptions | None = None) -> Decode:
    """Each decode one engine call of one window (the runner awaits the engine's threads)."""
    key = options or DecodeOptions()

    async def decode(audio: np.ndarray, options: LiveOptions, kind: Kind) -> Decoded:
        [r] = await run([options.window(audio)], key)
        return _decoded(r)

    return decode


def batcher_decoder(batcher: Batcher, session_id: str, owner: str | None = None,
                    options: DecodeOptions | None = None) -> Decode:
    """Each decode a one-window job of the shared batcher (``job_windows=1``: a short request,
    so it rides the decoder pool like a short upload, and beside a long upload it is a "fresh"
    job that gets a batch of its own)."""
    key = options or DecodeOptions()
    counter = itertools.count()

    async def decode(audio: np.ndarray, options: LiveOptions, kind: Kind) -> Decoded:
        job = f"live-{session_id}-{kind}-{next(counter)}"
        [fut] = batcher.submit(job, [options.window(audio)], key, job_windows=1, owner=owner,
                               **urgency(kind))
        # Cancelling the awaiting task cancels ``fut`` too, and the batcher skips a window whose
        # future is done: an interim decode given up on costs nothing once it is dropped.
        return _decoded(await fut)

    return decode
