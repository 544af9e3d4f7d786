"""Log-mel features for a whole batch in one torch call, equal to whisperx's per-window features.

whisperx's ``log_mel_spectrogram`` takes one window at a time: ~8-9 ms of one CPU thread per
window, ~0.3 s per batch of 32 while a GPU waits. Its steps are all batchable (STFT, the mel
filter bank, log) except one: the floor ``max - 8`` is taken over the whole input tensor, so a
naive batched call would floor every window by the loudest one. Here the max is per window, and
each row is zero-padded exactly as whisperx pads (``padding = n - len``), so every row equals
the per-window result (``tests/test_mel.py`` compares them). On CUDA the STFT runs on the
engine's device.

What crosses from host to device is the audio alone, and as little of it as possible: a batch
whose windows are all int16 PCM (``Window.audio``, as prep hands windows out of its shared
memory slots) goes over as int16 and is scaled by 1/32768 on the device, half the bytes of
float32 (a batch of 128 30 s windows: 123 MB instead of 246 MB); and it is written straight into
pinned (page-locked) host memory, which the copy engine reads directly, where pageable memory
is first copied by the driver into a staging buffer of its own. torch's caching host allocator
keeps the pinned blocks for the next batch (``cudaHostAlloc`` per batch would cost more than
the copy). The scaling is exact (a 16-bit sample times 2^-15 is a float32), so an int16 window
gives the same features as the float32 window it scales to.

On the CPU the same features come from numpy (:func:`host_features`), and a CPU service never
imports torch for its transcription: the import alone cost 2.9 CPU-s of a 4.9 CPU-s cold start
(``python -m app``, measured here), and its libraries the memory they map. The features equal
whisperx's within 5e-5 (float32 FFTs of two libraries; numpy's are the nearer to float64's) at
about torch's CPU cost on one thread (a batch of eight 30 s windows: ~115 ms numpy, 95-101 ms
torch, beside ~29 CPU-s of engine work on those 4 minutes).
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Sequence
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import numpy as np

from app.windows import INT16_SCALE, as_float

N_FFT = 400
HOP = 160
_local = threading.local()
log = logging.getLogger(__name__)
_unpinned: list[str] = []  # why pinned memory failed, once


def batch_features(audios: Sequence[np.ndarray], samples: int, n_mels: int,
                   device: str = "cpu") -> np.ndarray:
    """(batch, n_mels, samples // 160) float32 features of windows zero-padded to ``samples``,
    in host memory (computed on ``device``: the CPU's with numpy)."""
    if device == "cpu":
        return host_features(audios, samples, n_mels)
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

    if not device.startswith("cuda"):
        return ctranslate2.StorageView.from_array(
            np.ascontiguousarray(batch_features(audios, samples, n_mels, device)))
    import torch

    stream = side_stream(device)
    with torch.inference_mode(), torch.cuda.stream(stream):
        feats = _features(audios, samples, n_mels, device, pinned=True).contiguous()
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


def host_audio(audios: Sequence[np.ndarray], samples: int, pinned: bool = False) -> Any:
    """The batch as one zero-padded (batch, samples) host tensor: int16 when every window is
    int16 (scaled on the device, :func:`_features`), else float32 (an int16 window among
    float32 ones scaled here); in pinned memory when ``pinned`` (a copy to a GPU) and torch
    provides it."""
    import torch

    int16 = all(a.dtype == np.int16 for a in audios)
    shape = (len(audios), samples)
    dtype = torch.int16 if int16 else torch.float32
    out = pinned_empty(shape, dtype) if pinned else torch.empty(shape, dtype=dtype)
    x = out.numpy()
    for k, a in enumerate(audios):
        n = min(samples, len(a))
        x[k, :n] = a[:n] if int16 or a.dtype != np.int16 else a[:n] * INT16_SCALE
        x[k, n:] = 0
    return out


def pinned_empty(shape: tuple[int, int], dtype: Any) -> Any:
    """An uninitialised host tensor in pinned memory (torch's caching host allocator), or in
    ordinary memory where torch has none to give (a build without CUDA: said once)."""
    import torch

    if not _unpinned:
        try:
            return torch.empty(shape, dtype=dtype, pin_memory=True)
        except RuntimeError as exc:
            _unpinned.append(str(exc))
            log.warning("pinned host memory unavailable (%s): host-to-device copies go through "
                        "pageable memory", exc)
    return torch.empty(shape, dtype=dtype)


def _features(audios: Sequence[np.ndarray], samples: int, n_mels: int, device: str,
              pinned: bool = False) -> Any:
    """The log-mel tensor on ``device`` (call under inference mode)."""
    import torch
    from whisperx.audio import mel_filters

    audio: Any = host_audio(audios, samples, pinned)
    if device != "cpu":
        audio = audio.to(device, non_blocking=pinned)
    if audio.dtype == torch.int16:
        audio = audio.to(torch.float32) * INT16_SCALE
    window = torch.hann_window(N_FFT, device=audio.device)
    stft = torch.stft(audio, N_FFT, HOP, window=window, return_complex=True)
    magnitudes = stft[..., :-1].abs() ** 2
    mel = mel_filters(audio.device, n_mels) @ magnitudes
    log_spec = torch.clamp(mel, min=1e-10).log10()
    floor = log_spec.amax(dim=(-2, -1), keepdim=True) - 8.0  # per window, as whisperx
    return (torch.maximum(log_spec, floor) + 4.0) / 4.0


def host_features(audios: Sequence[np.ndarray], samples: int, n_mels: int) -> np.ndarray:
    """The features of :func:`batch_features` with numpy on the CPU, step by step as torch's
    ``stft`` (centred, reflect-padded, periodic Hann window) and whisperx's mel and floor; one
    window at a time, so the frames in memory are one window's (4.8 MB for 30 s)."""
    half = N_FFT // 2
    out = np.empty((len(audios), n_mels, samples // HOP), np.float32)
    x = np.empty(samples + 2 * half, np.float32)
    for k, a in enumerate(audios):
        n = min(samples, len(a))
        x[half:half + n] = as_float(a[:n])
        x[half + n:] = 0.0
        x[:half] = x[2 * half:half:-1]  # reflect: sample half+j mirrored to half-j
        x[half + samples:] = x[half + samples - 2:samples - 2:-1]
        frames = np.lib.stride_tricks.sliding_window_view(x, N_FFT)[::HOP][:-1]
        spec = np.fft.rfft(frames * _hann(), axis=-1)  # (frames, N_FFT // 2 + 1)
        power = (spec.real ** 2 + spec.imag ** 2).astype(np.float32)
        log_spec = np.log10(np.maximum(_filters(n_mels) @ power.T, np.float32(1e-10)))
        floor = log_spec.max() - np.float32(8.0)  # per window, as whisperx
        out[k] = (np.maximum(log_spec, floor) + np.float32(4.0)) / np.float32(4.0)
    return out


@functools.cache
def _hann() -> np.ndarray:
    return np.hanning(N_FFT + 1)[:-1].astype(np.float32)  # periodic, as torch.hann_window


@functools.cache
def _filters(n_mels: int) -> np.ndarray:
    """whisperx's mel filter bank (its packaged ``mel_filters.npz``; whisperx.audio, which
    loads it, imports torch)."""
    spec = find_spec("whisperx")
    assert spec is not None and spec.submodule_search_locations
    path = Path(next(iter(spec.submodule_search_locations))) / "assets" / "mel_filters.npz"
    with np.load(path) as f:
        return np.ascontiguousarray(f[f"mel_{n_mels}"], dtype=np.float32)
