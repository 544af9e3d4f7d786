"""Voice activity detection: which spans of an upload hold speech (only those reach the engine).

Silero VAD is faster-whisper's ONNX model, shipped in its wheel, run on onnxruntime with the same
session options and the same rules as faster-whisper's ``get_speech_timestamps``, with one
change: the model's first layer, an STFT written as a 1-D convolution with a 258 x 256 basis, is
done by numpy's FFT instead. On CPU that convolution is about a third of the model's time: the
corpus's VAD takes 0.43 s of CPU instead of 0.61 s (-29%, one thread). The graph is cut after
the STFT magnitude (``onnx.utils.Extractor``), and onnxruntime runs the rest. Speech
probabilities differ from the whole graph's by < 1e-5, and a start-up check falls back to the
whole graph if they ever do not (a different model file).

VAD runs in the prep pool, never on the event loop: ~0.7 ms of CPU per audio second.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from app.windows import SAMPLE_RATE, WINDOW_S

# pyannote.audio (whisperx's VAD) ships telemetry switched on: loading one of its models sends a
# span to otel.pyannote.ai. A server does not phone home unless its operator says so; this runs
# before whisperx (and so pyannote) is imported, and an explicit setting is kept.
os.environ.setdefault("PYANNOTE_METRICS_ENABLED", "false")

log = logging.getLogger(__name__)

CHUNK = 512  # samples per speech probability (32 ms)
CONTEXT = 64  # samples of the previous chunk prepended to each one
N_FFT, HOP, REFLECT = 256, 128, 64  # the model's STFT: reflect-pad 64 on the right, 4 frames
MAGNITUDE = "/encoder/feature_extractor/Sqrt_output_0"  # (chunks, 129, 4): where the graph is cut
BLOCK = 10_000  # chunks per onnxruntime call (faster-whisper's), ~5 min of audio
AGREE = 1e-4  # start-up check: largest allowed difference between the two paths' probabilities


class Vad(Protocol):
    def speech(self, audio: np.ndarray) -> list[tuple[float, float]]: ...


def _padded(audio: np.ndarray) -> np.ndarray:
    """Whole chunks, as faster-whisper pads (a full extra chunk when already whole); a copy."""
    return np.pad(audio.astype(np.float32, copy=False), (0, CHUNK - audio.size % CHUNK))


def _session(model: bytes) -> Any:
    import onnxruntime

    opts = onnxruntime.SessionOptions()  # as faster-whisper's SileroVADModel: 1 thread, no arena
    opts.inter_op_num_threads = 1
    opts.intra_op_num_threads = 1
    opts.enable_cpu_mem_arena = False
    opts.log_severity_level = 4
    return onnxruntime.InferenceSession(model, providers=["CPUExecutionProvider"],
                                        sess_options=opts)


class SileroVad:
    """faster-whisper's Silero VAD model and thresholds; the STFT by FFT (see the module doc)."""

    def __init__(self) -> None:
        import onnx
        import onnx.utils
        from faster_whisper.utils import get_assets_path
        from faster_whisper.vad import SileroVADModel

        path = str(Path(get_assets_path()) / "silero_vad_v6.onnx")
        # faster-whisper's own model call: the reference of the start-up check, and the fallback.
        self._whole = SileroVADModel(path)
        self._window = (0.5 - 0.5 * np.cos(2 * np.pi * np.arange(N_FFT) / N_FFT)).astype(np.float32)
        tail = onnx.utils.Extractor(onnx.load(path)).extract_model(
            [MAGNITUDE, "h", "c"], ["speech_probs", "hn", "cn"])
        self._tail: Any = _session(tail.SerializeToString())
        probe = np.random.default_rng(0).standard_normal(CHUNK * 64).astype(np.float32)
        probe *= np.linspace(0.0, 0.5, probe.size, dtype=np.float32)
        diff = float(np.abs(self.probabilities(probe) - self._whole(_padded(probe))).max())
        if not diff < AGREE:  # a model whose first layer is not this STFT
            log.warning("Silero VAD: the FFT front end differs from the model's by %.2g; "
                        "running the whole model", diff)
            self._tail = None

    @property
    def fft(self) -> bool:
        return self._tail is not None

    def probabilities(self, audio: np.ndarray) -> np.ndarray:
        """One speech probability per 512 samples, as faster-whisper's model call returns them."""
        padded = _padded(audio)
        if self._tail is None:
            return np.asarray(self._whole(padded))
        # As faster-whisper's call: each chunk is prepended with the previous one's last 64
        # samples (zeros for the first), and, through a view there, the last chunk's own last
        # 64 samples are zeroed too: kept, for equal output.
        chunks = padded.reshape(-1, CHUNK)
        chunks[-1, -CONTEXT:] = 0
        context = np.roll(chunks[:, -CONTEXT:], 1, axis=0)
        h = np.zeros((1, 1, 128), dtype=np.float32)
        c = np.zeros((1, 1, 128), dtype=np.float32)
        out = []
        for i in range(0, len(chunks), BLOCK):  # the LSTM state carries across blocks
            x = np.concatenate([context[i:i + BLOCK], chunks[i:i + BLOCK]], axis=1)
            probs, h, c = self._tail.run(None, {MAGNITUDE: self._magnitude(x), "h": h, "c": c})
            out.append(probs)
        return np.concatenate(out)

    def _magnitude(self, x: np.ndarray) -> np.ndarray:
        """The model's STFT magnitude: its basis is a periodic Hann window times the DFT."""
        x = np.concatenate([x, x[:, -2:-REFLECT - 2:-1]], axis=1)  # reflect, as the graph's Pad
        frames = np.lib.stride_tricks.sliding_window_view(x, N_FFT, axis=1)[:, ::HOP]
        spectrum = np.fft.rfft(frames * self._window, axis=-1)  # (chunks, 4, 129)
        return np.abs(spectrum).astype(np.float32).transpose(0, 2, 1)

    def speech(self, audio: np.ndarray) -> list[tuple[float, float]]:
        spans = speech_spans(self.probabilities(audio), audio.size)
        return [(s / SAMPLE_RATE, e / SAMPLE_RATE) for s, e in spans]


def speech_spans(probs: np.ndarray, n_samples: int, threshold: float = 0.5,
                 max_speech_s: float = WINDOW_S, min_silence_ms: int = 160,
                 speech_pad_ms: int = 400) -> list[tuple[int, int]]:
    """Speech spans in samples from the probabilities: faster-whisper's ``get_speech_timestamps``
    rules (adapted from silero-vad), which only run on its own cached model. Hysteresis between
    ``threshold`` and ``threshold - 0.15``; a span ends after ``min_silence_ms`` below it; one
    longer than ``max_speech_s`` is split at its last silence of > 98 ms, or else cut; spans are
    padded by ``speech_pad_ms`` each side (split evenly when closer)."""
    neg = max(threshold - 0.15, 0.01)
    pad = SAMPLE_RATE * speech_pad_ms / 1000
    max_speech = SAMPLE_RATE * max_speech_s - CHUNK - 2 * pad
    min_silence = SAMPLE_RATE * min_silence_ms / 1000
    min_silence_at_max = SAMPLE_RATE * 98 / 1000
    spans: list[list[float]] = []
    start: float | None = None
    temp_end = prev_end = next_start = 0
    for i, p in enumerate(probs.tolist()):
        at = CHUNK * i
        if p >= threshold and temp_end:
            temp_end = 0
            if next_start < prev_end:
                next_start = at
        if p >= threshold and start is None:
            start = at
            continue
        if start is not None and at - start > max_speech:
            if prev_end:
                spans.append([start, prev_end])
                # still below the threshold since that silence: not speech yet
                start = None if next_start < prev_end else next_start
            else:
                spans.append([start, at])
                start = None
                prev_end = next_start = temp_end = 0
                continue
            prev_end = next_start = temp_end = 0
        if p < neg and start is not None:
            temp_end = temp_end or at
            if at - temp_end > min_silence_at_max:  # a silence a long span may be split at
                prev_end = temp_end
            if at - temp_end < min_silence:
                continue
            if temp_end - start > 0:  # min_speech_duration_ms is 0
                spans.append([start, temp_end])
            start = None
            prev_end = next_start = temp_end = 0
            continue
    if start is not None and n_samples - start > 0:
        spans.append([start, n_samples])
    for i, span in enumerate(spans):
        if i == 0:
            span[0] = int(max(0, span[0] - pad))
        if i != len(spans) - 1:
            gap = spans[i + 1][0] - span[1]
            if gap < 2 * pad:
                span[1] += int(gap // 2)
                spans[i + 1][0] = int(max(0, spans[i + 1][0] - gap // 2))
            else:
                span[1] = int(min(n_samples, span[1] + pad))
                spans[i + 1][0] = int(max(0, spans[i + 1][0] - pad))
        else:
            span[1] = int(min(n_samples, span[1] + pad))
    return [(int(s), int(e)) for s, e in spans]


class PyannoteVad:
    """whisperx's pyannote VAD (weights in the whisperx wheel), with whisperx's thresholds."""

    def __init__(self, device: str) -> None:
        import torch
        from whisperx.vads import Pyannote

        self._model = Pyannote(torch.device(device), vad_onset=0.5, vad_offset=0.363, chunk_size=30)

    def speech(self, audio: np.ndarray) -> list[tuple[float, float]]:
        import torch
        from whisperx.vads import Pyannote

        with torch.inference_mode():
            scores = self._model({"waveform": Pyannote.preprocess_audio(audio),
                                  "sample_rate": SAMPLE_RATE})
        merged = Pyannote.merge_chunks(scores, WINDOW_S, onset=0.5, offset=0.363)
        # merge_chunks already packs regions into <= 30 s chunks; return their spans.
        return [(float(m["start"]), float(m["end"])) for m in merged]


def make_vad(kind: str, device: str) -> Vad:
    return PyannoteVad(device) if kind == "pyannote" else SileroVad()
