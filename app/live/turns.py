"""Server VAD: where a live turn starts and stops, from Silero's speech probabilities.

OpenAI's ``server_vad`` rules, on the probabilities of the service's own Silero model
(:meth:`app.audio.vad.SileroVad.probability_stream`, one per 512 samples = 32 ms):

* speech starts at the first chunk with ``p >= threshold``; the turn's audio begins
  ``prefix_padding_ms`` earlier (never before the previous turn's end), and that is the
  ``audio_start_ms`` of ``speech_started``;
* it stops once ``silence_duration_ms`` have passed since the probability last fell below
  ``threshold - 0.15`` (Silero's hysteresis, as app/audio/spans.py) without rising back over
  ``threshold``; ``audio_end_ms`` is that moment (OpenAI: "includes the silence duration");
* with ``early_final_ms`` (0: off), once the probability has stayed under ``threshold - 0.15``
  that long inside a turn, a ``pause`` edge (at most one per pause) says the turn may be over,
  and ``resume`` says it was not (the probability came back over ``threshold``): the session
  starts the turn's final decode at the pause, so the engine works while the VAD still waits
  out ``silence_duration_ms`` (the audio after the pause is silence by then, or it resumed);
* ``semantic_vad`` (``done_silence_ms`` set): the session judges the early final's text at
  each pause (:func:`sounds_finished`) and marks the pause; a marked pause ends the turn after
  ``done_silence_ms``, any other only after ``silence_duration_ms`` (eagerness's timeout), so a
  sentence said with pauses stays one turn and is read whole;
* a turn never outgrows Whisper's 30 s window (``max_turn_s``): it is cut at its last pause of
  >= 98 ms (the split rule of faster-whisper's VAD), or hard at the limit, and the next turn
  starts right there with no padding (the speech goes on).

All positions are in 16 kHz samples since the session's first audio. Pure and synchronous: the
session runs :meth:`SileroTurns.feed` in its executor (the model call is inference).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Literal, Protocol

import numpy as np

from app.audio.spans import CHUNK
from app.live.agreement import Agreement
from app.windows import SAMPLE_RATE

MIN_SPLIT_GAP = SAMPLE_RATE * 98 // 1000  # a pause a too-long turn may be cut at
ENDS = tuple(".?!。？！")


def ms(samples: int) -> int:
    return samples * 1000 // SAMPLE_RATE


def sounds_finished(text: str) -> bool:
    """Whether the read of a turn up to a pause sounds finished: Whisper punctuates by prosody,
    ending a sentence with ``.``, ``?`` or ``!`` and leaving a phrase that goes on open, with
    ``,`` or ``...`` or nothing. Over the corpus clips (whisper-base, no language given,
    pauses at 200 ms of Silero quiet): of the 51 pauses where server_vad's 500 ms ended a turn
    and the clip's speech went on, the read left 20 open, each inside a sentence ("And so my
    fellow Americans", "Montreal forced", "MFA is like"), and closed 31, most at a sentence or
    verse end; at the 81 clips' ends it closed 64, the rest ending on a comma (LJ Speech's
    clips stop mid-sentence) or an unfinished phrase (``python -m loadtest.live_pauses``)."""
    t = text.rstrip()
    return t.endswith(ENDS) and not t.endswith(("...", "…"))


@dataclass(frozen=True)
class Edge:
    kind: Literal["start", "stop", "pause", "resume"]
    at: int  # start: where the turn's audio begins (padding included); stop: where it ends;
    # pause / resume: where the probability had been low early_final_ms / came back
    speech_end: int | None = None  # stop, pause: where the last speech chunk ended
    forced: bool = False  # stop: cut at max_turn_s, the next turn begins here


@dataclass(frozen=True)
class VadRules:
    threshold: float = 0.5
    prefix_padding_ms: int = 300
    silence_duration_ms: int = 500
    max_turn_s: float = 29.5
    early_final_ms: int = 0  # pause edges this long into a silence (0: none), see the module doc
    done_silence_ms: int | None = None  # semantic_vad: the silence that ends a finished turn


class ProbabilityStream(Protocol):
    def feed(self, samples: np.ndarray) -> np.ndarray: ...

    def restart(self, last: int = 0) -> np.ndarray:
        """The model's state reset ``last`` chunks before the end of the last feed; those
        chunks' probabilities again."""
        ...


class TurnDetector:
    """The rules above over a stream of probabilities (one per ``CHUNK`` samples)."""

    def __init__(self, rules: VadRules, in_turn_from: int | None = None, at: int = 0) -> None:
        self.rules = rules
        self.neg = max(rules.threshold - 0.15, 0.01)
        self.pad = SAMPLE_RATE * rules.prefix_padding_ms // 1000
        self.silence = SAMPLE_RATE * rules.silence_duration_ms // 1000
        self.max_turn = int(SAMPLE_RATE * rules.max_turn_s)
        self.early = SAMPLE_RATE * rules.early_final_ms // 1000
        self.done_silence = None if rules.done_silence_ms is None \
            else SAMPLE_RATE * rules.done_silence_ms // 1000
        self._pause_at: int | None = None  # the current silence's pause edge (its ``at``)
        self._done_at: int | None = None  # a pause whose read sounded finished (mark_done)
        self.pos = at  # samples judged so far
        self.turn_start: int | None = in_turn_from  # the open turn's audio start
        self.floor = at  # no turn's audio starts before this (the last turn's end)
        self._below: int | None = None  # where the probability last fell under neg
        self._gap: int | None = None  # the open turn's last pause of >= 98 ms (its start)

    def end_turn(self, at: int) -> None:
        """The session ended the open turn at ``at`` (a commit, a clear): the next turn's audio
        starts after it."""
        self.turn_start, self._below, self._gap, self._pause_at = None, None, None, None
        self.floor = max(self.floor, at)

    def mark_done(self, pause_at: int) -> None:
        """semantic_vad: the read at the pause edge ``pause_at`` sounded finished. It counts
        while that silence lasts; speech resuming first makes it stale (the session's read
        comes back on the event loop, perhaps after this detector has moved on)."""
        self._done_at = pause_at

    def feed(self, probs: np.ndarray) -> list[Edge]:
        out: list[Edge] = []
        for p in probs.tolist():
            out += self._step(p, self.pos)
            self.pos += CHUNK
        return out

    def _step(self, p: float, at: int) -> list[Edge]:
        r = self.rules
        if self.turn_start is None:
            if p < r.threshold:
                return []
            self.turn_start = max(self.floor, at - self.pad)
            self._below = self._gap = None
            self._pause_at = None
            return [Edge("start", self.turn_start)]
        out: list[Edge] = []
        if p >= r.threshold:
            if self._below is not None and at - self._below >= MIN_SPLIT_GAP:
                self._gap = self._below
            self._below = None
            if self._pause_at is not None:
                self._pause_at = None
                out.append(Edge("resume", at))
        elif p < self.neg and self._below is None:
            self._below = at
        end = at + CHUNK
        quiet = self.silence
        if self.done_silence is not None and self._pause_at is not None \
                and self._done_at == self._pause_at:
            quiet = self.done_silence
        if self._below is not None and end - self._below >= quiet:
            out.append(Edge("stop", end, speech_end=self._below))
            self.turn_start, self.floor, self._pause_at = None, end, None
            return out
        if self.early and self._pause_at is None and self._below is not None \
                and end - self._below >= self.early:
            self._pause_at = end
            out.append(Edge("pause", end, speech_end=self._below))
        if end - self.turn_start >= self.max_turn:
            cut = self._gap if self._gap is not None and self._gap > self.turn_start else end
            out.append(Edge("stop", cut, speech_end=cut, forced=True))
            out.append(Edge("start", cut))
            self.turn_start, self.floor = cut, cut
            self._gap, self._pause_at = None, None
            if self._below is not None and self._below < cut:
                self._below = cut
        return out


class VadModel(Protocol):
    def probability_stream(self) -> ProbabilityStream: ...


class SileroTurns:
    """A session's turn detection: its own probability stream (the model's LSTM state carried
    across appends) and :class:`TurnDetector`.

    The state is reset where a turn ends (a stop after its silence, a commit, a clear), as
    Silero's ``reset_states`` between recordings. Carried on through a turn and the silence
    after it, the state held quiet speech under the threshold: in the live bench's 16 streams
    (corpus clips, 1-2 s pauses) three whispered clips, a falsetto and a creaky one never rose
    over 0.5 (at most 0.21-0.50), and no turn heard them; read from a fresh state the same
    audio reaches 0.50-0.81. Over 30 streams at each of four pause ranges (0.6-1.2 s to
    4-12 s), in digital silence and in noise at -60 dBFS, utterances no turn overlapped went
    from 56 of 1052 to 5, and no turn opened over the pauses either way."""

    def __init__(self, probs: ProbabilityStream, rules: VadRules,
                 in_turn_from: int | None = None, at: int = 0) -> None:
        self._probs = probs
        self.detector = TurnDetector(rules, in_turn_from, at)

    def feed(self, samples: np.ndarray) -> list[Edge]:
        probs, out, i = self._probs.feed(samples), [], 0
        while i < probs.size:
            edges = self.detector.feed(probs[i:i + 1])
            out += edges
            i += 1
            if any(e.kind == "stop" and not e.forced for e in edges):
                probs = np.concatenate([probs[:i], self._probs.restart(probs.size - i)])
        return out

    def end_turn(self, at: int) -> None:
        """The session ended the open turn at ``at`` (a commit, a clear)."""
        self.detector.end_turn(at)
        self._probs.restart()

    @property
    def semantic(self) -> bool:
        return self.detector.done_silence is not None

    def judge(self, pause_at: int, read: asyncio.Task[str]) -> None:
        """semantic_vad: the early final's decode started at the pause edge ``pause_at`` is back
        (a done callback, on the event loop): its text says whether the turn may end early."""
        if not read.cancelled() and read.exception() is None and sounds_finished(read.result()):
            self.detector.mark_done(pause_at)


@dataclass(eq=False)
class Turn:
    item_id: str
    start: int  # absolute sample where its audio begins
    vad: bool  # opened by server VAD (speech_started was sent)
    agreement: Agreement = field(default_factory=Agreement)
    interim: asyncio.Task[None] | None = None
    interim_upto: int = 0  # buffer end when the last interim decode was launched
    closed: bool = False
    early: asyncio.Task[str] | None = None  # the final's decode, started at a pause
    early_upto: int = 0  # where that decode's audio ends
    answered: int = 0  # interim decodes answered
    backoff: int = 1  # interim interval multiplier: doubled when the batcher sheds one
    refreshed: float = field(default_factory=time.monotonic)  # opened, or last interim answered


@dataclass
class Previous:
    """The turn closed last, which the next turn's final may read first and continue
    (``LiveSettings.context_gap_ms``): where its audio lies, and its transcript once back."""

    start: int
    end: int
    text: str | None = None


@dataclass
class LiveItem:
    """A committed turn, what ``completed`` (or ``failed``) said of it."""

    item_id: str
    start_ms: int
    end_ms: int
    transcript: str | None = None
    error: str | None = None
    interim_text: str = ""  # what was sent before the turn ended
