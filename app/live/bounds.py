"""What one live session may hold and how fast it may be fed (app/live/session.py uses them).

Probed from outside (issue 51), a session could take a replica's memory and its live threads:

* **The outgoing queue had no bound.** A client that never reads fills it: 30 error events
  echoing a 1 MB ``event_id`` left ~57 MB inside the service, kept for the session's hour by a
  client reading just enough to answer pings. :class:`Outbox` counts the bytes of what it
  holds (each event's JSON); an event past ``live.max_outbox_bytes`` is not queued, and the
  session ends (closed with 1008) instead of holding more for a client that does not read.
* **Appends at network speed.** Silence sent as fast as the socket takes it kept the two
  shared live threads running Silero for everyone. :class:`Pace` is a bucket of audio
  seconds: a session may send ``live.burst_s`` ahead at once, then ``live.max_speed`` times
  real time; an append past that waits (the socket is not read meanwhile), the client is
  slowed, not refused.
* :func:`append_seconds` reads an append's duration off its base64 length before anything is
  decoded: one 15 MiB ``audio/pcmu`` event is ~1,474 s of audio (94 MB as float32), refused by
  ``max_buffer_s`` before a byte is decoded.

:func:`serve` runs a session over any transport (the ``/v1/realtime`` WebSocket route,
app/api/realtime, through app/jobs/live.py): events go out through one writer task in
order while the session reads with :func:`first_of`, a read that also ends when the outbox
overflows.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from app.config import LiveSettings
from app.live.audio import Format
from app.live.protocol import ProtocolError
from app.windows import SAMPLE_RATE

Event = dict[str, Any]
Receive = Callable[[], Awaitable[str | bytes | None]]
WRITER_GRACE_S = 5.0  # a session over, its last events get this long to reach the client


class Outbox:
    """The session's outgoing events, bounded in bytes. One consumer (the transport's writer,
    :func:`serve`), or tests reading it directly."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self.overflowed = asyncio.Event()
        self._queue: asyncio.Queue[Event | None] = asyncio.Queue()
        self._sizes: deque[int] = deque()  # of the queued events, in queue order

    def put(self, event: Event) -> bool:
        """Queue ``event``; False (not queued, :attr:`overflowed` set) past the bound."""
        size = len(json.dumps(event, separators=(",", ":")))
        if self.bytes + size > self.max_bytes:
            self.overflowed.set()
            return False
        self.bytes += size
        self._sizes.append(size)
        self._queue.put_nowait(event)
        return True

    def close(self) -> None:
        """No more events: the reader gets None."""
        self._sizes.append(0)
        self._queue.put_nowait(None)

    async def get(self) -> Event | None:
        return self._took(await self._queue.get())

    def get_nowait(self) -> Event | None:
        return self._took(self._queue.get_nowait())

    def qsize(self) -> int:
        return self._queue.qsize()

    def _took(self, event: Event | None) -> Event | None:
        self.bytes -= self._sizes.popleft()
        return event


class Pace:
    """A bucket of audio seconds: ``burst_s`` deep, refilled at ``speed`` x real time."""

    def __init__(self, speed: float, burst_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.speed, self.burst_s, self._clock = speed, burst_s, clock
        self.tokens, self._at = burst_s, clock()

    def delay(self, seconds: float) -> float:
        """Take ``seconds`` of audio: how long to wait before handling it (0: at once). The
        bucket may go into debt by one append, which the wait pays back."""
        now = self._clock()
        self.tokens = min(self.burst_s, self.tokens + (now - self._at) * self.speed)
        self._at = now
        self.tokens -= seconds
        return 0.0 if self.tokens >= 0 else -self.tokens / self.speed


def append_seconds(payload: str, fmt: Format) -> float:
    """An append's audio duration from its base64 length and the session's format, before
    anything is decoded (an over-estimate by at most a sample for bad padding)."""
    raw = len(payload) * 3 // 4
    rate = getattr(fmt, "rate", None) or 8000
    width = 2 if fmt.type == "audio/pcm" else 1  # PCM16, or one byte of G.711 per sample
    return raw / (width * rate)


def over_buffer(limit_s: float, manual: bool, end: int, turn_start: int | None,
                samples: int) -> bool:
    """``samples`` more would take a session's uncommitted audio past ``limit_s``
    (``max_buffer_s``): in manual mode counted from the open turn's start, or from ``end`` when
    this append opens the turn (issue 51: unchecked on a turn's first append, a 3 s append
    passed a 1 s limit); with turn detection, one append alone (a turn is cut at
    ``max_turn_s`` anyway)."""
    limit = limit_s * SAMPLE_RATE
    if not manual:
        return samples > limit
    return end + samples - (turn_start if turn_start is not None else end) > limit


def buffer_full(limit_s: float, event_id: str | None) -> ProtocolError:
    return ProtocolError(f"The input audio buffer holds {limit_s:.0f} s, its maximum: commit it "
                         "(or clear it); this append was dropped.",
                         code="input_audio_buffer_full", param="audio", event_id=event_id)


class Overflowed(Exception):
    """The session's outbox passed its bound: the client does not read."""


async def first_of(receive: Awaitable[str | bytes | None], overflow: asyncio.Future[Any],
                   timeout: float) -> str | bytes | None:
    """The client's next message, unless the outbox overflows first (:class:`Overflowed`) or
    ``timeout`` passes (TimeoutError).

    The read is awaited in the caller's task, which the overflow interrupts (a cancel taken
    back at once) only while it waits here: a task per message and ``asyncio.wait`` cost
    ~5 % of the event loop's time at 32 sessions (py-spy), ten messages a second a session."""
    if overflow.done():
        if inspect.iscoroutine(receive):
            receive.close()
        raise Overflowed
    task = asyncio.current_task()
    assert task is not None
    waiting = [True]

    def interrupt(_: asyncio.Future[Any]) -> None:
        if waiting[0]:  # not once the read is back (the callback may run a tick later)
            task.cancel()

    overflow.add_done_callback(interrupt)
    try:
        async with asyncio.timeout(timeout):
            return await receive
    except asyncio.CancelledError:
        if overflow.done() and task.uncancel() == 0:  # our cancel alone: the outbox overflowed
            raise Overflowed from None
        raise
    finally:
        waiting[0] = False
        overflow.remove_done_callback(interrupt)


async def next_message(receive: Awaitable[str | bytes | None], overflow: asyncio.Future[Any],
                       started: float, limits: LiveSettings
                       ) -> tuple[str | bytes | None, ProtocolError | None]:
    """The client's next message (None: it left), or why the session ends instead: the outbox
    overflowed (code ``outbox_full``), no message within ``idle_timeout_s`` (``idle_timeout``)
    or the session is ``max_session_s`` old (``session_expired``); the error is the one to tell
    the client (but for ``outbox_full``: it does not read)."""
    loop = asyncio.get_running_loop()
    left = started + limits.max_session_s - loop.time()
    try:
        return await first_of(receive, overflow, min(limits.idle_timeout_s, left)), None
    except Overflowed:
        return None, ProtocolError("unread events", code="outbox_full")
    except TimeoutError:
        expired = loop.time() - started >= limits.max_session_s
        limit = (f"the maximum duration of {limits.max_session_s:.0f} s" if expired
                 else f"{limits.idle_timeout_s:.0f} s without a client event")
        return None, ProtocolError(f"The session hit {limit}; closing.",
                                   code="session_expired" if expired else "idle_timeout")


class Session(Protocol):
    """What :func:`serve` needs of a session (app/live/session.py's ``LiveSession``)."""

    outbox: Outbox

    async def run(self, receive: Receive) -> str: ...


async def serve(session: Session, receive: Receive,
                send: Callable[[dict[str, Any]], Awaitable[None]]) -> str:
    """Run ``session`` over a transport: events go out through ``send`` in order while ``run``
    reads; returns why it ended. A failing ``send`` drops events, never the session's work.
    Once the session is over its last events get ``WRITER_GRACE_S`` to go out (none when it
    ended because the client did not read them)."""

    async def write() -> None:
        failed = False
        while (event := await session.outbox.get()) is not None:
            if failed:
                continue
            try:
                await send(event)
            except Exception:  # the peer is gone: keep draining so finals still finish
                failed = True

    writer = asyncio.create_task(write())
    try:
        return await session.run(receive)
    finally:
        if not session.outbox.overflowed.is_set():
            await asyncio.wait({writer}, timeout=WRITER_GRACE_S)
        writer.cancel()
        await asyncio.gather(writer, return_exceptions=True)
