"""Webhooks: signing, durable at-least-once delivery with backoff, the outbound guard on every
attempt (submit-time and connect-time checks, deadline, bounded reads), and end to end on the
model."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import SecretStr

from app.config import OutboundSettings, Settings, WebhookSettings
from app.errors import BadRequest
from app.jobs.store import JobStore
from app.jobs.webhooks import WebhookDispatcher, check_callback_url, sign, verify
from app.net.outbound import OutboundGuard
from loadtest.lib.corpus import READ_SPEECH, Clip
from tests.conftest import COLD, Server
from tests.test_outbound import PUBLIC, stub

SECRET = "test-webhook-secret"


@dataclass
class Hit:
    headers: dict[str, str]
    body: bytes
    status: int

    @property
    def job(self) -> dict[str, Any]:
        return dict(json.loads(self.body))


@dataclass
class Receiver:
    """A real HTTP receiver: the first attempt per delivery gets 500 when ``fail_first``."""

    fail_first: bool = True
    fail_all: bool = False
    hits: list[Hit] = field(default_factory=list)
    server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.server_address[1]}/hook"

    def start(self) -> Receiver:
        rx = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                delivery = self.headers.get("X-Batchscribe-Delivery", "")
                seen = any(h.headers.get("X-Batchscribe-Delivery") == delivery for h in rx.hits)
                status = 500 if rx.fail_all or (rx.fail_first and not seen) else 200
                rx.hits.append(Hit(dict(self.headers), body, status))
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *_: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self.server:
            self.server.shutdown()
            self.server.server_close()

    def for_job(self, job_id: str) -> list[Hit]:
        return [h for h in self.hits if h.headers.get("X-Batchscribe-Delivery") == job_id]


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    rx = Receiver().start()
    yield rx
    rx.stop()


def signature_ok(hit: Hit, secret: str = SECRET) -> bool:
    """Checked independently of app.jobs.webhooks: HMAC-SHA256 over "timestamp.body" (with keys,
    ``secret`` is the key's own, from ``GET /webhooks/secret``)."""
    ts = hit.headers["X-Batchscribe-Timestamp"]
    mac = hmac.new(secret.encode(), ts.encode() + b"." + hit.body, hashlib.sha256).hexdigest()
    fresh = abs(time.time() - int(ts)) < 300
    return fresh and hmac.compare_digest(hit.headers["X-Batchscribe-Signature"], f"sha256={mac}")


# ---- signing and validation ------------------------------------------------------------------
def test_sign_and_verify() -> None:
    body, now = b'{"id":"x"}', int(time.time())
    sig = sign(SECRET, now, body)
    assert sig.startswith("sha256=") and verify(SECRET, body, str(now), sig)
    assert not verify(SECRET, body + b" ", str(now), sig)  # tampered body
    assert not verify("other", body, str(now), sig)  # wrong secret
    assert not verify(SECRET, body, str(now - 3600), sign(SECRET, now - 3600, body))  # replay
    assert not verify(SECRET, body, None, sig) and not verify(SECRET, body, "soon", sig)


async def test_callback_url_checks() -> None:
    on = WebhookSettings(secret=SecretStr(SECRET))
    public = OutboundGuard(OutboundSettings(), resolver=stub([PUBLIC]))
    assert await check_callback_url(on, public, " https://example.com/h ") == "https://example.com/h"
    assert await check_callback_url(on, public, "") is None
    for bad in ("ftp://example.com/h", "/relative", "http://", "http://exa mple.com/",
                "http://example.com/\x00"):
        with pytest.raises(BadRequest):
            await check_callback_url(on, public, bad)
    with pytest.raises(BadRequest, match="off"):
        await check_callback_url(WebhookSettings(), public, "https://example.com/h")
    await public.aclose()


async def test_callback_url_allow_list_and_its_old_name() -> None:
    """webhooks.allowed_hosts (the old setting) still works: it joins outbound.allowed_hosts."""
    settings = Settings(webhooks={"secret": SECRET,  # type: ignore[arg-type]
                                  "allowed_hosts": ["hooks.example.com", ".corp.example"]})
    assert settings.outbound.allowed_hosts == ["hooks.example.com", ".corp.example"]
    listed = OutboundGuard(settings.outbound, resolver=stub([PUBLIC]))
    for ok in ("https://hooks.example.com/h", "https://HOOKS.example.com./h",
               "https://corp.example/h", "http://a.b.corp.example:8080/h"):
        assert await check_callback_url(settings.webhooks, listed, ok) == ok
    for bad in ("https://example.com/h", "https://evil-hooks.example.com/h",
                "https://hooks.example.com.evil.net/h", "https://xcorp.example/h",
                "http://169.254.169.254/latest/meta-data", "http://127.0.0.1:8000/h"):
        with pytest.raises(BadRequest, match="not allowed"):
            await check_callback_url(settings.webhooks, listed, bad)
    await listed.aclose()


def local_guard() -> OutboundGuard:
    """The receivers here listen on 127.0.0.1, which the guard refuses unless listed."""
    return OutboundGuard(OutboundSettings(allowed_hosts=["127.0.0.1"]))


# ---- the dispatcher on a real store, no model --------------------------------------------------
async def new_job(store: JobStore, job_id: str, url: str | None) -> None:
    await store.insert(id=job_id, owner=None, status="running", created_at=time.time(),
                       filename="a.wav", upload_path="/nonexistent", options={},
                       audio_seconds=1.0, windows_done=0, attempts=1, callback_url=url)


async def until(store: JobStore, job_id: str, statuses: tuple[str, ...], limit: float = 30) -> Any:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        row = await store.get(job_id)
        if row is not None and row.webhook_status in statuses:
            return row
        await asyncio.sleep(0.05)
    raise AssertionError(f"webhook of {job_id} never reached {statuses}")


async def test_dispatcher_retries_then_delivers_once(tmp_path: Path, receiver: Receiver) -> None:
    store = JobStore(f"sqlite+aiosqlite:///{tmp_path / 'jobs.db'}")
    await store.init()
    hooks = WebhookDispatcher(WebhookSettings(secret=SecretStr(SECRET), backoff_s=0.05), store,
                              local_guard())
    hooks.start()
    try:
        await new_job(store, "j-failed", receiver.url)
        await new_job(store, "j-cancelled", receiver.url)
        await new_job(store, "j-nourl", None)
        assert await store.finish("j-failed", None, "failed", 3600,
                                  error={"type": "transcription_failed", "message": "boom"})
        await store.finish("j-cancelled", None, "cancelled", 3600)
        await store.finish("j-nourl", None, "done", 3600)
        hooks.wake()
        row = await until(store, "j-failed", ("delivered",))
        assert row.webhook_attempts == 2 and row.webhook_last_error is None
        hits = receiver.for_job("j-failed")
        assert [h.status for h in hits] == [500, 200]
        assert all(signature_ok(h) for h in hits)
        assert [h.headers["X-Batchscribe-Attempt"] for h in hits] == ["1", "2"]
        assert hits[-1].job["status"] == "failed" and hits[-1].job["error"]["message"] == "boom"
        assert hits[-1].headers["X-Batchscribe-Event"] == "job.failed"
        nourl = await store.get("j-nourl")
        assert not receiver.for_job("j-cancelled") and nourl is not None and nourl.webhook_status is None
    finally:
        await hooks.stop()
        await hooks.guard.aclose()
        await store.close()


async def test_a_stop_that_lands_as_the_dispatcher_wakes_still_stops_it(tmp_path: Path) -> None:
    """A wake and a stop in the same loop turn: the dispatcher's wait used asyncio.wait_for,
    which on Python 3.11 returns normally when the cancel lands as its event is set, so the
    cancel was lost and stop() waited on a loop that went on (a 900 s hang of
    tests/test_webhooks_guard.py, 2 runs in 12)."""
    store = JobStore(f"sqlite:///{tmp_path / 'jobs.db'}")
    await store.init()
    hooks = WebhookDispatcher(WebhookSettings(secret=SecretStr(SECRET)), store, local_guard())
    hooks.start()
    try:
        await asyncio.sleep(0.2)  # its first pass is done: it waits for a wake
        hooks.wake()
        await asyncio.wait_for(hooks.stop(), 10)  # cancels at once, in the same turn
    finally:
        await hooks.guard.aclose()
        await store.close()


async def test_dispatcher_gives_up_after_max_attempts(tmp_path: Path, receiver: Receiver) -> None:
    receiver.fail_all = True
    store = JobStore(f"sqlite+aiosqlite:///{tmp_path / 'jobs.db'}")
    await store.init()
    hooks = WebhookDispatcher(
        WebhookSettings(secret=SecretStr(SECRET), backoff_s=0.02, max_attempts=3), store,
        local_guard())
    hooks.start()
    try:
        await new_job(store, "j1", receiver.url)
        await store.finish("j1", None, "done", 3600)
        hooks.wake()
        row = await until(store, "j1", ("failed",))
        assert row.webhook_attempts == 3 and row.webhook_last_error == "HTTP 500"
        assert len(receiver.for_job("j1")) == 3
    finally:
        await hooks.stop()
        await hooks.guard.aclose()
        await store.close()


async def test_pending_delivery_resumes_with_a_new_dispatcher(tmp_path: Path,
                                                              receiver: Receiver) -> None:
    """What a restart does: the row says pending, a fresh dispatcher finds and sends it."""
    url = f"sqlite+aiosqlite:///{tmp_path / 'jobs.db'}"
    store = JobStore(url)
    await store.init()
    await new_job(store, "j1", receiver.url)
    await store.finish("j1", None, "done", 3600)  # finished while no dispatcher ran
    await store.close()
    store = JobStore(url)
    await store.init()
    hooks = WebhookDispatcher(WebhookSettings(secret=SecretStr(SECRET), backoff_s=0.05), store,
                              local_guard())
    hooks.start()
    try:
        await until(store, "j1", ("delivered",))
        assert [h.status for h in receiver.for_job("j1")] == [500, 200]
    finally:
        await hooks.stop()
        await hooks.guard.aclose()
        await store.close()


# ---- end to end on the real model --------------------------------------------------------------
HOOK_ENV = {**COLD, "BATCHSCRIBE_WEBHOOKS__SECRET": SECRET, "BATCHSCRIBE_WEBHOOKS__BACKOFF_S": "0.2",
            "BATCHSCRIBE_WEBHOOKS__ALLOWED_HOSTS": '["127.0.0.1"]'}


class HookService:
    """The module's webhook-enabled service, started once (a start is ~9 CPU-s, and these
    tests each started their own): jobs are told apart by id, and each test has its own
    receiver. A test that kills it gets a successor on the same data dir from ``server``, as a
    restarted pod would: the crash test's restart is that."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.current: Server | None = None

    @property
    def server(self) -> Server:
        if self.current is None or self.current.proc is None or self.current.proc.poll() is not None:
            self.current = Server(self.data_dir, env=HOOK_ENV).start()
        return self.current


@pytest.fixture(scope="module")
def hooked(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HookService]:
    svc = HookService(tmp_path_factory.mktemp("hooks"))
    yield svc
    if svc.current is not None:
        svc.current.kill()


def wait_webhook(client: httpx.Client, job_id: str, status: str = "delivered") -> dict[str, Any]:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        job = client.get(f"/jobs/{job_id}").json()
        if (job.get("webhook") or {}).get("status") == status:
            return dict(job)
        time.sleep(0.2)
    raise AssertionError(f"job {job_id}: webhook never {status}: {job}")


@pytest.mark.model
def test_every_finished_job_is_delivered_once_signed(
        hooked: HookService, receiver: Receiver, clips: list[Clip]) -> None:
    srv = hooked.server
    picked = [c for c in clips if c.set in READ_SPEECH][:3]
    with srv.client() as client:
        ids = []
        for clip in picked:
            with clip.path.open("rb") as f:
                r = client.post("/transcribe", files={"file": (clip.path.name, f)},
                                data={"callback_url": receiver.url, "language": "en"})
            assert r.status_code == 202, r.text
            assert r.json()["webhook"] == {"url": receiver.url, "status": "waiting", "attempts": 0,
                                           "next_attempt_at": None, "last_error": None,
                                           "delivered_at": None}
            ids.append(r.json()["id"])
        # A host off the allow-list (here the cloud metadata address) is refused up front.
        with picked[0].path.open("rb") as f:
            r = client.post("/transcribe", files={"file": (picked[0].path.name, f)},
                            data={"callback_url": "http://169.254.169.254/latest/meta-data"})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["field"] == "callback_url"
        jobs = [wait_webhook(client, i) for i in ids]
        # A final look after all are delivered: nothing is sent twice.
        assert [j["status"] for j in jobs] == ["done"] * len(ids)
    for job_id, job in zip(ids, jobs, strict=True):
        hits = receiver.for_job(job_id)
        assert [h.status for h in hits] == [500, 200], "one failed attempt, then one delivery"
        assert all(signature_ok(h) for h in hits)
        assert hits[-1].job["id"] == job_id and hits[-1].job["status"] == "done"
        assert hits[-1].job["result_url"] == f"/jobs/{job_id}/result"
        assert job["webhook"]["attempts"] == 2 and job["webhook"]["delivered_at"]


@pytest.mark.model
def test_pending_delivery_survives_a_crash(
        hooked: HookService, receiver: Receiver, clips: list[Clip]) -> None:
    receiver.fail_all = True  # the receiver is down while the job finishes
    srv = hooked.server
    clip = next(c for c in clips if c.set in READ_SPEECH)
    with srv.client() as client, clip.path.open("rb") as f:
        job_id = client.post("/transcribe", files={"file": f},
                             data={"callback_url": receiver.url}).json()["id"]
        deadline = time.monotonic() + 300
        while not receiver.for_job(job_id) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert client.get(f"/jobs/{job_id}").json()["webhook"]["status"] == "pending"
    srv.kill()  # SIGKILL: no chance to deliver or to clean up
    failed_attempts = len(receiver.for_job(job_id))
    receiver.fail_all = False
    receiver.fail_first = False
    srv = hooked.server  # a new process on the killed one's data dir
    with srv.client() as client:
        job = wait_webhook(client, job_id)
    hits = receiver.for_job(job_id)
    # (An attempt the crash cut off before it was recorded is made again: at-least-once.)
    assert [h.status for h in hits] == [500] * failed_attempts + [200]
    assert signature_ok(hits[-1]) and job["webhook"]["status"] == "delivered"


def test_callback_url_refused_when_webhooks_are_off(server: Server, clips: list[Clip]) -> None:
    clip = clips[0]
    with server.client() as client, clip.path.open("rb") as f:
        r = client.post("/transcribe", files={"file": f},
                        data={"callback_url": "http://127.0.0.1:9/hook"})
    assert r.status_code == 400 and r.json()["error"]["field"] == "callback_url"
