"""Audio in: open an upload with FFmpeg (PyAV) behind allow-lists and probe it (decoding it in
pieces: app/audio/decoder.py).

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

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import av

from app.errors import InvalidAudio, PayloadTooLarge, UnsupportedMedia

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
            if not any(frame.samples > 0 for frame in checked(frames(c))):
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


def checked(frames: Any) -> Any:
    """Frames whose rate and layout stay within the limits (a stream may change mid-way)."""
    for frame in frames:
        check_layout(int(frame.sample_rate or 0), len(frame.layout.channels))
        yield frame
