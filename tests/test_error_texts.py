"""Issue 38 item 4: one function renders every job error a client sees (app.errors.public_error).

A fake engine fails every batch with an exception whose text names a secret, a server path and
an address; no route shows any of it: GET /jobs (one and the list), ?wait=true, the event
stream, /v1 (JSON and its streaming answer), /asr and /detect-language. And the outbound error
categories do not tell an open port from a closed one.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator, Sequence
from typing import Any

import httpx
import pytest

from app.errors import public_error
from app.net.outbound import OutboundError, public_category
from loadtest.lib.corpus import Clip
from tests.fakes import FakeEngine
from tests.helpers import fake_service, post, wait_done

SECRET = "hunter2-engine-secret"
LEAKS = (SECRET, "/srv/models/private", "10.1.2.3", "5432")


def explode(windows: Sequence[Any]) -> None:
    raise RuntimeError(f"{SECRET} in /srv/models/private/model.bin via 10.1.2.3:5432 (open)")


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with fake_service(tmp_path_factory.mktemp("errtexts"), FakeEngine(fail=explode)) as base:
        yield base


@pytest.fixture(scope="module")
def clip(clips: list[Clip]) -> Clip:
    return min((c for c in clips if c.duration_s > 3), key=lambda c: c.duration_s)


def clean(text: str) -> None:
    for leak in LEAKS:
        assert leak not in text, (leak, text[:800])


def test_a_failing_engine_shows_no_exception_text_on_any_route(url: str, clip: Clip) -> None:
    with httpx.Client(base_url=url, timeout=60) as c:
        job = post(c, clip.path, "/transcribe", data={"language": "en"}).json()
        done = wait_done(c, job["id"])
        assert done["status"] == "failed" and done["error"]["type"] == "transcription_failed"
        answers = [c.get(f"/jobs/{job['id']}"), c.get("/jobs"),
                   c.get(f"/jobs/{job['id']}/events"),
                   post(c, clip.path, "/transcribe", data={"language": "en"},
                        params={"wait": "true"}),
                   post(c, clip.path, "/v1/audio/transcriptions",
                        data={"model": "whisper-1", "language": "en"}),
                   post(c, clip.path, "/v1/audio/transcriptions",
                        data={"model": "whisper-1", "language": "en", "stream": "true"}),
                   post(c, clip.path, "/asr", field="audio_file", params={"language": "en"}),
                   post(c, clip.path, "/detect-language", field="audio_file")]
    for r in answers:
        clean(r.text)
        assert "inference failed" in r.text or "transcription_failed" in r.text, (r.url, r.text)
    assert answers[3].json()["status"] == "failed"  # ?wait=true: the failed job, as GET shows it
    assert [r.status_code for r in answers[4:]] == [500, 200, 500, 500]  # the stream: its event


def test_rows_stored_with_exception_text_are_scrubbed() -> None:
    old = {"type": "transcription_failed", "cause": "RuntimeError",
           "message": f"inference failed for the window at 3.0s: {SECRET} /srv/models/private/x"}
    assert public_error(old) == {"type": "transcription_failed",
                                 "message": "inference failed for the window at 3.0s"}
    dia = public_error({"type": "diarization_failed", "message": f"speaker diarization failed: {SECRET}"})
    assert dia == {"type": "diarization_failed", "message": "speaker diarization failed"}
    other = public_error({"type": "invalid_audio", "message": "cannot read 10.1.2.3:5432 or [::1]:80"})
    assert other is not None and other["message"] == "cannot read <address> or <address>"


async def test_closed_and_open_ports_read_the_same() -> None:
    """connect_failed (closed), protocol_error / tls_failed (open, not HTTP), timeout (open,
    silent): one public word; the guard's own refusal and a busy host stay as they are."""
    for category in ("connect_failed", "protocol_error", "tls_failed", "timeout", "failed"):
        assert public_category(category) == "unreachable"
        assert OutboundError(category, "127.0.0.1:22 Connection refused").public == "unreachable"
    for category in ("refused", "invalid_url", "busy"):
        assert public_category(category) == category
    with socket.socket() as s:  # a real closed port: what a client is told is the same word
        s.bind(("127.0.0.1", 0))
        assert s.getsockname()[1] > 0
