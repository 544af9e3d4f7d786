"""Speech spans into <= 30 s windows (whisperx's ``merge_chunks`` rule), as the spans arrive.

Spans of ONE upload are joined while the window would stay within 30 s; anything still longer is
cut hard at 30 s so the encoder never silently drops audio, and pieces under 0.1 s are noise,
not a word. :class:`WindowCutter` does this incrementally: a window closes when the next span
cannot join it, or when no span still to come can (every one ends after the VAD's frontier),
so a long upload's first windows leave while the rest is still being decoded.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from app.windows import N_SAMPLES, SAMPLE_RATE, Window

MIN_PIECE = SAMPLE_RATE // 10  # < 0.1 s is noise, not a word


class WindowCutter:
    def __init__(self) -> None:
        self._open: tuple[int, int] | None = None

    @property
    def open_start(self) -> int | None:
        """Where the window still growing starts (its samples must be kept), if any."""
        return self._open[0] if self._open else None

    def add(self, spans: Iterable[tuple[int, int]], frontier: int) -> list[tuple[int, int]]:
        """Windows (sample ranges) closed by these spans; no span to come ends before
        ``frontier``."""
        out: list[tuple[int, int]] = []
        for start, end in spans:
            if self._open is not None and end - self._open[0] <= N_SAMPLES:
                self._open = (self._open[0], end)
                continue
            if self._open is not None:
                out.append(self._open)
            self._open = (start, end)
        if self._open is not None and frontier - self._open[0] > N_SAMPLES:
            out.append(self._open)
            self._open = None
        return out

    def finish(self) -> list[tuple[int, int]]:
        out = [self._open] if self._open is not None else []
        self._open = None
        return out


def pieces(start: int, end: int) -> list[tuple[int, int]]:
    """A window's range in hard 30 s pieces, dropping pieces under 0.1 s."""
    out = []
    s = max(0, start)
    while end - s > 0:
        e = min(end, s + N_SAMPLES)
        if e - s >= MIN_PIECE:
            out.append((s, e))
        s += N_SAMPLES
    return out


def cut_windows(audio: np.ndarray, regions: list[tuple[float, float]]) -> list[Window]:
    """Whole-upload convenience: regions in seconds to windows that own their samples."""
    cutter = WindowCutter()
    spans = [(int(a * SAMPLE_RATE), min(audio.size, int(b * SAMPLE_RATE))) for a, b in regions]
    ranges = cutter.add(spans, 0) + cutter.finish()
    return [Window(audio[s:e].copy(), s / SAMPLE_RATE, e / SAMPLE_RATE)
            for a, b in ranges for s, e in pieces(a, b)]
