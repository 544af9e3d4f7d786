"""The batched log-mel equals whisperx's per-window features, on the host (numpy) and through
torch (the device path), and as the engine's input; a CPU engine never imports torch."""

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


def _exact(audios: list[np.ndarray], samples: int, n_mels: int) -> np.ndarray:
    """The features in float64 throughout (numpy's own padding and FFT): the yardstick."""
    from app.engine.mel import _filters

    x = np.zeros((len(audios), samples))
    for k, a in enumerate(audios):
        x[k, :len(a)] = a[:samples]
    x = np.pad(x, ((0, 0), (200, 200)), mode="reflect")
    frames = np.lib.stride_tricks.sliding_window_view(x, 400, axis=1)[:, ::160][:, :-1]
    power = np.abs(np.fft.rfft(frames * np.hanning(401)[:-1], axis=-1)) ** 2
    log_spec = np.log10(np.maximum(np.einsum("mf,btf->bmt", _filters(n_mels).astype(float),
                                             power), 1e-10))
    floor = log_spec.max(axis=(-2, -1), keepdims=True) - 8
    return (np.maximum(log_spec, floor) + 4) / 4


@pytest.mark.parametrize("n_mels", [80, 128])
def test_batch_features_equal_whisperx_per_window(n_mels: int) -> None:
    """Each row is floored by its own maximum: a quiet window beside a loud one is unchanged.
    torch's batch (a GPU's path, run here on the CPU) equals whisperx within 1e-5 (the same
    library); numpy's (the CPU's) is no further from the float64 features than whisperx itself
    is (on the loud sine whisperx is 4.1e-5 off them, numpy 1.3e-5: float32 FFTs)."""
    import torch
    from whisperx.audio import log_mel_spectrogram

    from app.engine.mel import _features

    audios = _windows()
    got = batch_features(audios, N_SAMPLES, n_mels)
    exact = _exact(audios, N_SAMPLES, n_mels)
    with torch.inference_mode():
        through_torch = _features(audios, N_SAMPLES, n_mels, "cpu").numpy()
    for k, a in enumerate(audios):
        want = log_mel_spectrogram(a, n_mels=n_mels, padding=N_SAMPLES - len(a)).numpy()
        want = want[:, :got.shape[2]]
        np.testing.assert_allclose(through_torch[k], want, atol=1e-5)
        whisperx_off = np.abs(want - exact[k]).max()
        assert np.abs(got[k] - exact[k]).max() <= max(whisperx_off, 2e-6)
        np.testing.assert_allclose(got[k], want, atol=2 * whisperx_off + 2e-6)


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
    with torch.inference_mode():
        ordinary = mel._features(pcm, 15 * SAMPLE_RATE, 80, "cpu").numpy()
    np.testing.assert_array_equal(got, ordinary)
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


@pytest.mark.model
def test_a_cpu_engine_transcribes_without_importing_torch(clips: list[Clip]) -> None:
    """In a fresh interpreter: the real model on the CPU detects a clip's language and reads it
    without torch ever being imported (its import cost a CPU service 2.9 CPU-s of its start and
    ~470 MB of resident memory, measured here), and numpy's BLAS runs at one thread."""
    import subprocess
    import sys

    from tests.conftest import ROOT

    clip = sorted(clips, key=lambda c: c.duration_s)[len(clips) // 2]
    code = f"""
import sys
from pathlib import Path
from threadpoolctl import threadpool_info
from app.audio import prepare
from app.audio.vad import SileroVad
from app.config import ModelSettings, Settings
from app.engine.whisper import WhisperEngine
from app.windows import DecodeOptions
from models.registry import resolve
s = Settings()
engine = WhisperEngine(resolve(s.model.name, s.model.cache_dir, True),
                       ModelSettings(num_workers=1), s.model.name)
windows = prepare(Path({str(clip.path)!r}), SileroVad(), 3600)[1]
results = engine.transcribe_batch(windows, DecodeOptions())
print(repr(" ".join(r.text for r in results).strip()))
print("torch" in sys.modules)
print(sorted({{p["num_threads"] for p in threadpool_info() if p["user_api"] == "blas"}}))
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    text, torch_loaded, blas_threads = out.stdout.strip().splitlines()[-3:]
    assert len(text) > 10, out.stdout
    assert torch_loaded == "False"
    assert blas_threads == "[1]"
