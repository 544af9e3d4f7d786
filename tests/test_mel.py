"""The batched log-mel equals whisperx's per-window features, on the host and as the engine's input."""

from __future__ import annotations

import numpy as np

from app.engine.mel import batch_features, encoder_input
from app.windows import N_SAMPLES, SAMPLE_RATE


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
