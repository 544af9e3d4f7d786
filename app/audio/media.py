"""Audio in: probe and decode an upload, then cut its speech into <= 30 s windows.

All functions here block (PyAV decoding, VAD inference) and are called from the prep thread pool,
never on the event loop. PyAV bundles FFmpeg, so wav, flac, mp3, ogg, m4a and webm decode with no
system FFmpeg; everything is resampled to 16 kHz mono float32, which is what Whisper expects.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import av
import numpy as np

from app.audio.vad import Vad
from app.errors import InvalidAudio, PayloadTooLarge, UnsupportedMedia
from app.windows import N_SAMPLES, SAMPLE_RATE, WINDOW_S, Window

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Probe:
    duration_s: float  # best estimate before decoding (container metadata)
    codec: str
    sample_rate: int
    channels: int


def probe(path: Path, max_audio_s: float) -> Probe:
    """Check that ``path`` holds decodable audio and is within the duration limit.

    Reads only the container header and the first packets, so a 2-hour upload is rejected in
    milliseconds. Raises 415 for non-audio, 422 for audio with no decodable samples, 413 over
    the limit.
    """
    try:
        with _open(path) as c:
            if not c.streams.audio:
                raise UnsupportedMedia("the upload has no audio stream")
            s = c.streams.audio[0]
            duration = _declared_duration(c, s)
            if duration is None:  # e.g. a browser's streamed webm: time the packets instead
                duration = _packet_duration(path, max_audio_s)
            if duration is not None and duration > max_audio_s:
                raise PayloadTooLarge(
                    f"audio is {duration:.0f} s long; the limit is {max_audio_s:.0f} s",
                    limit_s=max_audio_s, duration_s=round(duration, 3),
                )
            got_samples = False
            for frame in _frames(c):
                if frame.samples > 0:
                    got_samples = True
                    break
            if not got_samples:
                raise InvalidAudio("the upload contains no decodable audio samples")
            return Probe(
                duration_s=duration or 0.0, codec=s.codec_context.name,
                sample_rate=int(s.codec_context.sample_rate or 0),
                channels=int(s.codec_context.channels or 0),
            )
    except (UnsupportedMedia, InvalidAudio, PayloadTooLarge):
        raise
    except (av.error.FFmpegError, UnicodeDecodeError, ValueError, IndexError) as exc:
        raise UnsupportedMedia(
            f"not a decodable audio file ({type(exc).__name__}); "
            "supported: wav, flac, mp3, ogg, m4a, webm"
        ) from exc


RIFF_IDS = (b"RIFF", b"RF64", b"BW64")  # a WAV starts with one, then its size, then b"WAVE"
SMALL_PROBE = {"probesize": "4096"}


def _open(path: Path) -> Any:
    """``av.open``, cheaper for WAV. FFmpeg's stream probe reads up to 5 MB of a file; for PCM
    that is the whole upload, parsed packet by packet: ~4 ms per open here, and every request
    opens its file twice (probe, decode), while a WAV header already holds what the probe
    looks for. Other formats keep FFmpeg's defaults (an mp3's ID3 cover art can be larger
    than a small probe), and so does a WAV whose stream the small probe left undescribed."""
    try:
        with path.open("rb") as f:
            head = f.read(12)
    except OSError:
        head = b""  # av.open below raises its own error for it, as it always did
    if head[:4] in RIFF_IDS and head[8:12] == b"WAVE":
        try:
            c = av.open(str(path), mode="r", metadata_errors="ignore", options=SMALL_PROBE)
        except av.error.FFmpegError:
            pass  # judged by the default probe below, exactly as before
        else:
            s = c.streams.audio[0] if c.streams.audio else None
            if s is not None and s.codec_context.sample_rate and s.codec_context.channels:
                return c
            c.close()
    return av.open(str(path), mode="r", metadata_errors="ignore")


def _declared_duration(c: Any, s: Any) -> float | None:
    if s.duration is not None and s.time_base is not None:
        return float(s.duration * s.time_base)
    if c.duration is not None:
        return float(c.duration) / av.time_base
    return None


def _packet_duration(path: Path, max_audio_s: float) -> float | None:
    """End time of the last audio packet: demuxing only (no decoding), so it stays cheap.

    Without it a header-less upload would count as 0 s in the backlog until it is decoded,
    and a burst of them would pass the 429 check. Stops once past the limit.
    """
    end = 0.0
    with _open(path) as c:
        for packet in c.demux(audio=0):
            if packet.pts is not None and packet.time_base is not None:
                end = max(end, float((packet.pts + (packet.duration or 0)) * packet.time_base))
                if end > max_audio_s:
                    break
    return end or None


def _frames(container: Any) -> Any:
    """Decoded audio frames, skipping corrupt packets (truncated files decode up to the damage)."""
    for packet in container.demux(audio=0):
        try:
            yield from packet.decode()
        except av.error.InvalidDataError:
            continue


def decode(path: Path, max_audio_s: float) -> np.ndarray:
    """Decode to 16 kHz mono float32, enforcing the duration limit while decoding.

    The limit is checked on decoded samples too, because a header can lie (a wav header
    claiming a huge size, a stream without duration metadata).
    """
    limit = int(max_audio_s * SAMPLE_RATE)
    resampler = av.AudioResampler(format="s16", layout="mono", rate=SAMPLE_RATE)
    chunks: list[np.ndarray] = []
    total = 0
    try:
        with _open(path) as c:
            for frame in _frames(c):
                for out in resampler.resample(frame):
                    arr = out.to_ndarray().reshape(-1)
                    chunks.append(arr)
                    total += arr.size
                if total > limit:
                    raise PayloadTooLarge(
                        f"audio is longer than the limit of {max_audio_s:.0f} s",
                        limit_s=max_audio_s,
                    )
            for out in resampler.resample(None):  # flush the resampler's tail
                chunks.append(out.to_ndarray().reshape(-1))
    except PayloadTooLarge:
        raise
    except av.error.FFmpegError as exc:
        if not chunks:
            raise UnsupportedMedia(f"cannot decode the upload: {exc}") from exc
        log.warning("decode stopped early at %.1f s: %s", total / SAMPLE_RATE, exc)
    if not chunks:
        raise InvalidAudio("the upload contains no decodable audio samples")
    return np.concatenate(chunks).astype(np.float32) / 32768.0


def cut_windows(audio: np.ndarray, regions: list[tuple[float, float]]) -> list[Window]:
    """Merge speech regions of ONE upload into <= 30 s windows (whisperx's merge_chunks rule).

    Regions are joined while the window would stay within 30 s; anything still longer is cut
    hard at 30 s so the encoder never silently drops audio.
    """
    spans: list[tuple[float, float]] = []
    cur: tuple[float, float] | None = None
    for start, end in regions:
        if cur is not None and end - cur[0] <= WINDOW_S:
            cur = (cur[0], end)
            continue
        if cur is not None:
            spans.append(cur)
        cur = (start, end)
    if cur is not None:
        spans.append(cur)
    windows = []
    for start, end in spans:
        s = max(0, int(start * SAMPLE_RATE))
        e = min(len(audio), int(end * SAMPLE_RATE))
        while e - s > 0:
            piece = audio[s:min(e, s + N_SAMPLES)]
            if piece.size >= SAMPLE_RATE // 10:  # < 0.1 s is noise, not a word
                windows.append(Window(piece, s / SAMPLE_RATE, (s + piece.size) / SAMPLE_RATE))
            s += N_SAMPLES
    return windows


def prepare(path: Path, vad: Vad, max_audio_s: float) -> tuple[np.ndarray, list[Window]]:
    """Decode and cut: the whole blocking preprocessing of one upload."""
    audio = decode(path, max_audio_s)
    return audio, cut_windows(audio, vad.speech(audio))
