"""A session's input audio: base64 payloads in the session's format to 16 kHz float32 mono.

``audio/pcm`` is little-endian int16 at 24 kHz (OpenAI's only rate) or 16 kHz; ``audio/pcmu`` and
``audio/pcma`` are G.711 mu-law / A-law at 8 kHz (ITU-T G.711, decoded by the standard 256-entry
tables built below). Rates other than 16 kHz go through FFmpeg's resampler (PyAV's
``AudioResampler``, already the service's decoder), which keeps its filter state between
payloads: a stream cut into 100 ms appends resamples as one signal (no clicks at the seams;
``tests/test_live_audio.py``). It costs ~1.7 ms of CPU per 100 ms of 24 kHz audio here, so it runs
with the VAD off the event loop (:meth:`app.live.session.LiveSession`'s executor).

A payload that splits a 16-bit sample keeps its odd byte for the next one.

:class:`ChunkBuffer` keeps the recent audio at 16 kHz, addressed by absolute sample position, in
one array that grows by half again when full: an append copies only its own samples (amortised),
a slice is a read-only view (no copy), and :meth:`ChunkBuffer.trim` drops what no turn can still
need by moving the start. Kept as the chunks they came in, as before, a slice of a 30 s turn
joined ~300 chunks in Python on the event loop: 339 us per slice against ~1 us here (timeit,
this host), paid by every interim and final of every live session. The buffer holds at most the
open turn (<= 30 s) plus the prefix padding in server-VAD mode, or ``max_buffer_s`` in manual
mode (the session refuses appends beyond it), in an array of at most 1.5 times that (or 1 s).
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

import numpy as np

from app.live.protocol import PcmaFormat, PcmFormat, PcmuFormat
from app.windows import SAMPLE_RATE

Format = PcmFormat | PcmuFormat | PcmaFormat


class BadAudio(ValueError):
    """A payload the session cannot use (answered with an ``error`` event, param ``audio``)."""


def _ulaw_table() -> np.ndarray:
    """G.711 mu-law byte -> linear 16-bit value (the ITU-T reference expansion)."""
    u = ~np.arange(256, dtype=np.int32) & 0xFF
    sign, exponent, mantissa = u & 0x80, (u >> 4) & 0x07, u & 0x0F
    magnitude = (((mantissa << 3) + 0x84) << exponent) - 0x84
    return np.where(sign != 0, -magnitude, magnitude).astype(np.float32) / 32768.0


def _alaw_table() -> np.ndarray:
    """G.711 A-law byte -> linear 16-bit value (even bits inverted, 13-bit magnitude << 3)."""
    a = np.arange(256, dtype=np.int32) ^ 0x55
    sign, exponent, mantissa = a & 0x80, (a >> 4) & 0x07, a & 0x0F
    magnitude = np.where(exponent == 0, (mantissa << 4) + 8,
                         ((mantissa << 4) + 0x108) << np.maximum(exponent - 1, 0))
    return np.where(sign != 0, magnitude, -magnitude).astype(np.float32) / 32768.0


ULAW = _ulaw_table()
ALAW = _alaw_table()


def format_rate(fmt: Format) -> int:
    return fmt.rate if isinstance(fmt, PcmFormat) else 8000


def b64decode(payload: str) -> bytes:
    """Strict base64 (RFC 4648 alphabet, padding checked); :class:`BadAudio` otherwise."""
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise BadAudio(f"Invalid 'audio': not base64 ({exc}).") from exc


class AudioDecoder:
    """One session's payloads, in order, to 16 kHz float32 (stateful: see the module doc)."""

    def __init__(self, fmt: Format) -> None:
        self.fmt = fmt
        self.rate = format_rate(fmt)
        self._odd = b""  # a 16-bit sample split across payloads
        self._resampler: Any = None
        if self.rate != SAMPLE_RATE:
            import av

            self._resampler = av.AudioResampler(format="flt", layout="mono", rate=SAMPLE_RATE)

    def decode(self, raw: bytes) -> np.ndarray:
        """Samples at 16 kHz for these bytes (a resampler may hold back a few ms)."""
        if isinstance(self.fmt, PcmFormat):
            data = self._odd + raw
            whole = len(data) // 2 * 2
            self._odd = data[whole:]
            samples = np.frombuffer(data[:whole], dtype="<i2").astype(np.float32) / 32768.0
        else:
            table = ULAW if isinstance(self.fmt, PcmuFormat) else ALAW
            samples = table[np.frombuffer(raw, dtype=np.uint8)]
        return self._resample(samples)

    def _resample(self, samples: np.ndarray) -> np.ndarray:
        if self._resampler is None or samples.size == 0:
            return samples
        import av

        frame = av.AudioFrame.from_ndarray(samples[None], format="flt", layout="mono")
        frame.sample_rate = self.rate
        out = [f.to_ndarray().reshape(-1) for f in self._resampler.resample(frame)]
        return np.concatenate(out) if out else np.zeros(0, dtype=np.float32)

    def flush(self) -> np.ndarray:
        """What the resampler still holds (a format change, or the end of the session)."""
        if self._resampler is None:
            return np.zeros(0, dtype=np.float32)
        out = [f.to_ndarray().reshape(-1) for f in self._resampler.resample(None)]
        return np.concatenate(out) if out else np.zeros(0, dtype=np.float32)


def encode_pcm16(samples: np.ndarray) -> bytes:
    """float32 in [-1, 1] to little-endian int16 bytes (clients, tests, benches)."""
    return (np.clip(samples, -1.0, 1.0) * 32767.0).astype("<i2").tobytes()


class ChunkBuffer:
    """Samples by absolute position (see the module doc). Samples once appended are never
    written again: a grown array is a new one, so a view handed out stays as it was."""

    def __init__(self, start: int = 0) -> None:
        self._data = np.zeros(0, dtype=np.float32)
        self._at = 0  # index in ``_data`` of sample ``base``
        self.base = start  # absolute position of the first sample held
        self.end = start  # absolute position after the last sample appended

    def __len__(self) -> int:
        return self.end - self.base

    def append(self, samples: np.ndarray) -> None:
        n, held = samples.size, self.end - self.base
        if not n:
            return
        if self._at + held + n > self._data.size:  # full: the held samples move to a new array
            grown = np.empty(max(3 * (held + n) // 2, SAMPLE_RATE), dtype=np.float32)
            grown[:held] = self._data[self._at:self._at + held]
            self._data, self._at = grown, 0
        self._data[self._at + held:self._at + held + n] = samples
        self.end += n

    def slice(self, a: int, b: int) -> np.ndarray:
        """Samples [a, b) (clipped to what is held), as a read-only view."""
        a, b = max(a, self.base), min(b, self.end)
        if b <= a:
            return np.zeros(0, dtype=np.float32)
        view = self._data[self._at + a - self.base:self._at + b - self.base]
        view.flags.writeable = False
        return view

    def trim(self, keep_from: int) -> None:
        """Drop the samples before ``keep_from``."""
        keep_from = min(max(keep_from, self.base), self.end)
        self._at += keep_from - self.base
        self.base = keep_from

    def clear(self) -> None:
        self.trim(self.end)
