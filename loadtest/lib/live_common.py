"""What both live benches share (loadtest/live.py for batchscribe, loadtest/live_peer.py for
WhisperLive): the streams, their real-time pacing, and the scoring.

**A stream** is corpus speech as a microphone would give it: clips (1-15 s, English, no
single-word set) in a seeded order, separated by pauses of 1.0-2.0 s, after 0.5 s of silence and
followed by ``tail_s`` of silence (so a VAD can end the last utterance). Every stream of a run
has its own order (seed + stream number), so N streams never speak in lockstep.

**Pacing**: 100 ms chunks, chunk k (samples [k*1600, (k+1)*1600)) sent at t0 + (k+1) x 0.1 s:
no chunk leaves before its audio would have been spoken, and lateness never accumulates (each
send waits for its own deadline, not for 0.1 s after the previous one).

**Where an utterance's speech is**: its clip's first and last 10 ms frame within
``SPEECH_DB`` of the clip's loudest frame (:func:`speech_bounds`: plain energy, the same for
both benches, not either service's VAD). Clips end with up to 1.8 s of near silence (30 of the
74 live clips more than 0.5 s; the MFA recordings most): measured from the clip's file end, a
turn the VAD rightly ended at the last word looked "not yet final" until the stream's next
utterance finished, seconds later (before 2026-11-27 both benches counted so).

**Heard**: an utterance some completed text overlaps (a turn's span for batchscribe, a
completed segment's for WhisperLive). One that none overlaps was not heard: the service's VAD
took it for silence (Silero at the client's threshold 0.5 misses the corpus's whispered,
falsetto and creaky MFA clips), so it has no turn to time; it is counted as ``not_heard``, its
words are missing from the WER, and ``turn_latency_with_not_heard`` keeps the older reading
(such an utterance "finalised" when a later turn passed it).

**Turn latency**: from the send time of the chunk holding an utterance's last speech sample
(the moment the speaker's last word reached the service) to the first message that finalises
it: a completed span reaching that sample (within ``tolerance``), or starting after it. Where
the completed spans over an utterance end short of its last speech by more than that (the
service's VAD ended the turn and never took the rest for speech: the whispered MFA clips, whose
room tone lies within ``SPEECH_DB`` of their loudest frame), it is timed from the last speech
sample they cover: the rest was never heard, and counts as missed words in the WER, not as
seconds until a later turn passed it (as for the utterances not heard at all).
**Interim**: an utterance of >= 4 s got interim text if some non-final text covering it
arrived before that same moment. WER: app.scoring (the project's one scorer) over the streams,
each stream's finalised text against its utterances' references; ``wer_heard_percent`` against
the references of the utterances heard only (what the decodes cost, apart from what the VAD
missed).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from app.client.scoring import wer_percent
from loadtest.lib.corpus import Clip, load_corpus
from loadtest.lib.stats import latency_summary

RATE = 16_000
CHUNK_S = 0.1
CHUNK = int(RATE * CHUNK_S)
LONG_TURN_S = 4.0
SKIP_SETS = ("commonvoice_single_word",)


SPEECH_DB = -35.0  # a 10 ms frame this close to the clip's loudest frame is speech


def speech_runs(audio: np.ndarray) -> list[tuple[float, float]]:
    """Seconds from the clip's start: each run of speech frames (see the module doc)."""
    frame = RATE // 100
    n = audio.size // frame
    if n == 0:
        return [(0.0, audio.size / RATE)]
    rms = np.sqrt((audio[:n * frame].reshape(n, frame).astype(np.float64) ** 2).mean(1) + 1e-12)
    speech = np.flatnonzero(20 * np.log10(rms / rms.max()) > SPEECH_DB)
    breaks = np.flatnonzero(np.diff(speech) > 1)
    firsts = np.concatenate([speech[:1], speech[breaks + 1]])
    lasts = np.concatenate([speech[breaks], speech[-1:]])
    return [(float(a * frame / RATE), float((b + 1) * frame / RATE)) for a, b in zip(firsts, lasts,
                                                                                  strict=True)]


def speech_bounds(audio: np.ndarray) -> tuple[float, float]:
    """Seconds from the clip's start to its first and last speech frame (see the module doc)."""
    runs = speech_runs(audio)
    return runs[0][0], runs[-1][1]


def sent_at(t: float) -> float:
    """Stream time at which the chunk holding stream time ``t`` is sent."""
    return float(np.ceil(t / CHUNK_S - 1e-9) * CHUNK_S)


@dataclass(frozen=True)
class Utterance:
    clip_id: str
    reference: str
    start_s: float  # stream time of its first speech frame
    end_s: float  # stream time of its last speech frame (not the clip's end: see the module doc)
    runs: tuple[tuple[float, float], ...] = ()  # its speech frames' runs, in stream time

    @property
    def spoken_at(self) -> float:
        """Stream time at which the chunk holding its last sample is sent."""
        return sent_at(self.end_s)

    def heard_until(self, spans: Sequence[tuple[float, float | None]]) -> float:
        """The end of its last speech that ``spans`` (start_s, end_s or None: open) cover."""
        runs = self.runs or ((self.start_s, self.end_s),)
        ends = [min(b, e if e is not None else b) for a, b in runs for s, e in spans
                if a < (e if e is not None else b) and b > s]
        return max(ends, default=self.end_s)


@dataclass
class Stream:
    audio: np.ndarray  # 16 kHz float32
    utterances: list[Utterance]


@dataclass
class Outcome:
    """What one stream's client saw."""

    final_at: dict[int, float] = field(default_factory=dict)  # utterance -> wall time finalised
    heard_to: dict[int, float] = field(default_factory=dict)  # utterance -> stream time timed from
    interim_before_end: set[int] = field(default_factory=set)
    heard: set[int] = field(default_factory=set)  # utterances some completed text overlaps
    text: str = ""  # everything finalised, in order
    # per utterance, the finalised texts of the turns that overlap it ([] where none does), and
    # for each of those turns, how many utterances it overlaps
    turns: list[list[tuple[str, int]]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    t0: float = 0.0  # wall time of stream time 0
    # every finalised turn: (start_s, end_s or None: the stream's end, text), in arrival order
    spans: list[tuple[float, float | None, str]] = field(default_factory=list)


def turn_audio(stream: Stream, spans: Sequence[tuple[float, float | None, str]]
               ) -> list[np.ndarray]:
    """Each turn's audio as the session heard it: the stream from its start to its end."""
    return [stream.audio[round(a * RATE):None if b is None else round(b * RATE)]
            for a, b, _ in spans]


def read_as(stream: Stream, outcome: Outcome, texts: Sequence[str]) -> Outcome:
    """``outcome`` with its turns read as ``texts`` instead (one per span, in span order): the
    same turns' uploads, scored as the live text is (:func:`wer_by_turns`)."""
    spans = [(a, b, t) for (a, b, _), t in zip(outcome.spans, texts, strict=True)]
    return Outcome(heard=set(outcome.heard), spans=spans,
                   text=" ".join(t.strip() for t in texts if t.strip()),
                   turns=turns_over(stream.utterances, spans))


def live_clips(clips: Sequence[Clip] | None = None) -> list[Clip]:
    pool = clips if clips is not None else load_corpus()
    return sorted((c for c in pool if 1.0 <= c.duration_s <= 15.0 and c.set not in SKIP_SETS),
                  key=lambda c: c.id)


def build_stream(clips: Sequence[Clip], seconds: float, seed: int, tail_s: float = 3.0,
                 cache: dict[str, np.ndarray] | None = None) -> Stream:
    """Clips in a seeded order with pauses until the speech passes ``seconds``."""
    from app.audio import decode

    rng = random.Random(seed)
    order = list(clips)
    rng.shuffle(order)
    parts = [np.zeros(int(0.5 * RATE), np.float32)]
    pos = parts[0].size
    utts: list[Utterance] = []
    for c in order:
        if pos / RATE >= seconds:
            break
        if cache is not None and c.id in cache:
            a = cache[c.id]
        else:
            a = decode(c.path, 60.0)
            if cache is not None:
                cache[c.id] = a
        at = pos / RATE
        runs = tuple((at + x, at + y) for x, y in speech_runs(a))
        utts.append(Utterance(c.id, c.reference, runs[0][0], runs[-1][1], runs))
        pause = np.zeros(int(rng.uniform(1.0, 2.0) * RATE), np.float32)
        parts += [a, pause]
        pos += a.size + pause.size
    parts.append(np.zeros(int(tail_s * RATE), np.float32))
    return Stream(np.concatenate(parts), utts)


async def paced(chunks: int, send: Callable[[int], Awaitable[None]], t0: float) -> None:
    """``send(k)`` for each 100 ms chunk k, each at its deadline (see the module doc)."""
    for k in range(chunks):
        delay = t0 + (k + 1) * CHUNK_S - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        await send(k)


def chunks_of(samples: int) -> int:
    return -(-samples // CHUNK)


Done = tuple[float, float | None, float]  # a completed turn (segment): start_s, end_s, wall time


def finalise(out: Outcome, stream: Stream, done: Sequence[Done], tolerance: float) -> None:
    """Which utterances were heard, when each was final and from when it is timed, given every
    completed span in arrival order (see the module doc)."""
    for k, u in enumerate(stream.utterances):
        over = [(a, b) for a, b, _ in done if a < u.end_s and (b is None or b > u.start_s)]
        if not over:
            continue
        out.heard.add(k)
        target = u.end_s
        if not any(b is None or b >= u.end_s - tolerance for _, b in over):
            target = u.heard_until(over)  # the turns heard its speech up to here, no further
        at = next((w for a, b, w in done if b is None or a >= target
                   or b >= max(target - tolerance, u.start_s)), None)
        if at is not None:
            out.final_at[k], out.heard_to[k] = at, target


def score(streams: Sequence[Stream], outcomes: Sequence[Outcome]) -> dict[str, Any]:
    """Turn latency, utterances never finalised, interim text on long turns, WER."""
    latencies, every, never, not_heard, long_turns, long_interim = [], [], 0, 0, 0, 0
    timeline: list[tuple[float, float]] = []  # (its end, s after the first stream's start; latency)
    base = min((o.t0 for o in outcomes), default=0.0)
    for s, o in zip(streams, outcomes, strict=True):
        for k, u in enumerate(s.utterances):
            at = o.final_at.get(k)
            end = o.t0 + sent_at(o.heard_to.get(k, u.end_s))
            late = None if at is None else at - end
            if late is not None:
                every.append(late)
            if k not in o.heard:  # no turn covered it: nothing to time (see the module doc)
                not_heard += 1
            elif late is None:
                never += 1
            else:
                latencies.append(late)
                timeline.append((round(end - base, 2), round(late, 3)))
            if u.end_s - u.start_s >= LONG_TURN_S:
                long_turns += 1
                long_interim += k in o.interim_before_end
    refs = [" ".join(u.reference for u in s.utterances) for s in streams]
    heard = [" ".join(u.reference for k, u in enumerate(s.utterances) if k in o.heard)
             for s, o in zip(streams, outcomes, strict=True)]
    return {
        "utterances": sum(len(s.utterances) for s in streams),
        "turn_latency": latency_summary(latencies),
        # Each timed turn, in order of its end: runs pool by these (loadtest/live_report.py),
        # and the tail shows where in the run it fell (beside an upload: its progress).
        "turn_latencies": [list(t) for t in sorted(timeline)],
        "never_finalised": never,
        "not_heard": not_heard,
        "turn_latency_with_not_heard": latency_summary(every),
        "long_turns": long_turns,
        "long_turns_with_interim": long_interim,
        "interim_share": round(long_interim / long_turns, 3) if long_turns else None,
        "wer_percent": wer_percent(refs, [o.text for o in outcomes]),
        "wer_heard_percent": wer_percent(heard, [o.text for o in outcomes]),
        "errors": sorted({e for o in outcomes for e in o.errors})[:10],
    }


def turns_over(utterances: Sequence[Utterance], spans: Sequence[tuple[float, float | None, str]]
               ) -> list[list[tuple[str, int]]]:
    """Per utterance, the ``(text, utterances it overlaps)`` of each finalised turn
    ``(start_s, end_s, text)`` that overlaps it (see :func:`wer_by_turns`)."""
    def over(start: float, end: float | None, u: Utterance) -> bool:
        return start < u.end_s and (end is None or end > u.start_s)

    reach = [sum(over(a, b, u) for u in utterances) for a, b, _ in spans]
    return [[(t, n) for (a, b, t), n in zip(spans, reach, strict=True) if over(a, b, u)]
            for u in utterances]


def wer_by_turns(streams: Sequence[Stream], outcomes: Sequence[Outcome],
                 batch: dict[str, str]) -> dict[str, Any]:
    """Live WER against batch WER (``batch``: each clip's upload text), utterance by utterance,
    split by how the session's VAD cut them: **one turn** (one turn holds the utterance and
    nothing else: the same audio as the upload, so any difference is the decoding's), **split**
    (the client's ``silence_duration_ms`` ended turns at pauses inside it, and each piece was
    decoded without the rest), **merged** (a turn held it and another utterance), **not heard**
    (no turn: the VAD took it for silence). Texts joined in turn order."""
    rows: dict[str, list[tuple[str, str, str]]] = {"one_turn": [], "split": [], "merged": []}
    not_heard = 0
    for s, o in zip(streams, outcomes, strict=True):
        for u, turns in zip(s.utterances, o.turns, strict=True):
            if not turns:
                not_heard += 1
                continue
            kind = ("merged" if any(n > 1 for _, n in turns)
                    else "one_turn" if len(turns) == 1 else "split")
            rows[kind].append((u.reference, " ".join(t.strip() for t, _ in turns),
                               batch[u.clip_id]))
    out: dict[str, Any] = {"not_heard": not_heard}
    for kind, rs in rows.items():
        refs = [r for r, _, _ in rs]
        out[kind] = {"utterances": len(rs), "words": sum(len(r.split()) for r in refs),
                     "live_wer_percent": wer_percent(refs, [t for _, t, _ in rs]) if rs else None,
                     "batch_wer_percent": wer_percent(refs, [t for _, _, t in rs]) if rs else None}
    return out


def wer_by_set(streams: Sequence[Stream], outcomes: Sequence[Outcome], batch: dict[str, str],
               sets: dict[str, str]) -> dict[str, Any]:
    """Live against batch WER (as :func:`wer_by_turns`, every utterance: one no turn covered
    reads as nothing) on the corpus's read speech and on its other sets, as the corpus README
    asks (the other sets are its hard cases: fillers, whisper, falsetto, creaky voice, children)
    and as loadtest/lib/stats.py :func:`~loadtest.lib.stats.wer_by_group` reports uploads."""
    from loadtest.lib.corpus import READ_SPEECH

    rows: dict[str, list[tuple[str, str, str]]] = {"read_speech": [], "other_sets": []}
    for s, o in zip(streams, outcomes, strict=True):
        for u, turns in zip(s.utterances, o.turns, strict=True):
            group = "read_speech" if sets.get(u.clip_id) in READ_SPEECH else "other_sets"
            rows[group].append((u.reference, " ".join(t.strip() for t, _ in turns),
                                batch[u.clip_id]))
    return {group: {"utterances": len(rs), "words": sum(len(r.split()) for r, _, _ in rs),
                    "live_wer_percent": wer_percent([r for r, _, _ in rs], [t for _, t, _ in rs]),
                    "batch_wer_percent": wer_percent([r for r, _, _ in rs], [b for _, _, b in rs])}
            for group, rs in rows.items()}


def loadavg() -> list[float]:
    import os

    return [round(x, 2) for x in os.getloadavg()]
