"""Issue 51, item 1 and the webhook rows of item 5: outbound requests one tenant cannot take.

Through real HTTP on a keyed app with a fake engine, against real local servers:

* key A posts 64 ``audio_url`` jobs at a server answering 200 with a 50 MB ``Content-Length``
  and then a byte a second: 16 accepted, 48 refused (the per-key transfer cap); key B's
  ``audio_url`` job at a normal file server *on the same address* is done within 10 s of its
  POST while A's downloads trickle, and each of A's 16 jobs fails with the rate rule's error
  naming the host, cut off (not left to hang); the metrics show A's fetches in flight (within
  its share at one address) and the cut-offs by rule;
* key A's webhook deliveries hang at a receiver that never answers, under two names of the
  address B's receiver uses too: A holds its share of that address's slots whatever the names,
  and B's delivery goes out at once (host slots keyed by address, a per-key share of them).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from loadtest.lib.corpus import Clip
from tests.helpers import bearer, fake_service, samples, sha
from tests.test_shared_slots import Origin
from tests.test_webhooks import Receiver

KEY_A, KEY_B = "fetch-key-a", "fetch-key-b"
OWNER_A = sha(KEY_A)[:16]
GRACE_S = 3.0  # the rate rule's grace here (10 s by default): four waves of A's cut-offs
PROMISE_S = 10.0  # the bound on B's job, POST to done


class Files(Origin):
    """tests/test_shared_slots.py's file server declaring 50 MB for ``/trickle``, named
    ``localhost`` in its base URL (the name the error must show)."""

    def __init__(self, clip: bytes) -> None:
        super().__init__("127.0.0.1", clip, declared=50 * 1000 * 1000)
        self.base = self.base.replace("127.0.0.1", "localhost")


@pytest.fixture(scope="module")
def clip(clips: list[Clip]) -> Clip:
    return min((c for c in clips if c.duration_s > 3), key=lambda c: c.duration_s)


@pytest.fixture
def url(tmp_path: Path) -> Iterator[str]:
    """Defaults but for the rate rule's grace, and webhooks' deadline (a long one: a delivery
    stuck behind A's would miss the bound by far)."""
    with fake_service(
            tmp_path, security={"api_key_sha256": [sha(KEY_A), sha(KEY_B)]},
            outbound={"allowed_hosts": ["localhost", "127.0.0.1"], "fetch_rate_grace_s": GRACE_S},
            webhooks={"secret": "fetch-limits-secret", "timeout_s": 60.0}) as base:
        yield base


def in_flight(url: str, kind: str, owner: str) -> float:
    found = samples(httpx.get(url + "/metrics").text).get("batchscribe_outbound_in_flight", [])
    return sum(v for labels, v in found if labels == {"kind": kind, "key": owner})


def test_b_is_done_in_10_s_while_a_trickles_and_a_is_cut_off(url: str, clip: Clip) -> None:
    files = Files(clip.path.read_bytes())
    try:
        with httpx.Client(base_url=url, timeout=60) as c:
            answers = [c.post("/transcribe", json={"audio_url": files.base + "/trickle"},
                              headers=bearer(KEY_A)) for _ in range(64)]
            codes = [r.status_code for r in answers]
            assert codes.count(202) == 16 and codes.count(429) == 48, codes
            assert {r.json()["error"]["limit"] for r in answers if r.status_code == 429} == {
                "max_transfers_per_key"}
            a_jobs = [r.json()["id"] for r in answers if r.status_code == 202]
            deadline = time.monotonic() + 30
            while files.trickling < 4:  # A's share at this address: the rest of A's wait
                assert time.monotonic() < deadline, files.trickling
                time.sleep(0.05)
            time.sleep(3.0 - GRACE_S / 2)  # "three seconds later", before any cut-off
            held = in_flight(url, "fetch", OWNER_A)
            t0 = time.monotonic()
            r = c.post("/transcribe", json={"audio_url": files.base + "/clip", "language": "en"},
                       params={"wait": "true"}, headers=bearer(KEY_B))
            took = time.monotonic() - t0
            assert r.status_code == 200 and r.json()["status"] == "done", r.text
            assert took <= PROMISE_S, took
            assert 1 <= held <= 4, held  # outbound.max_per_host_per_key

            def ended() -> list[dict[str, object]]:
                jobs = [c.get(f"/jobs/{j}", headers=bearer(KEY_A)).json() for j in a_jobs]
                return [j for j in jobs if j["status"] not in ("fetching", "queued")]

            deadline = time.monotonic() + 16 / 4 * (GRACE_S + 2) + 20
            while len(done := ended()) < len(a_jobs):
                assert time.monotonic() < deadline, [j["status"] for j in done]
                time.sleep(0.5)
            for job in done:
                assert job["status"] == "failed", job
                error = job["error"]
                assert isinstance(error, dict) and error["rule"] == "min_fetch_rate_bytes_s", job
                assert "localhost" in error["message"] and "cut off" in error["message"], error
            cut = samples(c.get("/metrics").text).get("batchscribe_outbound_cut_off_total", [])
            assert ({"kind": "fetch", "rule": "min_rate"}, 16.0) in cut, cut
            assert in_flight(url, "fetch", OWNER_A) == 0
    finally:
        files.close()


def test_a_keys_hanging_webhooks_leave_b_its_delivery(url: str, clip: Clip) -> None:
    files = Files(b"")
    rx = Receiver(fail_first=False).start()
    try:
        with httpx.Client(base_url=url, timeout=60) as c:
            def post(key: str, callback: str) -> str:
                with clip.path.open("rb") as f:
                    r = c.post("/transcribe", files={"file": (clip.path.name, f)}, headers=bearer(key),
                               data={"language": "en", "callback_url": callback})
                assert r.status_code == 202, r.text
                return str(r.json()["id"])

            for k in range(20):  # two names of one address: one destination's slots
                post(KEY_A, files.base.replace("localhost", "127.0.0.1" if k % 2 else "localhost")
                     + "/hang")
            deadline = time.monotonic() + 60
            while files.hanging < 4:
                assert time.monotonic() < deadline, files.hanging
                time.sleep(0.05)
            time.sleep(1.0)
            held = in_flight(url, "webhook", OWNER_A)
            job_b = post(KEY_B, rx.url)  # 127.0.0.1, as half of A's
            c.get(f"/jobs/{job_b}", params={"wait": "true"}, headers=bearer(KEY_B))
            t0 = time.monotonic()
            while not rx.for_job(job_b):
                assert time.monotonic() - t0 < PROMISE_S, "B's delivery waited behind A's"
                time.sleep(0.05)
            assert held == 4 and files.hanging == 4  # A never got past its share
    finally:
        files.close()
        rx.stop()
