"""Language, inside the batch (issue 17), on the real model.

* Detection comes from the encoder output the transcription computes anyway, at the window's
  own (dynamic) padded length, once per upload: on every clip of ``../shared/corpus-multilingual``
  and ``../shared/corpus`` it must be at least as accurate as faster-whisper's own detection on
  the full clip with the same weights (faster-whisper's answers kept between runs and
  spot-checked against it each run: tests/references.py).
* Windows of different languages, prompts and hotwords share one decoder batch: each reads as
  it does alone.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from app.audio import decode, prepare
from app.audio.vad import SileroVad
from app.engine.whisper import WhisperEngine
from app.windows import DecodeOptions, Prompt, Window
from loadtest.lib.corpus import Clip
from tests.conftest import Server, multilingual_clips
from tests.references import peer_reference

pytestmark = pytest.mark.model

def faster_whisper_detected(paths: list[Path]) -> list[str]:
    """faster-whisper's own ``detect_language`` on each whole clip, same model folder."""
    from faster_whisper import WhisperModel

    from app.config import Settings
    from models.registry import resolve

    s = Settings()
    model = WhisperModel(resolve(s.model.name, s.model.cache_dir, True), device="cpu",
                         compute_type="int8", cpu_threads=2)
    out = []
    for p in paths:
        language, _, _ = model.detect_language(decode(p, 3600.0))
        out.append(language)
    del model
    return out


def service_detected(server: Server, paths: list[Path]) -> list[str | None]:
    """The language the service decides for each clip posted with no language, 8 at a time (so
    detection runs inside shared batches). Through POST /detect-language: the same detection as
    a transcription's (the first speech window, at its own padded length, in a shared encoder
    batch), without the decode, which is not what is measured here."""
    def one(p: Path) -> str | None:
        with httpx.Client(base_url=server.url, timeout=600) as c, p.open("rb") as f:
            r = c.post("/detect-language", files={"audio_file": (p.name, f)})
        assert r.status_code == 200, r.text
        code = r.json()["language_code"]
        return None if code == "und" else str(code)

    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(one, paths))


def faster_whisper_reference(cases: list[tuple[str, Path, str]]) -> list[str]:
    """faster-whisper's detections, kept between runs and spot-checked (tests/references.py)."""
    from importlib.metadata import version

    from app.config import Settings
    from models.registry import resolve

    s = Settings()
    return peer_reference("faster-whisper-detect-language", [(i, p) for i, p, _ in cases],
                          faster_whisper_detected,
                          {"faster-whisper": version("faster-whisper"),
                           "ctranslate2": version("ctranslate2")},
                          Path(resolve(s.model.name, s.model.cache_dir, True)))


def test_detection_is_at_least_as_accurate_as_faster_whispers(server: Server,
                                                              clips: list[Clip]) -> None:
    multi = multilingual_clips()
    cases = [(c.id, c.path, c.language or "") for c in multi] + [(c.id, c.path, "en") for c in clips]
    paths = [p for _, p, _ in cases]
    ours = service_detected(server, paths)
    theirs = faster_whisper_reference(cases)
    report = {}
    for name, rows in (("multilingual", slice(0, len(multi))), ("english", slice(len(multi), None))):
        expected = [lang for _, _, lang in cases[rows]]
        ok_ours = sum(a == e for a, e in zip(ours[rows], expected, strict=True))
        ok_theirs = sum(a == e for a, e in zip(theirs[rows], expected, strict=True))
        report[name] = (ok_ours, ok_theirs, len(expected))
    misses = [(i, lang, o, t) for (i, _, lang), o, t in zip(cases, ours, theirs, strict=True)
              if o != lang or t != lang]
    for name, (ok_ours, ok_theirs, _) in report.items():
        assert ok_ours >= ok_theirs, (name, report, misses)
    assert report["multilingual"][0] >= 0.9 * report["multilingual"][2], (report, misses)


def test_languages_prompts_and_hotwords_share_a_decoder_batch(engine: WhisperEngine,
                                                              clips: list[Clip]) -> None:
    """Windows of five languages, with and without initial prompts and hotwords, encoded in one
    call and decoded in one decode of the engine (one padded length) read exactly as each does
    alone: language and prompt are per window, not batch keys. (CTranslate2 needs
    <|startoftranscript|> at one position per generate call, so prompts of different token
    counts run as separate generate calls inside that decode; languages always share one.)"""
    multi = {c.id: c.path for c in multilingual_clips()}
    vad = SileroVad()
    prompts = [Prompt(language="fr"), Prompt(language="de"),
               Prompt(language="es", initial_prompt="Noticias del día."),
               Prompt(language="en", hotwords="Kennedy, Americans"),
               Prompt(language="en", initial_prompt="A reading of poetry."),
               Prompt()]  # detected
    sources = [multi["fleurs-fr-cuttledoc-005"], multi["fleurs-de-cuttledoc-008"],
               multi["fleurs-es-cuttledoc-004"],
               next(c.path for c in clips if c.id == "jfk-inaugural-1961"),
               next(c.path for c in clips if c.set == "ljspeech" and c.duration_s > 7),
               multi["fleurs-pt-cuttledoc-002"]]
    windows: list[Window] = []
    for path, prompt in zip(sources, prompts, strict=True):
        w = prepare(path, vad, 3600.0)[1][0]
        w.prompt = prompt
        windows.append(w)
    # Trim to one length so the whole batch shares one padded length (one decoder call).
    n = min(len(w.audio) for w in windows)
    for w in windows:
        w.audio = w.audio[:n].copy()
    opts = DecodeOptions()
    assert len({engine.padded_samples(w) for w in windows}) == 1
    encoded = engine.encode(windows, opts)
    together = engine.decode(windows, encoded, opts)
    alone = [engine.transcribe_batch([w], opts)[0] for w in windows]
    assert [r.language for r in together] == [r.language for r in alone]
    assert [r.language for r in together][:5] == ["fr", "de", "es", "en", "en"]
    assert [r.text for r in together] == [r.text for r in alone]
    assert len({r.text for r in together}) == len(windows)  # six different transcripts
