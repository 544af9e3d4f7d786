"""Silero VAD with its STFT done by FFT (app/audio/vad.py) finds exactly the speech spans that
faster-whisper's own ``get_speech_timestamps`` finds, on the corpus's real audio."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest

from app.audio import decode
from app.audio.spans import speech_spans
from app.audio.vad import BLOCK, CHUNK, SileroVad
from app.windows import SPEECH_PAD_S
from loadtest.lib.corpus import Clip


def faster_whisper_spans(audio: np.ndarray,
                         pad_s: float = SPEECH_PAD_S) -> list[tuple[int, int]]:
    from faster_whisper.vad import VadOptions, get_speech_timestamps

    opts = VadOptions(threshold=0.5, max_speech_duration_s=30.0, min_silence_duration_ms=160,
                      speech_pad_ms=round(pad_s * 1000))
    return [(t["start"], t["end"]) for t in get_speech_timestamps(audio, opts)]


@pytest.fixture(scope="module")
def corpus_audio(clips: list[Clip]) -> list[np.ndarray]:
    return [decode(c.path, 3600.0) for c in clips]


@pytest.fixture(scope="module")
def vad() -> SileroVad:
    return SileroVad()


def test_the_fft_front_end_is_used_and_matches_the_whole_model(
        vad: SileroVad, corpus_audio: list[np.ndarray]) -> None:
    from faster_whisper.vad import get_vad_model

    assert vad.fft
    model = get_vad_model()
    for audio in corpus_audio[:20]:
        ours = vad.probabilities(audio)
        theirs = model(np.pad(audio, (0, CHUNK - audio.size % CHUNK)))
        assert ours.shape == theirs.shape
        assert float(np.abs(ours - theirs).max()) < 1e-4


def test_speech_spans_equal_faster_whispers_on_every_corpus_clip(
        vad: SileroVad, corpus_audio: list[np.ndarray]) -> None:
    assert len(corpus_audio) >= 80
    for audio in corpus_audio:
        probs = vad.probabilities(audio)
        assert speech_spans(probs, audio.size) == faster_whisper_spans(audio)
        # and at faster-whisper's own padding (0.4 s): the rules, not just one setting
        assert speech_spans(probs, audio.size, 0.4) == faster_whisper_spans(audio, 0.4)


def test_the_padding_reaches_into_the_audio_around_speech(
        vad: SileroVad, corpus_audio: list[np.ndarray]) -> None:
    """The service's padding is wider than faster-whisper's, never past the audio, and spans
    never overlap (neighbours closer than twice the pad split the gap)."""
    assert SPEECH_PAD_S > 0.4
    wider = 0
    for audio in corpus_audio:
        probs = vad.probabilities(audio)
        ours, theirs = speech_spans(probs, audio.size), speech_spans(probs, audio.size, 0.4)
        assert all(0 <= s < e <= audio.size for s, e in ours)
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(ours))
        if len(ours) == len(theirs):
            assert all(s1 <= s2 and e1 >= e2 for (s1, e1), (s2, e2) in zip(ours, theirs,
                                                                          strict=True))
            wider += ours != theirs
    assert wider >= len(corpus_audio) // 2


def test_long_audio_and_edge_cases(vad: SileroVad, corpus_audio: list[np.ndarray]) -> None:
    # Longer than one onnxruntime block (the LSTM state carries over) and than 30 s of speech
    # (spans are split), then silence, less than one chunk, exactly one chunk.
    long = np.concatenate(corpus_audio)
    assert long.size > BLOCK * CHUNK
    cases = [long, np.zeros(16000, np.float32), long[:100], long[:CHUNK]]
    for audio in cases:
        assert speech_spans(vad.probabilities(audio), audio.size) == faster_whisper_spans(audio)
    spans = vad.speech(long)
    assert len(spans) > 30 and max(e - s for s, e in spans) <= 30.0
    assert vad.speech(np.zeros(16000, np.float32)) == []


class BrokenFrontEnd(SileroVad):
    """A model whose first layer is not the STFT the FFT computes (fault injection)."""

    def _magnitude(self, x: np.ndarray) -> np.ndarray:
        return np.zeros_like(super()._magnitude(x))


def test_a_front_end_that_disagrees_falls_back_to_the_whole_model(
        corpus_audio: list[np.ndarray]) -> None:
    vad = BrokenFrontEnd()
    assert not vad.fft
    for audio in corpus_audio[:10]:
        assert speech_spans(vad.probabilities(audio), audio.size) == faster_whisper_spans(audio)


def test_the_front_end_cut_is_kept_and_read_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                corpus_audio: list[np.ndarray]) -> None:
    """The cut (onnx, ~0.7 CPU-s a process) is made once and kept in the model folder: the next
    VAD reads it without onnx and gives the same probabilities; a kept file that does not load
    is cut again; a folder that cannot be written costs only the cut."""
    import onnx.utils

    first = SileroVad(cache_dir=tmp_path)
    [kept] = tmp_path.glob("silero-fft-tail-*.onnx")
    assert first.fft and kept.read_bytes() == first.model().graph

    class NoCut:
        def __init__(self, *a: object) -> None:
            raise AssertionError("cut again although kept")

    with monkeypatch.context() as m:
        m.setattr(onnx.utils, "Extractor", NoCut)
        again = SileroVad(cache_dir=tmp_path)
    audio = corpus_audio[0]
    assert again.fft and np.array_equal(again.probabilities(audio), first.probabilities(audio))

    kept.write_bytes(b"not a graph")
    assert SileroVad(cache_dir=tmp_path).fft and kept.read_bytes() == first.model().graph  # again
    assert SileroVad(cache_dir=tmp_path / "missing" / "folder").fft


# Both cases in one child: importing pyannote.audio costs ~20 CPU-s (torch and lightning, whose
# import is most of it), and a child per case paid it twice (43 of this module's 53 CPU-s).
# The child imports those two libraries, neither of which reads PYANNOTE_METRICS_ENABLED, then
# forks once per case: each fork sets (or leaves unset) the variable and only then imports the
# app and whisperx's VAD, as a fresh process of its own would.
TELEMETRY_CHILD = """
import os, sys
import lightning.pytorch, torch
assert "PYANNOTE_METRICS_ENABLED" not in os.environ
assert not [m for m in sys.modules if m.split(".")[0] in ("app", "pyannote", "whisperx")]
for case in sys.argv[1:]:
    pid = os.fork()
    if pid == 0:
        if case != "unset":
            os.environ["PYANNOTE_METRICS_ENABLED"] = case
        import app.main, whisperx.vads, pyannote.audio.telemetry.metrics as m
        print(case, m.is_metrics_enabled(), flush=True)
        os._exit(0)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0, case
"""


@pytest.fixture(scope="module")
def telemetry() -> dict[str | None, str]:
    """``PYANNOTE_METRICS_ENABLED`` as pyannote reads it after the app's import, per setting
    the operator gave (None: none)."""
    import os
    import subprocess
    import sys

    child = {k: v for k, v in os.environ.items() if k != "PYANNOTE_METRICS_ENABLED"}
    out = subprocess.run([sys.executable, "-c", TELEMETRY_CHILD, "unset", "true"], env=child,
                         capture_output=True, text=True, timeout=300, check=True).stdout
    seen = dict(ln.split() for ln in out.splitlines() if ln.split()[:1] in (["unset"], ["true"]))
    return {None: seen["unset"], "true": seen["true"]}


@pytest.mark.parametrize("env, enabled", [(None, "False"), ("true", "True")])
def test_pyannote_telemetry_is_off_unless_the_operator_turns_it_on(
        telemetry: dict[str | None, str], env: str | None, enabled: str) -> None:
    """pyannote.audio (whisperx's VAD) ships telemetry on: loading a model sends a span to
    otel.pyannote.ai. Importing the app switches it off first; an explicit setting is kept."""
    assert telemetry[env] == enabled
