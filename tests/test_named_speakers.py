"""Named speakers (issue 36, item 2): reference clips of known speakers name the diarized
speakers they match, with how sure each match is; OpenAI's ``known_speaker_names[]`` /
``known_speaker_references[]`` through the real ``openai`` client, reference files on
``POST /transcribe``, and bad references as clear 400s.

The recording is pyannote-sample (Diane and Sheila on the phone; its RTTM: speaker90 is Diane,
speaker91 Sheila, as its STM names them): references are cut from its last 12 s, the upload is
its first 18 s, so a name can only come from the voice. A third reference, a woman reading (LJ
Speech), speaks nowhere in the upload and must not name anyone.
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
from openai import OpenAI

from app.results.openai import diarized_json
from app.speakers import Turn, assign_speakers
from app.speakers.named import BadReference, check_names, data_url_bytes, public_options
from app.speakers.report import NameMatch, SpeakerTurns
from app.speakers.voices import match
from tests.conftest import CORPUS as MAIN_CORPUS
from tests.conftest import Server
from tests.test_speakers import CORPUS, SAMPLE, corpus_item, der_module, need

SR = 16_000
BOUND = 600
DIANE, SHEILA = (18.6, 21.49), (21.8, 27.8)  # each alone, in the reference part
UPLOAD = (0.0, 18.0)
WHO = {"Diane": "speaker90", "Sheila": "speaker91"}


# ---- without models ------------------------------------------------------------------------
def test_references_are_checked() -> None:
    assert check_names([" Ann  Lee ", "Bo"], 2, "f") == ["Ann Lee", "Bo"]
    for names, refs, what in ((["A"], 2, "for 2 reference"), ([], 0, "1 to 4"),
                              (["A"] * 5, 5, "1 to 4"), (["A", "A"], 2, "distinct"),
                              (["", "B"], 2, "1-100"), (["SPEAKER_01"], 1, "labels")):
        with pytest.raises(BadReference, match=what):
            check_names(names, refs, "f")
    assert data_url_bytes("data:audio/wav;base64," + base64.b64encode(b"RIFF").decode(),
                          "f") == b"RIFF"
    for bad in ("https://example.com/a.wav", "data:audio/wav;base64,###",
                "data:text/plain;base64,aGk="):
        with pytest.raises(BadReference):
            data_url_bytes(bad, "f")


def test_matching_is_one_to_one_above_the_threshold() -> None:
    rng = np.random.default_rng(0)
    a, b, c = (v / np.linalg.norm(v) for v in rng.standard_normal((3, 192)))
    near_a = a + 0.3 * b
    voices = {0: near_a / np.linalg.norm(near_a), 1: b}
    names, report = match(voices, [{"name": "Ann", "voice": a.tolist()},
                                   {"name": "Cy", "voice": c.tolist()},
                                   {"name": "Ann2", "voice": (a + 0.3 * c).tolist()}])
    assert names == {0: "Ann"}  # Ann2 is close to speaker 0 too, but Ann closer; Cy: nobody
    assert [(m.name, m.speaker) for m in report] == [("Ann", "Ann"), ("Cy", None),
                                                     ("Ann2", None)]
    assert report[0].similarity > 0.9 and report[1].similarity < 0.3
    assert public_options({"known_speakers": [{"name": "Ann", "voice": [0.1]}]}) == {
        "known_speakers": ["Ann"]}


def test_names_are_kept_and_the_others_numbered() -> None:
    tr = {"text": "Hi. Yes. No.", "duration": 3.0, "segments": [
        {"id": k, "start": k * 1.0, "end": k + 0.9, "text": t, "tokens": []}
        for k, t in enumerate(("Hi.", "Yes.", "No."))]}
    turns = SpeakerTurns([Turn(0.0, 1.0, "SPEAKER_00"), Turn(1.0, 2.0, "Ann"),
                          Turn(2.0, 3.0, "SPEAKER_01")],
                         names=[NameMatch("Ann", "Ann", 0.8, 0.5), NameMatch("Bo", None, 0.2, 0.5)])
    out = assign_speakers(tr, turns)
    assert out["speakers"] == ["SPEAKER_00", "Ann", "SPEAKER_01"]
    assert out["diarization"]["known_speakers"] == [
        {"name": "Ann", "matched": True, "similarity": 0.8, "threshold": 0.5},
        {"name": "Bo", "matched": False, "similarity": 0.2, "threshold": 0.5}]
    dj = diarized_json(out)
    assert [s["speaker"] for s in dj["segments"]] == ["A", "Ann", "B"]
    assert dj["known_speakers"][1] == {"name": "Bo", "matched": False, "similarity": 0.2,
                                       "threshold": 0.5}


# ---- the real service ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def clips(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from app.audio import decode
    from loadtest.lib.common import write_wav16

    folder = tmp_path_factory.mktemp("named")
    audio = decode(CORPUS / corpus_item(SAMPLE)["file"], 3600)
    out = {}
    for name, (a, b) in (("upload", UPLOAD), ("Diane", DIANE), ("Sheila", SHEILA)):
        write_wav16(folder / f"{name}.wav", audio[int(a * SR): int(b * SR)])
        out[name] = folder / f"{name}.wav"
    lj = MAIN_CORPUS / "audio" / "ljspeech-LJ001-0001.wav"
    need(lj.is_file(), f"{lj} not found")
    out["Narrator"] = lj
    return out


def data_url(path: Path) -> str:
    return "data:audio/wav;base64," + base64.b64encode(path.read_bytes()).decode()


def speaker_of(start: float, end: float) -> str | None:
    """The reference speaker talking most in [start, end] of the upload (None: nobody)."""
    ref = der_module().load_rttm(str(CORPUS / corpus_item(SAMPLE)["rttm"]))[SAMPLE]
    time: dict[str, float] = {}
    for s, e, k in ref:
        time[k] = time.get(k, 0.0) + max(0.0, min(e, end) - max(s, start))
    best = max(time, key=time.__getitem__)
    return best if time[best] > 0 else None


def check_named(segments: list[tuple[float, float, str]], known: list[dict[str, Any]]) -> None:
    """Both speakers named, each name on segments of that speaker: >= 80 % of the named
    segments' time is the named person's (the first "Hello." is a 0.3 s diarization error)."""
    assert {k["name"]: k["matched"] for k in known} == {"Diane": True, "Sheila": True,
                                                        "Narrator": False}
    assert all(k["similarity"] >= k["threshold"] for k in known if k["matched"])
    assert {s for *_, s in segments} == {"Diane", "Sheila"}
    right = sum(e - s for s, e, k in segments if WHO[k] == speaker_of(s, e))
    assert right >= 0.8 * sum(e - s for s, e, _ in segments), segments


@pytest.mark.model
def test_known_speakers_through_the_openai_client(oa: OpenAI, clips: dict[str, Path]) -> None:
    names = ["Diane", "Sheila", "Narrator"]
    with clips["upload"].open("rb") as f:
        r = oa.audio.transcriptions.create(
            model="gpt-4o-transcribe-diarize", file=f, response_format="diarized_json",
            known_speaker_names=names,
            known_speaker_references=[data_url(clips[n]) for n in names])
    known = r.model_dump()["known_speakers"]
    check_named([(s.start, s.end, s.speaker) for s in r.segments], known)
    assert "Diane in New Jersey" in next(s.text for s in r.segments if s.speaker == "Diane"
                                         and "Diane" in s.text)


@pytest.mark.model
def test_reference_files_on_transcribe(server: Server, clips: dict[str, Path]) -> None:
    names = ["Diane", "Sheila", "Narrator"]
    files = [("file", ("upload.wav", clips["upload"].read_bytes()))] + [
        ("known_speaker_references", (f"{n}.wav", clips[n].read_bytes())) for n in names]
    with server.client(timeout=BOUND) as c:
        r = c.post("/transcribe", params={"wait": "true"}, files=files,
                   data={"diarize": "true", "language": "en", "known_speaker_names": names})
    assert r.status_code == 200, r.text
    job = r.json()
    result = job["result"]
    assert job["options"]["known_speakers"] == names  # names only, not the voices
    check_named([(s["start"], s["end"], s["speaker"]) for s in result["segments"] if s["text"]],
                result["diarization"]["known_speakers"])
    assert {t["speaker"] for t in result["turns"]} == {"Diane", "Sheila"}


@pytest.mark.model
def test_bad_references_are_400s_in_openais_shape(oa: OpenAI, server: Server,
                                                  clips: dict[str, Path], tmp_path: Path) -> None:
    from loadtest.lib.common import write_wav16

    write_wav16(tmp_path / "silence.wav", np.zeros(3 * SR, np.float32))
    write_wav16(tmp_path / "blip.wav", np.full(SR // 2, 0.1, np.float32))
    good = data_url(clips["Diane"])
    cases: list[tuple[dict[str, Any], str, str]] = [
        ({"known_speaker_names": ["A"] * 5, "known_speaker_references": [good] * 5},
         "1 to 4", "known_speaker_names[]"),
        ({"known_speaker_names": ["A", "B"], "known_speaker_references": [good]},
         "one name per reference", "known_speaker_names[]"),
        ({"known_speaker_names": ["A"], "known_speaker_references": ["https://x.test/a.wav"]},
         "data URL", "known_speaker_references[]"),
        ({"known_speaker_names": ["A"], "known_speaker_references": [
            data_url(tmp_path / "silence.wav")]}, "no speech", "known_speaker_references[]"),
        ({"known_speaker_names": ["A"], "known_speaker_references": [
            data_url(tmp_path / "blip.wav")]}, "lasts 0.5 s", "known_speaker_references[]"),
        ({"known_speaker_names": ["A"], "known_speaker_references": [
            "data:audio/wav;base64," + base64.b64encode(b"not audio" * 50).decode()]},
         "not usable audio", "known_speaker_references[]"),
        ({"known_speaker_names": ["A"], "known_speaker_references": [good],
          "response_format": "json"}, "diarized_json", "known_speaker_names[]"),
    ]
    for kw, message, param in cases:
        with clips["upload"].open("rb") as f, pytest.raises(openai.BadRequestError) as err:
            oa.audio.transcriptions.create(model="gpt-4o-transcribe-diarize", file=f,
                                           **{"response_format": "diarized_json", **kw})
        body: Any = err.value.body
        assert message in body["message"] and body["param"] == param, (kw, body)
    with server.client(timeout=BOUND) as c:
        r = c.post("/transcribe", files=[("file", ("u.wav", clips["upload"].read_bytes())),
                                         ("known_speaker_references", ("d.wav", b"x"))],
                   data={"known_speaker_names": ["A"]})
    assert r.status_code == 400 and "diarize=true" in r.json()["error"]["message"]


def test_a_reference_of_nobody_in_the_recording_names_nobody() -> None:
    """The Hungarian step cannot hand a name to a speaker below the threshold even when it
    is the only reference and the only speaker."""
    rng = np.random.default_rng(1)
    a, b = (v / np.linalg.norm(v) for v in rng.standard_normal((2, 192)))
    names, report = match({0: a}, [{"name": "Ann", "voice": b.tolist()}])
    assert names == {} and report[0].speaker is None
    assert match({}, [{"name": "Ann", "voice": b.tolist()}])[1][0].similarity == -1.0
