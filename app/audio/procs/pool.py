"""The prep processes, seen from the service: spawned once, fed whole streams, replaced if
they die; the slots the windows come back in, granted as credits.

* **Processes.** ``multiprocessing``'s spawn context: a fresh interpreter, never a fork of a
  service that may have started CUDA and holds engine threads. Each is started once and reused
  (start-up ~1 s of CPU: it gets the VAD graph the service checked rather than building it).
  Its pipe is read by one thread (records go to the event loop) and written by another (a
  command never blocks the loop on a full pipe). All the state here belongs to the event loop.
* **Placement.** A stream goes to the live process with the least audio left to prepare.
* **Credits.** A stream is granted slots (at most ``STREAM_AHEAD`` unused at a time), while its
  job holds fewer than its share (:class:`app.audio.feeding.Credits`); free slots go first to the
  job holding fewest, so a short upload's windows never wait behind a long one's read-ahead.
  A slot comes back when its window is released (its batch done), or unused with the stream's
  last record, or when its process dies.
* **Death.** The pipe's end of file says a process died (a decoder crash on a hostile file, the
  OOM killer, a kill); its streams' owners are told, and whether the process was working on each
  when it died (it names the stream before every step), and a new process takes its place. A
  step running past ``step_timeout_s`` (a decoder in an endless loop) is killed the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from app.audio.feeding import Credits
from app.audio.procs import child
from app.audio.procs.proc import Owner, Proc, Stream
from app.audio.procs.slots import Arena, engine_audio
from app.audio.procs.wire import Failure, Out, Spec
from app.audio.vad import SileroModel
from app.errors import ShuttingDown
from app.windows import SAMPLE_RATE

log = logging.getLogger(__name__)
STREAM_AHEAD = 8  # slots a stream may hold unused: ~2-4 chunks' windows
EARLY_DEATH_S = 30.0  # a process dying this soon after its start counts towards the backoff
BROKEN_AFTER = 3  # early deaths in a row of every process: prep cannot start here


def _span(spec: Spec) -> tuple[int, int]:
    """Where a stream starts and is expected to end, in samples (a minute when unknown)."""
    header = int(spec.duration_s * SAMPLE_RATE)
    part = spec.part
    if part is None:
        return 0, header or 60 * SAMPLE_RATE
    end = part.boundary if part.boundary is not None else max(header, part.start)
    return part.start, end


class ProcPool:
    def __init__(self, processes: int, slots: int, model: SileroModel, credits: Credits,
                 nice: int = 0, step_timeout_s: float = 120.0,
                 target: Callable[..., None] = child.main) -> None:
        self.size = processes
        self.target = target  # the processes' entry point (tests wrap it to inject faults)
        self.arena = Arena(slots)
        self.model = model
        self.credits = credits
        self.nice = nice
        self.step_timeout_s = step_timeout_s
        self.procs: list[Proc] = []
        self.streams: dict[int, Stream] = {}
        self._holder: dict[int, Stream] = {}  # slot -> the stream whose window is in it
        self._sids = itertools.count(1)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._early: dict[int, int] = {}  # index -> deaths in a row soon after a start
        self._closed = False
        self.deaths = 0
        self._all_ready: asyncio.Event | None = None
        self.on_death: Callable[[], None] | None = None  # metrics, tests

    # ---- life -----------------------------------------------------------------------------
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._all_ready = asyncio.Event()
        self.procs = [self._proc(k) for k in range(self.size)]
        await asyncio.to_thread(self._start_all)
        self._loop.call_later(self.step_timeout_s / 4, self._watch)

    def _proc(self, index: int) -> Proc:
        return Proc(index, self.target, (self.arena.name, self.arena.count, self.nice),
                    ("model", self.model), self.post, self._unpack)

    def _unpack(self, msg: tuple[Any, ...]) -> None:
        """On a pipe's reader thread: a record's samples read out of their slots (the slots
        are the stream's until released, so nothing else writes them meanwhile)."""
        if msg[0] == "out":
            msg[2].unpack(self.arena.view, engine_audio)

    async def ready(self) -> None:
        """Until every process has started (benchmarks and tests; the service does not wait:
        streams opened meanwhile queue in the pipes)."""
        assert self._all_ready is not None
        await self._all_ready.wait()

    def _start_all(self) -> None:
        for p in self.procs:
            p.start()

    @property
    def closed(self) -> bool:
        return self._closed

    def shutdown(self) -> None:
        """Refuse new streams, end the open ones (their owners get ShuttingDown: the jobs stay
        queued), and let the processes exit; reaped on a thread of their own."""
        if self._closed:
            return
        self._closed = True
        for s in list(self.streams.values()):
            if not s.ended:
                self._end(s)
                s.owner.failed(s, ShuttingDown("service stopping; the job stays queued"))
        for p in self.procs:
            p.send(("exit",))
            p.stop()
        self.arena.close()
        self._reaper = threading.Thread(target=self._reap, name="prep-reaper", daemon=True)
        self._reaper.start()

    def _reap(self, timeout_s: float = 5.0) -> None:
        for p in self.procs:
            p.join(timeout_s)

    async def stop(self) -> None:
        """:meth:`shutdown`, and wait until the processes have exited."""
        self.shutdown()
        await asyncio.to_thread(self._reaper.join)

    def post(self, proc: Proc, msg: tuple[Any, ...]) -> None:
        """From a pipe's reader thread."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(self._on, proc, msg)

    # ---- the streams' side ------------------------------------------------------------------
    @property
    def broken(self) -> bool:
        """Every process died soon after its start, again and again (an install that cannot
        run them): streams fail with an internal error instead of waiting for one."""
        return all(self._early.get(p.index, 0) >= BROKEN_AFTER for p in self.procs)

    def open(self, owner: Owner, job: str, spec: Spec, gated: bool = False) -> Stream:
        """A stream on the live process with the least audio left to prepare (by the headers:
        sixteen 20-minute uploads and one split in two, placed by count, left one process
        20 minutes more than the other at the end)."""
        live = [p for p in self.procs if not p.dead] or self.procs
        proc = min(live, key=lambda p: (not p.ready, self._load(p), p.index))
        at, until = _span(spec)
        s = Stream(next(self._sids), owner, job, spec, proc, gated=gated, at=at, until=until)
        self.streams[s.sid] = s
        if self.broken or self._closed:
            s.ended = True
            self._forget(s)
            assert self._loop is not None
            self._loop.call_soon(owner.failed, s, self._refusal())
            return s
        proc.streams.add(s.sid)
        proc.send(("open", s.sid, spec))
        self._grant()
        return s

    def _load(self, proc: Proc) -> int:
        return sum(self.streams[sid].left for sid in proc.streams if sid in self.streams)

    def _refusal(self) -> Exception:
        if self._closed:
            return ShuttingDown("service stopping; the job stays queued")
        return RuntimeError("the prep processes keep dying at start; see the server log")

    def close(self, s: Stream) -> None:
        if not s.ended and not s.closing:
            s.closing = True
            s.proc.send(("close", s.sid))

    def ungate(self, s: Stream) -> None:
        if s.gated:
            s.gated = False
            self._grant()

    def stop_at(self, s: Stream, end: int | None) -> None:
        if not s.ended:
            s.proc.send(("stop_at", s.sid, end))

    def ack(self, s: Stream) -> None:
        if not s.ended:
            s.proc.send(("ack", s.sid))

    def release(self, slot: int) -> None:
        s = self._holder.pop(slot, None)
        if s is None:
            return
        s.held.discard(slot)
        self.arena.give(slot)
        self._forget(s)
        self._grant()

    @property
    def held(self) -> int:
        return self.arena.count - self.arena.free

    # ---- records ----------------------------------------------------------------------------
    def _on(self, proc: Proc, msg: tuple[Any, ...]) -> None:
        kind = msg[0]
        if kind == "dead":
            self._died(proc)
            return
        if kind == "ready":
            proc.ready = True
            self._early[proc.index] = 0
            if self._all_ready is not None and all(p.ready for p in self.procs):
                self._all_ready.set()
            self._grant()
            return
        s = self.streams.get(msg[1])
        if kind == "busy":
            proc.busy, proc.busy_since = msg[1], time.monotonic()
            return
        if kind == "closed":
            if s is not None:
                self._give_back(s, msg[2])
                if s.closing:
                    self._end(s)
            return
        if s is None or s.proc is not proc:
            return
        proc.busy = None
        if kind == "opened":
            s.owner.opened(s, msg[2], msg[3])
        elif kind == "out":
            out: Out = msg[2]
            s.at = out.fed
            for slot, *_ in out.windows:
                s.granted.discard(slot)
                s.held.add(slot)
                self._holder[slot] = s
            if out.done:
                self._give_back(s, out.unused)
                self._end(s)
            s.owner.out(s, out)
        elif kind == "error":
            failure: Failure = msg[2]
            self._end(s)
            s.owner.failed(s, failure.exception())
        self._grant()

    def _give_back(self, s: Stream, slots: list[int]) -> None:
        for slot in slots:
            if slot in s.granted:
                s.granted.discard(slot)
                self.arena.give(slot)
        self._forget(s)

    def _end(self, s: Stream) -> None:
        s.ended = True
        s.proc.streams.discard(s.sid)
        self._forget(s)

    def _forget(self, s: Stream) -> None:
        if s.ended and not s.granted and not s.held:
            self.streams.pop(s.sid, None)

    # ---- credits ----------------------------------------------------------------------------
    def _grant(self) -> None:
        """Free slots to the streams that may take one, the job holding fewest first."""
        if self._closed or not self.arena.free:
            return
        live = [s for s in self.streams.values()
                if not s.ended and not s.closing and not s.proc.dead and not s.gated]
        jobs: dict[str, int] = {}
        for s in self.streams.values():
            if not s.ended or s.held:
                jobs[s.job] = jobs.get(s.job, 0) + len(s.granted) + len(s.held)
        share = self.credits.per_job(len({s.job for s in live}))
        heap = [(jobs.get(s.job, 0), len(s.granted), s.sid) for s in live
                if len(s.granted) < STREAM_AHEAD and jobs.get(s.job, 0) < share]
        heapq.heapify(heap)
        given: dict[int, list[int]] = {}
        while heap and self.arena.free:
            held, granted, sid = heapq.heappop(heap)
            s = self.streams[sid]
            if jobs.get(s.job, 0) != held:  # the job took a slot through another stream
                held = jobs.get(s.job, 0)
                if held < share:
                    heapq.heappush(heap, (held, granted, sid))
                continue
            slot = self.arena.take()
            assert slot is not None
            s.granted.add(slot)
            given.setdefault(sid, []).append(slot)
            jobs[s.job] = held + 1
            if granted + 1 < STREAM_AHEAD and held + 1 < share:
                heapq.heappush(heap, (held + 1, granted + 1, sid))
        for sid, slots in given.items():
            s = self.streams[sid]
            s.proc.send(("credit", sid, slots))

    # ---- deaths -----------------------------------------------------------------------------
    def _died(self, proc: Proc) -> None:
        if proc.dead:
            return
        proc.dead = True
        if self._closed:
            return
        self.deaths += 1
        early = not proc.ready and time.monotonic() - proc.started < EARLY_DEATH_S
        n = self._early[proc.index] = self._early.get(proc.index, 0) + 1 if early else 0
        log.warning("prep process %s died (exit %s) while %s", proc.process.pid,
                    proc.process.exitcode,
                    f"working on stream {proc.busy}" if proc.busy else "idle")
        if self.on_death is not None:
            self.on_death()
        # Its replacement first, so that the streams opened again below have a place.
        new = self.procs[proc.index] = self._proc(proc.index)
        delay = 0.0 if n <= 1 else min(60.0, 2.0 ** (n - 1))
        assert self._loop is not None
        self._loop.call_later(delay, lambda: asyncio.ensure_future(self._start(new, proc)))
        for sid in sorted(proc.streams):
            s = self.streams[sid]
            self._give_back(s, list(s.granted))  # its credits died with it
            was_open = not s.closing
            self._end(s)
            if was_open and self.broken:
                s.owner.failed(s, self._refusal())
            elif was_open:
                s.owner.lost(s, blamed=proc.busy == sid)
        proc.streams.clear()
        proc.stop()
        self._grant()

    async def _start(self, new: Proc, dead: Proc) -> None:
        await asyncio.to_thread(dead.join, 1.0)
        if self._closed:
            return
        try:
            await asyncio.to_thread(new.start)
        except Exception:
            log.exception("could not start a prep process")
            self._died(new)

    def _watch(self) -> None:
        """A step that outlives ``step_timeout_s`` (a decoder that never returns): kill it, and
        it is handled as a crash on that upload."""
        if self._closed or self._loop is None:
            return
        now = time.monotonic()
        for p in self.procs:
            if not p.dead and p.busy is not None and now - p.busy_since > self.step_timeout_s:
                log.warning("prep process %d stuck on stream %d for %.0f s; killing it",
                            p.process.pid, p.busy, now - p.busy_since)
                with contextlib.suppress(Exception):
                    p.process.kill()
        self._loop.call_later(self.step_timeout_s / 4, self._watch)
