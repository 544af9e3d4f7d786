"""The batched log-mel equals whisperx's per-window features, on the host and as the engine's input."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from app.engine.mel import batch_features, encoder_input
from app.engine.whisper import WhisperEngine
from app.windows import N_SAMPLES, SAMPLE_RATE, DecodeOptions, Prompt, Window
from loadtest.lib.corpus import Clip


def _windows() -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    quiet = 0.01 * rng.standard_normal(3 * SAMPLE_RATE).astype(np.float32)
    loud = 0.5 * np.sin(np.arange(11 * SAMPLE_RATE) * 0.05).astype(np.float32)
    return [quiet, loud, rng.uniform(-1, 1, 29 * SAMPLE_RATE).astype(np.float32)]


def test_batch_features_equal_whisperx_per_window() -> None:
    """Each row is floored by its own maximum: a quiet window beside a loud one is unchanged."""
    from whisperx.audio import log_mel_spectrogram

    audios = _windows()
    got = batch_features(audios, N_SAMPLES, 80)
    for k, a in enumerate(audios):
        want = log_mel_spectrogram(a, n_mels=80, padding=N_SAMPLES - len(a)).numpy()
        np.testing.assert_allclose(got[k], want[:, :got.shape[2]], atol=1e-5)


def test_encoder_input_is_the_same_features() -> None:
    audios = _windows()
    view = encoder_input(audios, 15 * SAMPLE_RATE, 80)
    assert view.device == "cpu" and list(view.shape) == [3, 80, 1500]
    np.testing.assert_array_equal(np.asarray(view), batch_features(audios, 15 * SAMPLE_RATE, 80))


def _int16(audios: list[np.ndarray]) -> list[np.ndarray]:
    """int16 PCM of each window, and (second) the float32 windows they read as."""
    return [np.clip(np.round(a * 32768), -32768, 32767).astype(np.int16) for a in audios]


def test_int16_windows_give_the_features_of_the_float32_they_read_as() -> None:
    """prep hands int16 windows; the scaling (x 2^-15) is exact, so the features are equal."""
    from app.windows import as_float

    pcm = _int16(_windows())
    floats = [as_float(a) for a in pcm]
    assert all(f.dtype == np.float32 for f in floats)
    want = batch_features(floats, 20 * SAMPLE_RATE, 80)
    np.testing.assert_array_equal(batch_features(pcm, 20 * SAMPLE_RATE, 80), want)
    mixed = [pcm[0], floats[1], pcm[2]]  # a float32 window among int16 ones: scaled on the host
    np.testing.assert_array_equal(batch_features(mixed, 20 * SAMPLE_RATE, 80), want)


def test_the_gpu_copy_goes_as_int16_from_pinned_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """The device path's host side, with a fake for torch's pinned allocator (this machine has
    no CUDA): an all-int16 batch is asked for as one (batch, samples) int16 buffer, half the
    bytes of float32, whose padding is written (the allocator's memory is not zeroed); a batch
    with a float32 window goes as float32. The features equal the host path's."""
    import torch

    from app.engine import mel

    asked: list[tuple[tuple[int, int], Any]] = []

    def fake_pinned(shape: tuple[int, int], dtype: Any) -> Any:
        asked.append((shape, dtype))
        return torch.full(shape, 7, dtype=dtype)  # garbage where nothing is written

    monkeypatch.setattr(mel, "pinned_empty", fake_pinned)
    pcm = _int16(_windows())
    with torch.inference_mode():
        got = mel._features(pcm, 15 * SAMPLE_RATE, 80, "cpu", pinned=True).numpy()
    assert asked == [((3, 15 * SAMPLE_RATE), torch.int16)]
    np.testing.assert_array_equal(got, batch_features(pcm, 15 * SAMPLE_RATE, 80))
    with torch.inference_mode():
        mel._features([pcm[0], _windows()[1]], 15 * SAMPLE_RATE, 80, "cpu", pinned=True)
    assert asked[1] == ((2, 15 * SAMPLE_RATE), torch.float32)


def test_without_cuda_pinned_memory_falls_back_to_ordinary_memory(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from app.engine import mel

    monkeypatch.setattr(mel, "_unpinned", [])
    t = mel.pinned_empty((2, 8), torch.int16)  # this machine's torch has no CUDA
    assert tuple(t.shape) == (2, 8) and t.dtype == torch.int16
    if not torch.cuda.is_available():
        assert not t.is_pinned() and mel._unpinned


@pytest.mark.model
def test_the_engine_reads_int16_windows_as_the_float32_they_scale_to(
        engine: WhisperEngine, clips: list[Clip]) -> None:
    """End to end on the real model: the same texts and scores from int16 windows."""
    from app.audio import prepare
    from app.audio.vad import SileroVad

    picked = sorted(clips, key=lambda c: c.id)[::11][:5]
    windows = [w for c in picked for w in prepare(c.path, SileroVad(), 3600)[1]]
    for w in windows:
        w.prompt = Prompt(language="en")
    pcm = [Window(a, w.start, w.end, w.prompt)
           for w, a in zip(windows, _int16([w.audio for w in windows]), strict=True)]
    from app.windows import as_float

    floats = [Window(as_float(w.audio), w.start, w.end, w.prompt) for w in pcm]
    want = engine.transcribe_batch(floats, DecodeOptions())
    got = engine.transcribe_batch(pcm, DecodeOptions())
    assert [(r.text, r.avg_logprob) for r in got] == [(r.text, r.avg_logprob) for r in want]
    assert any(r.text.strip() for r in got)
