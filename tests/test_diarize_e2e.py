"""Speakers end to end: a real service process, the real Whisper and speaker models, over HTTP.

Needs ``../shared/corpus-diarization`` (BATCHSCRIBE_DIARIZATION_CORPUS), the corpus and the
provisioned speaker models (scripts/setup.sh); under ``CI`` a missing one fails the test.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import srt
import webvtt

from app.speakers import Turn
from loadtest.lib.corpus import Clip
from tests.conftest import Server
from tests.helpers import openai_client, post
from tests.test_speaker_output import stereo, two_clips
from tests.test_speakers import (
    CORPUS,
    SAMPLE,
    best_mapping,
    corpus_item,
    der_module,
    segment_words,
)
from tests.wer import wer

pytestmark = pytest.mark.model
BOUND = 600  # seconds: a hang guard (the first diarize job also loads the speaker models)


def transcribed(client: httpx.Client, path: Path, **data: Any) -> dict[str, Any]:
    """The job of ``path`` uploaded with ``data``, waited for: done."""
    r = post(client, path, data=data, wait=True)
    assert r.status_code == 200, r.text
    job: dict[str, Any] = r.json()
    assert job["status"] == "done", job
    return job


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[httpx.Client]:
    with server.client(timeout=BOUND) as c:
        yield c


@pytest.fixture(scope="module")
def sample() -> Path:
    return Path(CORPUS / corpus_item(SAMPLE)["file"])


@pytest.fixture(scope="module")
def diarized(client: httpx.Client, sample: Path) -> dict[str, Any]:
    return transcribed(client, sample, diarize="true", word_timestamps="true", language="en")


def stm() -> list[tuple[float, float, str]]:
    """The sample's time-aligned utterances: (start, end, speaker name)."""
    rows = (line.split(maxsplit=5) for line in
            (CORPUS / "transcripts" / f"{SAMPLE}.stm").read_text().splitlines())
    return [(float(p[3]), float(p[4]), p[2]) for p in rows if len(p) >= 5]


def test_sample_has_two_speakers_whose_turns_match_the_reference(diarized: dict[str, Any]) -> None:
    """pyannote-sample (Diane and Sheila on the phone) through POST /transcribe?wait=true.

    Tolerances: 90% of words under the speaker of the reference utterance they fall in (word
    times from cross-attention are good to ~0.5 s, so the word at each of the 12 changes may
    fall either side; measured here: 71 of 75); and every reference turn of >= 1 s has most
    of its words (>= 75%, judged outside 0.25 s collars: the corpus's scoring collar) under its
    speaker, so no turn is lost or given to the other speaker (measured: all 7 such turns
    100%)."""
    result = diarized["result"]
    assert result["speakers"] == ["SPEAKER_00", "SPEAKER_01"] and diarized["diarization_s"] > 0
    assert next(s for s in result["segments"] if s["text"])["speaker"] == "SPEAKER_00"
    words, segments = result["words"], result["segments"]
    assert len(words) > 60 and all(w["speaker"] in result["speakers"] for w in words)
    utterances = stm()
    mapping = best_mapping(utterances, [Turn(s["start"], s["end"], s["speaker"])
                                        for s in segments])
    assert len(set(mapping.values())) == 2
    right = 0
    for w in words:
        mid = (w["start"] + w["end"]) / 2
        who = min(utterances, key=lambda u: max(u[0] - mid, 0, mid - u[1]))[2]
        right += w["speaker"] == mapping[who]
    assert right >= 0.9 * len(words), (right, len(words))
    der = der_module()
    reference = der.load_rttm(str(CORPUS / corpus_item(SAMPLE)["rttm"]))[SAMPLE]
    rttm_map = best_mapping(reference, [Turn(s["start"], s["end"], s["speaker"])
                                        for s in segments])
    for s, e, spk in reference:
        inside = [w for w in words if s + 0.25 <= (w["start"] + w["end"]) / 2 <= e - 0.25]
        if e - s < 1.0 or not inside:
            continue
        mine = sum(w["speaker"] == rttm_map[spk] for w in inside)
        assert mine >= 0.75 * len(inside), (s, e, spk, [(w["word"], w["speaker"]) for w in inside])
    for seg, own in segment_words(segments, words):  # split at every change
        assert {w["speaker"] for w in own} == {seg["speaker"]}, seg


def test_speaker_bounds_are_honoured(client: httpx.Client, sample: Path, tmp_path: Path) -> None:
    one = transcribed(client, sample, diarize="true", max_speakers="1", language="en")
    assert one["result"]["speakers"] == ["SPEAKER_00"] and one["options"]["max_speakers"] == 1
    assert {s["speaker"] for s in one["result"]["segments"]} == {"SPEAKER_00"}
    assert one["result"]["words"] is None  # decoded with word times, returned only if asked
    assert one["result"]["diarization"] == {"speakers": 1, "asked": {"max_speakers": 1},
                                            "met": True}
    three = transcribed(client, sample, diarize="true", num_speakers="3", language="en")["result"]
    assert len({t["speaker"] for t in three["turns"]}) == 3 == len(three["speakers"])
    assert three["diarization"] == {"speakers": 3, "asked": {"num_speakers": 3}, "met": True}
    # ~2 s of speech cannot hold 4 speakers: the result says so instead of answering quietly.
    from app.audio import decode
    from loadtest.lib.common import write_wav16

    write_wav16(tmp_path / "short.wav", decode(sample, 3600)[3 * 16_000: int(5.5 * 16_000)])
    short = transcribed(client, tmp_path / "short.wav", diarize="true", num_speakers="4")["result"]
    assert short["diarization"]["met"] is False and short["diarization"]["speakers"] < 4
    assert "num_speakers=4" in short["diarization"]["note"]


def test_turns_as_rttm(client: httpx.Client, diarized: dict[str, Any]) -> None:
    """The diarizer's turns, in the JSON and as RTTM named after the upload: what diarization
    scorers read. Their speakers are the segments'."""
    result = diarized["result"]
    rttm = client.get(f"/jobs/{diarized['id']}/result", params={"format": "rttm"})
    assert rttm.status_code == 200 and rttm.headers["content-type"].startswith("text/plain")
    rows = [line.split() for line in rttm.text.splitlines()]
    assert [(r[0], r[1], r[2], r[7]) for r in rows] == [
        ("SPEAKER", SAMPLE, "1", t["speaker"]) for t in result["turns"]]
    assert [(float(r[3]), round(float(r[3]) + float(r[4]), 3)) for r in rows] == [
        (t["start"], t["end"]) for t in result["turns"]]
    assert {t["speaker"] for t in result["turns"]} == set(result["speakers"])
    der = der_module()
    ref = der.load_rttm(str(CORPUS / corpus_item(SAMPLE)["rttm"]))[SAMPLE]
    hyp = [(float(r[3]), float(r[3]) + float(r[4]), r[7]) for r in rows]
    assert der.der(ref, hyp, 0.25, False, 30.0)["der"] <= 0.05
    plain = transcribed(client, CORPUS / corpus_item(SAMPLE)["file"], language="en")
    wrong = client.get(f"/jobs/{plain['id']}/result", params={"format": "rttm"})
    assert wrong.status_code == 400 and "diarize=true" in wrong.json()["error"]["message"]


def test_srt_and_vtt_carry_the_speakers(client: httpx.Client, diarized: dict[str, Any]) -> None:
    job_id, result = diarized["id"], diarized["result"]
    names = [s["speaker"] for s in result["segments"] if s["text"]]
    subs = list(srt.parse(client.get(f"/jobs/{job_id}/result", params={"format": "srt"}).text))
    assert len(subs) == len(names)
    for sub, name in zip(subs, names, strict=True):
        assert sub.content.startswith(f"[{name}] "), sub.content
    vtt = client.get(f"/jobs/{job_id}/result", params={"format": "vtt"}).text
    cues = webvtt.from_string(vtt).captions
    assert [c.voice for c in cues] == names
    assert {c.voice for c in cues} == set(result["speakers"])
    tsv = client.get(f"/jobs/{job_id}/result", params={"format": "tsv"}).text.splitlines()
    assert tsv[0] == "start\tend\ttext\tspeaker" and [r.split("\t")[3] for r in tsv[1:]] == names


def test_diarized_json_through_the_openai_client(server: Server, sample: Path,
                                                 diarized: dict[str, Any]) -> None:
    from openai.types.audio import TranscriptionDiarized

    oa = openai_client(server.url, timeout=BOUND)
    try:
        with sample.open("rb") as f:
            r = oa.audio.transcriptions.create(model="gpt-4o-transcribe-diarize", file=f,
                                               response_format="diarized_json",
                                               chunking_strategy="auto", language="en")
    finally:
        oa.close()
    assert isinstance(r, TranscriptionDiarized)
    assert {s.speaker for s in r.segments} == {"A", "B"}
    assert r.usage is not None and r.usage.type == "duration" and r.usage.seconds == r.duration
    assert r.text == " ".join(s.text for s in r.segments)
    # The same speakers on the same segments as the job API's, named A, B by first appearance.
    letters = {n: "AB"[k] for k, n in enumerate(diarized["result"]["speakers"])}
    ours = [(s["start"], s["end"], s["text"], letters[s["speaker"]])
            for s in diarized["result"]["segments"] if s["text"]]
    assert [(s.start, s.end, s.text, s.speaker) for s in r.segments] == ours


def test_diarize_false_is_unchanged(client: httpx.Client, sample: Path) -> None:
    """No speaker field anywhere, the job has no diarization time, subtitles have no names."""
    job = transcribed(client, sample, language="en")
    assert "diarization_s" not in job and job["options"]["diarize"] is False
    result = job["result"]
    assert set(result) == {"text", "language", "language_probability", "duration", "segments",
                           "words"}
    assert all("speaker" not in s for s in result["segments"])
    subs = client.get(f"/jobs/{job['id']}/result", params={"format": "srt"}).text
    assert "[SPEAKER" not in subs and len(list(srt.parse(subs))) == len(result["segments"])
    assert client.get(f"/jobs/{job['id']}/result",
                      params={"format": "tsv"}).text.startswith("start\tend\ttext\n")


def test_channels_separate_puts_each_channels_text_under_its_label(
        client: httpx.Client, clips: list[Clip], tmp_path: Path) -> None:
    """A stereo file built from two different read-speech clips, one per channel: each
    channel's transcript (whisper-base on read speech: WER ~5-10%, so <= 15%) is its own
    clip's, and not the other's."""
    stereo(clips, tmp_path / "call.wav")
    left, right = two_clips(clips)
    job = transcribed(client, tmp_path / "call.wav", channels="separate", language="en")
    result = job["result"]
    assert result["speakers"] == ["channel_0", "channel_1"]
    text = {n: " ".join(s["text"] for s in result["segments"] if s["speaker"] == n)
            for n in result["speakers"]}
    assert wer([left.reference], [text["channel_0"]]) <= 0.15, text
    assert wer([right.reference], [text["channel_1"]]) <= 0.15, text
    assert wer([right.reference], [text["channel_0"]]) > 0.6
    assert wer([left.reference], [text["channel_1"]]) > 0.6
    starts = [s["start"] for s in result["segments"]]
    assert starts == sorted(starts)
    vtt = client.get(f"/jobs/{job['id']}/result", params={"format": "vtt"}).text
    assert {c.voice for c in webvtt.from_string(vtt).captions} == {"channel_0", "channel_1"}
