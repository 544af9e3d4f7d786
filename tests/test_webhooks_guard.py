"""Webhooks through the outbound guard: a callback host that rebinds to 127.0.0.1 after submit is
refused at delivery (resolver stub), and receivers that trickle their answer or stream an
endless body cannot hold an attempt past its deadline or grow the service's memory.
"""

from __future__ import annotations

import socketserver
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from pydantic import SecretStr

from app.config import OutboundSettings, WebhookSettings
from app.jobs.store import JobStore
from app.jobs.webhooks import WebhookDispatcher, check_callback_url
from app.net.outbound import OutboundGuard
from loadtest.lib.common import proc_status_kb
from loadtest.lib.corpus import READ_SPEECH, Clip
from tests.conftest import Server
from tests.test_outbound import PUBLIC, stub
from tests.test_webhooks import SECRET, Receiver, new_job, until, wait_webhook


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    rx = Receiver().start()
    yield rx
    rx.stop()


async def test_a_name_that_rebinds_after_submit_is_refused_at_delivery(
        tmp_path: Path, receiver: Receiver) -> None:
    """The callback host resolved to a public address when the job was submitted and to the
    receiver on 127.0.0.1 when the delivery is made: refused, the receiver never hears of it,
    and the job's webhook state says only "refused"."""
    url = receiver.url.replace("127.0.0.1", "hooks.rebind.example")
    guard = OutboundGuard(OutboundSettings(), resolver=stub([PUBLIC], ["127.0.0.1"]))
    settings = WebhookSettings(secret=SecretStr(SECRET), backoff_s=0.02, max_attempts=2)
    assert await check_callback_url(settings, guard, url) == url  # submit: public, accepted
    store = JobStore(f"sqlite:///{tmp_path / 'jobs.db'}")
    await store.init()
    hooks = WebhookDispatcher(settings, store, guard)
    hooks.start()
    try:
        await new_job(store, "j1", url)
        await store.finish("j1", None, "done", 3600)
        hooks.wake()
        row = await until(store, "j1", ("failed",))
        assert row.webhook_attempts == 2 and row.webhook_last_error == "refused"
        assert receiver.hits == []
    finally:
        await hooks.stop()
        await hooks.guard.aclose()
        await store.close()



@dataclass
class Hostile:
    """A webhook receiver that misbehaves on purpose, on raw sockets: ``slow_head`` sends a
    status line and then one header byte every 0.1 s, forever; ``endless_body`` answers 200 and
    then streams an endless body as fast as the socket takes it."""

    mode: str
    connections: list[float] = field(default_factory=list)  # seconds each connection lasted
    sent: list[int] = field(default_factory=list)  # body bytes each connection got out
    server: socketserver.ThreadingTCPServer | None = None
    ended: threading.Condition = field(default_factory=threading.Condition)

    def wait_connections(self, n: int, timeout: float = 10.0) -> bool:
        """Until ``n`` connections have ended here. The service records an attempt as over
        when it hangs up; this side notices on its next send (up to 0.1 s later for
        ``slow_head``), so a count read at once could miss the last one (seen once: 5 of 6)."""
        with self.ended:
            return self.ended.wait_for(lambda: len(self.connections) >= n, timeout)

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.server_address[1]}/hook"

    def start(self) -> Hostile:
        rx = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                start, sent = time.monotonic(), 0
                sock = self.request
                try:
                    sock.recv(65536)  # the request (a small JSON body)
                    if rx.mode == "slow_head":
                        sock.sendall(b"HTTP/1.1 200 OK\r\n")
                        for _ in range(3000):
                            sock.sendall(b"X")
                            time.sleep(0.1)
                    else:
                        sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\n")
                        block = b"y" * 65536
                        while sent < 1 << 34:
                            sock.sendall(block)
                            sent += len(block)
                except OSError:
                    pass  # the service hung up: what it should do
                finally:
                    with rx.ended:
                        rx.connections.append(time.monotonic() - start)
                        rx.sent.append(sent)
                        rx.ended.notify_all()

        socketserver.ThreadingTCPServer.daemon_threads = True
        self.server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self.server:
            self.server.shutdown()
            self.server.server_close()


@pytest.mark.model
def test_hostile_receivers_cannot_hold_an_attempt_or_memory(
        make_server: type[Server], tmp_path: Path, clips: list[Clip]) -> None:
    """Each attempt ends by the 1 s deadline whatever the receiver does; an endless body is cut
    after the read cap (the status counts: delivered); the service's RSS stays flat."""
    srv = make_server(tmp_path / "srv", env={
        "BATCHSCRIBE_WEBHOOKS__SECRET": SECRET, "BATCHSCRIBE_WEBHOOKS__TIMEOUT_S": "1",
        "BATCHSCRIBE_WEBHOOKS__MAX_ATTEMPTS": "3", "BATCHSCRIBE_WEBHOOKS__BACKOFF_S": "0.2",
        "BATCHSCRIBE_OUTBOUND__ALLOWED_HOSTS": '["127.0.0.1"]'}).start()
    slow, endless = Hostile("slow_head").start(), Hostile("endless_body").start()
    clip = min((c for c in clips if c.set in READ_SPEECH), key=lambda c: c.duration_s)
    assert srv.proc is not None

    def post(url: str | None) -> str:
        with srv.client() as c, clip.path.open("rb") as f:
            r = c.post("/transcribe", files={"file": (clip.path.name, f)},
                       data={"language": "en", **({"callback_url": url} if url else {})},
                       params={"wait": "true"})
        assert r.status_code == 200, r.text
        return str(r.json()["id"])

    try:
        for _ in range(2):
            post(None)  # warm-up: the first requests grow the heap
        rss_before = proc_status_kb(srv.proc.pid, "VmRSS")
        ids = {post(slow.url): "slow", post(endless.url): "endless", post(slow.url): "slow",
               post(endless.url): "endless"}
        with srv.client() as c:
            final = {i: wait_webhook(c, i, "failed" if kind == "slow" else "delivered")
                     for i, kind in ids.items()}
        rss_after = proc_status_kb(srv.proc.pid, "VmRSS")
        slow.wait_connections(6)
        endless.wait_connections(2)
    finally:
        slow.stop()
        endless.stop()
    print(f"attempts lasted {sorted(round(t, 2) for t in slow.connections + endless.connections)} s;"
          f" endless body sent {endless.sent} B before the cut; RSS {rss_before} -> {rss_after} KiB")
    for job_id, kind in ids.items():
        hook = final[job_id]["webhook"]
        if kind == "slow":
            # "unreachable": a port scan learns nothing
            assert hook["attempts"] == 3 and hook["last_error"] == "unreachable", hook
        else:
            assert hook["attempts"] == 1 and hook["last_error"] is None, hook
    assert len(slow.connections) == 6 and len(endless.connections) == 2
    # Each attempt is over by its deadline (1 s; slack for the receiver noticing the close).
    assert max(slow.connections + endless.connections) < 3.0, (slow.connections,
                                                               endless.connections)
    # The endless body was cut off at once, not read for the whole deadline.
    assert max(endless.sent) < 64 << 20, endless.sent
    assert rss_before is not None and rss_after is not None
    assert rss_after - rss_before < 30 * 1024, (rss_before, rss_after)  # KiB: flat
