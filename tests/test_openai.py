"""The OpenAI-compatible API, driven by the real ``openai`` client against the real model."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import openai
import pytest
import srt
import webvtt
from openai import OpenAI

from loadtest.lib.corpus import Clip
from tests.conftest import Server
from tests.helpers import openai_client
from tests.wer import wer

pytestmark = pytest.mark.model

# Read speech of every kind the corpus has, one of them long enough for two windows.
CLIP_IDS = ("librispeech-2412-153948-0000", "ljspeech-LJ001-0001",
            "librivox-sense-and-sensibility-0870", "librivox-shakespeare-sonnet-1")
MAX_WER = 0.15  # whisper-base on read English speech is ~5-10 %


@pytest.fixture(scope="module")
def picked(clips: list[Clip]) -> list[Clip]:
    by_id = {c.id: c for c in clips}
    return [by_id[i] for i in CLIP_IDS]


def transcribe(oa: OpenAI, clip: Clip, **kw: Any) -> Any:
    with clip.path.open("rb") as f:
        return oa.audio.transcriptions.create(model="whisper-1", file=f, **kw)


def each(oa: OpenAI, clips: list[Clip], **kw: Any) -> list[Any]:
    """All clips at once: concurrent requests share the service's micro-batches."""
    with ThreadPoolExecutor(len(clips)) as ex:
        return list(ex.map(lambda c: transcribe(oa, c, **kw), clips))


def secs(stamp: str) -> float:
    h, m, s = stamp.split(":")
    return int(h) * 3600 + int(m) * 60 + float(s)


def check_cues(cues: list[tuple[float, float]], duration: float) -> None:
    assert cues, "no cues"
    starts = [a for a, _ in cues]
    assert starts == sorted(starts)
    for (a, b), nxt in zip(cues, [*starts[1:], duration], strict=True):
        assert 0 <= a <= b <= nxt <= duration + 0.05  # ordered, no overlap, inside the audio


def test_json_and_text(oa: OpenAI, picked: list[Clip]) -> None:
    as_json = each(oa, picked, response_format="json")
    as_text = each(oa, picked, response_format="text")
    refs = [c.reference for c in picked]
    assert all(isinstance(t, str) for t in as_text)
    assert wer(refs, [r.text for r in as_json]) <= MAX_WER
    assert wer(refs, as_text) <= MAX_WER
    for c, r in zip(picked, as_json, strict=True):
        assert wer([c.reference], [r.text]) <= 0.3, (c.id, r.text)


def test_srt_parses_and_stays_inside_the_audio(oa: OpenAI, picked: list[Clip]) -> None:
    texts = each(oa, picked, response_format="srt")
    for clip, text in zip(picked, texts, strict=True):
        subs = list(srt.parse(text))
        check_cues([(s.start.total_seconds(), s.end.total_seconds()) for s in subs],
                   clip.duration_s)
        assert [s.index for s in subs] == list(range(1, len(subs) + 1))
        assert wer([clip.reference], [" ".join(s.content for s in subs)]) <= 0.3


def test_vtt_parses_and_stays_inside_the_audio(oa: OpenAI, picked: list[Clip]) -> None:
    texts = each(oa, picked, response_format="vtt")
    for clip, text in zip(picked, texts, strict=True):
        cues = webvtt.from_string(text).captions
        check_cues([(secs(c.start), secs(c.end)) for c in cues], clip.duration_s)
        assert wer([clip.reference], [" ".join(c.text for c in cues)]) <= 0.3
    long = texts[CLIP_IDS.index("librivox-shakespeare-sonnet-1")]
    assert len(webvtt.from_string(long).captions) >= 6  # sentence cues, not 30 s windows


def test_verbose_json_segments(oa: OpenAI, picked: list[Clip]) -> None:
    results = each(oa, picked, response_format="verbose_json",
                   timestamp_granularities=["segment"])
    for clip, r in zip(picked, results, strict=True):
        assert r.language == "english"  # detected: no language was given
        assert abs(r.duration - clip.duration_s) < 0.1
        assert r.words is None  # only asked for segments
        assert wer([clip.reference], [r.text]) <= 0.3
        segs = r.segments
        assert segs and [s.id for s in segs] == list(range(len(segs)))
        check_cues([(s.start, s.end) for s in segs], clip.duration_s)
        for s in segs:
            assert s.tokens and all(isinstance(t, int) for t in s.tokens)
            assert s.avg_logprob < 0 and 0 <= s.no_speech_prob <= 1
            assert s.compression_ratio > 0 and s.temperature == 0.0
        assert " ".join(s.text for s in segs) == r.text
        extra = r.model_extra or {}
        assert 0.5 < extra["language_probability"] <= 1.0


def test_verbose_json_words(oa: OpenAI, picked: list[Clip]) -> None:
    clip = picked[-1]
    r = transcribe(oa, clip, response_format="verbose_json", language="en",
                   timestamp_granularities=["word", "segment"])
    assert r.words and r.segments
    starts = [w.start for w in r.words]
    assert starts == sorted(starts) and all(w.start <= w.end <= r.duration for w in r.words)
    assert wer([clip.reference], [" ".join(w.word for w in r.words)]) <= 0.3


def test_translation(oa: OpenAI, picked: list[Clip]) -> None:
    """English speech translated to English: the words must still match the reference."""
    clip = picked[0]
    with clip.path.open("rb") as f:
        plain = oa.audio.translations.create(model="whisper-1", file=f)
    assert wer([clip.reference], [plain.text]) <= 0.3
    with clip.path.open("rb") as f:
        verbose = oa.audio.translations.create(model="whisper-1", file=f,
                                               response_format="verbose_json")
    assert verbose.to_dict()["task"] == "translate"
    assert verbose.language == "english" and verbose.segments
    with clip.path.open("rb") as f:
        subs = oa.audio.translations.create(model="whisper-1", file=f, response_format="srt")
    assert list(srt.parse(subs))


def test_temperature_and_prompt(oa: OpenAI, picked: list[Clip]) -> None:
    clip = picked[0]
    r = transcribe(oa, clip, response_format="verbose_json", temperature=0.4,
                   prompt="A traveller's memoir.")
    assert all(s.temperature == pytest.approx(0.4) for s in r.segments)
    assert wer([clip.reference], [r.text]) <= 0.5  # sampling: looser


def test_requests_are_jobs(oa: OpenAI, server: Server, picked: list[Clip]) -> None:
    clip = picked[0]
    with clip.path.open("rb") as f:
        raw = oa.audio.transcriptions.with_raw_response.create(
            model="whisper-1", file=f, response_format="verbose_json", language="en")
    job_id = raw.headers["x-batchscribe-job-id"]
    with server.client() as c:
        job = c.get(f"/jobs/{job_id}").json()
    assert job["status"] == "done" and job["options"]["word_timestamps"] is True
    assert job["result"]["text"] == raw.parse().text


def test_models(oa: OpenAI) -> None:
    models = oa.models.list().data
    assert [m.id for m in models] == ["whisper-base"]
    assert oa.models.retrieve("whisper-1").id == "whisper-base"


@pytest.mark.parametrize("kw,status,param,code", [
    ({"response_format": "xml"}, 400, "response_format", "invalid_value"),
    ({"model": "whisper-9"}, 404, "model", "model_not_found"),
    ({"language": "xx"}, 400, "language", "bad_request"),
    ({"timestamp_granularities": ["word"]}, 400, "timestamp_granularities[]", "bad_request"),
    ({"temperature": 3}, 400, "temperature", "invalid_value"),
])
def test_errors_use_openai_shape(oa: OpenAI, picked: list[Clip], kw: dict[str, Any], status: int,
                                 param: str, code: str) -> None:
    with pytest.raises(openai.APIStatusError) as info, picked[0].path.open("rb") as f:
        oa.audio.transcriptions.create(**{"model": "whisper-1", "file": f, **kw})
    err = info.value
    assert err.status_code == status and isinstance(err.message, str)
    assert err.body == {"message": err.body["message"], "type": "invalid_request_error",  # type: ignore[index]
                        "param": param, "code": code}


def test_not_audio_is_an_openai_error(oa: OpenAI) -> None:
    with pytest.raises(openai.APIStatusError) as info:
        oa.audio.transcriptions.create(model="whisper-1",
                                       file=("notes.txt", b"this is not audio " * 100))
    assert info.value.status_code == 415 and info.value.code == "unsupported_media"
    assert info.value.type == "invalid_request_error"


def test_unknown_v1_path_is_an_openai_error(server: Server) -> None:
    with server.client() as c:
        r = c.post("/v1/audio/speech", json={})
    assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_client_hanging_up_cancels_its_job(server: Server, picked: list[Clip]) -> None:
    """A synchronous caller that gave up can never collect the result: the job is cancelled."""
    clip = picked[-1]  # the long one
    impatient = openai_client(server.url, timeout=0.5)
    with pytest.raises(openai.APITimeoutError), clip.path.open("rb") as f:
        impatient.audio.transcriptions.create(model="whisper-1", file=f)
    deadline = time.monotonic() + 120
    with server.client() as c:
        while time.monotonic() < deadline:
            mine = [j for j in c.get("/jobs").json()["jobs"] if j["filename"] == clip.path.name]
            if mine and mine[0]["status"] == "cancelled":
                return
            time.sleep(0.2)
    raise AssertionError(f"the abandoned job was not cancelled: {mine[:1]}")
