"""A prep process as the service sees it (:class:`Proc`: the process and its two pipe
threads), and a stream placed on one (:class:`Stream`). The pool (app/audio/procs/pool.py)
owns both; every field here is read and written on its event loop, except the pipe's, which
only the two threads touch: the reader posts each record to the loop, the writer sends the
loop's commands (so a full pipe never blocks the loop)."""

from __future__ import annotations

import contextlib
import multiprocessing
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from app.audio.procs.wire import Out, Spec


class Owner(Protocol):
    """Whoever opened a stream (app/audio/procs/feed.py): told what becomes of it."""

    def opened(self, stream: Stream, parts: int, duration_s: float | None) -> None: ...

    def out(self, stream: Stream, out: Out) -> None: ...

    def failed(self, stream: Stream, exc: Exception) -> None: ...

    def lost(self, stream: Stream, blamed: bool) -> None: ...


@dataclass(eq=False)
class Stream:
    sid: int
    owner: Owner
    job: str
    spec: Spec
    proc: Proc
    granted: set[int] = field(default_factory=set)  # slots it may write to, not yet used
    held: set[int] = field(default_factory=set)  # slots holding its windows, not released
    ended: bool = False  # the process is done with it (its last record, an error, a death)
    closing: bool = False
    gated: bool = False  # no slots yet (a later part, until the first part has a window)
    at: int = 0  # the upload's samples it has decoded up to
    until: int = 0  # where it is expected to end (the header's duration, or its part's end)

    @property
    def left(self) -> int:
        """Samples still to prepare, as far as is known: its process's load."""
        return max(0, self.until - self.at) if not self.ended else 0


class Proc:
    """One prep process and its two pipe threads. Made at once (commands queue in its outbox,
    behind the VAD graph, until it is started), ``dead`` once its pipe ends."""

    def __init__(self, index: int, target: Callable[..., None], args: tuple[Any, ...],
                 first: tuple[Any, ...], post: Callable[[Proc, tuple[Any, ...]], None],
                 unpack: Callable[[tuple[Any, ...]], None]) -> None:
        self.index = index
        self.streams: set[int] = set()
        self.busy: int | None = None
        self.busy_since = 0.0
        self.ready = self.dead = False
        self.started = time.monotonic()
        ctx = multiprocessing.get_context("spawn")
        self.conn, theirs = ctx.Pipe()
        self.process = ctx.Process(target=target, name=f"prep-{index}", daemon=True,
                                   args=(theirs, *args))
        self._theirs = theirs
        self._outbox: queue.SimpleQueue[tuple[Any, ...] | None] = queue.SimpleQueue()
        # The VAD graph (~2 MB) goes down the pipe first, not with the spawn's arguments: those
        # are read while the child imports its modules, and the start would wait for that.
        self._outbox.put(first)
        self._post = post
        self._unpack = unpack  # run on the reader thread before a record is posted

    def start(self) -> None:
        """Blocking (the spawn writes its arguments down the pipe): off the event loop."""
        self.started = time.monotonic()
        self.process.start()
        self._theirs.close()  # ours closed: the pipe ends when the process does
        threading.Thread(target=self._read, name=f"prep-{self.index}-in", daemon=True).start()
        threading.Thread(target=self._write, name=f"prep-{self.index}-out", daemon=True).start()

    def send(self, msg: tuple[Any, ...]) -> None:
        self._outbox.put(msg)

    def _write(self) -> None:
        while (msg := self._outbox.get()) is not None:
            try:
                self.conn.send(msg)
            except (OSError, ValueError):
                return  # it died: the reader reports that

    def _read(self) -> None:
        post = self._post
        while True:
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):
                post(self, ("dead",))
                return
            self._unpack(msg)
            post(self, msg)

    def stop(self) -> None:
        self._outbox.put(None)

    def join(self, timeout: float) -> None:
        if self.process.pid is None:  # never started
            return
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout)
        with contextlib.suppress(OSError):
            self.conn.close()
