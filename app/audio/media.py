"""Audio in: open an upload with FFmpeg (PyAV) behind allow-lists, probe it, decode it in pieces.

All functions here block and run in the prep pool, never on the event loop. PyAV bundles FFmpeg,
so wav, flac, mp3, ogg/opus, m4a, webm and the other common containers decode with no system
FFmpeg; everything is resampled to 16 kHz mono float32, which is what Whisper expects.

FFmpeg opens much more than audio: 400+ demuxers, among them playlists (``concat``, HLS, DASH)
that open *other files* by name. An upload whose bytes are an ``ffconcat`` playlist naming
another job's spool file was transcribed from that other tenant's audio. So every open passes
``format_whitelist`` (audio and audio/video containers only) and ``protocol_whitelist=file``,
the audio stream's decoder must be an audio codec we list, and its rate and channel count must
be sane (1 Hz-384 kHz, <= 8 channels) at probe time and on every decoded frame. Anything else
is a 415 at upload.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import av
import numpy as np

from app.errors import InvalidAudio, PayloadTooLarge, UnsupportedMedia
from app.windows import SAMPLE_RATE

log = logging.getLogger(__name__)

# Demuxer names as FFmpeg matches them (one entry matches a demuxer listing several names).
FORMATS = ("wav,w64,flac,mp3,ogg,mov,matroska,aac,aiff,caf,amr,asf,avi,mpegts,au,wv,ape,tta,"
           "mpc,mpc8,spx,loas,voc,ac3,eac3,dts,truehd,mlp,gsm,g722,g723_1,g729,tak,shorten,"
           "mp2,mp1,sln,s16le,sox")
OPEN_OPTIONS = {"format_whitelist": FORMATS, "protocol_whitelist": "file"}
CODECS = frozenset((
    "flac", "mp3", "mp3float", "mp2", "mp2float", "mp1", "mp1float", "aac", "aac_fixed",
    "aac_latm", "opus", "libopus", "vorbis", "libvorbis", "alac", "wavpack", "ape", "tta",
    "tak", "shorten", "amrnb", "amrwb", "wmav1", "wmav2", "wmapro", "wmalossless", "wmavoice",
    "gsm", "gsm_ms", "g722", "g723_1", "g726", "g726le", "g729", "speex", "ac3", "ac3_fixed",
    "eac3", "dca", "truehd", "mlp", "mace3", "mace6", "qdm2", "qdmc", "ra_144", "ra_288",
    "cook", "atrac3", "atrac3plus", "nellymoser", "ilbc", "sipr", "musepack7", "musepack8",
    "dsd_lsbf", "dsd_msbf", "dsd_lsbf_planar", "dsd_msbf_planar", "sol_dpcm", "interplay_dpcm",
    "roq_dpcm", "xan_dpcm", "derf_dpcm", "comfortnoise",
))
CODEC_PREFIXES = ("pcm_", "adpcm_")
MAX_RATE = 384_000
MAX_CHANNELS = 8
RIFF_IDS = (b"RIFF", b"RF64", b"BW64")  # a WAV starts with one, then its size, then b"WAVE"
# WAV: a 4 KB probe (see open_audio), and packets sized to the file instead of the wav
# demuxer's 4096-byte default. Every packet costs a demux, decode, frame and resample step in
# Python under the GIL: a 16 kHz mono WAV came in 2048-byte packets, and on the H200 run (16 prep
# threads, 16 twenty-minute WAV uploads at once: loadtest/results/gpu-h200.json) the prep threads
# spent 56 % of their samples in that per-packet loop and 15 % resampling, while the GPU was busy
# 29 % of the time. Decoding a 20-minute WAV here: 3,100x real time with 2 KB packets, 36,900x
# with 256 KB ones (8 s of 16 kHz mono; 1.4 s of 48 kHz stereo).
# But the packet size is also what opening costs: FFmpeg's stream probe reads and decodes a
# first packet, ~55 ns per byte here, so an open took 14 ms at 256 KB against 0.5 ms at 4 KB and
# 2.4 ms at 32 KB, paid twice by every upload (the service's probe, then prep's decoder) and
# once more by a long one's check for parts. A short clip's probe and decode cost 13.5 ms of CPU
# at 256 KB, 5.0 ms at 32 KB (10 corpus WAVs, best of 5); a 20-minute WAV's 42 ms at 256 KB,
# 55 ms at 64 KB, 91 ms at 32 KB. So the header checks (probe, parts) open with 4 KB packets,
# and a decoder with packets of ~1/128 of the file, 32 KB to 256 KB (:func:`wav_packet`).
WAV_PROBE = {"probesize": "4096"}
PROBE_PACKET = 4096  # opens that read the header and a first packet only
MIN_PACKET, MAX_PACKET = 32 * 1024, 256 * 1024
# Demuxers whose seek is an estimate, so a decoder started mid-way finds its place by demuxing
# the packets before it in order instead (timed exactly from their durations; no decoding).
# FFmpeg's MP3 seek goes to a byte offset by bit rate (or by a VBR file's Xing table, up to
# seconds off) and then reports the time it asked for, not the time it reached. Demuxing a
# 20-minute 128 kb/s MP3 to its end costs 0.11 s against 1.87 s to decode it, here, and decoding
# from SCAN_LEAD packets before the point gives exactly the samples one pass gives from the
# fourth frame on (MP3's bit reservoir reaches back at most 511 bytes: the frames before).
SCAN_SEEK = frozenset({"mp3", "aac"})
SCAN_LEAD = 10


def wav_packet(size: int) -> int:
    """Packet bytes to decode a WAV of ``size`` bytes in: a power of two near ``size / 128``,
    from 32 KB (clips up to ~2 minutes at 16 kHz mono) to 256 KB (from ~9 minutes)."""
    return min(MAX_PACKET, max(MIN_PACKET, 1 << max(0, size // 128 - 1).bit_length()))


@dataclass(frozen=True)
class Probe:
    duration_s: float  # best estimate before decoding (container metadata)
    codec: str
    sample_rate: int
    channels: int


def check_stream(codec: str, rate: int, channels: int) -> None:
    """415 unless the audio is an audio codec we decode, at a sane rate and channel count."""
    if codec not in CODECS and not codec.startswith(CODEC_PREFIXES):
        raise UnsupportedMedia(f"audio codec {codec!r} is not accepted")
    check_layout(rate, channels)


def check_layout(rate: int, channels: int) -> None:
    if not 1 <= rate <= MAX_RATE:
        raise UnsupportedMedia(f"a sample rate of {rate} Hz is not accepted (1-{MAX_RATE} Hz)")
    if not 1 <= channels <= MAX_CHANNELS:
        raise UnsupportedMedia(f"{channels} channels are not accepted (1-{MAX_CHANNELS})")


def probe(path: Path, max_audio_s: float) -> Probe:
    """Check that ``path`` holds decodable audio and is within the duration limit.

    Reads only the container header and the first packets, so a 2-hour upload is rejected in
    milliseconds. Raises 415 for non-audio (or a container, codec, rate or layout we refuse),
    422 for audio with no decodable samples, 413 over the limit.
    """
    try:
        with open_audio(path, PROBE_PACKET) as c:
            s = c.streams.audio[0]
            cc = s.codec_context
            check_stream(cc.name, int(cc.sample_rate or 0), int(cc.channels or 0))
            duration = _declared_duration(c, s)
            if duration is None:  # e.g. a browser's streamed webm: time the packets instead
                duration = _packet_duration(path, max_audio_s)
            else:  # a header that under-states the audio is charged what the file holds
                duration = _plausible_duration(path, duration, max_audio_s)
            if duration is not None and duration > max_audio_s:
                raise PayloadTooLarge(
                    f"audio is {duration:.0f} s long; the limit is {max_audio_s:.0f} s",
                    limit_s=max_audio_s, duration_s=round(duration, 3),
                )
            if not any(frame.samples > 0 for frame in _checked(frames(c))):
                raise InvalidAudio("the upload contains no decodable audio samples")
            return Probe(duration_s=duration or 0.0, codec=cc.name,
                         sample_rate=int(cc.sample_rate or 0), channels=int(cc.channels or 0))
    except (UnsupportedMedia, InvalidAudio, PayloadTooLarge):
        raise
    except (av.error.FFmpegError, UnicodeDecodeError, ValueError, IndexError) as exc:
        raise UnsupportedMedia(
            f"not a decodable audio file ({type(exc).__name__}); "
            "supported: wav, flac, mp3, ogg/opus, m4a/mp4, webm/mkv and other audio containers"
        ) from exc


def open_audio(path: Path, packet: int | None = None) -> Any:
    """``av.open`` behind the allow-lists, with an audio stream (else 415); cheaper for WAV.

    FFmpeg's stream probe reads up to 5 MB of a file; for PCM that is the whole upload, parsed
    packet by packet: ~4 ms per open here, and every request opens its file twice (probe,
    decode), while a WAV header already holds what the probe looks for. Other formats keep
    FFmpeg's defaults (an mp3's ID3 cover art can be larger than a small probe), and so does a
    WAV whose stream the small probe left undescribed. A WAV is demuxed in ``packet``-byte
    packets (None: sized to the file for decoding, :func:`wav_packet`)."""
    c = _open(path, packet)
    if not c.streams.audio:
        c.close()
        raise UnsupportedMedia("the upload has no audio stream")
    return c


def _open(path: Path, packet: int | None) -> Any:
    try:
        with path.open("rb") as f:
            head = f.read(12)
            size = os.fstat(f.fileno()).st_size
    except OSError:
        head, size = b"", 0  # av.open below raises its own error for it, as it always did
    if head[:4] in RIFF_IDS and head[8:12] == b"WAVE":
        max_size = str(packet or wav_packet(size))
        try:
            c = av.open(str(path), mode="r", metadata_errors="ignore",
                        options={**OPEN_OPTIONS, **WAV_PROBE, "max_size": max_size})
        except av.error.FFmpegError:
            pass  # judged by the default probe below, exactly as before
        else:
            s = c.streams.audio[0] if c.streams.audio else None
            if s is not None and s.codec_context.sample_rate and s.codec_context.channels:
                return c
            c.close()
    return av.open(str(path), mode="r", metadata_errors="ignore", options=dict(OPEN_OPTIONS))


def _declared_duration(c: Any, s: Any) -> float | None:
    if s.duration is not None and s.time_base is not None:
        return float(s.duration * s.time_base)
    if c.duration is not None:
        return float(c.duration) / av.time_base
    return None


# Bytes per second of audio above which a header is not taken at its word: 1.6 Mb/s, four
# times the richest lossy codec's rate; speech PCM (16 kHz mono: 32 kB/s) and FLAC at CD
# quality are below it.
SUSPICIOUS_BYTES_PER_S = 200_000
LENGTH_SLACK_S = 1.0


def _plausible_duration(path: Path, declared: float, max_audio_s: float) -> float:
    """The duration to charge: the header's, unless the file's size says it holds far more
    (a 90 s file whose header says 5 s): then its packets are timed (demuxing only, no
    decoding) and the longer one counts. A header that lies cannot make its job cost one padded
    window in every budget while it takes minutes of others' engine time; what slips under
    this (silence compresses well) is counted at its decoded length once decoding passes the
    header (app/jobs/work.py) and stopped at ``limits.max_audio_s``."""
    if path.stat().st_size / max(declared, 0.5) <= SUSPICIOUS_BYTES_PER_S:
        return declared
    timed = _packet_duration(path, max_audio_s) or 0.0
    return timed if timed > declared + LENGTH_SLACK_S else declared


def _packet_duration(path: Path, max_audio_s: float) -> float | None:
    """End time of the last audio packet: demuxing only (no decoding), so it stays cheap.

    Without it a header-less upload would count as 0 s in the backlog until it is decoded,
    and a burst of them would pass the 429 check. Stops once past the limit.
    """
    end = 0.0
    with open_audio(path) as c:
        for packet in c.demux(audio=0):
            if packet.pts is not None and packet.time_base is not None:
                end = max(end, float((packet.pts + (packet.duration or 0)) * packet.time_base))
                if end > max_audio_s:
                    break
    return end or None


def frames(container: Any, packets: Iterable[Any] | None = None) -> Any:
    """Decoded audio frames, skipping corrupt packets (truncated files decode up to the damage):
    of ``packets`` where given (the rest of a demux that found a seek point), else the whole
    audio stream."""
    for packet in container.demux(audio=0) if packets is None else packets:
        try:
            yield from packet.decode()
        except av.error.InvalidDataError:
            continue


def _checked(frames: Any) -> Any:
    """Frames whose rate and layout stay within the limits (a stream may change mid-way)."""
    for frame in frames:
        check_layout(int(frame.sample_rate or 0), len(frame.layout.channels))
        yield frame


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
        self._frames = _checked(frames(self._container, packets))
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
