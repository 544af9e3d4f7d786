"""Speech spans from Silero VAD's speech probabilities: faster-whisper's rules, one
probability at a time, so a long upload is cut as it streams in (app/audio/vad.py feeds them).

The spans equal faster-whisper's ``get_speech_timestamps`` on every corpus clip, at its 0.4 s
padding and at the service's (``tests/test_vad.py``).
"""

from __future__ import annotations

import math

import numpy as np

from app.windows import SAMPLE_RATE, SPEECH_PAD_S, WINDOW_S

CHUNK = 512  # samples per speech probability (32 ms)


def speech_spans(probs: np.ndarray, n_samples: int,
                 pad_s: float = SPEECH_PAD_S) -> list[tuple[int, int]]:
    """Speech spans in samples from the probabilities of a whole upload (:class:`SpanTracker`)."""
    t = SpanTracker(speech_pad_ms=round(pad_s * 1000))
    return t.feed(probs) + t.finish(n_samples)


class SpanTracker:
    """faster-whisper's ``get_speech_timestamps`` rules (adapted from silero-vad; they only run
    on its own cached model), one probability at a time. Hysteresis between ``threshold`` and
    ``threshold - 0.15``; a span ends after ``min_silence_ms`` below it; one longer than
    ``max_speech_s`` is split at its last silence of > 98 ms, or else cut; spans are padded by
    ``speech_pad_ms`` each side (split evenly when closer): faster-whisper's 400 ms, or the
    service's :data:`~app.windows.SPEECH_PAD_S`.

    A span is final once the next one has begun (their gap is known) or once the audio has gone
    2 x pad past its end with nothing begun (the gap is at least that): the same spans as one
    pass over the whole upload, with at most ~2 x pad of lookahead (``tests/test_prep.py``).

    ``origin``: the sample the first probability is of, for a part of an upload prepared on
    its own (app/audio/parts.py): spans are in the upload's samples and none starts before it
    (its padding is cut there, as the upload's start cuts the first span's)."""

    def __init__(self, threshold: float = 0.5, max_speech_s: float = WINDOW_S,
                 min_silence_ms: int = 160,
                 speech_pad_ms: int = round(SPEECH_PAD_S * 1000), origin: int = 0) -> None:
        self.threshold = threshold
        self.neg = max(threshold - 0.15, 0.01)
        self.pad = SAMPLE_RATE * speech_pad_ms / 1000
        self.max_speech = SAMPLE_RATE * max_speech_s - CHUNK - 2 * self.pad
        self.min_silence = SAMPLE_RATE * min_silence_ms / 1000
        self.min_silence_at_max = SAMPLE_RATE * 98 / 1000
        self.origin = origin
        self._i = 0  # probabilities seen
        self._start: float | None = None
        self._temp_end = self._prev_end = self._next_start = 0.0
        self._raw: list[list[float]] = []  # raw spans not yet final (at most two)
        self._last_end: float | None = None  # raw end of the last span made final

    def feed(self, probs: np.ndarray) -> list[tuple[int, int]]:
        for p in probs.tolist():
            self._step(p, self._at())
            self._i += 1
        return self._settle(final=False, n_samples=0)

    def finish(self, n_samples: int) -> list[tuple[int, int]]:
        if self._start is not None and n_samples - self._start > 0:
            self._raw.append([self._start, n_samples])
        self._start = None
        return self._settle(final=True, n_samples=n_samples)

    def frontier(self) -> int:
        """Spans not yet returned end after their raw end, or after the probabilities seen."""
        return int(min([r[1] for r in self._raw] + [self._at()]))

    def keep_from(self) -> int:
        """Padding moves a start back by at most ``pad``; spans not yet begun start later."""
        starts = [r[0] for r in self._raw] + [self._at()]
        if self._start is not None:
            starts.append(self._start)
        return max(self.origin, int(min(starts) - self.pad))

    def _at(self) -> int:
        """The sample where the next probability's chunk begins."""
        return self.origin + CHUNK * self._i

    def _step(self, p: float, at: int) -> None:
        if p >= self.threshold and self._temp_end:
            self._temp_end = 0
            if self._next_start < self._prev_end:
                self._next_start = at
        if p >= self.threshold and self._start is None:
            self._start = at
            return
        if self._start is not None and at - self._start > self.max_speech:
            if self._prev_end:
                self._raw.append([self._start, self._prev_end])
                # still below the threshold since that silence: not speech yet
                self._start = None if self._next_start < self._prev_end else self._next_start
            else:
                self._raw.append([self._start, at])
                self._start = None
                self._prev_end = self._next_start = self._temp_end = 0
                return
            self._prev_end = self._next_start = self._temp_end = 0
        if p < self.neg and self._start is not None:
            self._temp_end = self._temp_end or at
            if at - self._temp_end > self.min_silence_at_max:  # a silence a long span may split at
                self._prev_end = self._temp_end
            if at - self._temp_end < self.min_silence:
                return
            if self._temp_end - self._start > 0:  # min_speech_duration_ms is 0
                self._raw.append([self._start, self._temp_end])
            self._start = None
            self._prev_end = self._next_start = self._temp_end = 0

    def _settle(self, final: bool, n_samples: int) -> list[tuple[int, int]]:
        """Pad the raw spans whose neighbours are known: faster-whisper's padding pass."""
        out: list[tuple[int, int]] = []
        pad = self.pad
        while self._raw:
            span = self._raw[0]
            if len(self._raw) > 1:
                nxt: float | None = self._raw[1][0]
            elif self._start is not None:
                nxt = self._start
            elif final:
                nxt = None
            elif self._at() - span[1] >= 2 * pad:
                nxt = math.inf  # whatever comes next starts at least 2 x pad later
            else:
                break
            start, end = span
            if self._last_end is None:  # the first span
                start = max(self.origin, start - pad)
            else:  # the gap to the previous span, as it was padded
                gap = start - self._last_end
                start = max(0, start - (gap // 2 if gap < 2 * pad else pad))
            if nxt is None:
                end = min(n_samples, end + pad)
            else:
                gap = nxt - span[1]
                end = span[1] + gap // 2 if gap < 2 * pad else end + pad
            self._last_end = span[1]
            self._raw.pop(0)
            out.append((int(start), int(end)))
        return out
