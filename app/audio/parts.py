"""One long upload on many cores: a seekable upload cut into parts prepared side by side,
joined at a silence so that no word is lost or read twice at a seam.

A 20-minute upload prepared as one stream runs at one core's pace (~650x real time for a
16 kHz WAV here, ~250x for MP3, Opus or AAC), so one 60-minute upload alone could never fill a
GPU's batch. Cut into parts, each decoded from its own seek point in its own prep process
(app/audio/procs), it runs at the pace of as many cores as it has parts.

* **Where parts begin.** Part k is nominally ``[B_k, B_k+1)``. It decodes from ``B_k - WARM_S``
  so Silero's LSTM state has warmed up by ``B_k`` (from a cold state its probabilities differ
  from one pass's by up to 0.5 at first, 0.04-0.18 after 8 s, and settle within ~1-2 minutes:
  measured on a 20-minute corpus upload, three seek points), then looks for a silence in
  ``[B_k, B_k + SEARCH_S)``: the first run of chunks below the span rules' lower threshold at
  least two paddings long, else the longest run, else the least speech-like chunk. The seam
  ``C_k`` is that run's middle. Its windows are those of the spans from ``C_k`` on (their
  padding cut there, as the upload's start cuts the first span's).
* **Where parts end.** Part k-1 decodes up to ``B_k`` freely, then waits to be told ``C_k``
  (the pool relays it as soon as part k has found it, usually long before) and ends its audio
  there: its last span's padding is cut at the seam. Every sample after the seam belongs to
  exactly one part, so no speech is in two windows and none in no window.
* **Which containers.** Those whose decoder finds a sample exactly: WAV, FLAC, Ogg (Opus) and
  MP4 (AAC) by FFmpeg's seek, counted from the stream's start time (a codec's delay); MP3 and
  ADTS AAC, whose seek is an estimate (a byte offset by bit rate, or a VBR file's Xing table:
  seconds off), by demuxing the packets before the point in order (app/audio/decoder.py
  ``SCAN_SEEK``: 0.11 s to demux a 20-minute MP3, 1.87 s to decode it; a part pays for the
  minutes before its start, so a 60-minute MP3 in 12 parts demuxes 330 minutes, ~1.8 CPU-s
  beside the ~18 it takes to prepare). Each lands on the sample one pass gives
  (tests/test_parts.py). Matroska/WebM seeks by its cues.
  A part whose seek fails is empty, and the part before it runs on to the next seam.

Windows near a seam differ from one pass's (a window that would have crossed it is two), and
so do span edges where the warmed state still differs; the transcript of a split 20-minute
upload matches the unsplit one (tests/test_parts_model.py). A new window start can change what
Whisper reads, as any window start can: on 4 minutes of read speech in 60 s parts (the shortest
``prep.part_s`` allows), part 1's first window [64.90, 93.38] s holds every sample of "he could
wait no longer", and whisper-base without timestamps reads that window, alone, without it (also
from 64.8 s, where the unsplit cutter would start it). tests/test_parts.py checks the samples:
every one that one pass calls speech is in exactly one window, at the shortest parts too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import av
import numpy as np

from app.audio.decoder import SCAN_SEEK, AudioDecoder, NotSeekable
from app.audio.media import PROBE_PACKET, _declared_duration, open_audio
from app.audio.server_vad import TunedVad
from app.audio.spans import CHUNK, SpanTracker
from app.audio.stream import Chunk, _Track
from app.audio.vad import SileroVad, Vad
from app.errors import UnsupportedMedia
from app.windows import SAMPLE_RATE, Window

WARM_S = 8.0
SEARCH_S = 20.0
SPLITTABLE = frozenset({"wav", "w64", "flac", "aiff", "ogg", "mov,mp4,m4a,3gp,3g2,mj2",
                        "matroska,webm", *SCAN_SEEK})
EMPTY = np.zeros(0, dtype=np.float32)


@dataclass(frozen=True)
class Part:
    """Part ``index`` of an upload: nominally from sample ``start`` to ``boundary`` (None:
    the last part, to the end of the audio)."""

    index: int
    start: int
    boundary: int | None


def plan(duration_s: float, parts: int) -> list[Part]:
    """``parts`` equal parts of an upload of ``duration_s`` seconds (by its header)."""
    n = max(1, parts)
    edges = [round(k * duration_s * SAMPLE_RATE / n) for k in range(n)]
    return [Part(k, edges[k], edges[k + 1] if k + 1 < n else None) for k in range(n)]


def splittable(path: Path) -> float | None:
    """The upload's declared duration in seconds if it can be split (a container that seeks
    where its timestamps say, with a duration in its header), else None (also for a file that
    does not open: the stream that opens it says why)."""
    try:
        with open_audio(path, PROBE_PACKET) as c:  # the header only
            if c.format.name not in SPLITTABLE:
                return None
            return _declared_duration(c, c.streams.audio[0])
    except (av.error.FFmpegError, UnsupportedMedia, OSError, ValueError, IndexError):
        return None


def find_seam(probs: np.ndarray, first: int, lo: int, neg: float, pad: float,
              complete: bool) -> int | None:
    """The seam in ``[lo, lo + SEARCH_S)`` from the probabilities of the chunks from sample
    ``first`` (see the module doc), or None while more audio may change it (``complete``: no
    more comes). Returns -1 when the audio ends before ``lo`` (the part is empty)."""
    lo_j = math.ceil((lo - first) / CHUNK)
    hi_j = lo_j + math.ceil(SEARCH_S * SAMPLE_RATE / CHUNK)
    if probs.size <= lo_j:
        return -1 if complete else None
    window = probs[lo_j:hi_j]
    runs = _silences(window < neg)
    prefer = math.ceil(2 * pad / CHUNK)
    for a, b in runs:
        if b - a >= prefer:
            return first + CHUNK * (lo_j + a + (b - a) // 2)
    if probs.size < hi_j and not complete:
        return None
    if runs:
        a, b = max(runs, key=lambda r: r[1] - r[0])  # the first of the longest
        return first + CHUNK * (lo_j + a + (b - a) // 2)
    return first + CHUNK * (lo_j + int(np.argmin(window)))


def _silences(silent: np.ndarray) -> list[tuple[int, int]]:
    """Runs of True as (start, end) indices."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], silent.astype(np.int8), [0]])))
    return list(zip(edges[::2].tolist(), edges[1::2].tolist(), strict=True))


def silero_of(vad: Vad) -> tuple[SileroVad, float, float]:
    """The Silero model behind a job's VAD, and its span rules' lower threshold and padding
    (parts are cut only with Silero: its probabilities can be warmed up at a seek point)."""
    if isinstance(vad, TunedVad):
        base, spans = vad.vad, vad.spans()
    elif isinstance(vad, SileroVad):
        base, spans = vad, vad.spans()
    else:
        raise TypeError(f"parts need the Silero VAD, not {type(vad).__name__}")
    return base, spans.neg, spans.pad


def spans_at(vad: Vad, origin: int) -> SpanTracker:
    assert isinstance(vad, TunedVad | SileroVad)
    return vad.spans(origin)


class Probabilities(Protocol):
    """Silero's speech probabilities of audio fed in pieces (app/audio/vad.py)."""

    def feed(self, samples: np.ndarray) -> np.ndarray: ...

    def finish(self) -> np.ndarray: ...


class WarmStream:
    """A :class:`~app.audio.vad.VadStream` whose probabilities were computed from before its
    origin (the warm-up): those from the origin on are handed over once, then it runs on."""

    def __init__(self, probs: Probabilities, spans: SpanTracker,
                 backlog: np.ndarray | None) -> None:
        self._probs = probs
        self._spans = spans
        self._backlog: np.ndarray | None = backlog
        self._n = spans.origin

    def feed(self, samples: np.ndarray) -> list[tuple[int, int]]:
        self._n += samples.size
        if self._backlog is not None:  # ``samples``: the audio the backlog was computed from
            p, self._backlog = self._backlog, None
            return self._spans.feed(p)
        return self._spans.feed(self._probs.feed(samples))

    def finish(self) -> list[tuple[int, int]]:
        out = self._spans.feed(self._probs.finish())
        return out + self._spans.finish(self._n)

    def frontier(self) -> int:
        return self._spans.frontier()

    def keep_from(self) -> int:
        return self._spans.keep_from()


class PartStream:
    """One part of an upload (mono), a chunk at a time, as :class:`app.audio.AudioStream`."""

    def __init__(self, path: Path, vad: Vad, max_audio_s: float, chunk_s: float,
                 part: Part) -> None:
        self.part = part
        self._vad = vad
        silero, self._neg, self._pad = silero_of(vad)
        self._first = 0 if part.index == 0 else max(0, part.start - int(WARM_S * SAMPLE_RATE))
        self._probs = silero.probability_stream(keep_last=False)
        self._chunk = max(1, int(chunk_s * SAMPLE_RATE))
        self._fed = self._first  # the upload's samples decoded and handed on so far
        self._carry = EMPTY  # decoded past the boundary while the end is not known
        self.end: int | None = None  # where it stops, once known (None: the end of the audio)
        self.end_known = part.boundary is None
        self.done = self.empty = False
        self.windows = 0
        self.seam: int | None = None  # where its windows begin, once found
        self._seen: list[tuple[np.ndarray, np.ndarray]] = []  # searching: (audio, probs)
        self._track: _Track | None = None
        try:
            self._decoder: AudioDecoder | None = AudioDecoder(path, max_audio_s,
                                                              start=self._first)
        except NotSeekable:
            self._decoder = None
            self._finish_empty()
            return
        if part.index == 0:
            self._begin(0, EMPTY, None, final=False)

    @property
    def samples(self) -> int:
        """The upload's samples decoded so far (its end, where the audio ended here)."""
        return self._fed

    @property
    def seconds(self) -> float:
        return self._fed / SAMPLE_RATE

    @property
    def waiting(self) -> bool:
        """At its boundary, waiting to be told its end (:meth:`stop_at`)."""
        b = self.part.boundary
        return not self.done and not self.end_known and b is not None and self._fed >= b

    def stop_at(self, end: int | None) -> None:
        """End at the next part's seam (None: no later part has audio; run to the end)."""
        self.end, self.end_known = end, True

    def read_chunk(self) -> Chunk:
        start = self._fed
        if self.done or self.waiting:
            return Chunk([], [], EMPTY, start / SAMPLE_RATE)
        try:
            audio, last = self._next_audio()
        except NotSeekable:
            if self.seam is not None:
                raise
            self._finish_empty()
            return Chunk([], [], EMPTY, start / SAMPLE_RATE)
        self._fed += audio.size
        if self._track is None:
            windows = self._search(audio, last)
        else:
            windows = self._track.add(audio, self._fed, last)
        if last and not self.done:
            self._close()
        self.windows += len(windows)
        return Chunk(windows, [0] * len(windows), EMPTY, start / SAMPLE_RATE)

    def _next_audio(self) -> tuple[np.ndarray, bool]:
        """The next samples to hand on, and whether they are the last of this part."""
        assert self._decoder is not None
        stop = self.end if self.end_known else self.part.boundary
        want = self._chunk if stop is None else min(self._chunk, stop - self._fed)
        carry = self._carry
        while carry.size < want and not self._decoder.done:
            got = self._decoder.read(want - carry.size)
            carry = np.concatenate([carry, got]) if carry.size else got
        audio, self._carry = carry[:want], carry[want:].copy() if carry.size > want else EMPTY
        last = self._decoder.done and not self._carry.size
        if self.end_known and stop is not None and self._fed + audio.size >= stop:
            last = True
        return audio, last

    def _search(self, audio: np.ndarray, last: bool) -> list[Window]:
        """Warm-up and seam search: hold the audio and probabilities until the seam is
        known, then start the windows there."""
        self._seen.append((audio, self._probs.feed(audio)))
        probs = np.concatenate([p for _, p in self._seen])
        seam = find_seam(probs, self._first, self.part.start, self._neg, self._pad, last)
        if seam is None:
            return []
        if seam < 0:
            self._finish_empty()
            return []
        held = np.concatenate([a for a, _ in self._seen])
        self._seen = []
        at = seam - self._first
        return self._begin(seam, held[at:], probs[at // CHUNK:], final=last)

    def _begin(self, seam: int, audio: np.ndarray, backlog: np.ndarray | None,
               final: bool) -> list[Window]:
        self.seam = seam
        self._track = _Track(WarmStream(self._probs, spans_at(self._vad, seam), backlog))
        self._track.buf_start = seam
        return self._track.add(audio, self._fed, final) if audio.size or final else []

    def _finish_empty(self) -> None:
        self.seam, self.empty = -1, True
        self._close()

    def _close(self) -> None:
        self.done = True
        self._carry = EMPTY
        if self._decoder is not None:
            self._decoder.close()

    def close(self) -> None:
        if not self.done:
            self._close()
        if self._track is not None:
            self._track.clear()
