"""Issue 38 item 2: each API key's webhook deliveries are signed with that key's own secret.

Through real HTTP on a keyed app with a fake engine: tenant A points a job at tenant B's
receiver; B, verifying with B's secret (GET /webhooks/secret with B's key), rejects it; the
body names A's key id, and A's secret verifies it. B's own deliveries verify with B's secret.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from app.jobs.webhooks import key_secret, verify
from loadtest.lib.corpus import Clip
from tests.helpers import bearer, fake_service, sha
from tests.test_webhooks import Hit, Receiver

KEY_A, KEY_B = "tenant-a-key", "tenant-b-key"
SERVER_SECRET = "the-server-webhook-secret"


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with fake_service(tmp_path_factory.mktemp("tenanthooks"), webhooks={"secret": SERVER_SECRET},
                      security={"api_key_sha256": [sha(KEY_A), sha(KEY_B)]},
                      outbound={"allowed_hosts": ["127.0.0.1"]}) as base:
        yield base


@pytest.fixture
def receiver_b() -> Iterator[Receiver]:
    rx = Receiver(fail_first=False).start()
    yield rx
    rx.stop()


def delivered(rx: Receiver, job_id: str, timeout: float = 60) -> Hit:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if hits := rx.for_job(job_id):
            return hits[0]
        time.sleep(0.1)
    raise AssertionError(f"no delivery for job {job_id}")


def submit(url: str, key: str, path: Path, callback: str) -> str:
    with path.open("rb") as f:
        r = httpx.post(url + "/transcribe", files={"file": (path.name, f)}, headers=bearer(key),
                       data={"language": "en", "callback_url": callback}, timeout=60)
    assert r.status_code == 202, r.text
    return str(r.json()["id"])


def secret_of(url: str, key: str) -> tuple[str, str]:
    r = httpx.get(url + "/webhooks/secret", headers=bearer(key))
    assert r.status_code == 200, r.text
    return r.json()["key_id"], r.json()["secret"]


def test_b_rejects_a_delivery_signed_for_a(url: str, clips: list[Clip],
                                           receiver_b: Receiver) -> None:
    clip = min((c for c in clips if c.duration_s > 3), key=lambda c: c.duration_s)
    id_a, secret_a = secret_of(url, KEY_A)
    id_b, secret_b = secret_of(url, KEY_B)
    assert len({secret_a, secret_b, SERVER_SECRET}) == 3 and id_a != id_b
    assert secret_a == key_secret(SERVER_SECRET, id_a)
    assert httpx.get(url + "/webhooks/secret").status_code == 401

    hit = delivered(receiver_b, submit(url, KEY_A, clip.path, receiver_b.url))
    ts, sig = hit.headers["X-Batchscribe-Timestamp"], hit.headers["X-Batchscribe-Signature"]
    assert not verify(secret_b, hit.body, ts, sig)  # B's receiver rejects it
    assert not verify(SERVER_SECRET, hit.body, ts, sig)  # nor does the server's secret sign it
    assert verify(secret_a, hit.body, ts, sig)  # it was signed for A, and says so
    assert hit.job["key_id"] == id_a and hit.headers["X-Batchscribe-Key-Id"] == id_a

    own = delivered(receiver_b, submit(url, KEY_B, clip.path, receiver_b.url))
    assert verify(secret_b, own.body, own.headers["X-Batchscribe-Timestamp"],
                  own.headers["X-Batchscribe-Signature"])
    assert own.job["key_id"] == id_b
