"""What the service process and its prep processes say to each other over their pipe.

Small tuples, pickled by ``multiprocessing.connection``: a command or a record is a few hundred
bytes (the samples travel in shared memory, app/audio/procs/slots.py), except a diarize job's
chunk audio (int16, ~1.9 MB per minute of audio), which its speaker stream needs whole.

Service -> prep process::

    ("open", sid, Spec)        open a stream (Spec.part: one part of a split upload)
    ("credit", sid, [slot])    slots it may write windows into
    ("stop_at", sid, end)      a part's end: the next part's seam (None: the end of the audio)
    ("ack", sid)               one chunk of audio taken by the speaker stream
    ("close", sid)             stop; give back its unused slots
    ("exit",)

Prep process -> service::

    ("ready", pid)
    ("busy", sid)              about to work on sid (a crash now is blamed on its upload)
    ("opened", sid, parts, duration_s)
    ("out", sid, Out)          what one step made
    ("error", sid, Failure)
    ("closed", sid, [slot])    unused slots given back (also for a stream it no longer has)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from app.audio.parts import Part
from app.errors import ServiceError


@dataclass(frozen=True)
class Spec:
    path: str
    max_audio_s: float
    chunk_s: float
    separate: bool = False
    vad: dict[str, float] | None = None  # a request's server_vad settings
    audio: bool = False  # hand each chunk's samples back too (speakers)
    split: int = 1  # at most this many parts, if the upload can be split (decided on open)
    part_s: float = 300.0  # and no part shorter than this
    part: Part | None = None  # one part of a split upload
    skip: int = 0  # windows already delivered (a retry: the same stream, replayed)
    skip_audio: int = 0  # samples of chunk audio already delivered
    duration_s: float = 0.0  # the upload's length by its header (placement: the least loaded)


@dataclass
class Out:
    windows: list[tuple[int, int, int, int, int]] = field(default_factory=list)
    # (slot, samples, start sample, end sample, channel) in order
    fed: int = 0  # the upload's samples decoded so far
    audio: bytes | None = None  # the chunk's samples, int16 (Spec.audio)
    audio_start: int = 0  # the sample the chunk starts at
    channels: int = 1  # rows of ``audio``
    seam: int | None = None  # a part's seam, once found (-1: the part is empty)
    done: bool = False  # the stream's last record
    unused: list[int] = field(default_factory=list)  # slots given back with ``done``
    # Made in the service by the pipe's reader thread (numpy lets go of the GIL): the windows'
    # samples as the engine takes them, the chunk's as float32. Off the event loop.
    arrays: list[Any] = field(default_factory=list)
    chunk: Any = None

    def unpack(self, view: Any, engine_audio: Any) -> None:
        self.arrays = [engine_audio(view(slot, n)) for slot, n, *_ in self.windows]
        if self.audio is not None:
            pcm = np.frombuffer(self.audio, dtype=np.int16).reshape(self.channels, -1)
            self.chunk = np.multiply(pcm if self.channels > 1 else pcm[0],
                                     np.float32(1 / 32768), dtype=np.float32)
            self.audio = b""


@dataclass(frozen=True)
class Failure:
    """An exception from a prep process: a service error is raised again as itself (its type,
    message, details and the client's two hints, ``retry_after`` and ``no_retry``); anything
    else is an internal error."""

    error_type: str
    message: str
    details: dict[str, Any] = field(default_factory=dict)
    retry_after: int | None = None
    no_retry: bool = False

    @classmethod
    def of(cls, exc: BaseException) -> Failure:
        if isinstance(exc, ServiceError):
            return cls(exc.error_type, exc.message, dict(exc.details), exc.retry_after,
                       exc.no_retry)
        return cls("internal_error", f"{type(exc).__name__}: {exc}")

    def exception(self) -> Exception:
        kind = _service_error(self.error_type)
        if kind is None:
            return RuntimeError(f"prep process: {self.message}")
        exc = kind.__new__(kind)  # its own __init__ may take other arguments (InvalidChunking)
        ServiceError.__init__(exc, self.message, retry_after=self.retry_after,
                              no_retry=self.no_retry, **self.details)
        return exc


def _service_error(error_type: str) -> type[ServiceError] | None:
    todo: list[type[ServiceError]] = [ServiceError]
    while todo:
        cls = todo.pop()
        if cls.error_type == error_type and cls is not ServiceError:
            return cls
        todo.extend(cls.__subclasses__())
    return None
