"""Hostile and multi-tenant traffic against the running service (issue 18). ``audio_url`` is in
tests/test_audio_url.py; no start beyond loopback without keys and the keyless Host check are in
tests/test_security.py.

One service with two API keys, webhooks on and small per-key limits. Checks: the reported SSRF
URLs are refused at submit; the OpenAI SDK makes one request and one job for audio found
undecodable later (a 4xx that says not to retry); form parts, event streams and file names are
bounded; a key flooding tiny jobs gets 429s naming its limit while another key gets none and
waits only for the engine work that limit admits.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from app.audio import decode
from loadtest.lib.corpus import Clip
from loadtest.lib.hostile_inputs import SSRF_URLS, encode, header_only_wav, lying_flac, wav
from tests.conftest import Server
from tests.helpers import bearer, post, sha
from tests.test_security import KEY_A, KEY_B

pytestmark = pytest.mark.model

MAX_UPLOAD = 8 * 1024 * 1024
MAX_AUDIO_S = 290.0  # under lying_flac()'s 300 s
JOBS_PER_KEY = 6
STREAMS_PER_KEY = 2


def rate_change_mp3() -> bytes:
    """Two MP3s back to back, 16 kHz then 44.1 kHz: the probe decodes the first frames; the
    decoder fails where the sample rate changes."""
    t = np.arange(32000) / 16000
    x = (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32)
    y = np.interp(np.arange(88200) / 44100, t, x).astype(np.float32)
    return encode(x, 16000, "mp3", "libmp3lame") + encode(y, 44100, "mp3", "libmp3lame")


# ---- fixtures ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hostile(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = Server(tmp_path_factory.mktemp("hostile"), env={
        "BATCHSCRIBE_SECURITY__API_KEY_SHA256": f"{sha(KEY_A)},{sha(KEY_B)}",
        "BATCHSCRIBE_WEBHOOKS__SECRET": "hook-secret",
        "BATCHSCRIBE_LIMITS__MAX_UPLOAD_BYTES": str(MAX_UPLOAD),
        "BATCHSCRIBE_LIMITS__MAX_AUDIO_S": str(MAX_AUDIO_S),
        "BATCHSCRIBE_LIMITS__MAX_QUEUED_JOBS_PER_KEY": str(JOBS_PER_KEY),
        "BATCHSCRIBE_LIMITS__MAX_EVENT_STREAMS_PER_KEY": str(STREAMS_PER_KEY),
    }).start()
    yield srv
    srv.terminate()


@pytest.fixture(scope="module")
def short_clip(clips: list[Clip]) -> Clip:
    # (Not librispeech-1272-128104-0000: its audio is another utterance than its reference.)
    return min((c for c in clips if c.set == "ljspeech" and c.duration_s > 3),
               key=lambda c: c.duration_s)


def post_as(srv: Server, key: str, *, wait: bool = False, timeout: float = 300,
            **kw: Any) -> httpx.Response:
    """POST /transcribe to ``srv`` with ``key``'s bearer token; ``kw`` as httpx's (data,
    files, json)."""
    with srv.client(timeout=timeout) as c:
        return post(c, None, wait=wait, headers=bearer(key), **kw)


def job_ids(srv: Server, key: str) -> set[str]:
    with srv.client() as c:
        return {j["id"] for j in c.get("/jobs", params={"limit": 1000},
                                       headers=bearer(key)).json()["jobs"]}


# ---- SSRF ---------------------------------------------------------------------------------------
def test_every_reported_ssrf_callback_url_is_400_at_submit(hostile: Server, short_clip: Clip) -> None:
    before = job_ids(hostile, KEY_A)
    for url in SSRF_URLS:
        r = post_as(hostile, KEY_A, data={"callback_url": url},
                 files={"file": (short_clip.path.name, short_clip.path.read_bytes())})
        assert r.status_code == 400, (url, r.text)
        err = r.json()["error"]
        assert err["field"] == "callback_url" and "127." not in err["message"], err
        assert r.headers["x-should-retry"] == "false"
    assert job_ids(hostile, KEY_A) == before  # nothing was accepted


# ---- clients that retry ---------------------------------------------------------------------------
def sdk(srv: Server, key: str, seen: list[object]) -> openai.OpenAI:
    """The real OpenAI client with its default retries; every HTTP request it makes is seen."""
    http = openai.DefaultHttpxClient(event_hooks={"request": [seen.append]}, timeout=600)
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key=key, http_client=http)


def named(srv: Server, key: str, filename: str) -> list[dict[str, Any]]:
    with srv.client() as c:
        jobs = c.get("/jobs", params={"limit": 1000}, headers=bearer(key)).json()["jobs"]
    return [j for j in jobs if j["filename"] == filename]


def test_openai_sdk_makes_one_job_for_audio_that_fails_later(hostile: Server) -> None:
    """Accepted on its header, failed when decoded: a 413 that says not to retry, one request,
    one job (it used to be a 500, retried twice: three jobs)."""
    seen: list[object] = []
    with pytest.raises(openai.APIStatusError) as info:
        sdk(hostile, KEY_B, seen).audio.transcriptions.create(
            model="whisper-1", file=("liar.flac", lying_flac()))
    err = info.value
    assert err.status_code == 413 and err.response.headers["x-should-retry"] == "false"
    assert err.code == "payload_too_large" and f"{MAX_AUDIO_S:.0f} s" in err.message
    assert len(seen) == 1
    [job] = named(hostile, KEY_B, "liar.flac")
    assert job["status"] == "failed" and job["error"]["type"] == "payload_too_large"
    body = err.body  # the client sees no exception text and no server path
    assert isinstance(body, dict), body
    assert "Error" not in body["message"] and "/tmp" not in body["message"], body


def test_a_sample_rate_change_mid_stream_decodes(hostile: Server) -> None:
    """Two MP3s of different rates joined pass the probe; the rate change mid-stream once
    raised a bare ValueError in the resampler (a 500 on /v1). The decoder now starts a new
    resampler there: one request, one answer, no error."""
    seen: list[object] = []
    out = sdk(hostile, KEY_B, seen).audio.transcriptions.create(
        model="whisper-1", file=("rates2.mp3", rate_change_mp3()))
    assert isinstance(out.text, str) and len(seen) == 1


def test_undecodable_upload_is_422_with_no_retry(hostile: Server) -> None:
    header_only = header_only_wav(1.0)
    for path in ("/transcribe", "/v1/audio/transcriptions"):
        with hostile.client() as c:
            r = c.post(path, files={"file": ("h.wav", header_only)},
                       data={"model": "whisper-1"}, headers=bearer(KEY_B))
        assert r.status_code == 422 and r.headers["x-should-retry"] == "false", (path, r.text)


# ---- caps -----------------------------------------------------------------------------------------
def test_form_parts_are_capped(hostile: Server, short_clip: Clip) -> None:
    data = short_clip.path.read_bytes()
    two = [("file", ("a.flac", data)), ("file", ("b.flac", data))]
    with hostile.client() as c:
        r = c.post("/transcribe", files=two, headers=bearer(KEY_A))
        assert r.status_code == 400 and "files" in r.json()["error"]["message"], r.text
        assert r.headers["x-should-retry"] == "false"
        r = c.post("/transcribe", files=[("file", ("a.flac", data))],
                   data={f"f{i}": "x" for i in range(40)}, headers=bearer(KEY_A))
        assert r.status_code == 400 and "fields" in r.json()["error"]["message"], r.text
        r = c.post("/v1/audio/transcriptions", files=two, data={"model": "whisper-1"},
                   headers=bearer(KEY_A))
        assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param",
                                                                  "code"}


def long_speech(clips: list[Clip], seconds: float) -> bytes:
    parts, total = [], 0.0
    for c in sorted((c for c in clips if c.set == "ljspeech"), key=lambda c: c.id):
        parts.append(decode(c.path, 3600.0))
        total += c.duration_s
        if total >= seconds:
            break
    return wav(np.concatenate(parts), 16000)


def test_event_streams_are_capped_per_key(hostile: Server, clips: list[Clip],
                                          short_clip: Clip) -> None:
    mine = post_as(hostile, KEY_A, data={"language": "en"}, wait=True,
                files={"file": (short_clip.path.name, short_clip.path.read_bytes())})
    assert mine.status_code == 200, mine.text
    # Long enough (~270 s of speech, seconds of work) to still be running when cancelled.
    r = post_as(hostile, KEY_B, data={"language": "en"},
             files={"file": ("long.wav", long_speech(clips, MAX_AUDIO_S - 20))})
    assert r.status_code == 202, r.text
    job_id = r.json()["id"]
    got: list[list[str]] = []

    def listen() -> None:
        events: list[str] = []
        got.append(events)
        with httpx.Client(base_url=hostile.url, timeout=120) as c, \
                c.stream("GET", f"/jobs/{job_id}/events", headers=bearer(KEY_B)) as s:
            for line in s.iter_lines():  # one at a time: the test watches them arrive
                if line.startswith("event: "):
                    events.append(line[7:])

    readers = [threading.Thread(target=listen) for _ in range(STREAMS_PER_KEY)]
    for t in readers:
        t.start()
    with hostile.client() as c:
        deadline = time.monotonic() + 30  # a hang guard: until both streams have an event
        while not (len(got) == STREAMS_PER_KEY and all(got)) and time.monotonic() < deadline:
            time.sleep(0.02)
        r = c.get(f"/jobs/{job_id}/events", headers=bearer(KEY_B))
        assert r.status_code == 429, r.text
        assert r.json()["error"]["limit"] == "max_event_streams_per_key" and r.headers["retry-after"]
        # Another key's streams are its own: A watches its own (finished) job meanwhile.
        r = c.get(f"/jobs/{mine.json()['id']}/events", headers=bearer(KEY_A))
        assert r.status_code == 200 and "event: done" in r.text
        assert c.delete(f"/jobs/{job_id}", headers=bearer(KEY_B)).status_code == 200
    for t in readers:
        t.join(60)
    assert all(events[-1] == "cancelled" for events in got), got
    with hostile.client() as c:  # the closed streams gave their slots back
        r = c.get(f"/jobs/{job_id}/events", headers=bearer(KEY_B))
        assert r.status_code == 200 and "event: cancelled" in r.text


def test_control_characters_in_file_names(hostile: Server, short_clip: Clip) -> None:
    """A raw NUL (clients percent-encode it; a hostile one need not) and a right-to-left
    override: the job keeps a clean display name."""
    data = short_clip.path.read_bytes()
    body = (b'--b\r\nContent-Disposition: form-data; name="file"; filename="a\x00b\xe2\x80\xaec.flac"'
            b"\r\nContent-Type: audio/flac\r\n\r\n" + data + b'\r\n--b\r\nContent-Disposition: '
            b'form-data; name="language"\r\n\r\nen\r\n--b--\r\n')
    with hostile.client() as c:
        r = c.post("/transcribe", params={"wait": "true"}, content=body,
                   headers={"content-type": "multipart/form-data; boundary=b", **bearer(KEY_A)})
    assert r.status_code == 200, r.text
    assert r.json()["filename"] == "abc.flac" and r.json()["status"] == "done"


# ---- fairness across keys ------------------------------------------------------------------------
@dataclass
class Phases:
    """One of B's requests: total latency, then its job's own timings."""

    total_s: float
    accepted_s: float  # request start -> job row committed (HTTP, probe, admission)
    queue_wait_s: float  # committed -> claimed (the store's claim order)
    processing_s: float  # claimed -> done (prep, batcher, engine)
    status: int
    batches: int = 0  # engine batches that ran from the post to the answer
    windows: int = 0  # windows those batches transcribed


@dataclass
class Flood:
    idle: list[Phases]
    loaded: list[Phases]
    flood: list[httpx.Response]

    @staticmethod
    def median(runs: list[Phases], what: str) -> float:
        return statistics.median(getattr(r, what) for r in runs)


def engine_batches(srv: Server) -> tuple[int, int]:
    with srv.client() as c:
        text = c.get("/metrics").text
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    batches = sum(s.value for s in fams["batchscribe_batches"].samples if s.name.endswith("_total"))
    windows = sum(s.value for s in fams["batchscribe_batch_size_windows"].samples
                  if s.name.endswith("_sum"))
    return int(batches), int(windows)


def timed(srv: Server, key: str, clip: Clip) -> Phases:
    before = engine_batches(srv)
    start = time.time()
    r = post_as(srv, key, data={"language": "en"}, wait=True,
             files={"file": (clip.path.name, clip.path.read_bytes())})
    total = time.time() - start
    after = engine_batches(srv)
    batches, windows = after[0] - before[0], after[1] - before[1]
    if r.status_code != 200:
        return Phases(total, 0, 0, 0, r.status_code, batches, windows)
    job = r.json()
    return Phases(total, job["created_at"] - start, job["queue_wait_s"] or 0,
                  job["processing_s"] or 0, r.status_code, batches, windows)


@pytest.fixture(scope="module")
def flooded(hostile: Server, short_clip: Clip) -> Flood:
    """Key A floods 1 s clips (each a padded 10 s window plus a language detection) from six
    threads that retry 20 ms after a 429 (a hostile client ignores Retry-After); key B sends
    its usual request five times idle, then five times under the flood."""
    tiny = wav(decode(short_clip.path, 3600.0)[:16000], 16000)  # speech: it costs a window
    timed(hostile, KEY_B, short_clip)  # warm-up
    idle = [timed(hostile, KEY_B, short_clip) for _ in range(5)]
    stop = threading.Event()
    outcomes: list[httpx.Response] = []

    def flood() -> None:
        with hostile.client(timeout=60) as c:
            while not stop.is_set():
                r = c.post("/transcribe", files={"file": ("tiny.wav", tiny)}, headers=bearer(KEY_A))
                outcomes.append(r)
                if r.status_code == 429:
                    time.sleep(0.02)

    flooders = [threading.Thread(target=flood) for _ in range(6)]
    for t in flooders:
        t.start()
    try:
        time.sleep(2.0)  # A's share of the queue fills
        loaded = [timed(hostile, KEY_B, short_clip) for _ in range(5)]
    finally:
        stop.set()
        for t in flooders:
            t.join(60)
    run = Flood(idle, loaded, outcomes)
    refused = sum(1 for r in outcomes if r.status_code == 429)
    for name in ("total_s", "accepted_s", "queue_wait_s", "processing_s", "batches", "windows"):
        print(f"B {name}: idle median {Flood.median(idle, name):.2f}, under A's flood "
              f"{Flood.median(loaded, name):.2f} ({[round(getattr(p, name), 2) for p in loaded]})")
    print(f"A: {len(outcomes)} requests, {len(outcomes) - refused} accepted, {refused} refused")
    return run


def test_a_key_flooding_tiny_jobs_is_limited_and_another_key_is_not(flooded: Flood) -> None:
    """The admission side: A's excess gets 429 naming its per-key limit, with Retry-After; B
    never gets a 429 and every request of B finishes."""
    assert [p.status for p in flooded.idle + flooded.loaded] == [200] * 10
    refused = [r for r in flooded.flood if r.status_code == 429]
    assert refused, "A was never limited"
    assert {r.json()["error"]["limit"] for r in refused} <= {"max_queued_jobs_per_key",
                                                            "max_queued_s_per_key"}
    assert all(int(r.headers["retry-after"]) >= 1 for r in refused)
    assert {r.status_code for r in flooded.flood} <= {202, 429}


def test_another_key_waits_only_for_what_as_limit_admits(flooded: Flood) -> None:
    """The service is not taken away from B: the engine work done between B's post and its
    answer (windows transcribed, every tenant's) stays within B's own plus what A's per-key
    limit lets into the batcher: the batch running when B arrives and the one B rides in.

    Counted in windows, not seconds: this check used to be B's wall latency within 3x its idle
    latency, which held alone (0.63 s vs 0.38 s) but failed once in CI (1.60 s vs 0.53 s) with
    the two other test workers on the same 2 cores, so it measured the neighbours. Windows do
    not depend on them, and they still tell the failure apart: with A's limit raised from 6 to
    400 jobs each of B's requests waited for 49 windows in 4 batches (7.7 s); with it, 1-7."""
    idle = Flood.median(flooded.idle, "windows")
    loaded = Flood.median(flooded.loaded, "windows")
    assert idle >= 1, flooded.idle  # B's own clip is one window or more
    assert loaded <= idle + 2 * JOBS_PER_KEY, (loaded, idle, [p.windows for p in flooded.loaded])
