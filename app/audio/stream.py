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

:meth:`AudioStream.read_chunk` also hands out the chunk's samples, for a stage that needs the
whole signal rather than the speech windows (speaker diarization, app/speakers), and with
``separate`` each channel of the upload is its own track (VAD and cutter of its own), its
windows labelled by channel (``channels=separate``: a call recording's two sides).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from app.audio.cut import WindowCutter, pieces
from app.audio.decoder import AudioDecoder
from app.audio.vad import Vad, VadStream
from app.windows import SAMPLE_RATE, Window

CHUNK_S = 60.0


@dataclass
class Chunk:
    """What one prep step produced."""

    windows: list[Window]  # windows the chunk completed, track by track, each in time order
    channels: list[int]  # each window's channel (all 0 for the mono mix)
    audio: np.ndarray  # the chunk's samples: (n,) mono, or (channels, n) when separate
    start_s: float  # where the chunk starts in the upload


class _Track:
    """One signal's VAD and window cutting (the mono mix, or one channel)."""

    def __init__(self, vad: VadStream) -> None:
        self.vad = vad
        self.cutter = WindowCutter()
        self.buf = np.zeros(0, dtype=np.float32)
        self.buf_start = 0  # sample index of self.buf[0]

    def add(self, audio: np.ndarray, total: int, final: bool) -> list[Window]:
        """Feed the next samples (``total`` decoded so far); the windows they closed."""
        self.buf = np.concatenate([self.buf, audio]) if self.buf.size else audio
        ranges = self.cutter.add(self.vad.feed(audio), self.vad.frontier())
        if final:
            ranges += self.cutter.add(self.vad.finish(), total) + self.cutter.finish()
        out = [self._window(s, e) for a, b in ranges for s, e in pieces(a, min(b, total))]
        self._trim(final)
        return out

    def _window(self, s: int, e: int) -> Window:
        lo, hi = s - self.buf_start, e - self.buf_start
        if lo < 0:
            raise RuntimeError(f"window at sample {s} needs audio already released")
        return Window(self.buf[lo:hi].copy(), s / SAMPLE_RATE, e / SAMPLE_RATE)

    def _trim(self, final: bool) -> None:
        keep = self.vad.keep_from()
        if self.cutter.open_start is not None:
            keep = min(keep, self.cutter.open_start)
        drop = min(self.buf.size, keep - self.buf_start)
        if final:
            drop = self.buf.size
        if drop > 0:
            self.buf = self.buf[drop:].copy()  # a copy: the old array is freed
            self.buf_start += drop

    def clear(self) -> None:
        self.buf = np.zeros(0, dtype=np.float32)


class AudioStream:
    def __init__(self, path: Path, vad: Vad, max_audio_s: float, chunk_s: float = CHUNK_S,
                 separate: bool = False) -> None:
        self._decoder = AudioDecoder(path, max_audio_s, separate)
        self._tracks = [_Track(vad.stream()) for _ in range(self._decoder.channels)]
        self._chunk = max(1, int(chunk_s * SAMPLE_RATE))
        self.windows = 0  # cut so far
        self.done = False
        # A cancelled job closes its stream while a prep thread may still be inside read_chunk
        # (a thread cannot be interrupted): close waits for it, never frees the container under
        # it (that crashed the process).
        self._lock = threading.Lock()

    @property
    def channels(self) -> int:
        """Tracks: the upload's channels when separate, else 1 (the mono mix)."""
        return len(self._tracks)

    @property
    def samples(self) -> int:
        """Decoded so far (all of the upload once ``done``)."""
        return self._decoder.samples

    @property
    def seconds(self) -> float:
        return self.samples / SAMPLE_RATE

    def next_chunk(self) -> list[Window]:
        """Decode the next chunk; the windows it completed (the rest once the audio ends)."""
        return self.read_chunk().windows

    def read_chunk(self) -> Chunk:
        """Decode the next chunk: the windows it completed, and its samples."""
        with self._lock:
            return self._read_chunk()

    def _read_chunk(self) -> Chunk:
        start = self.samples
        if self.done:
            return Chunk([], [], np.zeros(0, dtype=np.float32), start / SAMPLE_RATE)
        audio = self._decoder.read(self._chunk)
        final = self._decoder.done
        windows: list[Window] = []
        channels: list[int] = []
        signals = audio if self._decoder.separate else [audio]
        for k, (track, signal) in enumerate(zip(self._tracks, signals, strict=True)):
            got = track.add(signal, self.samples, final)
            windows += got
            channels += [k] * len(got)
        if final:
            self.done = True
            self._decoder.close()
        self.windows += len(windows)
        return Chunk(windows, channels, audio, start / SAMPLE_RATE)

    def close(self) -> None:
        with self._lock:
            if not self.done:
                self._decoder.close()
                self.done = True
            for t in self._tracks:
                t.clear()


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
