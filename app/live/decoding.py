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

import asyncio
import itertools
import weakref
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

import numpy as np

from app.windows import (
    SAMPLE_RATE,
    DecodeOptions,
    Prompt,
    Refresh,
    Shed,
    Urgency,
    Window,
    WindowResult,
)

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
    prefix: str | None = None  # a final read after the turn before it: that turn's text

    def window(self, audio: np.ndarray, pad_margin_s: float | None = None) -> Window:
        return Window(audio, 0.0, audio.size / SAMPLE_RATE,
                      Prompt(language=self.language, initial_prompt=self.prompt,
                             hotwords=self.hotwords, prefix=self.prefix), pad_margin_s)


@dataclass(frozen=True)
class Decoded:
    text: str
    language: str | None = None
    doubtful: bool = False  # read with a prefix, and looped or unsure: read it again without


class Decode(Protocol):
    async def __call__(self, audio: np.ndarray, options: LiveOptions, kind: Kind,
                       refresh: Refresh = (0, 0.0)) -> Decoded: ...


def demote(decode: Decode, task: asyncio.Task[Any]) -> None:
    """The final decode running in ``task`` is an interim now (a decoder that cannot tell
    ignores it): see :meth:`app.batching.batcher.Batcher.demote`."""
    hook = getattr(decode, "demote", None)
    if hook is not None:
        hook(task)


def _decoded(r: WindowResult) -> Decoded:
    return Decoded(r.text, r.language, r.doubtful)


def engine_decoder(run: RunWindows, options: DecodeOptions | None = None,
                   pad_margin_s: float | None = None) -> Decode:
    """Each decode one engine call of one window (the runner awaits the engine's threads),
    padded as ``pad_margin_s`` says (None: the model's margin)."""
    key = options or DecodeOptions()

    async def decode(audio: np.ndarray, options: LiveOptions, kind: Kind,
                     refresh: Refresh = (0, 0.0)) -> Decoded:
        [r] = await run([options.window(audio, pad_margin_s)], key)
        return _decoded(r)

    return decode


class _BatcherDecode:
    """:func:`batcher_decoder`'s decoder: it knows each running decode's batcher job, so a
    final that became an interim can be demoted there."""

    def __init__(self, batcher: Batcher, session_id: str, owner: str | None,
                 options: DecodeOptions | None, interim_pad_margin_s: float | None,
                 on_interim: Callable[[str], None] | None,
                 final_pad_margin_s: float | None = None) -> None:
        self._batcher, self._session, self._owner = batcher, session_id, owner
        self._key = options or DecodeOptions()
        self._margin = interim_pad_margin_s
        self._final_margin = final_pad_margin_s
        self._count = on_interim or (lambda outcome: None)
        self._counter = itertools.count()
        self._jobs: weakref.WeakKeyDictionary[asyncio.Task[Any], str] = \
            weakref.WeakKeyDictionary()

    async def __call__(self, audio: np.ndarray, options: LiveOptions, kind: Kind,
                       refresh: Refresh = (0, 0.0)) -> Decoded:
        job = f"live-{self._session}-{kind}-{next(self._counter)}"
        margin = self._margin if kind == "interim" else self._final_margin
        [fut] = self._batcher.submit(job, [options.window(audio, margin)], self._key,
                                     job_windows=1, owner=self._owner, urgency=urgency(kind),
                                     refresh=refresh)
        task = asyncio.current_task()
        if task is not None:
            self._jobs[task] = job
        if kind == "interim":
            self._count("sent")
        # Cancelling the awaiting task cancels ``fut`` too, and the batcher skips a window whose
        # future is done: an interim decode given up on costs nothing once it is dropped.
        try:
            return _decoded(await fut)
        except Shed:
            self._count("shed")
            raise

    def demote(self, task: asyncio.Task[Any]) -> None:
        job = self._jobs.get(task)
        if job is not None:
            self._batcher.demote(job)


def batcher_decoder(batcher: Batcher, session_id: str, owner: str | None = None,
                    options: DecodeOptions | None = None,
                    interim_pad_margin_s: float | None = None,
                    on_interim: Callable[[str], None] | None = None,
                    final_pad_margin_s: float | None = None) -> Decode:
    """Each decode a one-window job of the shared batcher (``job_windows=1``: a short request,
    so it rides the decoder pool like a short upload, and beside a long upload it is a "fresh"
    job that gets a batch of its own). ``on_interim("sent" | "shed")`` counts interim decodes."""
    return _BatcherDecode(batcher, session_id, owner, options, interim_pad_margin_s, on_interim,
                          final_pad_margin_s)
