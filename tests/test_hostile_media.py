"""Hostile media (issue 18, items 1 and 2), against the running service with the real model.

* FFmpeg opens uploads only behind allow-lists: a concat playlist naming another tenant's
  spool file (which used to be transcribed *from that upload*) and other playlists are 415.
* A WAV that declares a huge sample rate or channel count is 415 at upload.
* A header that lies about the duration is counted at the decoded length while decoding.
"""

from __future__ import annotations

import time

import httpx
import numpy as np
import pytest

from loadtest.lib.corpus import Clip
from loadtest.lib.hostile_inputs import load, lying_mkv, playlists, wav, wav_declaring
from tests.conftest import Server
from tests.helpers import post

pytestmark = pytest.mark.model

EN = {"language": "en"}


def assert_415(r: httpx.Response) -> None:
    assert r.status_code == 415, r.text
    assert r.json()["error"]["type"] == "unsupported_media"
    assert r.headers.get("x-should-retry") in (None, "false")
    message = r.json()["error"]["message"]
    assert "/tmp" not in message and "/root" not in message and "spool" not in message


def test_playlists_are_refused_and_read_nothing(server: Server, clips: list[Clip]) -> None:
    """A queued upload sits in the spool folder under its job id; a playlist naming it, or any
    other file, must be refused at upload: never transcribed from someone else's audio."""
    victim = next(c for c in clips if c.id == "jfk-inaugural-1961")
    with server.client() as c:
        c.post("/transcribe", files={"file": ("v.flac", victim.path.read_bytes())})  # 202
        jobs = c.get("/jobs").json()["jobs"]
        assert jobs
        other = jobs[0]["id"]
        before = {j["id"] for j in c.get("/jobs").json()["jobs"]}
        for name, body in playlists(other, victim.path).items():
            assert_415(post(c, (name, body), data=EN, wait=True))
        assert {j["id"] for j in c.get("/jobs").json()["jobs"]} == before  # no job was made


@pytest.mark.parametrize(("rate", "channels"), [(10_000_000, 1), (16000, 64), (0, 1)])
def test_absurd_rates_and_layouts_are_refused_at_upload(server: Server, rate: int,
                                                        channels: int) -> None:
    with server.client() as c:
        r = post(c, ("tiny.wav", wav_declaring(rate, channels)), data=EN)
    assert r.status_code in (415, 422), r.text
    assert r.json()["error"]["type"] in ("unsupported_media", "invalid_audio")


def test_a_sane_stereo_48k_wav_still_works(server: Server, clips: list[Clip]) -> None:
    clip = next(c for c in clips if c.id == "jfk-inaugural-1961")
    body = wav(load(clip.path, 48000, 2), 48000)
    with server.client() as c:
        r = post(c, ("stereo.wav", body), data=EN, wait=True)
    assert r.status_code == 200 and "country" in r.json()["result"]["text"].lower()


def test_a_duration_lie_is_counted_at_the_decoded_length(server: Server,
                                                         clips: list[Clip]) -> None:
    """A Matroska file whose header says 5 s and which holds 180 s of speech: its size says no
    codec packs 180 s into 5 s, so its packets are timed and it is admitted (and counted in the
    store and the backlog) at the real length, not the header's (issue 38); the result has the
    real length."""
    speech = np.concatenate([load(c.path, 16000).reshape(-1) for c in clips[:40]])
    body = lying_mkv(np.tile(speech, 2)[: 180 * 16000], 5.0)
    with server.client() as c:
        r = post(c, ("liar.mka", body), data=EN)
        assert r.status_code == 202, r.text
        job = r.json()
        assert job["audio_seconds"] > 175  # admitted at the file's length, not the header's
        seen = []
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            job = c.get(job["status_url"]).json()
            seen.append((job["status"], job["audio_seconds"]))
            if job["status"] in ("done", "failed", "cancelled"):
                break
            time.sleep(0.05)
    assert job["status"] == "done", job
    assert job["audio_seconds"] > 175
    running = [a for st, a in seen if st == "running"]
    assert any(a > 60 for a in running), seen[:40]  # counted at real length while it ran
