"""Backpressure: a burst of 10x capacity on a service with a small backlog bound.

Capacity here is ``limits.max_backlog_s`` (60 s of queued audio); the burst is 600 s of speech
from 16 concurrent clients. Early uploads are accepted and all finish; later ones get 429 with a
``Retry-After`` and a JSON body naming the limit; nothing else fails (no 5xx, no dropped
connection); /healthz keeps answering; and the server's RSS, sampled from /proc, stays under the
budget (``BATCHSCRIBE_TEST_RSS_BUDGET_MB``, default 3072: the idle service is ~1.3 GB on CPU).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import httpx
import pytest
from prometheus_client import CollectorRegistry, Counter

from app.jobs.speed import DEFAULT_SPEED, Speed
from loadtest.lib.common import proc_status_kb
from loadtest.lib.corpus import Clip
from tests.conftest import COLD, Server
from tests.helpers import wait_until
from tests.test_bad_input import HealthWatch
from tests.test_crash import speech_clips, submit

BACKLOG_S = 60.0
BURST_FACTOR = 10
RSS_BUDGET = int(os.environ.get("BATCHSCRIBE_TEST_RSS_BUDGET_MB", "3072")) * 1024 * 1024


class RssSampler(threading.Thread):
    """VmRSS of one pid every 0.2 s, read from /proc (what the kernel and the OOM killer see)."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid = pid
        self.stop = threading.Event()
        self.samples: list[int] = []

    def run(self) -> None:
        while not self.stop.wait(0.2):
            kb = proc_status_kb(self.pid, "VmRSS")
            if kb is None:  # the process is gone
                return
            self.samples.append(kb * 1024)


class BacklogWatch(threading.Thread):
    """The backlog gauge, scraped every 0.2 s: the bound must hold at every instant."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.stop = threading.Event()
        self.values: list[float] = []

    def run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=10) as c:
            while not self.stop.wait(0.2):
                for line in c.get("/metrics").text.splitlines():
                    if line.startswith("batchscribe_backlog_audio_seconds "):
                        self.values.append(float(line.split()[1]))


@pytest.fixture(scope="module")
def bounded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One small-backlog service for the module (it was one per test: the burst test leaves
    nothing queued, every accepted job is awaited)."""
    srv = Server(tmp_path_factory.mktemp("bounded"), env={**COLD,
        "BATCHSCRIBE_LIMITS__MAX_BACKLOG_S": str(BACKLOG_S),
        "BATCHSCRIBE_LIMITS__SYNC_TIMEOUT_S": "0.5",
    }).start()
    yield srv
    srv.kill()


def burst_of(clips: list[Clip], audio_s: float) -> list[Clip]:
    pool = speech_clips(clips, 200)
    out: list[Clip] = []
    while sum(c.duration_s for c in out) < audio_s:
        out.append(pool[len(out) % len(pool)])
    return out


@pytest.mark.model
def test_burst_of_10x_capacity(bounded: Server, clips: list[Clip]) -> None:
    assert bounded.proc is not None
    burst = burst_of(clips, BACKLOG_S * BURST_FACTOR)
    rss = RssSampler(bounded.proc.pid)
    health = HealthWatch(bounded.url)
    backlog = BacklogWatch(bounded.url)
    for watcher in (rss, health, backlog):
        watcher.start()

    def one(clip: Clip) -> tuple[Clip, httpx.Response | Exception]:
        try:
            with bounded.client(timeout=120) as c:
                return clip, submit(c, clip)
        except httpx.HTTPError as exc:
            return clip, exc

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, burst))
    errors = [r for _, r in results if isinstance(r, Exception)]
    assert not errors, errors
    responses = [(c, r) for c, r in results if isinstance(r, httpx.Response)]
    assert not [r.text for _, r in responses if r.status_code not in (202, 429)]
    accepted = {r.json()["id"]: c for c, r in responses if r.status_code == 202}
    rejected = [r for _, r in responses if r.status_code == 429]
    print(f"burst: {len(burst)} uploads, {sum(c.duration_s for c in burst):.0f} s of audio; "
          f"{len(accepted)} accepted ({sum(c.duration_s for c in accepted.values()):.0f} s), "
          f"{len(rejected)} rejected")
    assert accepted and rejected
    for r in rejected:
        retry = int(r.headers["retry-after"])
        err = r.json()["error"]
        assert retry >= 1 and err["retry_after_s"] == retry, r.text
        assert err["type"] == "overloaded" and err["limit_s"] == BACKLOG_S

    # Everything accepted finishes, with its own text (nothing accepted is lost).
    with bounded.client() as c:
        def all_done() -> bool:
            return all(c.get(f"/jobs/{i}").json()["status"] == "done" for i in accepted)

        assert wait_until(all_done, 600), bounded.log()
        for job_id, clip in accepted.items():
            text = c.get(f"/jobs/{job_id}").json()["result"]["text"]
            assert text.strip(), clip.id
    for watcher in (rss, health, backlog):
        watcher.stop.set()
        watcher.join(15)
    rss_peak = max(rss.samples)
    print(f"RSS: start {rss.samples[0] / 2**20:.0f} MiB, peak {rss_peak / 2**20:.0f} MiB, "
          f"budget {RSS_BUDGET / 2**20:.0f} MiB; /healthz answered {health.ok} times")
    assert rss_peak < RSS_BUDGET
    # Concurrent uploads never overshoot the bound: when each job was accepted, the audio of
    # the accepted jobs not yet finished fitted (each clip is one window, so a job's audio
    # leaves the backlog when it finishes). 1 s slack: the decoded length replaces the header's.
    with bounded.client() as c:
        rows = [c.get(f"/jobs/{i}").json() for i in accepted]
    peak = max(sum(j["audio_seconds"] for j in rows
                   if j["created_at"] <= k["created_at"] < j["finished_at"]) for k in rows)
    print(f"backlog at admissions: peak {peak:.1f} s of {BACKLOG_S:.0f} s; gauge peak "
          f"{max(backlog.values):.1f} s")
    assert peak <= BACKLOG_S + 1.0
    assert health.failures == [] and health.ok > 0


@pytest.mark.model
def test_sync_timeout_answers_202_and_the_job_continues(bounded: Server, clips: list[Clip]) -> None:
    """?wait=true past limits.sync_timeout_s (0.5 s here): 202 with the job, which still runs."""
    longest = max((c for c in clips if c.duration_s < BACKLOG_S), key=lambda c: c.duration_s)
    with bounded.client() as c:
        r = submit(c, longest, wait=True)  # ~1 min of audio: more than 0.5 s of work on any host
        assert r.status_code == 202, r.text
        body = r.json()
        assert body["status"] in ("queued", "running")
        assert r.headers["location"].endswith(body["id"])
        assert wait_until(lambda: c.get(f"/jobs/{body['id']}").json()["status"] == "done", 300)


def test_retry_after_follows_the_current_speed() -> None:
    """Retry-After = excess audio / throughput, throughput measured over recent batches."""
    reg = CollectorRegistry()
    audio, busy = Counter("a", "", registry=reg), Counter("b", "", registry=reg)
    speed = Speed(SimpleNamespace(audio_processed=audio, processing=busy),  # type: ignore[arg-type]
                  lambda: 2)
    assert speed.retry_after_s(100) == 10  # nothing measured yet: assume 10x realtime
    audio.inc(100)
    busy.inc(10)  # 10x realtime per worker, 2 workers: 20 audio s per second
    speed._recent.clear()
    assert speed.retry_after_s(200) == 10
    t, a, b = speed._recent[0]
    speed._recent[0] = (t - 2, a, b)  # that sample is now 2 s old, so the next call records one
    audio.inc(100)
    busy.inc(50)  # the engine slowed down to 2x realtime per worker: 4 audio s per second now
    assert speed.retry_after_s(200) == 50  # the whole run's average would say 20
    assert speed.retry_after_s(10**9) == 3600  # capped


def test_speed_is_not_judged_before_any_audio_is_decoded() -> None:
    """Encoder calls count their engine time before their windows' audio is counted (at the
    decode): right after a start the whole run read ~0x, and /v1 refused a 1 s clip (413)."""
    reg = CollectorRegistry()
    audio, busy = Counter("a", "", registry=reg), Counter("b", "", registry=reg)
    speed = Speed(SimpleNamespace(audio_processed=audio, processing=busy),  # type: ignore[arg-type]
                  lambda: 2)
    busy.inc(0.5)  # the first encoder call ended, nothing decoded yet
    assert speed.now() == DEFAULT_SPEED
    busy.inc(7.5)
    audio.inc(1.5)  # one short window decoded beside 8 s of encoder time
    assert speed.now() == DEFAULT_SPEED
    audio.inc(78.5)  # enough measured: 80 audio s over 7.5 busy s since the first reading
    assert speed.now() == pytest.approx(2 * 80 / 7.5)
