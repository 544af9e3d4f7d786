"""WAV uploads are opened with a small FFmpeg probe (app.audio._open): it must never change what
is decoded or probed. Every corpus WAV, and WAVs of every sample width, stereo, mu-law, ADPCM
and a streaming writer's 4 GiB header, decode to the same samples and probe to the same facts
as with FFmpeg's default probe."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from app.audio import decode
from app.audio import media as audio
from loadtest.lib.corpus import Clip
from loadtest.lib.hostile_inputs import encode, load, wav
from tests.test_bad_input import huge_header_wav


def variants(clips: list[Clip], tmp: Path) -> list[Path]:
    files = [Path(c.path) for c in clips if Path(c.path).read_bytes()[8:12] == b"WAVE"]
    speech = load(Path(clips[0].path), 22050)
    made = {
        "u8.wav": wav(speech, 22050, 1), "s24.wav": wav(speech, 22050, 3),
        "s32.wav": wav(speech, 22050, 4), "stereo.wav": wav(np.hstack([speech, speech]), 22050),
        "huge-header.wav": huge_header_wav(load(Path(clips[0].path), 16000)),
        # Compressed payloads in a WAV container: the header still describes the stream.
        "mulaw.wav": encode(load(Path(clips[0].path), 8000)[:, 0], 8000, "wav", "pcm_mulaw"),
        "adpcm.wav": encode(load(Path(clips[0].path), 16000)[:, 0], 16000, "wav", "adpcm_ms"),
    }
    for name, data in made.items():
        (tmp / name).write_bytes(data)
        files.append(tmp / name)
    return files


def test_wav_packets_grow_with_the_file_within_their_bounds() -> None:
    assert audio.wav_packet(0) == audio.wav_packet(160_000) == 32 * 1024  # a 5 s clip
    assert audio.wav_packet(8_000_000) == 64 * 1024  # ~4 minutes at 16 kHz mono
    assert audio.wav_packet(16_000_000) == 128 * 1024
    assert audio.wav_packet(38_400_044) == audio.wav_packet(10**11) == 256 * 1024  # 20 minutes


def test_small_wav_probe_changes_nothing(clips: list[Clip], tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    files = variants(clips, tmp_path)
    assert len(files) > 10
    small = [(audio.probe(f, 3600), decode(f, 3600)) for f in files]
    # FFmpeg's defaults: its own probe size, and the wav demuxer's 4096-byte packets
    monkeypatch.setattr(audio, "WAV_PROBE", {})
    monkeypatch.setattr(audio, "wav_packet", lambda size: 4096)
    default = [(audio.probe(f, 3600), decode(f, 3600)) for f in files]
    for f, (p1, a1), (p2, a2) in zip(files, small, default, strict=True):
        assert p1 == p2, f
        assert np.array_equal(a1, a2), f
        assert a1.size > 0, f
