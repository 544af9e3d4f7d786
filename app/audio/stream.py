"""One upload's preparation, a chunk at a time: decode, VAD, cut, hand over the windows.

A 20-minute upload used to be decoded and VAD-cut whole on the prep thread before its first
window reached the batcher (short uploads queued behind it), and its whole PCM lived until the
job ended, the windows being views into it (RSS 1.37 -> 3.07 GB with one such upload in
flight). Here each call to :meth:`AudioStream.next_chunk` decodes ``chunk_s`` seconds, feeds
them to the VAD stream and the window cutter, and returns the windows they closed, each a copy
of its own samples. Only the audio some window may still need is kept (from the open window's
start, or from where the VAD may still start a span): about a minute, whatever the upload's
length. Chunk edges change nothing: the VAD's state and its span rules carry across them, so
the windows are those of one pass over the whole upload (``tests/test_prep.py``).
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np

from app.audio.cut import WindowCutter, pieces
from app.audio.media import AudioDecoder
from app.audio.vad import Vad
from app.windows import SAMPLE_RATE, Window

CHUNK_S = 60.0


class AudioStream:
    def __init__(self, path: Path, vad: Vad, max_audio_s: float, chunk_s: float = CHUNK_S) -> None:
        self._decoder = AudioDecoder(path, max_audio_s)
        self._vad = vad.stream()
        self._cutter = WindowCutter()
        self._chunk = max(1, int(chunk_s * SAMPLE_RATE))
        self._buf = np.zeros(0, dtype=np.float32)
        self._buf_start = 0  # sample index of self._buf[0]
        self.windows = 0  # cut so far
        self.done = False
        # A cancelled job closes its stream while a prep thread may still be inside
        # next_chunk (a thread cannot be interrupted): close waits for it, never frees the
        # container under it.
        self._lock = threading.Lock()

    @property
    def samples(self) -> int:
        """Decoded so far (all of the upload once ``done``)."""
        return self._decoder.samples

    @property
    def seconds(self) -> float:
        return self.samples / SAMPLE_RATE

    def next_chunk(self) -> list[Window]:
        """Decode the next chunk; the windows it completed (the rest once the audio ends)."""
        with self._lock:
            return self._next_chunk()

    def _next_chunk(self) -> list[Window]:
        if self.done:
            return []
        audio = self._decoder.read(self._chunk)
        self._buf = np.concatenate([self._buf, audio]) if self._buf.size else audio
        ranges = self._cutter.add(self._vad.feed(audio), self._vad.frontier())
        if self._decoder.done:
            ranges += self._cutter.add(self._vad.finish(), self.samples) + self._cutter.finish()
            self.done = True
            self._decoder.close()
        out = [self._window(s, e) for a, b in ranges for s, e in pieces(a, min(b, self.samples))]
        self.windows += len(out)
        self._trim()
        return out

    def _window(self, s: int, e: int) -> Window:
        lo, hi = s - self._buf_start, e - self._buf_start
        if lo < 0:
            raise RuntimeError(f"window at sample {s} needs audio already released")
        return Window(self._buf[lo:hi].copy(), s / SAMPLE_RATE, e / SAMPLE_RATE)

    def _trim(self) -> None:
        keep = self._vad.keep_from()
        if self._cutter.open_start is not None:
            keep = min(keep, self._cutter.open_start)
        drop = min(self._buf.size, keep - self._buf_start)
        if self.done:
            drop = self._buf.size
        if drop > 0:
            self._buf = self._buf[drop:].copy()  # a copy: the old array is freed
            self._buf_start += drop

    def close(self) -> None:
        with self._lock:
            if not self.done:
                self._decoder.close()
                self.done = True
            self._buf = np.zeros(0, dtype=np.float32)


def prepare(path: Path, vad: Vad, max_audio_s: float) -> tuple[float, list[Window]]:
    """A whole upload at once (tests, benchmarks): its decoded length and all its windows."""
    stream = AudioStream(path, vad, max_audio_s)
    windows: list[Window] = []
    try:
        while not stream.done:
            windows += stream.next_chunk()
    finally:
        stream.close()
    return stream.seconds, windows
