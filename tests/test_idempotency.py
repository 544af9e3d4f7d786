"""``Idempotency-Key`` on the POST routes (app/api/idempotency.py), and GET /jobs?ids=.

In process on a fake engine (the whole app: middleware, routes, SQLite store, real decode and
VAD), then end to end on the real model over HTTP: the same POST twice -> one job, and the real
``openai`` client with ``extra_headers``.
"""

from __future__ import annotations

import hashlib
import io
import os
import sqlite3
import time
import wave
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from app.jobs.store import JobStore
from app.main import create_app
from loadtest.lib.corpus import Clip
from tests.conftest import CORPUS, Server, corpus_clips
from tests.fakes import FakeEngine
from tests.helpers import fake_settings, openai_client, post, serve, wait_done
from tests.wer import wer


def wav_bytes(seconds: float = 2.0, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    pcm = (rng.standard_normal(int(seconds * 16000)) * 3000).astype("<i2")
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes(pcm.tobytes())
    return buf.getvalue()


def submit(c: httpx.Client, key: str | None, body: bytes | None = None,
           wait: bool = False) -> httpx.Response:
    """An upload (``body``, else two seconds of noise) with ``key`` as its Idempotency-Key
    (None: without one)."""
    headers = {"Idempotency-Key": key} if key is not None else {}
    return post(c, ("a.wav", body if body is not None else wav_bytes()), data={"language": "en"},
                headers=headers, wait=wait)


def db_rows(data: Path) -> list[dict[str, Any]]:
    with sqlite3.connect(data / "jobs.db") as db:
        db.row_factory = sqlite3.Row
        return [dict(r) for r in db.execute("SELECT * FROM jobs")]


@pytest.fixture
def app_url(tmp_path: Path) -> Iterator[tuple[str, FakeEngine, Path]]:
    fake = FakeEngine()
    data = tmp_path / "data"
    with serve(create_app(fake_settings(data), engine_factory=lambda s: fake)) as url:
        yield url, fake, data
    fake.gate.set()


def test_same_key_twice_gives_the_first_job_without_reading_the_upload(app_url: Any) -> None:
    url, _, data = app_url
    with httpx.Client(base_url=url, timeout=60) as c:
        first = submit(c, "row-1")
        assert first.status_code == 202, first.text
        job = first.json()
        assert "Idempotent-Replayed" not in first.headers
        # The same key with a body that is not even audio: answered from the key (a 415 would
        # mean the upload was spooled and probed), the same job, flagged as a replay.
        again = submit(c, "row-1", body=b"not audio" * 100)
        assert again.status_code == 202 and again.json()["id"] == job["id"], again.text
        assert again.headers["Idempotent-Replayed"] == "true"
        assert again.headers["Location"] == f"/jobs/{job['id']}"
        # ?wait=true on a replay answers as the route does: the finished job, 200.
        done = submit(c, '"row-1"', wait=True)  # a structured-field string: the same key
        assert done.status_code == 200 and done.json()["id"] == job["id"]
        assert done.json()["status"] == "done"
        other = submit(c, "row-2")
        assert other.status_code == 202 and other.json()["id"] != job["id"]
        plain = [submit(c, None).json()["id"] for _ in range(2)]  # no key: a job per POST
        assert len(set(plain)) == 2
        listed = c.get("/jobs", params={"limit": 1000}).json()["jobs"]
    assert sorted(j["id"] for j in listed) == sorted([job["id"], other.json()["id"], *plain])
    rows = db_rows(data)
    keyed = [r["idempotency_key"] for r in rows if r["idempotency_key"]]
    assert len(keyed) == 2 and all(len(k) == 64 for k in keyed)  # digests, never the raw key
    assert not any("row-" in k for k in keyed)


def test_a_concurrent_duplicate_loses_at_the_unique_index(app_url: Any,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Both requests miss the lookup (forced here, a race in real life) and spool their upload;
    the second INSERT violates the unique index and that request answers with the first job."""
    url, _, data = app_url
    real = JobStore.by_idempotency_key
    misses = {"left": 2}  # the two gate lookups; the conflict's own lookup is real

    async def racing(self: JobStore, digest: str, since: float) -> Any:
        if misses["left"] > 0:
            misses["left"] -= 1
            return None
        return await real(self, digest, since)

    monkeypatch.setattr(JobStore, "by_idempotency_key", racing)
    with httpx.Client(base_url=url, timeout=60) as c:
        a, b = submit(c, "same"), submit(c, "same")
        assert a.status_code == b.status_code == 202, (a.text, b.text)
        assert a.json()["id"] == b.json()["id"]
        assert len(c.get("/jobs").json()["jobs"]) == 1
    assert misses["left"] == 0
    assert [p.name for p in (data / "uploads").iterdir()] in ([], [a.json()["id"]])


def test_many_concurrent_posts_with_one_key_make_one_job(app_url: Any) -> None:
    url, fake, _ = app_url
    fake.gate.clear()  # nothing finishes meanwhile
    body = wav_bytes(3.0)
    with ThreadPoolExecutor(8) as ex, httpx.Client(base_url=url, timeout=60) as c:
        answers = list(ex.map(lambda _: submit(c, "burst", body=body), range(8)))
        fake.gate.set()
        assert {r.status_code for r in answers} == {202}, [r.text for r in answers]
        assert len({r.json()["id"] for r in answers}) == 1
        assert len(c.get("/jobs").json()["jobs"]) == 1


def test_keys_are_per_caller(tmp_path: Path) -> None:
    keys = ("key-alice", "key-bob")
    digests = [hashlib.sha256(k.encode()).hexdigest() for k in keys]
    settings = fake_settings(tmp_path, security={"api_key_sha256": digests})
    with serve(create_app(settings, engine_factory=lambda s: FakeEngine())) as url:
        alice = httpx.Client(base_url=url, timeout=60, headers={"Authorization": f"Bearer {keys[0]}"})
        bob = httpx.Client(base_url=url, timeout=60, headers={"Authorization": f"Bearer {keys[1]}"})
        with alice, bob:
            a1, b1, a2 = submit(alice, "k"), submit(bob, "k"), submit(alice, "k")
            assert a1.json()["id"] == a2.json()["id"] != b1.json()["id"]
            assert "Idempotent-Replayed" not in b1.headers
            # bob cannot see alice's job through the batch route either
            ids = f"{a1.json()['id']},{b1.json()['id']}"
            assert [j["id"] for j in bob.get("/jobs", params={"ids": ids}).json()["jobs"]] == [
                b1.json()["id"]]
            assert httpx.post(url + "/transcribe", headers={"Idempotency-Key": "k"}).status_code == 401


def test_a_key_older_than_the_window_makes_a_new_job(app_url: Any) -> None:
    url, _, data = app_url
    with httpx.Client(base_url=url, timeout=60) as c:
        old = submit(c, "reused").json()["id"]
        wait_done(c, old)
        with sqlite3.connect(data / "jobs.db") as db:  # made 25 h ago
            db.execute("UPDATE jobs SET created_at = created_at - 90000 WHERE id = ?", (old,))
        new = submit(c, "reused")
        assert new.status_code == 202 and new.json()["id"] != old
        assert submit(c, "reused").json()["id"] == new.json()["id"]
        assert c.get(f"/jobs/{old}").json()["status"] == "done"  # the old job is kept
    by_id = {r["id"]: r for r in db_rows(data)}
    assert by_id[old]["idempotency_key"] is None and by_id[new.json()["id"]]["idempotency_key"]


@pytest.fixture(scope="module")
def speech() -> Clip:
    """A read-speech clip: VAD finds windows in it, so its job waits for the (gated) engine."""
    if not (CORPUS / "manifest.jsonl").is_file() and os.environ.get("CI"):
        pytest.fail(f"corpus not found at {CORPUS}: CI needs it")
    return next(c for c in corpus_clips() if c.set == "librispeech" and c.duration_s > 8)


def test_a_replay_is_not_refused_by_a_full_backlog(tmp_path: Path, speech: Clip) -> None:
    fake = FakeEngine()
    fake.gate.clear()  # the first job stays in the backlog
    settings = fake_settings(tmp_path, limits={"max_backlog_s": 1.5 * speech.duration_s})
    body = speech.path.read_bytes()
    with serve(create_app(settings, engine_factory=lambda s: fake)) as url, \
            httpx.Client(base_url=url, timeout=60) as c:
        try:
            first = submit(c, "k", body=body)
            assert first.status_code == 202
            assert submit(c, None, body=body).status_code == 429  # full for new work
            again = submit(c, "k", body=body)
            assert again.status_code == 202 and again.json()["id"] == first.json()["id"]
        finally:
            fake.gate.set()


@pytest.mark.parametrize("bad", ["", "\"\"", "x" * 256, "caf\u00e9"])
def test_a_malformed_key_is_a_400_not_worth_retrying(app_url: Any, bad: str) -> None:
    url, _, _ = app_url
    raw = bad.encode("latin-1")
    with httpx.Client(base_url=url, timeout=60) as c:
        r = c.post("/transcribe", headers=[(b"Idempotency-Key", raw)],
                   files={"file": ("a.wav", wav_bytes())})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["field"] == "Idempotency-Key"
        assert r.headers["x-should-retry"] == "false"
        v1 = c.post("/v1/audio/transcriptions", headers=[(b"Idempotency-Key", raw)],
                    data={"model": "whisper-1"}, files={"file": ("a.wav", wav_bytes())})
        assert v1.status_code == 400 and v1.json()["error"]["param"] == "Idempotency-Key", v1.text
        assert not c.get("/jobs").json()["jobs"]


def test_v1_replays_and_keeps_its_job_for_the_retry(app_url: Any) -> None:
    url, _, _ = app_url
    with httpx.Client(base_url=url, timeout=60) as c:
        def v1(key: str) -> httpx.Response:
            return c.post("/v1/audio/transcriptions", headers={"Idempotency-Key": key},
                          data={"model": "whisper-1", "language": "en"},
                          files={"file": ("a.wav", wav_bytes())})

        a, b = v1("v"), v1("v")
        assert a.status_code == b.status_code == 200, (a.text, b.text)
        assert a.headers["X-Batchscribe-Job-Id"] == b.headers["X-Batchscribe-Job-Id"]
        assert b.headers["Idempotent-Replayed"] == "true" and a.json() == b.json()
        assert len(c.get("/jobs").json()["jobs"]) == 1


def test_jobs_by_ids_in_one_request(app_url: Any) -> None:
    url, _, _ = app_url
    with httpx.Client(base_url=url, timeout=60) as c:
        ids = [submit(c, None).json()["id"] for _ in range(3)]
        r = c.get("/jobs", params={"ids": f"{ids[2]},nope,{ids[0]},{ids[2]}"})
        assert r.status_code == 200
        assert [j["id"] for j in r.json()["jobs"]] == [ids[2], ids[0]]  # asked order, no unknown
        assert float(r.headers["X-Backlog-Seconds"]) >= 0
        assert float(r.headers["X-Backlog-Limit-Seconds"]) == 6 * 3600
        too_many = c.get("/jobs", params={"ids": ",".join(f"j{k}" for k in range(101))})
        assert too_many.status_code == 400 and too_many.headers["x-should-retry"] == "false"
        # Ids are bounded so that even an encoded hostile value stays a JSON answer of the app,
        # never the HTTP parser's plain-text 400 for an over-long request line.
        hostile = c.get("/jobs", params={"ids": "\u00ca" * 2600})
        assert hostile.status_code == 422 and hostile.json()["error"]["type"] == "invalid_request"


# ---- end to end, the real model -----------------------------------------------------------
def jobs_total(c: httpx.Client) -> int:
    return len(c.get("/jobs", params={"limit": 1000}).json()["jobs"])


@pytest.mark.model
def test_same_post_twice_is_one_job_on_the_real_service(server: Server, clips: list[Clip]) -> None:
    clip = next(c for c in clips if c.set == "librispeech")
    key = f"e2e-{time.time_ns()}"
    with server.client() as c:
        before = jobs_total(c)
        answers = []
        for _ in range(2):
            with clip.path.open("rb") as f:
                answers.append(c.post("/transcribe", params={"wait": "true"},
                                      headers={"Idempotency-Key": key},
                                      data={"language": "en"}, files={"file": (clip.path.name, f)}))
        assert [r.status_code for r in answers] == [200, 200], [r.text for r in answers]
        assert answers[0].json()["id"] == answers[1].json()["id"]
        assert answers[1].headers["Idempotent-Replayed"] == "true"
        assert jobs_total(c) == before + 1
    assert wer([clip.reference], [answers[1].json()["result"]["text"]]) < 0.3


@pytest.mark.model
def test_openai_client_with_an_idempotency_key(server: Server, clips: list[Clip]) -> None:

    clip = next(c for c in clips if c.set == "ljspeech")
    key = f"oa-{time.time_ns()}"
    oa = openai_client(server.url)
    with server.client() as c, oa:
        before = jobs_total(c)
        texts, job_ids = [], []
        for _ in range(2):
            with clip.path.open("rb") as f:
                raw = oa.audio.transcriptions.with_raw_response.create(
                    model="whisper-1", file=f, language="en",
                    extra_headers={"Idempotency-Key": key})
            job_ids.append(raw.headers["X-Batchscribe-Job-Id"])
            texts.append(raw.parse().text)
        assert job_ids[0] == job_ids[1] and texts[0] == texts[1]
        assert jobs_total(c) == before + 1
    assert wer([clip.reference], [texts[0]]) < 0.3

