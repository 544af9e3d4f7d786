"""OpenAI fields that were accepted and ignored (issue 36, items 3 and 4), through the real
``openai`` client against the real model: ``include[]=logprobs`` (token log-probabilities on
json, verbose_json and the stream's events; word ``probability`` in verbose_json) and
``chunking_strategy``'s ``server_vad`` object (the VAD's settings for the request; invalid
values a 400 in OpenAI's shape)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
from openai import OpenAI

from app.api.openai.protocol import parse_chunking as parse
from app.audio import decode
from app.audio.server_vad import TunedVad, vad_for
from app.audio.vad import SileroVad
from app.errors import InvalidChunking
from loadtest.lib.common import write_wav16
from loadtest.lib.corpus import Clip
from tests.test_vad import faster_whisper_spans

SR = 16_000
CLIP = "librispeech-1088-134315-0000"  # 16 s of read speech
GARBLED = (5.0, 9.0)  # this span is played backwards


# ---- chunking_strategy without the service -------------------------------------------------
def test_chunking_strategy_is_parsed_and_checked() -> None:
    assert parse(None, {}) is None and parse("auto", {}) is None
    assert parse(None, {"type": "server_vad", "threshold": "0.7", "silence_duration_ms": "300"}
                 ) == {"threshold": 0.7, "silence_duration_ms": 300}
    assert parse('{"type": "server_vad", "prefix_padding_ms": 200}', {}) == {
        "prefix_padding_ms": 200}
    for raw, fields, what in (
            ("semantic", {}, "auto"), ('{"type": "semantic_vad"}', {}, "server_vad, not"),
            (None, {"type": "server_vad", "threshold": "1.5"}, "0.0-1.0"),
            (None, {"type": "server_vad", "threshold": "nan"}, "a number"),
            (None, {"type": "server_vad", "silence_duration_ms": "-1"}, "0-10000"),
            (None, {"type": "server_vad", "prefix_padding_ms": "2.5"}, "an integer"),
            (None, {"type": "server_vad", "eagerness": "low"}, "unknown"),
            ("auto", {"type": "server_vad"}, "not both")):
        with pytest.raises(InvalidChunking, match=what):
            parse(raw, fields)


def test_server_vad_spans_are_faster_whispers_with_those_settings(clips: list[Clip]) -> None:
    """The request's threshold, padding and silence are faster-whisper's ``VadOptions``
    ``threshold``, ``speech_pad_ms`` and ``min_silence_duration_ms``: the same spans."""
    from faster_whisper.vad import VadOptions, get_speech_timestamps

    vad = SileroVad()
    audio = np.concatenate([decode(c.path, 60) for c in clips if c.id.startswith("mfa-")][:6])
    default = vad.speech(audio)
    for settings in ({"threshold": 0.8}, {"prefix_padding_ms": 100},
                     {"silence_duration_ms": 1500, "threshold": 0.3}):
        tuned = vad_for(vad, settings)
        assert isinstance(tuned, TunedVad)
        opts = VadOptions(threshold=settings.get("threshold", 0.5), max_speech_duration_s=30.0,
                          min_silence_duration_ms=int(settings.get("silence_duration_ms", 160)),
                          speech_pad_ms=int(settings.get("prefix_padding_ms", 1400)))
        want = [(t["start"] / SR, t["end"] / SR) for t in get_speech_timestamps(audio, opts)]
        assert tuned.speech(audio) == want and want != default, settings
    assert vad_for(vad, None) is vad
    assert [(a / SR, b / SR) for a, b in faster_whisper_spans(audio)] == default
    with pytest.raises(InvalidChunking, match="pyannote"):
        vad_for(object(), {"threshold": 0.6})  # type: ignore[arg-type]


# ---- through the service -------------------------------------------------------------------
@pytest.fixture(scope="module")
def garbled(clips: list[Clip], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The clip with 4 s of it played backwards: Whisper writes made-up words there."""
    audio = decode(next(c for c in clips if c.id == CLIP).path, 60)
    a, b = (int(t * SR) for t in GARBLED)
    audio[a:b] = audio[a:b][::-1].copy()
    path = tmp_path_factory.mktemp("garbled") / "garbled.wav"
    write_wav16(path, audio)
    return path


def create(oa: OpenAI, path: Path, **kw: Any) -> Any:
    with path.open("rb") as f:
        return oa.audio.transcriptions.create(model="whisper-1", file=f, language="en", **kw)


def by_word(words: list[Any], logprobs: list[Any]) -> list[list[float]]:
    """Each word's tokens' log-probabilities: tokens in order add up to the words' text."""
    out, k = [], 0
    for w in words:
        got, text = [], ""
        while k < len(logprobs) and text.strip() != w.word:
            text += logprobs[k].token
            got.append(logprobs[k].logprob)
            k += 1
        assert text.strip() == w.word, (w.word, text)
        out.append(got)
    assert k == len(logprobs)
    return out


@pytest.mark.model
def test_logprobs_are_lower_where_the_audio_is_garbled(oa: OpenAI, garbled: Path) -> None:
    """Measured: words inside the backwards span 0.24 on average, outside 0.96."""
    r = create(oa, garbled, response_format="verbose_json", include=["logprobs"],
               timestamp_granularities=["word"])
    logprobs = r.logprobs if hasattr(r, "logprobs") else r.model_extra["logprobs"]
    logprobs = [openai.types.audio.transcription.Logprob(**p) if isinstance(p, dict) else p
                for p in logprobs]
    tokens = by_word(r.words, logprobs)
    inside = [k for k, w in enumerate(r.words) if w.start < GARBLED[1] and w.end > GARBLED[0]]
    outside = [k for k in range(len(r.words)) if k not in inside]
    assert len(inside) >= 3 and len(outside) >= 20
    for k, w in enumerate(r.words):  # the word's probability is its tokens' mean probability
        if w.word.isalpha():  # (punctuation merged into a word keeps out of its probability)
            assert w.probability == pytest.approx(np.mean([math.exp(p) for p in tokens[k]]),
                                                  abs=2e-3)
    mean = {name: float(np.mean([p for k in idx for p in tokens[k]]))
            for name, idx in (("inside", inside), ("outside", outside))}
    assert mean["inside"] < math.log(0.5) < math.log(0.8) < mean["outside"], mean
    assert np.mean([r.words[k].probability for k in inside]) < 0.5
    assert np.mean([r.words[k].probability for k in outside]) > 0.85


@pytest.mark.model
def test_logprobs_on_json_and_the_stream_events(oa: OpenAI, garbled: Path) -> None:
    j = create(oa, garbled, include=["logprobs"])
    assert j.logprobs and "".join(p.token for p in j.logprobs).split() == j.text.split()
    assert all(bytes(int(b) for b in p.bytes).decode() == p.token for p in j.logprobs
               if p.token.isascii())
    assert all(p.logprob <= 0 for p in j.logprobs)
    deltas, done = [], None
    for ev in create(oa, garbled, include=["logprobs"], stream=True):
        if ev.type == "transcript.text.delta":
            assert ev.logprobs, ev
            deltas += ev.logprobs
        else:
            done = ev
    assert done is not None and done.text == j.text
    assert [(p.token, p.logprob) for p in deltas] == [(p.token, p.logprob) for p in done.logprobs]
    assert [(p.token, p.logprob) for p in deltas] == [(p.token, p.logprob) for p in j.logprobs]
    plain = create(oa, garbled)  # without include: no logprobs, as before
    assert plain.text == j.text and getattr(plain, "logprobs", None) is None


@pytest.mark.model
def test_server_vad_settings_reach_the_vad_and_bad_ones_are_400s(oa: OpenAI, garbled: Path
                                                                 ) -> None:
    words = create(oa, garbled).text.split()
    assert len(words) > 20
    # Speech probabilities never reach 1: with that threshold nothing is speech.
    assert create(oa, garbled, chunking_strategy={"type": "server_vad", "threshold": 1.0}
                  ).text == ""
    same = create(oa, garbled, chunking_strategy={"type": "server_vad", "threshold": 0.5,
                                                  "prefix_padding_ms": 1400,
                                                  "silence_duration_ms": 160})
    assert same.text.split() == words  # the service's own settings, spelled out
    assert create(oa, garbled, chunking_strategy="auto").text.split() == words
    for bad, what in (({"type": "server_vad", "threshold": 2}, "0.0-1.0"),
                      ({"type": "server_vad", "silence_duration_ms": 0.5}, "an integer"),
                      ({"type": "server_vad", "prefix_padding_ms": 60_000}, "0-5000"),
                      ({"type": "semantic_vad"}, "server_vad"),
                      ({"type": "server_vad", "create_response": True}, "unknown")):
        with pytest.raises(openai.BadRequestError) as err:
            create(oa, garbled, chunking_strategy=bad)
        body: Any = err.value.body
        assert what in body["message"] and body["param"] == "chunking_strategy", body
    for fmt in ("srt", "text", "diarized_json"):
        with pytest.raises(openai.BadRequestError) as err:
            create(oa, garbled, include=["logprobs"], response_format=fmt)
        assert err.value.body["param"] == "include[]"  # type: ignore[index]
