"""Log-mel features for a whole batch in one torch call, equal to whisperx's per-window features.

whisperx's ``log_mel_spectrogram`` takes one window at a time: ~8-9 ms of one CPU thread per
window, ~0.3 s per batch of 32 while a GPU waits. Its steps are all batchable (STFT, the mel
filter bank, log) except one: the floor ``max - 8`` is taken over the whole input tensor, so a
naive batched call would floor every window by the loudest one. Here the max is per window, and
each row is zero-padded exactly as whisperx pads (``padding = n - len``), so every row equals
the per-window result (``tests/test_mel.py`` compares them). On CUDA the STFT runs on the
engine's device.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

N_FFT = 400
HOP = 160
_local = threading.local()


def batch_features(audios: Sequence[np.ndarray], samples: int, n_mels: int,
                   device: str = "cpu") -> np.ndarray:
    """(batch, n_mels, samples // 160) float32 features of windows zero-padded to ``samples``,
    in host memory (computed on ``device``)."""
    import torch

    with torch.inference_mode():
        out: np.ndarray = _features(audios, samples, n_mels, device).to("cpu").numpy()
    return out.astype(np.float32, copy=False)


def encoder_input(audios: Sequence[np.ndarray], samples: int, n_mels: int,
                  device: str = "cpu") -> Any:
    """The features as the CTranslate2 ``StorageView`` the encoder takes, where they were made.

    On CUDA they stay on the GPU: CTranslate2 reads a torch tensor through the CUDA array
    interface (the view keeps the tensor alive), so the features make no trip to the host and
    back (for a batch of 64 30 s windows: 61 MB each way). What must cross is the audio itself
    (one host-to-device copy, 1.9 MB per 30 s window: the STFT needs it on the device). torch
    runs here on a stream of this thread's own, not on CUDA's legacy default stream: CTranslate2's
    worker streams are created blocking (``cudaStreamCreate``), so work on the default stream
    would serialise against every batch in flight on the device. The stream is synchronised
    before CTranslate2 reads the features, since it reads them on its own stream."""
    import ctranslate2
    import torch

    if not device.startswith("cuda"):
        return ctranslate2.StorageView.from_array(
            np.ascontiguousarray(batch_features(audios, samples, n_mels, device)))
    stream = side_stream(device)
    with torch.inference_mode(), torch.cuda.stream(stream):
        feats = _features(audios, samples, n_mels, device).contiguous()
    stream.synchronize()
    return ctranslate2.StorageView.from_array(feats)


def side_stream(device: str) -> Any:
    """This thread's own torch stream on ``device`` (created once per thread and device; torch
    makes them non-blocking, so they never wait on CTranslate2's streams)."""
    import torch

    streams: dict[str, Any] = getattr(_local, "streams", None) or {}
    _local.streams = streams
    if device not in streams:
        streams[device] = torch.cuda.Stream(device=device)
    return streams[device]


def _features(audios: Sequence[np.ndarray], samples: int, n_mels: int, device: str) -> Any:
    """The log-mel tensor on ``device`` (call under inference mode)."""
    import torch
    from whisperx.audio import mel_filters

    x = np.zeros((len(audios), samples), dtype=np.float32)
    for k, a in enumerate(audios):
        n = min(samples, len(a))
        x[k, :n] = a[:n]
    audio: Any = torch.from_numpy(x)
    if device != "cpu":
        audio = audio.to(device)
    window = torch.hann_window(N_FFT, device=audio.device)
    stft = torch.stft(audio, N_FFT, HOP, window=window, return_complex=True)
    magnitudes = stft[..., :-1].abs() ** 2
    mel = mel_filters(audio.device, n_mels) @ magnitudes
    log_spec = torch.clamp(mel, min=1e-10).log10()
    floor = log_spec.amax(dim=(-2, -1), keepdim=True) - 8.0  # per window, as whisperx
    return (torch.maximum(log_spec, floor) + 4.0) / 4.0
