"""How a live session gets text for its audio: one awaitable, so the transport and the engine
stay out of the state machine.

    async def decode(audio, options, kind, refresh) -> Decoded  # kind: "interim" | "final"

``audio`` is at most one Whisper window (30 s) of 16 kHz float32. A *final* decode is the turn's
transcript and latency-critical; an *interim* one only refreshes the text shown while the turn
is open, and may be dropped: raising :class:`Shed` tells the session it was (nothing is sent,
the next interim or the final catches up). ``refresh`` (an interim's): its turn's need of
fresh text (:data:`~app.windows.Refresh`), so that a batcher behind serves a turn that shows
nothing yet first, then the turn whose text has waited longest. The decoder must never run
inference on the event loop: both adapters below await the engine's own thread pool.

Adapters:

* :func:`engine_decoder`: straight to an engine runner (``EngineRunner.run`` /
  ``EnginePool.run``): no batching; tests and the single-stream bench.
* :func:`batcher_decoder`: through the service's shared cross-request batcher, each decode a
  one-window job, so live turns share batches with uploads: finals as ``Urgency.LIVE_FINAL``
  (first in every choice, never shed), interim decodes as ``LIVE_INTERIM`` (shed, their future
  raising :class:`~app.windows.Shed`, when superseded or behind; app/batching/urgency.py).
"""

from __future__ import annotations

import itertools
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol

import numpy as np

from app.windows import SAMPLE_RATE, DecodeOptions, Prompt, Refresh, Urgency, Window, WindowResult

if TYPE_CHECKING:
    from app.batching.batcher import Batcher

Kind = Literal["interim", "final"]
RunWindows = Callable[[Sequence[Window], DecodeOptions], Awaitable[list[WindowResult]]]


def urgency(kind: Kind) -> Urgency:
    """The one place the live path states a decode's urgency to the batcher: a turn's final is
    latency-critical (``LIVE_FINAL``: first in every choice, never shed), an interim droppable
    (``LIVE_INTERIM``: shed when superseded or behind, its future raising :class:`Shed`)."""
    return Urgency.LIVE_FINAL if kind == "final" else Urgency.LIVE_INTERIM


@dataclass(frozen=True)
class LiveOptions:
    """What the session's ``audio.input.transcription`` asks of every decode."""

    language: str | None = None  # None: detected by the turn's own window
    prompt: str | None = None
    hotwords: str | None = None  # ``keywords``, space-joined

    def window(self, audio: np.ndarray, pad_margin_s: float | None = None) -> Window:
        return Window(audio, 0.0, audio.size / SAMPLE_RATE,
                      Prompt(language=self.language, initial_prompt=self.prompt,
                             hotwords=self.hotwords), pad_margin_s)


@dataclass(frozen=True)
class Decoded:
    text: str
    language: str | None = None


class Decode(Protocol):
    async def __call__(self, audio: np.ndarray, options: LiveOptions, kind: Kind,
                       refresh: Refresh = (0, 0.0)) -> Decoded: ...


def _decoded(r: WindowResult) -> Decoded:
    return Decoded(r.text, r.language)


def engine_decoder(run: RunWindows, options: DecodeOptions | None = None) -> Decode:
    """Each decode one engine call of one window (the runner awaits the engine's threads)."""
    key = options or DecodeOptions()

    async def decode(audio: np.ndarray, options: LiveOptions, kind: Kind,
                     refresh: Refresh = (0, 0.0)) -> Decoded:
        [r] = await run([options.window(audio)], key)
        return _decoded(r)

    return decode


def batcher_decoder(batcher: Batcher, session_id: str, owner: str | None = None,
                    options: DecodeOptions | None = None,
                    interim_pad_margin_s: float | None = None) -> Decode:
    """Each decode a one-window job of the shared batcher (``job_windows=1``: a short request,
    so it rides the decoder pool like a short upload, and beside a long upload it is a "fresh"
    job that gets a batch of its own)."""
    key = options or DecodeOptions()
    counter = itertools.count()

    async def decode(audio: np.ndarray, options: LiveOptions, kind: Kind,
                     refresh: Refresh = (0, 0.0)) -> Decoded:
        job = f"live-{session_id}-{kind}-{next(counter)}"
        margin = interim_pad_margin_s if kind == "interim" else None
        [fut] = batcher.submit(job, [options.window(audio, margin)], key, job_windows=1, owner=owner,
                               urgency=urgency(kind), refresh=refresh)
        # Cancelling the awaiting task cancels ``fut`` too, and the batcher skips a window whose
        # future is done: an interim decode given up on costs nothing once it is dropped.
        return _decoded(await fut)

    return decode
