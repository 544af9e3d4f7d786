"""Live input audio (app/live/audio.py, app/live/buffer.py): formats, resampling across
appends, the chunk buffer."""

from __future__ import annotations

import audioop  # Python 3.11: the reference G.711 codec (deprecated, still shipped)
import base64

import numpy as np
import pytest

from app.live.audio import ALAW, ULAW, AudioDecoder, BadAudio, ChunkBuffer, b64decode, encode_pcm16
from app.live.protocol import PcmaFormat, PcmFormat, PcmuFormat


def test_g711_tables_match_the_reference_codec() -> None:
    every = bytes(range(256))
    u = np.frombuffer(audioop.ulaw2lin(every, 2), "<i2") / 32768.0
    a = np.frombuffer(audioop.alaw2lin(every, 2), "<i2") / 32768.0
    assert np.array_equal(u.astype(np.float32), ULAW)
    assert np.array_equal(a.astype(np.float32), ALAW)


def tone(rate: int, seconds: float, hz: float = 440.0) -> np.ndarray:
    t = np.arange(int(rate * seconds)) / rate
    return (0.3 * np.sin(2 * np.pi * hz * t)).astype(np.float32)


def test_pcm16_at_16k_is_passed_through() -> None:
    x = tone(16_000, 0.5)
    got = AudioDecoder(PcmFormat(rate=16000)).decode(encode_pcm16(x))
    assert np.abs(got - x).max() < 1e-4


@pytest.mark.parametrize("fmt,rate", [(PcmFormat(), 24_000), (PcmuFormat(), 8_000),
                                      (PcmaFormat(), 8_000)])
def test_appends_resample_as_one_signal(fmt: PcmFormat | PcmuFormat | PcmaFormat,
                                        rate: int) -> None:
    """100 ms appends give the samples one append of the whole stream gives (the resampler's
    state carries), and the tone keeps its pitch at 16 kHz."""
    x = tone(rate, 2.0)
    if isinstance(fmt, PcmFormat):
        raw = encode_pcm16(x)
    else:
        lin = encode_pcm16(x)
        raw = audioop.lin2ulaw(lin, 2) if isinstance(fmt, PcmuFormat) else audioop.lin2alaw(lin, 2)
    width = 2 if isinstance(fmt, PcmFormat) else 1
    step = rate // 10 * width
    whole_dec = AudioDecoder(fmt)
    whole = np.concatenate([whole_dec.decode(raw), whole_dec.flush()])
    parts_dec = AudioDecoder(fmt)
    parts = np.concatenate([parts_dec.decode(raw[i:i + step]) for i in range(0, len(raw), step)]
                           + [parts_dec.flush()])
    assert abs(parts.size - 32_000) <= 64 and parts.size == whole.size
    assert np.abs(parts - whole).max() < 1e-4
    spectrum = np.abs(np.fft.rfft(parts[4000:20000]))
    assert abs(np.argmax(spectrum) * 16_000 / 16_000 - 440) <= 2


def test_a_sample_split_across_appends_is_kept() -> None:
    x = encode_pcm16(tone(16_000, 0.01))
    dec = AudioDecoder(PcmFormat(rate=16000))
    a, b = dec.decode(x[:3]), dec.decode(x[3:])
    assert a.size == 1 and a.size + b.size == len(x) // 2


def test_bad_base64_is_refused() -> None:
    assert b64decode(base64.b64encode(b"\x01\x02").decode()) == b"\x01\x02"
    for bad in ("not base64!", "AAA", "AA=A"):
        with pytest.raises(BadAudio):
            b64decode(bad)


def test_chunk_buffer_slices_and_trims_by_absolute_position() -> None:
    buf = ChunkBuffer()
    for k in range(5):
        buf.append(np.full(100, k, dtype=np.float32))
    assert len(buf) == 500 and buf.slice(150, 260).tolist() == [1.0] * 50 + [2.0] * 60
    buf.trim(230)
    assert buf.base == 230 and buf.slice(0, 240).tolist() == [2.0] * 10
    assert buf.slice(480, 900).tolist() == [4.0] * 20
    buf.clear()
    assert len(buf) == 0 and buf.end == 500 and buf.slice(0, 500).size == 0


def test_chunk_buffer_slices_are_views_that_later_appends_never_change() -> None:
    """A slice is handed to a decode that may still run while the session appends, trims
    and grows the buffer: what it holds must stay as it was, and no one may write into it."""
    rng = np.random.default_rng(0)
    buf, whole = ChunkBuffer(1000), np.zeros(0, dtype=np.float32)
    kept: list[tuple[int, int, np.ndarray]] = []
    for k in range(400):  # 100 ms appends, 40 s in all: the array grows and moves many times
        chunk = rng.standard_normal(1600).astype(np.float32)
        buf.append(chunk)
        whole = np.concatenate([whole, chunk])
        if k % 50 == 49:
            a, b = buf.end - 16_000 * 3, buf.end
            kept.append((a, b, buf.slice(a, b)))
            buf.trim(buf.end - 16_000)  # a turn's start moves on
        assert buf.end == 1000 + whole.size and len(buf) <= 16_000 + 50 * 1600
    for a, b, view in kept:
        assert np.array_equal(view, whole[a - 1000:b - 1000])
        with pytest.raises(ValueError):
            view[0] = 1.0
    assert np.array_equal(buf.slice(buf.base, buf.end), whole[buf.base - 1000:])
