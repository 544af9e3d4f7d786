"""One live session: OpenAI's Realtime transcription protocol as a transport-free state machine.

The transport (the ``/v1/realtime`` WebSocket route, app/api/realtime) only moves messages::

    session = LiveSession(decode, vad, limits, executor)
    reason = await serve(session, receive, send)   # receive() -> str | bytes | None (gone)
                                                   # send(event dict); then close the socket

``run`` handles each client message in order and ends when the client leaves, on the idle or
total limit (an ``error`` first), or when cancelled; however it ends, an open turn is committed
and every final awaited, so :attr:`LiveSession.items` holds everything said (kept as a job).
Bad input never ends the session: it is answered with an ``error`` event.

Audio work (base64, G.711, resampling, Silero) runs in ``executor`` (the service's: app/live/
offload.py), never on the event loop; decodes go through :class:`~app.live.decoding.Decode`;
turns, reading, interims, event order: app/live/turns.py, reading.py, agreement.py, events.py.
A client faster than real time is slowed, not buffered: an append waits while
``max_pending_finals`` turns are decoding, or while it runs ahead of ``live.max_speed`` x real
time (the socket is then not read). What a session holds is bounded (app/live/bounds.py): its
outgoing events in bytes (past them it ends, ``outbox_full``), its uncommitted audio by
``max_buffer_s`` (judged before an append is decoded, on a turn's first append too), and its
audio waiting for a transcript counts in its key's queued-seconds share (``admit``).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable, Coroutine
from concurrent.futures import Executor
from typing import Any

import numpy as np

from app.errors import ServiceError
from app.live.audio import AudioDecoder, BadAudio, ChunkBuffer, b64decode
from app.live.bounds import (
    Outbox,
    Pace,
    Receive,
    append_seconds,
    buffer_full,
    next_message,
    over_buffer,
    serve,
)
from app.live.config import LiveLimits, SessionConfig, wall_clock
from app.live.decoding import Decode, demote
from app.live.events import (
    Cleared,
    Committed,
    ErrorEvent,
    ItemAdded,
    ServerEvent,
    SessionCreated,
    SessionUpdated,
    SpeechStarted,
    SpeechStopped,
    TranscriptionCompleted,
    TranscriptionDelta,
    TranscriptionFailed,
    new_id,
)
from app.live.offload import Offload, run_on
from app.live.protocol import (
    Append,
    Clear,
    Commit,
    ProtocolError,
    SessionUpdate,
    TranscriptionSession,
    parse_client_event,
)
from app.live.reading import Reader
from app.live.turns import Edge, LiveItem, Previous, SileroTurns, Turn, VadModel, ms
from app.windows import N_SAMPLES, SAMPLE_RATE

log = logging.getLogger(__name__)
MIN_COMMIT = SAMPLE_RATE // 10  # OpenAI refuses to commit less than 100 ms
__all__ = ["Admit", "LiveSession", "Receive", "serve"]
# Audio seconds an append adds to its key's share -> why it does not fit (None: it does).
Admit = Callable[[float], Awaitable[str | None]]


class LiveSession:
    def __init__(self, decode: Decode, vad: VadModel | None, limits: LiveLimits | None = None,
                 executor: Executor | Offload | None = None, session_id: str | None = None,
                 initial: dict[str, Any] | None = None, admit: Admit | None = None) -> None:
        """``initial``: the session a client secret was minted for (app/live/protocol.py
        :func:`parse_session`, as stored in the secret): ``session.created`` already shows it.
        ``admit``: the key's share, asked before each append's audio is taken."""
        self.id = session_id or new_id("sess")
        self.limits = limits or LiveLimits()
        self.outbox = Outbox(self.limits.max_outbox_bytes)
        self._pace = Pace(self.limits.max_speed, self.limits.burst_s)
        self._admit = admit
        self._finals_s = 0.0  # audio of the turns whose finals are decoding
        self.config = SessionConfig()
        if initial is not None:
            self.config.apply(TranscriptionSession.model_validate(initial))
        self.items: list[LiveItem] = []
        self.counts = {"interim": 0, "interim_shed": 0, "final": 0, "errors": 0}
        self._decode, self._vad, self._executor = decode, vad, executor
        self._read = Reader(decode, self.limits, self.counts, self.id)
        self._created = wall_clock()
        self._audio = AudioDecoder(self.config.format)
        self._buf = ChunkBuffer()
        self._turn: Turn | None = None
        self._turns = self._new_turns()
        self._finals: set[asyncio.Task[None]] = set()
        self._last_final: asyncio.Task[None] | None = None
        self._last_item: str | None = None
        self._previous: Previous | None = None  # the turn closed last (see reading.py)

    # ---- the transport's side -----------------------------------------------------------------
    async def run(self, receive: Receive) -> str:
        """Serve until the client leaves or a limit; why it ended (see the module doc)."""
        started = asyncio.get_running_loop().time()
        self._emit(SessionCreated(session=self.config.as_session(self.id, self.limits, self._created)))
        overflow = asyncio.ensure_future(self.outbox.overflowed.wait())
        try:
            while True:
                msg, ended = await next_message(receive(), overflow, started, self.limits)
                if ended is not None:
                    if ended.code == "outbox_full":
                        log.info("live session %s: %d bytes of events unread; closing", self.id,
                                 self.outbox.bytes)
                    else:
                        self._error(ended)
                    return str(ended.code)
                if msg is None:
                    return "disconnected"
                await self.handle(msg)
        finally:
            overflow.cancel()
            await self._wind_down()

    def pending_s(self) -> float:
        """Untranscribed audio: the open turn's and that of turns whose finals are decoding."""
        t = self._turn
        held = (self._buf.end - t.start) / SAMPLE_RATE if t is not None else 0.0
        return held + self._finals_s

    async def handle(self, raw: str | bytes) -> None:
        """One client message; never raises for anything the client sent."""
        event = parse_client_event(raw, self.limits.max_event_bytes)
        try:
            if isinstance(event, ProtocolError):
                self._error(event)
            elif isinstance(event, SessionUpdate):
                self._update(event)
            elif isinstance(event, Append):
                await self._append(event)
            elif isinstance(event, Commit):
                self._commit(event)
            elif isinstance(event, Clear):
                self._clear()
        except Exception as exc:  # a bug here must not drop the socket either
            log.exception("live session %s: event failed", self.id)
            self._error(ProtocolError(f"Internal error: {type(exc).__name__}", code="server_error",
                                      type="server_error"))

    def _update(self, ev: SessionUpdate) -> None:
        old_td = self.config.turn_detection
        fmt_changed, td_changed = self.config.apply(ev.session)
        if td_changed and self.config.turn_detection is not None and self._vad is None:
            self.config.turn_detection = old_td
            self._error(ProtocolError("Server VAD is not available here; use null (manual turns).",
                                      code="invalid_value", event_id=ev.event_id,
                                      param="session.audio.input.turn_detection"))
            return
        if fmt_changed:
            self._buf.append(self._audio.flush())
            self._audio = AudioDecoder(self.config.format)
        if td_changed:  # an open turn goes on, now ended by the new rules (or by a commit)
            self._turns = self._new_turns()
        self._emit(SessionUpdated(session=self.config.as_session(self.id, self.limits, self._created)))

    async def _append(self, ev: Append) -> None:
        while len(self._finals) >= self.limits.max_pending_finals:
            await asyncio.wait(set(self._finals), return_when=asyncio.FIRST_COMPLETED)
        seconds = append_seconds(ev.audio, self.config.format)
        if self._over_buffer(round(seconds * SAMPLE_RATE)):  # before a byte is decoded
            self._buffer_full(ev)
            return
        if self._admit is not None and (why := await self._admit(seconds)) is not None:
            self._error(ProtocolError(why, code="rate_limit_exceeded", param="audio",
                                      event_id=ev.event_id))
            return
        if (wait := self._pace.delay(seconds)) > 0:  # ahead of max_speed: slowed, not refused
            await asyncio.sleep(wait)
        try:
            samples, edges = await run_on(self._executor, self._ingest, ev.audio)
        except BadAudio as exc:
            self._error(ProtocolError(str(exc), code="invalid_value", param="audio",
                                      event_id=ev.event_id))
            return
        if self._over_buffer(samples.size):
            self._buffer_full(ev)
            return
        at = self._buf.end
        self._buf.append(samples)
        if self._turns is None and self._turn is None and samples.size:
            self._turn = Turn(new_id("item"), at, vad=False)  # manual: audio opens the item
        for e in edges:
            self._edge(e)
        self._maybe_interim()
        self._trim()

    def _over_buffer(self, samples: int) -> bool:
        t = self._turn
        return over_buffer(self.limits.max_buffer_s, self._turns is None, self._buf.end,
                           t.start if t is not None else None, samples)

    def _buffer_full(self, ev: Append) -> None:
        self._error(buffer_full(self.limits.max_buffer_s, ev.event_id))

    def _commit(self, ev: Commit) -> None:
        t = self._turn
        held = self._buf.end - t.start if t is not None else 0
        if t is None or held < MIN_COMMIT:
            self._error(ProtocolError(
                "Error committing input audio buffer: buffer too small. Expected at least 100ms "
                f"of audio, but buffer only has {held * 1000 / SAMPLE_RATE:.2f}ms of audio.",
                code="input_audio_buffer_commit_empty", event_id=ev.event_id))
            return
        if self._turns is not None:
            self._turns.end_turn(self._buf.end)
        self._close(self._buf.end, stopped=False)

    def _clear(self) -> None:
        if self._turn is not None:
            self._turn.closed = True
            for task in (self._turn.interim, self._turn.early):
                if task is not None:
                    task.cancel()
            self._turn = None
        if self._turns is not None:
            self._turns.end_turn(self._buf.end)
        self._buf.clear()
        self._previous = None  # the audio before a clear is not the next turn's context
        self._emit(Cleared())

    # ---- turns --------------------------------------------------------------------------------
    def _edge(self, e: Edge) -> None:
        t = self._turn
        if e.kind == "start":
            if t is not None:  # a manual-mode turn the VAD now sees begin again
                return
            self._turn = Turn(new_id("item"), e.at, vad=True)
            self._emit(SpeechStarted(audio_start_ms=ms(e.at), item_id=self._turn.item_id))
        elif t is None:
            return
        elif e.kind == "pause" and t.vad and t.early is None:  # the final, early (turns.py)
            t.early, t.early_upto = asyncio.create_task(self._final_decode(t.start, e.at)), e.at
            if self._turns is not None and self._turns.semantic:  # its text judges the pause
                t.early.add_done_callback(functools.partial(self._turns.judge, e.at))
        elif e.kind == "resume" and t.early is not None:
            # Not over: the early decode read the turn so far, which is an interim's input, so
            # its text is the turn's next interim rather than work thrown away (at 16 streams
            # 31 of 129 early decodes were resumed after).
            if t.interim is not None:
                t.interim.cancel()
            demote(self._decode, t.early)  # behind every true final from now on
            t.interim, t.early = asyncio.create_task(self._interim(t, t.early)), None
        elif e.kind == "stop":  # speech_stopped only for a turn speech_started opened
            self._close(e.at, stopped=t.vad, at_pause=not e.forced)

    def _close(self, end: int, stopped: bool, at_pause: bool = False) -> None:
        t = self._turn
        assert t is not None
        self._turn, t.closed = None, True
        if t.interim is not None:  # superseded by the final
            t.interim.cancel()
        if stopped:
            self._emit(SpeechStopped(audio_end_ms=ms(end), item_id=t.item_id))
        self._emit(Committed(item_id=t.item_id, previous_item_id=self._last_item))
        self._emit(ItemAdded.user_audio(t.item_id, self._last_item))
        self._last_item = t.item_id
        item = LiveItem(t.item_id, ms(t.start), ms(end), interim_text=t.agreement.text)
        self.items.append(item)
        early, t.early = t.early, None
        if early is not None and not at_pause:  # a commit or a cut: the audio ran on
            early.cancel()
            early = None
        audio = self._buf.slice(t.start, end)
        fresh = self._final_decode(t.start, end) \
            if early is None and audio.size <= N_SAMPLES else None
        self._previous = Previous(t.start, end)
        task = asyncio.create_task(self._final(t, item, audio, self._last_final, early, fresh,
                                               self._previous))
        self._finals.add(task)
        self._finals_s += audio.size / SAMPLE_RATE
        task.add_done_callback(functools.partial(self._final_done, audio.size / SAMPLE_RATE))
        self._last_final = task

    def _final_done(self, seconds: float, task: asyncio.Task[None]) -> None:
        self._finals.discard(task)
        self._finals_s = max(0.0, self._finals_s - seconds)

    async def _final(self, t: Turn, item: LiveItem, audio: np.ndarray,
                     before: asyncio.Task[None] | None, early: asyncio.Task[str] | None,
                     fresh: Coroutine[Any, Any, str] | None, mine: Previous) -> None:
        """Read the closed turn (:meth:`Reader.settle`) and tell the client, in turn order."""
        text, error = await self._read.settle(audio, self.config.options(), early, fresh, before)
        if error is not None:
            item.error = f"{type(error).__name__}: {error}"
            log.warning("live session %s: final decode failed: %s", self.id, item.error)
            # The service's own errors say what happened; anything else stays in the log (issue
            # 38: no exception text leaves the service).
            public = error.message if isinstance(error, ServiceError) else \
                "The turn could not be transcribed; the service's log has the cause."
            self._emit(TranscriptionFailed.of(t.item_id, public,
                                              code=getattr(error, "cause", None) or "server_error"))
            return
        delta, item.transcript = t.agreement.final(text or "")
        mine.text = item.transcript or None
        if delta:
            self._emit(TranscriptionDelta(item_id=t.item_id, delta=delta))
        self._emit(TranscriptionCompleted.of(t.item_id, item.transcript, audio.size / SAMPLE_RATE))

    def _maybe_interim(self) -> None:
        t = self._turn
        every = SAMPLE_RATE * self.limits.interim_interval_ms * (t.backoff if t else 1) // 1000
        if t is None or every <= 0 or (t.interim is not None and not t.interim.done()):
            return
        if self._finals or t.early is not None:  # a final is decoding: no interim beside it
            return
        if self._buf.end - max(t.start, t.interim_upto) < every or self._buf.end - t.start > N_SAMPLES:
            return
        t.interim_upto = self._buf.end
        t.interim = asyncio.create_task(self._interim(t, self._buf.slice(t.start, self._buf.end)))

    async def _interim(self, t: Turn, audio: np.ndarray | asyncio.Task[str]) -> None:
        heard = audio.size if isinstance(audio, np.ndarray) else t.early_upto - t.start
        text = await self._read.interim(t, audio, self.config.options())
        if text is None or t.closed:
            return
        delta = t.agreement.interim(text, heard / SAMPLE_RATE)
        if delta:
            self._emit(TranscriptionDelta(item_id=t.item_id, delta=delta))

    def _final_decode(self, start: int, end: int) -> Coroutine[Any, Any, str]:
        return self._read.final(self._buf, self._previous, start, end, self.config.options())

    def _ingest(self, payload: str) -> tuple[np.ndarray, list[Edge]]:
        """Executor side: base64, format, resampling, VAD (this session's state only)."""
        samples = self._audio.decode(b64decode(payload))
        edges = self._turns.feed(samples) if self._turns is not None else []
        return samples, edges

    def _new_turns(self) -> SileroTurns | None:
        rules = self.config.rules(self.limits)
        if rules is None or self._vad is None:
            return None
        t = self._turn
        return SileroTurns(self._vad.probability_stream(), rules,
                           in_turn_from=t.start if t is not None else None, at=self._buf.end)

    def _trim(self) -> None:
        if self._turn is not None:
            keep = self._turn.start
        elif self._turns is not None:  # what a turn starting in the next append may reach back to
            keep = self._buf.end - self._turns.detector.pad - 2 * 512
        else:
            keep = self._buf.end
        p = self._previous  # the turn before, while a next turn may still read it
        if p is not None and self._buf.end - p.start > self.limits.context_max_s * SAMPLE_RATE:
            self._previous = p = None
        self._buf.trim(keep if p is None else min(keep, p.start))

    def _emit(self, event: ServerEvent) -> None:
        self.outbox.put(event.as_dict())  # past the bound: dropped, and the session ends

    def _error(self, err: ProtocolError) -> None:
        self.counts["errors"] += 1
        self._emit(ErrorEvent.of(err))

    async def _wind_down(self) -> None:
        """Commit an open turn, await every final decode, then close the outbox."""
        try:
            t = self._turn
            if t is not None and self._buf.end - t.start >= MIN_COMMIT:
                self._close(self._buf.end, stopped=False)
            elif t is not None:
                for task in (t.interim, t.early):
                    if task is not None:
                        task.cancel()
            if self._finals:
                await asyncio.gather(*self._finals, return_exceptions=True)
        except asyncio.CancelledError:
            for task in self._finals:
                task.cancel()
            raise
        finally:
            self.outbox.close()
