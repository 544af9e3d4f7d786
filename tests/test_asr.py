"""whisper-asr-webservice's API (/asr, /detect-language) as Bazarr calls it, hotwords, subtitle
options on every route, and GET /status: shapes in process, then the real model over HTTP.

Bazarr's provider (custom_libs/subliminal_patch/providers/whisperai.py) extracts the track with
its own ffmpeg and posts raw s16le 16 kHz mono PCM with ``encode=false``, as a multipart field
``audio_file`` named ``audio_file`` (what ``requests`` does with bytes), plus ``video_file``.
"""

from __future__ import annotations

import io
import secrets
import wave
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import srt
import webvtt
from fastapi import UploadFile

from app import audio
from app.api.asr.protocol import spool_pcm
from app.errors import PayloadTooLarge
from app.results.asr import asr_body, asr_json
from app.results.formats import CueOptions
from loadtest.lib.corpus import Clip
from tests.conftest import Server, multilingual_clips
from tests.helpers import wait_until
from tests.test_e2e import metric
from tests.test_subtitles import SENTENCE, timed_result
from tests.wer import wer


# ---- shapes (no model) -------------------------------------------------------------------------
def test_asr_json_is_faster_whisper_shaped() -> None:
    out = asr_json(timed_result(), words=True)
    assert set(out) == {"language", "segments", "text"} and out["language"] == "en"
    seg = out["segments"][0]
    assert set(seg) == {"id", "seek", "start", "end", "text", "tokens", "avg_logprob",
                        "compression_ratio", "no_speech_prob", "words", "temperature"}
    assert seg["id"] == 1 and seg["text"] == " " + SENTENCE  # Whisper's leading space
    assert out["text"] == "".join(s["text"] for s in out["segments"])
    assert seg["words"][0] == {"start": 1.0, "end": 1.4, "word": " The", "probability": 0.9}
    assert asr_json(timed_result(), words=False)["segments"][0]["words"] is None
    assert asr_body(timed_result(), "txt", False, CueOptions()) == f"{SENTENCE}\nDone.\n"


def pcm_upload(data: bytes) -> UploadFile:
    return UploadFile(io.BytesIO(data), filename="audio_file")


def test_raw_pcm_is_wrapped_in_a_wav_header(tmp_path: Path) -> None:
    samples = bytes(range(256)) * 100 + b"\x07"  # an odd byte at the end: half a sample
    dest = tmp_path / "a"
    assert spool_pcm(pcm_upload(samples), dest, 1 << 20) == len(samples) - 1
    with wave.open(str(dest)) as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, 16000)
        assert w.readframes(w.getnframes()) == samples[:-1]


def test_raw_pcm_limits(tmp_path: Path) -> None:
    two_s = b"\x01\x00" * 32000
    with pytest.raises(PayloadTooLarge):
        spool_pcm(pcm_upload(two_s), tmp_path / "big", 10_000)
    # Language detection keeps the head and reads the rest away; the limit still bounds the head.
    assert spool_pcm(pcm_upload(two_s), tmp_path / "head", 1 << 20, max_s=0.5) == 16000
    with wave.open(str(tmp_path / "head")) as w:
        assert w.getnframes() == 8000
    assert spool_pcm(pcm_upload(two_s), tmp_path / "small", 10_000, max_s=0.5) == 10_000


# ---- the real model over HTTP ------------------------------------------------------------------
def pcm(path: Path) -> bytes:
    """What Bazarr's ffmpeg call produces: s16le, 16 kHz, mono, no header."""
    samples = audio.decode(path, 3600)
    return (np.clip(samples, -1, 1) * 32767).astype("<i2").tobytes()


def bazarr(client: httpx.Client, route: str, body: bytes, **params: str) -> httpx.Response:
    return client.post(route, params={"encode": "false", "video_file": "/tv/Show/S01E01.mkv", **params},
                       files={"audio_file": ("audio_file", body)})


def batches_over_one(text: str) -> float:
    return metric(text, "batchscribe_batch_size_windows_count") - metric(
        text, "batchscribe_batch_size_windows_bucket", '{le="1.0"}')


@pytest.mark.model
def test_bazarr_calls_at_once_are_answered_and_batched_together(
        server: Server, clips: list[Clip]) -> None:
    picked = sorted((c for c in clips if c.set in ("librispeech", "ljspeech") and c.duration_s > 5),
                    key=lambda c: c.id)[:6]
    bodies = [pcm(c.path) for c in picked]
    with server.client() as client, ThreadPoolExecutor(len(picked)) as pool:
        before = client.get("/metrics").text
        detected = list(pool.map(lambda b: bazarr(client, "/detect-language", b), bodies))
        subs = list(pool.map(lambda b: bazarr(client, "/asr", b, task="transcribe", language="en",
                                              output="srt"), bodies))
        after = client.get("/metrics").text
        status = client.get("/status").json()
    for r in detected:
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["detected_language"] == "english" and body["language_code"] == "en"
        assert 0.5 < body["confidence"] <= 1
    hyps = []
    for clip, r in zip(picked, subs, strict=True):
        assert r.status_code == 200, r.text
        assert r.headers["content-type"].startswith("text/plain")
        assert r.headers["asr-engine"] == "faster_whisper"
        assert r.headers["content-disposition"] == 'attachment; filename="audio_file.srt"'
        cues = list(srt.parse(r.text))
        assert cues and all(0 <= c.start.total_seconds() <= c.end.total_seconds()
                            <= clip.duration_s + 0.05 for c in cues)
        hyps.append(" ".join(c.content.replace("\n", " ") for c in cues))
    assert wer([c.reference for c in picked], hyps) < 0.15, hyps
    # Batched together: some engine batch held windows of more than one of these calls.
    assert batches_over_one(after) - batches_over_one(before) >= 1
    assert status["ready"] and status["batch_size"] >= 1 and status["rtf"] > 0


@pytest.mark.model
def test_asr_outputs_and_subtitle_options(server: Server, clips: list[Clip]) -> None:
    clip = next(c for c in clips if c.id == "jfk-inaugural-1961")
    data = clip.path.read_bytes()

    def asr(**params: Any) -> httpx.Response:
        r = client.post("/asr", params=params, files={"audio_file": (clip.path.name, data)})
        assert r.status_code == 200, r.text
        assert r.headers["content-disposition"].endswith(f'.{params.get("output", "txt")}"')
        return r

    with server.client() as client:
        assert "ask not what your country" in asr().text  # txt, encode=true (a flac)
        as_json = asr(output="json", word_timestamps="true").json()
        assert as_json["language"] == "en" and as_json["text"].startswith(" ")
        assert all(s["words"] for s in as_json["segments"])
        vtt = asr(output="vtt").text
        assert len(webvtt.from_string(vtt).captions) >= 2
        tsv = asr(output="tsv").text.splitlines()
        assert tsv[0] == "start\tend\ttext" and all(r.split("\t")[0].isdigit() for r in tsv[1:])
        narrow = list(srt.parse(asr(output="srt", max_line_width=20, max_line_count=1).text))
        assert len(narrow) > len(tsv) - 1  # cut into more cues than segments
        assert all("\n" not in c.content and len(c.content) <= 20 for c in narrow)
        short = list(srt.parse(asr(output="srt", max_cue_s=2).text))
        assert all((c.end - c.start).total_seconds() <= 2.0 for c in short)
        # The same options on a job's result and on /v1.
        job_id = asr(output="srt").headers["x-batchscribe-job-id"]
        cut = client.get(f"/jobs/{job_id}/result", params={"format": "tsv", "max_cue_s": 2})
        assert cut.headers["content-type"].startswith("text/tab-separated-values")
        assert len(cut.text.splitlines()) - 1 == len(short)
        v1 = client.post("/v1/audio/transcriptions", files={"file": (clip.path.name, data)},
                         data={"model": "whisper-1", "response_format": "vtt", "max_line_width": 16})
        assert all(len(line) <= 16 for c in webvtt.from_string(v1.text).captions
                   for line in c.text.split("\n"))


def multilingual() -> dict[str, tuple[Path, str]]:
    """The longest clip of German, French and Spanish: {language: (path, clip id)}."""
    clips = multilingual_clips()
    longest = {lang: max((c for c in clips if c.language == lang), key=lambda c: c.duration_s)
               for lang in ("de", "fr", "es")}
    return {lang: (c.path, c.id) for lang, c in longest.items()}


@pytest.mark.model
def test_detect_language_of_other_languages_and_of_silence(server: Server) -> None:
    picked = multilingual()
    with server.client() as client:
        for lang, (path, clip_id) in picked.items():
            raw = bazarr(client, "/detect-language", pcm(path)).json()
            assert raw["language_code"] == lang, (clip_id, raw)
            encoded = client.post("/detect-language", files={"audio_file": (path.name, path.read_bytes())})
            assert encoded.json()["language_code"] == lang, (clip_id, encoded.text)
        silence = bazarr(client, "/detect-language", b"\0\0" * 16000 * 3)
        assert silence.status_code == 200
        assert silence.json() == {"detected_language": "undefined", "language_code": "und",
                                  "confidence": 0.0}  # Bazarr reads "und" as "not detected"


@pytest.mark.model
def test_asr_bad_input_is_a_json_4xx(server: Server, clips: list[Clip]) -> None:
    clip = next(c for c in clips if c.id == "jfk-inaugural-1961")
    with server.client() as client:
        r = bazarr(client, "/asr", pcm(clip.path), language="klingon")
        assert r.status_code == 400 and r.json()["error"]["type"] == "bad_request"
        r = bazarr(client, "/asr", pcm(clip.path), output="doc")
        assert r.status_code == 422 and "output" in r.json()["error"]["message"]
        for body in (b"", b"\x01"):  # nothing, or half a sample
            r = bazarr(client, "/asr", body)
            assert r.status_code == 422 and r.json()["error"]["type"] == "invalid_audio"
        r = client.post("/asr", files={"audio_file": ("notes.txt", b"not audio at all\n" * 40)})
        assert r.status_code == 415 and r.json()["error"]["type"] == "unsupported_media"
        assert client.get("/healthz").status_code == 200


@pytest.mark.model
def test_hotwords_reach_the_job(server: Server, clips: list[Clip]) -> None:
    """Accepted on /transcribe and /v1 with faster-whisper's meaning, kept in the job's options
    (the engine adds them to each window's prompt), bounded like prompts."""
    clip = next(c for c in clips if c.id == "jfk-inaugural-1961")
    data = clip.path.read_bytes()
    with server.client() as client:
        r = client.post("/transcribe", params={"wait": "true"}, files={"file": ("a.flac", data)},
                        data={"hotwords": "  Kennedy \n Americans  "})
        assert r.status_code == 200, r.text
        job = r.json()
        assert job["options"]["hotwords"] == "Kennedy Americans"
        assert "country" in job["result"]["text"]
        r = client.post("/v1/audio/transcriptions", files={"file": ("a.flac", data)},
                        data={"model": "whisper-1", "hotwords": "Kennedy"})
        assert r.status_code == 200 and "country" in r.json()["text"]
        job_id = r.headers["x-batchscribe-job-id"]
        assert client.get(f"/jobs/{job_id}").json()["options"]["hotwords"] == "Kennedy"
        r = client.post("/transcribe", files={"file": ("a.flac", data)}, data={"hotwords": "x" * 1001})
        assert r.status_code == 422 and "hotwords" in r.json()["error"]["message"]
        r = client.post("/v1/audio/transcriptions", files={"file": ("a.flac", data)},
                        data={"model": "whisper-1", "hotwords": "x" * 1001})
        assert r.status_code == 400 and r.json()["error"]["param"] == "hotwords"


@pytest.mark.model
def test_an_asr_client_that_hangs_up_cancels_its_job(server: Server, clips: list[Clip]) -> None:
    """Nobody can collect the answer of a synchronous call whose client left (Bazarr retries)."""
    longest = sorted(clips, key=lambda c: -c.duration_s)[:3]  # ~165 s: seconds of engine work
    body = b"".join(pcm(c.path) for c in longest)
    name = f"hangup-{secrets.token_hex(4)}"
    with server.client() as client:
        with pytest.raises(httpx.ReadTimeout):
            client.post("/asr", params={"encode": "false", "language": "en"},
                        files={"audio_file": (name, body)}, timeout=httpx.Timeout(60, read=1.0))

        def cancelled() -> bool:
            mine = [j for j in client.get("/jobs").json()["jobs"] if j["filename"] == name]
            return bool(mine) and mine[0]["status"] == "cancelled"

        assert wait_until(cancelled, 60)
