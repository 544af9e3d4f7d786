"""A deterministic discrete-event simulation of the speech batcher: the real owner and policy
(app/batching/owner.py, policy.py) on a simulated clock, engine calls that take what a cost
model says, and clients that submit windows as the service's would.

Wall-clock benches on this shared 2-core host are contended; the policy is pure and the owner
takes its clock as an argument, so the scheduler's bound can be checked exactly here: which
calls ran, when each window waited, for what. Nothing of asyncio runs (an event loop is only
created to make futures).

The cost model (:class:`Costs`) is calibrated from engine traces on this host (whisper-base
int8, two workers of one thread on 2 cores): ``loadtest/results/stall-same-clips.trace.jsonl``
(eccc0cd, load 0.6-3): encoder 0.0154 s per padded second at any batch size (200 calls, p10-p90
0.0144-0.0171), a 30 s fallback 0.0589 s per padded second; app/batching/policy.py: a decoder
batch's cost per 30 s window 461 ms alone, 310 ms in two, 200 ms in six. The issue's outside run
(a meeting-like upload, windows of ~28 s) saw its one-call batches of four windows take ~6.9 s:
``Costs(scale=1.5)`` is that slower host.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from app.batching.owner import Call, Owner
from app.batching.stages import Done, Item, Submit
from app.config import BatcherSettings
from app.engine.whisper import padded_length
from app.metrics import Metrics
from app.windows import (
    SAMPLE_RATE,
    DecodeOptions,
    Encoded,
    Prompt,
    Refresh,
    Urgency,
    Window,
    WindowResult,
)

OPTIONS = DecodeOptions()
_LOOP = asyncio.new_event_loop()  # only to make futures: it never runs
MARGIN = 8 * SAMPLE_RATE  # the engine's pad margin (ModelSettings.pad_margin_s)


@dataclass(frozen=True)
class Costs:
    """Engine seconds of a call (see the module doc)."""

    encode_per_padded_s: float = 0.0154
    decode_per_speech_s: float = 0.024  # a ~28 s dense window alone: ~0.67 s
    redo_per_padded_s: float = 0.0589
    per_call_s: float = 0.01
    scale: float = 1.0  # a slower (or busier) host: every call this much longer

    def of(self, stage: str, items: Sequence[Item]) -> float:
        n = len(items)
        enc = sum(padded_s(i) for i in items) * self.encode_per_padded_s
        dec = sum(i.window.duration for i in items) * self.decode_per_speech_s * max(0.35, n ** -0.47)
        cost = {"encode": enc, "decode": dec, "run": enc + dec,
                "redo": n * 30.0 * self.redo_per_padded_s}[stage]
        return self.scale * (cost + self.per_call_s)


def offline_rate(costs: Costs, clips: Sequence[float], batch: int, workers: int) -> float:
    """Audio seconds per second of ``clips`` run offline as the bench's engine limit runs them:
    sorted into padded-length classes, ``batch`` windows a call (encoder and decoder in one),
    the calls shared evenly by ``workers``."""
    classes: dict[int, list[float]] = {}
    for c in clips:
        classes.setdefault(padded_length(int(c * SAMPLE_RATE), MARGIN), []).append(c)
    total = 0.0
    for padded, group in classes.items():
        for k in range(0, len(group), batch):
            b = group[k:k + batch]
            enc = len(b) * padded / SAMPLE_RATE * costs.encode_per_padded_s
            dec = sum(b) * costs.decode_per_speech_s * max(0.35, len(b) ** -0.47)
            total += costs.scale * (enc + dec + costs.per_call_s)
    return sum(clips) / (total / workers)


def padded_s(item: Item) -> float:
    return (item.padded or padded_length(len(item.window.audio), MARGIN)) / SAMPLE_RATE


@dataclass
class Record:
    """One window's life: submitted, its first engine call, answered (simulated seconds)."""

    job: str
    urgency: Urgency
    critical: bool  # a short request's window or a live final: the bound's subject
    submitted: float
    started: float | None = None
    answered: float | None = None
    shed: bool = False
    waited_behind: list[tuple[str, float, bool]] = field(default_factory=list)  # calls running at submit


class Sim:
    """The owner on a simulated clock. ``staged``: two stages (CPU); ``loops``: windows whose
    decode asks for the 30 s fallback (by job id)."""

    def __init__(self, settings: BatcherSettings, workers: int = 2, staged: bool = True,
                 costs: Costs | None = None, loops: Callable[[Item], bool] = lambda i: False) -> None:
        self.loop = _LOOP
        self.owner = Owner(settings, workers, Metrics(), staged=staged,
                           size_class=lambda w: padded_length(len(w.audio), MARGIN),
                           padded=lambda w: padded_length(len(w.audio), MARGIN))
        self.staged = staged
        self.costs = costs or Costs()
        self.loops = loops
        self.now = 0.0
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self.records: dict[int, Record] = {}  # by id(item)
        self.items: dict[int, Item] = {}
        self.calls: list[tuple[float, float, Call]] = []  # start, end, call
        self._running: dict[int, tuple[float, Call]] = {}
        self._answered: dict[int, Callable[[Item, float], None]] = {}
        self._tick: float | None = None

    # ---- clients -----------------------------------------------------------------------------
    def at(self, t: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._events, (t, next(self._seq), fn))

    def submit(self, job: str, seconds: Sequence[float], *, first_rank: int = 0,
               job_windows: int | None = None, urgency: Urgency = Urgency.REQUEST,
               refresh: Refresh = (0, 0.0), critical: bool = False, margin_s: float = 8.0,
               answered: Callable[[Item, float], None] | None = None) -> list[Item]:
        """Windows of ``seconds`` each, submitted now (as Batcher.submit builds them)."""
        size = max(job_windows or 0, first_rank + len(seconds))
        items = []
        for k, s in enumerate(seconds):
            w = Window(np.zeros(int(s * SAMPLE_RATE), np.float32), 0.0, s, Prompt(language="en"))
            padded = padded_length(len(w.audio), int(margin_s * SAMPLE_RATE))
            item = Item(job, first_rank + k, w, OPTIONS, self.loop.create_future(), self.now,
                        job_windows=size, padded=padded if self.staged else 0, urgency=urgency,
                        refresh=refresh)
            self.records[id(item)] = Record(job, urgency, critical, self.now, waited_behind=[
                (c.stage, round(c.cost_s or 0.0, 3), c.bulk) for _, c in self._running.values()])
            self.items[id(item)] = item
            if answered is not None:
                self._answered[id(item)] = answered
            items.append(item)
        self._apply(Submit(tuple(items)))
        return items

    # ---- the engine and the clock ------------------------------------------------------------
    def _start(self, call: Call | None) -> None:
        if call is None:
            return
        for i in call.items:
            r = self.records[id(i)]
            if r.started is None:
                r.started = self.now
        cost = self.costs.of(call.stage, call.items)
        self._running[call.id] = (self.now, call)
        self.at(self.now + cost, lambda: self._finish(call))

    def _finish(self, call: Call) -> None:
        start, _ = self._running.pop(call.id)
        self.calls.append((start, self.now, call))
        results: list[WindowResult] | list[Encoded] = []
        if call.stage == "encode":
            results = [Encoded(i.padded, np.zeros(1, np.float32), "en", None) for i in call.items]
        else:
            results = [WindowResult("w", "en", None, -0.1, 0.0, 1.0,
                                    redo=call.stage != "redo" and self.loops(i))
                       for i in call.items]
        self._apply(Done(call.id, results, None, self.now - start))

    def _apply(self, msg: Submit | Done) -> None:
        self._start(self.owner.apply(msg, self.now))
        self._settle()

    def _settle(self) -> None:
        """Start what the policy picks; note the windows answered; set the next tick."""
        while isinstance(choice := self.owner.next(self.now), Call):
            self._start(choice)
        for key, item in list(self.items.items()):
            if item.future.done():
                r = self.records[key]
                r.answered = self.now
                r.shed = item.future.exception() is not None if not item.future.cancelled() else True
                del self.items[key]
                if key in self._answered:
                    self._answered.pop(key)(item, self.now)
        until = choice.until
        if until is not None and until > self.now and until != self._tick:
            self._tick = until
            self.at(until, self._settle)

    def run(self, until: float = 10_000.0, done: Callable[[], bool] = lambda: False) -> None:
        while self._events and self._events[0][0] <= until and not done():
            t, _, fn = heapq.heappop(self._events)
            self.now = max(self.now, t)
            fn()

    # ---- what it shows -----------------------------------------------------------------------
    def critical(self) -> list[Record]:
        return [r for r in self.records.values() if r.critical and r.answered is not None]

    def longest_call(self, bulk_only: bool = False) -> float:
        return max((e - s for s, e, c in self.calls if c.bulk or not bulk_only), default=0.0)


def percentile(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))] if s else 0.0


# ---- the traffic ---------------------------------------------------------------------------------
SHORT_CLIPS = (2.1, 3.4, 5.0, 7.2, 9.5, 1.5, 4.4, 6.1, 8.3, 2.9)  # corpus-like short clips (s)


class Upload:
    """A long upload of continuous speech, prepared a chunk at a time as app/jobs/work.py does:
    a chunk of ``chunk_s`` every ``prep_s`` (prep at ~105x real time beside a busy thread),
    at most ``ahead`` windows cut and not answered before the next chunk."""

    def __init__(self, sim: Sim, job: str, windows: Sequence[float], *, chunk_s: float = 60.0,
                 prep_s: float = 0.57, ahead: int = 24, start: float = 0.0,
                 on_done: Callable[[float], None] | None = None) -> None:
        self.sim, self.job, self.windows = sim, job, list(windows)
        self.on_done = on_done
        self.chunk_s, self.prep_s, self.ahead = chunk_s, prep_s, ahead
        self.cut = 0
        self.waiting = 0
        self.done_at: float | None = None
        self.answered = 0
        self._blocked = False
        sim.at(start + prep_s, self._chunk)

    def _chunk(self) -> None:
        if self.waiting >= self.ahead:
            self._blocked = True
            return
        seconds: list[float] = []
        total = 0.0
        while self.cut + len(seconds) < len(self.windows) and total < self.chunk_s:
            seconds.append(self.windows[self.cut + len(seconds)])
            total += seconds[-1]
        if not seconds:
            return
        self.sim.submit(self.job, seconds, first_rank=self.cut,
                        job_windows=max(len(self.windows), self.cut + len(seconds)),
                        answered=self._answered)
        self.cut += len(seconds)
        self.waiting += len(seconds)
        if self.cut < len(self.windows):
            self.sim.at(self.sim.now + self.prep_s, self._chunk)

    def _answered(self, item: Item, t: float) -> None:
        self.waiting -= 1
        self.answered += 1
        if self.answered == len(self.windows):
            self.done_at = t
            if self.on_done is not None:
                self.on_done(t)
        if self._blocked and self.waiting < self.ahead:
            self._blocked = False
            self.sim.at(t + self.prep_s, self._chunk)


class ShortClient:
    """One client posting short clips one at a time: each next clip ``overhead_s`` after the
    last answer (HTTP, spool, prep: the part of a request outside the batcher)."""

    def __init__(self, sim: Sim, n: int, *, start: float = 0.0, overhead_s: float = 0.3,
                 clips: Sequence[float] = SHORT_CLIPS, name: str = "short") -> None:
        self.sim, self.n, self.overhead_s, self.clips = sim, n, overhead_s, clips
        self.name = name  # job ids are name-k: clients beside each other need names of their own
        self.sent = 0
        self.latency: list[tuple[float, float]] = []  # (submitted, latency incl. overhead)
        sim.at(start, self._send)

    def _send(self) -> None:
        clip = self.clips[self.sent % len(self.clips)]
        self.sim.submit(f"{self.name}-{self.sent}", [clip], critical=True,
                        answered=self._answered)
        self.sent += 1

    def _answered(self, item: Item, t: float) -> None:
        self.latency.append((item.enqueued, t - item.enqueued + self.overhead_s))
        if self.sent < self.n:
            self.sim.at(t + self.overhead_s, self._send)


class LiveSession:
    """A Realtime session reading utterances of ``turns`` seconds, ``pause_s`` apart, as
    app/live does: while a turn is open, an interim decode of it every ``interval_s`` of new
    audio (one at a time, each its own batcher job, padded by ``margin_s``; text shows once a
    second one is answered, the local-agreement policy of app/live/agreement.py); its final
    ``silence_s`` after it ends (a waiting interim is dropped then). A turn's latency: its end
    to its final answer (the silence included)."""

    def __init__(self, sim: Sim, name: str, turns: Sequence[float], *, start: float = 0.0,
                 pause_s: float = 1.2, interval_s: float = 1.0, silence_s: float = 0.5,
                 margin_s: float = 3.0) -> None:
        self.sim, self.name, self.turns = sim, name, list(turns)
        self.pause_s, self.interval_s, self.silence_s = pause_s, interval_s, silence_s
        self.margin_s = margin_s
        self.results: list[tuple[float, float, bool]] = []  # (turn s, latency, interim shown)
        self._turn = -1
        self._n = itertools.count()
        sim.at(start, self._open)

    def _open(self) -> None:
        self._turn += 1
        if self._turn >= len(self.turns):
            return
        length, began = self.turns[self._turn], self.sim.now
        shown = [False]
        answered = [0]
        flying: list[Item] = []

        def got_interim(item: Item, t: float) -> None:
            if not item.future.cancelled() and item.future.exception() is None:
                answered[0] += 1
                # Text is sent once two decodes agree (app/live/agreement.py): a second one.
                shown[0] = answered[0] >= 2

        def interim(heard: float) -> None:
            if heard >= length:
                return
            if not (flying and not flying[-1].future.done()):
                flying[:] = self.sim.submit(
                    f"{self.name}-interim-{next(self._n)}", [heard], urgency=Urgency.LIVE_INTERIM,
                    refresh=(answered[0], began), margin_s=self.margin_s, answered=got_interim)
            self.sim.at(self.sim.now + self.interval_s, lambda: interim(heard + self.interval_s))

        def got_final(item: Item, t: float) -> None:
            self.results.append((length, t - (began + length), shown[0]))

        def final() -> None:
            if flying and not flying[-1].future.done():
                flying[-1].future.cancel()
            self.sim.submit(f"{self.name}-final-{next(self._n)}", [length],
                            urgency=Urgency.LIVE_FINAL, critical=True, margin_s=self.margin_s,
                            answered=got_final)

        self.sim.at(began + self.interval_s, lambda: interim(self.interval_s))
        self.sim.at(began + length + self.silence_s, final)
        self.sim.at(began + length + self.pause_s, self._open)


def meeting(minutes: float = 20.0, seed: int = 48) -> list[float]:
    """Window lengths of a meeting-like upload: continuous speech cut at its short pauses,
    windows of 26-29.5 s (the issue's ~28 s)."""
    rng = np.random.default_rng(seed)
    out: list[float] = []
    while sum(out) < minutes * 60:
        out.append(float(rng.uniform(26.0, 29.5)))
    return out


class KeptUpload:
    """A long upload kept in flight, posted again when it ends (as loadtest/stall.py does)."""

    def __init__(self, sim: Sim, windows: Sequence[float], *, start: float = 0.0) -> None:
        self.sim, self.windows = sim, windows
        self.uploads: list[Upload] = []
        self._post(start)

    def _post(self, t: float) -> None:
        self.uploads.append(Upload(self.sim, f"upload-{len(self.uploads)}", self.windows,
                                   start=t, on_done=self._post))

    def progress(self, t: float) -> float:
        """Windows of the uploads answered by ``t``, in uploads (1.0: one whole upload)."""
        return sum(1 for r in self.sim.records.values() if r.job.startswith("upload-")
                   and r.answered is not None and r.answered <= t) / len(self.windows)


def blocked(sim: Sim, record: Record, key: int) -> float:
    """A window's time in the batcher outside its own engine calls: queued, or encoded and
    waiting for its decode."""
    own = sum(e - s for s, e, c in sim.calls if any(id(i) == key for i in c.items))
    assert record.answered is not None
    return record.answered - record.submitted - own
