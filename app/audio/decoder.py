"""An upload decoded in pieces (:class:`AudioDecoder`), from its start or from any sample of it:
a part of a long upload (app/audio/parts.py) starts where one pass would have that sample.

A decoder started mid-way must give the samples one pass gives from that point, or a part's
seam loses or doubles audio. Three things stood in the way, each measured against one pass:
where FFmpeg's seek lands (exact for WAV, FLAC, Ogg, WebM, MP4; a byte estimate for MP3), which
clock frame times count in (from the stream's start time: MP3's encoder delay of 1105 samples,
Opus's pre-skip of 312 at 48 kHz, made a seek land 25 or 6.5 ms off), and the resampler's phase
(one started elsewhere put every 16 kHz output a fraction of a sample off one pass's: up to 0.2
apart on speech from a 44.1 kHz MP3). With all three handled, FLAC and MP3 parts give one
pass's samples exactly, Opus and AAC within 2e-5 of the signal's mean (tests/test_parts.py).
"""

from __future__ import annotations

import itertools
import logging
import math
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import av
import numpy as np

from app.audio.media import checked, frames, open_audio
from app.errors import InvalidAudio, PayloadTooLarge, UnsupportedMedia
from app.windows import SAMPLE_RATE

log = logging.getLogger(__name__)

# Demuxers whose seek is an estimate, so a decoder started mid-way finds its place by demuxing
# the packets before it in order instead (timed exactly from their durations; no decoding).
# FFmpeg's MP3 seek goes to a byte offset by bit rate (or by a VBR file's Xing table, up to
# seconds off) and then reports the time it asked for, not the time it reached. Demuxing a
# 20-minute 128 kb/s MP3 to its end costs 0.11 s against 1.87 s to decode it, here, and decoding
# from SCAN_LEAD packets before the point gives exactly the samples one pass gives from the
# fourth frame on (MP3's bit reservoir reaches back at most 511 bytes: the frames before).
SCAN_SEEK = frozenset({"mp3", "aac"})
SCAN_LEAD = 10


class AudioDecoder:
    """One upload decoded in pieces, as 16 kHz float32: only the piece asked for is held.

    Mono (FFmpeg's downmix) by default; with ``separate`` every channel is kept, each resampled
    on its own (``channels`` of them, the stream's layout: no remixing), for uploads whose
    channels are different speakers (a call recording, ``channels=separate``).

    The duration limit is checked on decoded samples too, because a header can lie (a WAV
    header claiming a huge size, a stream without duration metadata)."""

    def __init__(self, path: Path, max_audio_s: float, separate: bool = False,
                 start: int = 0) -> None:
        self._limit = int(max_audio_s * SAMPLE_RATE)
        self._max_audio_s = max_audio_s
        try:
            self._container = open_audio(path)
        except av.error.FFmpegError as exc:
            raise UnsupportedMedia("cannot open the upload as audio") from exc
        self.start = start  # the upload's sample the first one returned is (see _seek)
        self._skip: int | None = 0  # samples still to drop before it (None: not known yet)
        self._origin_s = 0.0  # the stream's time of its first sample (see _seek)
        packets = self._seek(start) if start else None
        self._frames = checked(frames(self._container, packets))
        layout: Any = "mono"
        self.channels = 1
        if separate:
            cc = self._container.streams.audio[0].codec_context
            layout = cc.layout  # the stream's own: no channel is remixed into another
            self.channels = len(layout.channels)
        self.separate = separate
        self._layout = layout
        self._resampler = self._new_resampler()
        self._format: tuple[str, str, int] | None = None
        self.samples = 0  # decoded so far (per channel)
        self.done = False

    def read(self, n: int) -> np.ndarray:
        """At least ``n`` samples (fewer only at the end; empty once done): shape (samples,),
        or (channels, samples) when separate."""
        parts: list[np.ndarray] = []
        got = 0
        try:
            while got < n and not self.done:
                frame = next(self._frames, None)
                if self._skip is None:  # the first frame after a seek
                    if frame is None:
                        raise NotSeekable("the audio ends before the seek point")
                    frame = self._align(frame)
                    if frame is None:
                        continue
                for out in self._resample(frame):  # None flushes the resampler's tail
                    arr = out.to_ndarray()
                    arr = arr.reshape(self.channels, -1) if self.separate else arr.reshape(-1)
                    if self._skip:
                        drop = min(self._skip, arr.shape[-1])
                        arr, self._skip = arr[..., drop:], self._skip - drop
                    parts.append(arr)
                    got += arr.shape[-1]
                if frame is None:
                    self.done = True
        except av.error.FFmpegError as exc:
            if not self.samples and not parts:
                raise UnsupportedMedia("cannot decode the upload") from exc
            log.warning("decode stopped early at %.1f s: %s",
                        (self.samples + got) / SAMPLE_RATE, type(exc).__name__)
            self.done = True
        self.samples += got
        if self.start + self.samples > self._limit:
            raise PayloadTooLarge(f"audio is longer than the limit of {self._max_audio_s:.0f} s",
                                  limit_s=self._max_audio_s)
        if not parts:
            return np.zeros((self.channels, 0) if self.separate else 0, dtype=np.float32)
        pcm = np.concatenate(parts, axis=-1) if len(parts) > 1 else parts[0]
        return np.multiply(pcm, np.float32(1 / 32768), dtype=np.float32)

    def _new_resampler(self) -> Any:
        # Planar output when separate: to_ndarray() is then (channels, samples).
        return av.AudioResampler(format="s16p" if self.separate else "s16", layout=self._layout,
                                 rate=SAMPLE_RATE)

    def _resample(self, frame: Any) -> list[Any]:
        """PyAV's resampler takes one input format for life; a stream whose rate or layout
        changes mid-way (two MP3s joined, a broadcast capture) gets a new one, the old one's
        tail flushed first."""
        if frame is not None:
            fmt = (frame.format.name, frame.layout.name, frame.sample_rate)
            if self._format is not None and fmt != self._format:
                tail = list(self._resampler.resample(None))
                self._resampler = self._new_resampler()
                self._format = fmt
                return tail + list(self._resampler.resample(frame))
            self._format = fmt
        return list(self._resampler.resample(frame))

    def _seek(self, start: int) -> Iterator[Any] | None:
        """Decode from the upload's sample ``start``: the decoder starts at the packet at or
        before it, and the samples before it are dropped once the first frame says where it
        landed. Times count from the stream's start time, which is where one pass's first
        sample is (a codec's delay: MP3's 1105 samples, Opus's pre-skip of 312 at 48 kHz; a seek
        in the stream's own clock landed that much late). Returns the packets to decode where
        the seek point was found by demuxing (:data:`SCAN_SEEK`), else None (FFmpeg sought)."""
        s = self._container.streams.audio[0]
        if s.time_base is None:
            raise NotSeekable("the stream has no time base")
        origin = s.start_time or 0
        self._origin_s = float(origin * s.time_base)
        self._skip = None
        target = origin + int(start / SAMPLE_RATE / s.time_base)
        if self._container.format.name in SCAN_SEEK:
            return self._scan(s, target)
        try:
            self._container.seek(target, stream=s, backward=True, any_frame=False)
        except av.error.FFmpegError as exc:
            raise NotSeekable(f"seek failed ({type(exc).__name__})") from exc
        return None

    def _scan(self, stream: Any, target: int) -> Iterator[Any]:
        """The packets from :data:`SCAN_LEAD` before the one that holds ``target`` on, found
        by demuxing in order (see :data:`SCAN_SEEK`)."""
        packets = self._container.demux(stream)
        lead: deque[Any] = deque(maxlen=SCAN_LEAD)
        try:
            for packet in packets:
                if packet.size == 0:
                    break  # the demuxer's flush at the end
                if packet.pts is None:
                    raise NotSeekable("a packet has no time")
                lead.append(packet)
                if packet.pts + (packet.duration or 0) > target:
                    return itertools.chain(lead, packets)
        except av.error.FFmpegError as exc:
            raise NotSeekable(f"demuxing to the seek point failed ({type(exc).__name__})") from exc
        raise NotSeekable("the audio ends before the seek point")

    def _align(self, frame: Any) -> Any | None:
        """The first frame after a seek, cut to begin where one pass's resampler has an output
        sample: a multiple of rate / gcd(rate, 16000) input samples from the stream's start (441
        at 44.1 kHz, 3 at 48 kHz). A resampler started elsewhere puts every output a fraction
        of a sample off one pass's (up to 0.2 apart on speech, a VBR MP3 at 44.1 kHz); started
        there, it gives one pass's samples exactly, once its filter has filled. Sets the output
        samples to drop before ``start``; None when all of the frame is before that point."""
        if frame.pts is None or frame.time_base is None:
            raise NotSeekable("the first frame after the seek has no time")
        rate = int(frame.sample_rate)
        n_in = round((float(frame.pts * frame.time_base) - self._origin_s) * rate)
        cut = -n_in % (rate // math.gcd(rate, SAMPLE_RATE))
        at = (n_in + cut) * SAMPLE_RATE // rate
        if at > self.start:
            raise NotSeekable(f"the seek landed {(at - self.start) / SAMPLE_RATE:.3f} s late")
        if cut >= frame.samples:
            return None
        self._skip = self.start - at
        if not cut:
            return frame
        arr = frame.to_ndarray()
        width = cut if frame.format.is_planar else cut * len(frame.layout.channels)
        out = av.AudioFrame.from_ndarray(np.ascontiguousarray(arr[:, width:]),
                                         format=frame.format.name, layout=frame.layout.name)
        out.sample_rate = rate
        return out

    def close(self) -> None:
        self._container.close()


class NotSeekable(Exception):
    """An upload cannot be decoded from a given point (a part of it: app/audio/parts.py)."""


def decode(path: Path, max_audio_s: float) -> np.ndarray:
    """A whole upload at once (tests, benchmarks): the pieces of :class:`AudioDecoder`."""
    dec = AudioDecoder(path, max_audio_s)
    try:
        parts = []
        while not dec.done:
            parts.append(dec.read(SAMPLE_RATE * 60))
    finally:
        dec.close()
    audio = np.concatenate(parts) if parts else np.zeros(0, dtype=np.float32)
    if not audio.size:
        raise InvalidAudio("the upload contains no decodable audio samples")
    return audio
