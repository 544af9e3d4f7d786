"""The hostile inputs of issue 18, as bytes: one copy, used by the tests (tests/test_hostile*.py,
tests/test_bad_input.py, tests/test_audio.py, tests/test_outbound.py) and by the soak
(loadtest/soak.py), which sends them beside its mixed load.

Files are made with numpy, ``wave`` and PyAV (the FFmpeg the service bundles); no ffmpeg binary
is needed. Nothing here imports pytest, torch or the app: the soak's client process stays light.
"""

from __future__ import annotations

import io
import struct
import wave
from collections.abc import Iterable
from pathlib import Path

import av
import numpy as np

# callback_url values reported in issue 18: cloud metadata, a database port on loopback, an
# IPv4-mapped loopback, loopback as one decimal number, a private address, and a loopback name.
SSRF_URLS = ("http://169.254.169.254/latest/meta-data/", "http://127.0.0.1:5432/",
             "http://[::ffff:127.0.0.1]:22/", "http://2130706433/", "http://10.0.0.1/",
             "http://localhost/")


# ---- plain audio ------------------------------------------------------------------------------
def load(path: Path, rate: int, channels: int = 1) -> np.ndarray:
    """An audio file as float32 (frames, channels) at ``rate``."""
    layout = "mono" if channels == 1 else "stereo"
    rs = av.AudioResampler(format="flt", layout=layout, rate=rate)
    out = []
    with av.open(str(path)) as c:
        for frame in c.decode(audio=0):
            out += [f.to_ndarray().reshape(-1, channels) for f in rs.resample(frame)]
    out += [f.to_ndarray().reshape(-1, channels) for f in rs.resample(None)]
    return np.concatenate(out)


def wav(samples: np.ndarray, rate: int, width: int = 2) -> bytes:
    """PCM wav of float samples (frames[, channels]) with 1-4 byte samples."""
    x = np.clip(samples.reshape(len(samples), -1 if samples.ndim > 1 else 1), -1, 1)
    ints = np.round(x * (2 ** (8 * width - 1) - 1)).astype("<i4")
    raw = ints.view(np.uint8).reshape(-1, 4)[:, :width].tobytes()  # little-endian low bytes
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(x.shape[1])
        w.setsampwidth(width)
        w.setframerate(rate)
        w.writeframes(raw)
    return buf.getvalue()


def encode_chunks(chunks: Iterable[np.ndarray], rate: int, fmt: str, codec: str) -> bytes:
    """Encode mono s16 chunks (1 x n) with PyAV (bundled FFmpeg) into an in-memory file."""
    buf = io.BytesIO()
    with av.open(buf, mode="w", format=fmt) as c:
        s = c.add_stream(codec, rate=rate, layout="mono")
        assert isinstance(s, av.audio.stream.AudioStream)
        for chunk in chunks:
            f = av.AudioFrame.from_ndarray(np.ascontiguousarray(chunk), format="s16",
                                           layout="mono")
            f.sample_rate = rate
            for p in s.encode(f):
                c.mux(p)
        for p in s.encode(None):
            c.mux(p)
    return buf.getvalue()


def encode(samples: np.ndarray, rate: int, fmt: str, codec: str) -> bytes:
    """Encode mono float samples into an in-memory file, 10 s per frame."""
    pcm = (np.clip(samples.reshape(1, -1), -1, 1) * 32767).astype(np.int16)
    step = rate * 10
    return encode_chunks((pcm[:, i:i + step] for i in range(0, pcm.shape[1], step)),
                         rate, fmt, codec)


# ---- headers that lie -------------------------------------------------------------------------
def header_only_wav(seconds: float, rate: int = 16000) -> bytes:
    """A 16-bit mono WAV header announcing ``seconds`` of samples (none follow): undecodable."""
    data = int(seconds * rate) * 2
    return (b"RIFF" + (36 + data).to_bytes(4, "little") + b"WAVEfmt " + (16).to_bytes(4, "little")
            + (1).to_bytes(2, "little") + (1).to_bytes(2, "little") + rate.to_bytes(4, "little")
            + (rate * 2).to_bytes(4, "little") + (2).to_bytes(2, "little")
            + (16).to_bytes(2, "little") + b"data" + data.to_bytes(4, "little"))


def wav_declaring(rate: int, channels: int, frames: int = 16) -> bytes:
    """A syntactically valid PCM WAV header (plus a few silent frames) with any rate/layout:
    10 MHz, 64 channels or 0 Hz must be refused at upload."""
    width = 2
    data = bytes(frames * channels * width)
    fmt = struct.pack("<HHIIHH", 1, channels, rate, rate * channels * width, channels * width,
                      8 * width)
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + \
        struct.pack("<I", len(data)) + data
    return b"RIFF" + struct.pack("<I", len(body)) + body


def lying_flac(seconds: float = 300.0) -> bytes:
    """A FLAC whose STREAMINFO says 1 s; its frames hold ``seconds`` (1 s of tone, then silence).
    The probe believes the header, so the upload is accepted; a service whose duration limit
    is under ``seconds`` fails the job when decoding passes it."""
    rate = 16000
    x = np.zeros(int(rate * seconds), np.float32)
    x[:rate] = 0.3 * np.sin(2 * np.pi * 220 * np.arange(rate) / rate)
    data = bytearray(encode(x, rate, "flac", "flac"))
    v = int.from_bytes(data[18:26], "big")  # STREAMINFO: rate, channels, bits, total samples
    data[18:26] = ((v >> 36 << 36) | rate).to_bytes(8, "big")
    return bytes(data)


def lying_mkv(samples: np.ndarray, claimed_s: float) -> bytes:
    """16 kHz mono PCM in Matroska whose Segment Info Duration is overwritten with
    ``claimed_s``: its size gives the lie away, so it is admitted at its timed length (and counted
    at the decoded one whatever happens)."""
    pcm = (np.clip(samples.reshape(-1), -1, 1) * 32767).astype(np.int16)[None]
    buf = io.BytesIO()
    with av.open(buf, "w", format="matroska") as c:
        stream = c.add_stream("pcm_s16le", rate=16000, layout="mono")
        for k in range(0, pcm.shape[1], 160_000):
            f = av.AudioFrame.from_ndarray(np.ascontiguousarray(pcm[:, k:k + 160_000]),
                                           format="s16", layout="mono")
            f.sample_rate = 16000
            for packet in stream.encode(f):
                c.mux(packet)
        for packet in stream.encode(None):
            c.mux(packet)
    data = bytearray(buf.getvalue())
    at = data.find(b"\x44\x89\x88")  # EBML Duration, an 8-byte float in milliseconds
    if at < 0:
        raise ValueError("the muxer wrote no Duration element")
    data[at + 3:at + 11] = struct.pack(">d", claimed_s * 1000)
    return bytes(data)


# ---- playlists ---------------------------------------------------------------------------------
def playlists(other_job: str, absolute: Path | str) -> dict[str, bytes]:
    """Playlists that would make FFmpeg open other files: ``other_job`` is another job's id
    (its upload sits in the spool folder under that name, beside this upload's own spool
    file, so a relative ffconcat entry points at it), ``absolute`` any path on the server."""
    return {
        "concat.txt": f"ffconcat version 1.0\nfile '{other_job}'\n".encode(),
        "concat-abs.txt": f"ffconcat version 1.0\nfile '{absolute}'\n".encode(),
        "list.m3u8": f"#EXTM3U\n#EXTINF:10,\n{absolute}\n#EXT-X-ENDLIST\n".encode(),
        "plain.m3u": f"{absolute}\n".encode(),
    }
