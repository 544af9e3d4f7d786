"""The feed bench's uploads: continuous speech built from the corpus's clips, in the formats
whose prep costs differ most.

Upload k is the corpus's clips from clip 7k on, in turn, 0.8 s of silence between them, until
it is ``minutes`` long (so no two uploads are the same audio). Formats: ``wav16`` (16 kHz mono
WAV, what the H200 run sent), ``wav48s`` (48 kHz stereo WAV: resampling and downmix), ``flac``
(16 kHz mono, compressed and seekable), ``mp3`` (44.1 kHz stereo, 128 kb/s: compressed; split
by demuxing to each part's start, its own seek being an estimate); ``ogg`` (Opus) and ``m4a``
(AAC) also split. Encoded with PyAV (FFmpeg in its wheel); kept in ``work`` and reused.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from loadtest.lib.common import write_wav16
from loadtest.lib.corpus import Clip

FORMATS = {
    # name: (suffix, container, codec, rate, layout, sample format, bit rate)
    "wav16": (".wav", "wav", "pcm_s16le", 16000, "mono", "s16", None),
    "wav48s": (".wav", "wav", "pcm_s16le", 48000, "stereo", "s16", None),
    "flac": (".flac", "flac", "flac", 16000, "mono", "s16", None),
    "mp3": (".mp3", "mp3", "libmp3lame", 44100, "stereo", "s16p", 128_000),
    "ogg": (".ogg", "ogg", "libopus", 48000, "mono", "s16", 32_000),
    "m4a": (".m4a", "mp4", "aac", 48000, "mono", "fltp", 64_000),
    # (tests: the other ways one seeks) VBR MP3 (Xing table, LAME V4), raw ADTS AAC, WebM/Opus
    "mp3vbr": (".mp3", "mp3", "libmp3lame", 44100, "mono", "s16p", None),
    "aac": (".aac", "adts", "aac", 44100, "mono", "fltp", 64_000),
    "webm": (".webm", "webm", "libopus", 48000, "mono", "s16", 32_000),
}
LAME_V4 = 4 * 118  # global_quality for a VBR MP3: LAME's -V 4 (FF_QP2LAMBDA is 118)
GAP_S = 0.8


def speech(clips: Sequence[Clip], k: int, seconds: float, decoded: list[np.ndarray]) -> np.ndarray:
    """Upload ``k``'s samples (16 kHz mono float32)."""
    gap = np.zeros(int(GAP_S * 16000), np.float32)
    parts: list[np.ndarray] = []
    total, i = 0, 7 * k
    while total < seconds * 16000:
        a = decoded[i % len(decoded)]
        parts += [a, gap]
        total += a.size + gap.size
        i += 1
    return np.concatenate(parts)[: int(seconds * 16000)]


def encode(samples: np.ndarray, path: Path, fmt: str) -> None:
    import av

    _, container, codec, rate, layout, sample_fmt, bit_rate = FORMATS[fmt]
    if fmt == "wav16":
        write_wav16(path, samples)
        return
    out: Any = av.open(str(path), "w", format=container)
    stream: Any = out.add_stream(codec, rate=rate)
    stream.layout = layout
    stream.format = sample_fmt
    if bit_rate:
        stream.bit_rate = bit_rate
    elif codec == "libmp3lame":
        stream.codec_context.qscale = True  # VBR
        stream.codec_context.global_quality = LAME_V4
    resampler = av.AudioResampler(format=sample_fmt, layout=layout, rate=rate)
    pcm = (np.clip(samples, -1, 1) * 32767).astype(np.int16)
    step = 16000 * 10
    for i in [*range(0, pcm.size, step), None]:
        frames: list[Any] = []
        if i is None:
            frames = list(resampler.resample(None))
        else:
            f = av.AudioFrame.from_ndarray(pcm[None, i:i + step], format="s16", layout="mono")
            f.sample_rate = 16000
            f.pts = i
            frames = list(resampler.resample(f))
        for rf in frames:
            rf.pts = None
            for packet in stream.encode(rf):
                out.mux(packet)
    for packet in stream.encode(None):
        out.mux(packet)
    out.close()


def uploads(clips: Sequence[Clip], work: Path, n: int, minutes: float, fmt: str) -> list[Path]:
    """``n`` uploads of ``minutes`` in ``fmt`` (made once, then reused)."""
    from app.audio import decode

    work.mkdir(parents=True, exist_ok=True)
    suffix = FORMATS[fmt][0]
    paths = [work / f"up{k:02d}-{minutes:g}min-{fmt}{suffix}" for k in range(n)]
    missing = [(k, p) for k, p in enumerate(paths) if not p.is_file()]
    if missing:
        decoded = [decode(Path(c.path), 3600.0) for c in sorted(clips, key=lambda c: c.id)]
        for k, p in missing:
            tmp = p.with_name(p.stem + ".part" + p.suffix)
            encode(speech(clips, k, minutes * 60, decoded), tmp, fmt)
            tmp.rename(p)
    return paths
