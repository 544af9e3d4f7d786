"""Voice activity detection: which spans of an upload hold speech (only those reach the engine).

Silero VAD is faster-whisper's ONNX model, shipped in its wheel, run on onnxruntime with the same
session options and the same rules as faster-whisper's ``get_speech_timestamps``, with one
change: the model's first layer, an STFT written as a 1-D convolution with a 258 x 256 basis, is
done by numpy's FFT instead. On CPU that convolution is about a third of the model's time: the
corpus's VAD takes 0.43 s of CPU instead of 0.61 s (-29%, one thread). The graph is cut after
the STFT magnitude (``onnx.utils.Extractor``, once: the cut is kept in the model folder), and
onnxruntime runs the rest. Speech probabilities differ from the whole graph's by < 1e-5, and a
start-up check falls back to the whole graph if they ever do not (a different model file).

VAD runs in the prep pool, never on the event loop: ~0.7 ms of CPU per audio second.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from app.audio.spans import CHUNK, SpanTracker
from app.engine.threads import load_torch
from app.windows import SAMPLE_RATE, SPEECH_PAD_S, WINDOW_S

# pyannote.audio (whisperx's VAD) ships telemetry switched on: loading one of its models sends a
# span to otel.pyannote.ai. A server does not phone home unless its operator says so; this runs
# before whisperx (and so pyannote) is imported, and an explicit setting is kept.
os.environ.setdefault("PYANNOTE_METRICS_ENABLED", "false")

log = logging.getLogger(__name__)

CONTEXT = 64  # samples of the previous chunk prepended to each one
N_FFT, HOP, REFLECT = 256, 128, 64  # the model's STFT: reflect-pad 64 on the right, 4 frames
MAGNITUDE = "/encoder/feature_extractor/Sqrt_output_0"  # (chunks, 129, 4): where the graph is cut
BLOCK = 512  # chunks per onnxruntime call (~16 s): the FFT front end's buffers stay ~10 MB
AGREE = 1e-4  # start-up check: largest allowed difference between the two paths' probabilities


class VadStream(Protocol):
    """One upload's VAD, fed its audio in order, a chunk at a time: only what it has not settled
    is held (Silero: one partial 512-sample chunk and the span rules' state)."""

    def feed(self, samples: np.ndarray) -> list[tuple[int, int]]:
        """Spans (in samples from the start) that are now final, in order."""
        ...

    def finish(self) -> list[tuple[int, int]]:
        """The rest of the spans, once the upload has no more audio."""
        ...

    def frontier(self) -> int:
        """No span still to be returned ends before this sample."""
        ...

    def keep_from(self) -> int:
        """No span still to be returned starts before this sample (audio before it can go)."""
        ...


class Vad(Protocol):
    def stream(self) -> VadStream: ...

    def speech(self, audio: np.ndarray) -> list[tuple[float, float]]: ...


def whole(vad: Vad, audio: np.ndarray) -> list[tuple[float, float]]:
    """A whole array through a stream: the spans, in seconds."""
    s = vad.stream()
    spans = s.feed(audio) + s.finish()
    return [(a / SAMPLE_RATE, b / SAMPLE_RATE) for a, b in spans]


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


TAIL_CACHE = "silero-fft-tail-{digest}.onnx"  # in the model cache folder (model.cache_dir)


def _fft_tail(path: Path, folder: Path | None) -> tuple[bytes, Any]:
    """The graph cut after the STFT magnitude, and its session. The cut imports onnx (~0.7 s of
    CPU: a sixth of a service's start on CPU, paid again by every process that builds the VAD),
    so it is kept in the model cache folder, named by the model file's digest, and read from
    there next time; a folder that cannot be written only costs the cut again, and a kept file
    that does not load is cut afresh. The start-up check runs on it either way. ``folder``:
    the model cache folder (``model.cache_dir``; the pipeline builder passes it), None: cut
    every time."""
    source = path.read_bytes()
    kept = folder / TAIL_CACHE.format(digest=hashlib.sha256(source).hexdigest()[:16]) \
        if folder else None
    if kept is not None and kept.is_file():
        graph = kept.read_bytes()
        try:
            return graph, _session(graph)
        except Exception as exc:
            log.warning("Silero VAD: kept front-end cut %s does not load (%s); cutting again",
                        kept, exc)
    import onnx
    import onnx.utils

    tail = onnx.utils.Extractor(onnx.load_from_string(source)).extract_model(
        [MAGNITUDE, "h", "c"], ["speech_probs", "hn", "cn"])
    graph = tail.SerializeToString()
    if kept is not None:
        tmp = kept.with_name(f"{kept.name}.{os.getpid()}.tmp")
        try:
            tmp.write_bytes(graph)
            os.replace(tmp, kept)  # whole or not at all, whoever else writes it meanwhile
        except OSError:  # e.g. a read-only model volume
            with contextlib.suppress(OSError):
                tmp.unlink()
    return graph, _session(graph)


@dataclass(frozen=True)
class SileroModel:
    """What a prep process needs to run the same VAD (app/audio/procs): the padding and the
    ONNX graph the service checked, the STFT-cut tail (``fft``) or the whole model. Building
    it again there would import onnx and faster-whisper (~2 s of CPU per process)."""

    pad_s: float
    graph: bytes
    fft: bool


class SileroVad:
    """faster-whisper's Silero VAD model and thresholds; the STFT by FFT (see the module doc)."""

    def __init__(self, pad_s: float = SPEECH_PAD_S, model: SileroModel | None = None,
                 cache_dir: Path | None = None) -> None:
        self.pad_s = pad_s
        self._window = (0.5 - 0.5 * np.cos(2 * np.pi * np.arange(N_FFT) / N_FFT)).astype(np.float32)
        if model is not None:  # checked where it was built
            self.pad_s = model.pad_s
            self._graph = model.graph
            self._tail: Any = _session(model.graph) if model.fft else None
            self._whole: Any = None if model.fft else _Whole(_session(model.graph))
            return
        from faster_whisper.utils import get_assets_path
        from faster_whisper.vad import SileroVADModel

        path = str(Path(get_assets_path()) / "silero_vad_v6.onnx")
        # faster-whisper's own model: the reference of the start-up check, and the fallback.
        self._whole = SileroVADModel(path)
        self._graph, self._tail = _fft_tail(Path(path), cache_dir)
        probe = np.random.default_rng(0).standard_normal(CHUNK * 64).astype(np.float32)
        probe *= np.linspace(0.0, 0.5, probe.size, dtype=np.float32)
        diff = float(np.abs(self.probabilities(probe) - self._whole(_padded(probe))).max())
        if not diff < AGREE:  # a model whose first layer is not this STFT
            log.warning("Silero VAD: the FFT front end differs from the model's by %.2g; "
                        "running the whole model", diff)
            self._tail = None
            self._graph = Path(path).read_bytes()

    def model(self) -> SileroModel:
        return SileroModel(self.pad_s, self._graph, self.fft)

    @property
    def fft(self) -> bool:
        return self._tail is not None

    def stream(self) -> SileroStream:
        return SileroStream(self)

    def spans(self, origin: int = 0) -> SpanTracker:
        """The span rules alone (a part of an upload: app/audio/parts.py)."""
        return SpanTracker(speech_pad_ms=round(self.pad_s * 1000), origin=origin)

    def speech(self, audio: np.ndarray) -> list[tuple[float, float]]:
        return whole(self, audio)

    def probability_stream(self, keep_last: bool = True) -> _Probabilities:
        """Speech probabilities of audio fed in pieces (live turn detection, app/live/turns.py;
        a part of an upload, app/audio/parts.py)."""
        return _Probabilities(self, keep_last=keep_last)

    def probabilities(self, audio: np.ndarray) -> np.ndarray:
        """One speech probability per 512 samples, as faster-whisper's model call returns them."""
        p = _Probabilities(self)
        return np.concatenate([p.feed(audio), p.finish()])

    def run(self, rows: np.ndarray, h: np.ndarray, c: np.ndarray
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The model on (chunks, 64 + 512) rows (each chunk after its predecessor's last 64
        samples), its LSTM state carried in and out: any split of an upload into calls gives
        the probabilities of one call over all of it."""
        if self._tail is None:
            probs, h, c = self._whole.session.run(None, {"input": rows, "h": h, "c": c})
        else:
            probs, h, c = self._tail.run(None, {MAGNITUDE: self._magnitude(rows), "h": h, "c": c})
        return np.asarray(probs).reshape(-1), h, c

    def _magnitude(self, x: np.ndarray) -> np.ndarray:
        """The model's STFT magnitude: its basis is a periodic Hann window times the DFT."""
        x = np.concatenate([x, x[:, -2:-REFLECT - 2:-1]], axis=1)  # reflect, as the graph's Pad
        frames = np.lib.stride_tricks.sliding_window_view(x, N_FFT, axis=1)[:, ::HOP]
        spectrum = np.fft.rfft(frames * self._window, axis=-1)  # (chunks, 4, 129)
        return np.abs(spectrum).astype(np.float32).transpose(0, 2, 1)


class _Whole:
    """The whole graph's session, as faster-whisper's model object holds it."""

    def __init__(self, session: Any) -> None:
        self.session = session


class _Probabilities:
    """Speech probabilities of an upload fed in pieces, equal to faster-whisper's one call: each
    chunk is prepended with the previous one's last 64 samples (zeros for the first); the end is
    padded to a whole chunk (a whole extra chunk when already whole) whose last 64 samples are
    zeroed, as that call's in-place context trick does.

    ``keep_last`` (live turns): the last feed's chunks are kept, so :meth:`restart` can read them
    again; an upload's 60 s feeds keep nothing (each would hold ~4 MB more at the peak)."""

    def __init__(self, vad: SileroVad, keep_last: bool = False) -> None:
        self._vad = vad
        self._keep = keep_last
        self._h = np.zeros((1, 1, 128), dtype=np.float32)
        self._c = np.zeros((1, 1, 128), dtype=np.float32)
        self._context = np.zeros(CONTEXT, dtype=np.float32)
        self._pending = np.zeros(0, dtype=np.float32)
        self._last: tuple[np.ndarray, np.ndarray] | None = None  # (contexts, chunks) kept

    def feed(self, samples: np.ndarray) -> np.ndarray:
        data = np.concatenate([self._pending, samples.astype(np.float32, copy=False)])
        whole = data.size // CHUNK * CHUNK
        self._pending = data[whole:].copy()
        return self._run(data[:whole].reshape(-1, CHUNK))

    def finish(self) -> np.ndarray:
        last = np.zeros(CHUNK, dtype=np.float32)
        last[:self._pending.size] = self._pending
        last[-CONTEXT:] = 0
        self._pending = np.zeros(0, dtype=np.float32)
        return self._run(last.reshape(1, CHUNK))

    def _run(self, chunks: np.ndarray) -> np.ndarray:
        if not len(chunks):
            return np.zeros(0, dtype=np.float32)
        context = np.concatenate([self._context[None], chunks[:-1, -CONTEXT:]])
        self._context = chunks[-1, -CONTEXT:].copy()
        if self._keep:
            self._last = (context, chunks)
        return self._model(context, chunks)

    def _model(self, context: np.ndarray, chunks: np.ndarray) -> np.ndarray:
        out = []
        for i in range(0, len(chunks), BLOCK):
            rows = np.concatenate([context[i:i + BLOCK], chunks[i:i + BLOCK]], axis=1)
            probs, self._h, self._c = self._vad.run(rows, self._h, self._c)
            out.append(probs)
        return np.concatenate(out) if out else np.zeros(0, dtype=np.float32)

    def restart(self, last: int = 0) -> np.ndarray:
        """The LSTM state back to zeros (Silero's ``reset_states``) ``last`` chunks before the
        end of the previous :meth:`feed` (``keep_last``): those chunks' probabilities, read again
        from there."""
        self._h = np.zeros_like(self._h)
        self._c = np.zeros_like(self._c)
        if last <= 0 or self._last is None:
            return np.zeros(0, dtype=np.float32)
        context, chunks = self._last
        return self._model(context[-last:], chunks[-last:])


class SileroStream:
    """Silero probabilities and faster-whisper's span rules, both incremental (``spans``: other
    rules for one upload, e.g. OpenAI's ``server_vad``: app/audio/server_vad.py)."""

    def __init__(self, vad: SileroVad, spans: SpanTracker | None = None) -> None:
        self._probs = _Probabilities(vad)
        self._spans = spans or SpanTracker(speech_pad_ms=round(vad.pad_s * 1000))
        self._samples = 0

    def feed(self, samples: np.ndarray) -> list[tuple[int, int]]:
        self._samples += samples.size
        return self._spans.feed(self._probs.feed(samples))

    def finish(self) -> list[tuple[int, int]]:
        out = self._spans.feed(self._probs.finish())
        return out + self._spans.finish(self._samples)

    def frontier(self) -> int:
        return self._spans.frontier()

    def keep_from(self) -> int:
        return self._spans.keep_from()


class PyannoteVad:
    """whisperx's pyannote VAD (weights in the whisperx wheel), with whisperx's thresholds."""

    def __init__(self, device: str) -> None:
        from whisperx.vads import Pyannote

        torch = load_torch()  # at the engine's thread count

        self._model = Pyannote(torch.device(device), vad_onset=0.5, vad_offset=0.363, chunk_size=30)

    def stream(self) -> PyannoteStream:
        return PyannoteStream(self)

    def speech(self, audio: np.ndarray) -> list[tuple[float, float]]:
        return whole(self, audio)

    def regions(self, audio: np.ndarray) -> list[tuple[int, int]]:
        """whisperx's merged speech regions (<= 30 s each) of ``audio``, in samples."""
        import torch
        from whisperx.vads import Pyannote

        with torch.inference_mode():
            scores = self._model({"waveform": Pyannote.preprocess_audio(audio),
                                  "sample_rate": SAMPLE_RATE})
        merged = Pyannote.merge_chunks(scores, WINDOW_S, onset=0.5, offset=0.363)
        return [(int(m["start"] * SAMPLE_RATE), int(m["end"] * SAMPLE_RATE)) for m in merged]


class PyannoteStream:
    """pyannote over a rolling buffer: regions that end more than ``LOOKAHEAD_S`` before the
    buffer's end are final; the buffer then restarts at the last final region's end, so every
    sample is judged until it is settled and none is in two regions. pyannote's segmentation
    sees 10 s windows, so 30 s of lookahead leaves its decisions unchanged far from the edge."""

    LOOKAHEAD_S = 30.0
    RUN_S = 120.0  # buffer length that triggers a pass

    def __init__(self, vad: PyannoteVad) -> None:
        self._vad = vad
        self._buf = np.zeros(0, dtype=np.float32)
        self._offset = 0  # sample index of the buffer's start

    def feed(self, samples: np.ndarray) -> list[tuple[int, int]]:
        self._buf = np.concatenate([self._buf, samples.astype(np.float32, copy=False)])
        if self._buf.size < self.RUN_S * SAMPLE_RATE:
            return []
        limit = self._buf.size - int(self.LOOKAHEAD_S * SAMPLE_RATE)
        done = [r for r in self._vad.regions(self._buf) if r[1] <= limit]
        cut = done[-1][1] if done else limit
        self._buf = self._buf[cut:].copy()
        out = [(a + self._offset, b + self._offset) for a, b in done]
        self._offset += cut
        return out

    def frontier(self) -> int:
        return self._offset

    def keep_from(self) -> int:
        return self._offset

    def finish(self) -> list[tuple[int, int]]:
        regions = self._vad.regions(self._buf) if self._buf.size else []
        out = [(a + self._offset, b + self._offset) for a, b in regions]
        self._buf = np.zeros(0, dtype=np.float32)
        return out


def make_vad(kind: str, device: str, pad_s: float = SPEECH_PAD_S,
             cache_dir: Path | None = None) -> Vad:
    """pyannote keeps whisperx's own merge rules; ``pad_s`` is Silero's span padding;
    ``cache_dir`` keeps Silero's cut front end (see :func:`_fft_tail`)."""
    return PyannoteVad(device) if kind == "pyannote" else SileroVad(pad_s, cache_dir=cache_dir)
