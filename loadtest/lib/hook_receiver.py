"""A local webhook receiver for the soak: some deliveries get a plain 200, others a 200 whose
body never ends, trickled slowly (the service must give up at its per-attempt deadline) or
pushed as fast as the socket takes it (the service must stop after ``max_answer_bytes``).

It listens on 127.0.0.2, not 127.0.0.1: the service under soak lists only 127.0.0.2 in
``OUTBOUND__ALLOWED_HOSTS``, so the SSRF values of issue 18 that resolve to 127.0.0.1
(``127.0.0.1:5432``, ``2130706433``, ``localhost``) stay refused while deliveries here go
through. The mode is the first path segment of the callback URL: ``/ok/..``, ``/trickle/..``,
``/stream/..``. Every delivery's signature is checked with the secret of the API key it names
(``X-Batchscribe-Key-Id``, and ``key_id`` in the signed body: deliveries are signed per key,
app/jobs/webhooks.py ``key_secret``); a delivery naming no key the soak knows is a bad one.

The receiver learns that the service hung up when a write fails: a write after the peer's
FIN still succeeds (it draws the RST), the next one fails. So a trickle (a byte every
``TRICKLE_EVERY_S``) sees the hang-up at most two intervals late, which the ``slack_s`` of the
deadline check covers.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import threading
import time
from collections import Counter, defaultdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

MODES = ("ok", "trickle", "stream")
TRICKLE_EVERY_S = 0.2
HOLD_CAP_S = 120.0  # the receiver's own bound: a connection the service never closes ends here


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:
        return

    def do_POST(self) -> None:
        started = time.monotonic()
        body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        mode = self.path.strip("/").split("/")[0]
        rx = self.server.owner
        rx.received(mode, self.headers.get("X-Batchscribe-Delivery", ""),
                    rx.signed(body, self.headers.get("X-Batchscribe-Key-Id", ""),
                              self.headers.get("X-Batchscribe-Timestamp"),
                              self.headers.get("X-Batchscribe-Signature")))
        self.close_connection = True
        if mode not in ("trickle", "stream"):
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"ok")
            return
        self.send_response(200)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        chunk = b"1\r\nx\r\n" if mode == "trickle" else b"4000\r\n" + b"x" * 0x4000 + b"\r\n"
        self.connection.settimeout(HOLD_CAP_S)
        rx.opened(+1)
        try:
            while time.monotonic() - started < HOLD_CAP_S:
                self.wfile.write(chunk)
                self.wfile.flush()
                if mode == "trickle":
                    time.sleep(TRICKLE_EVERY_S)
        except OSError:
            pass  # the service hung up: what it must do
        finally:
            rx.opened(-1)
            rx.held(mode, time.monotonic() - started)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    owner: HookReceiver


class HookReceiver:
    """Start with :meth:`start`; :attr:`url` is the base for callback URLs."""

    def __init__(self, secrets: dict[str, str], deadline_s: float, slack_s: float = 2.0,
                 host: str = "127.0.0.2") -> None:
        """``secrets``: each API key's id -> the secret its deliveries are signed with."""
        self.secrets = {k: v.encode() for k, v in secrets.items()}
        self.deadline_s = deadline_s
        self.slack_s = slack_s
        self.lock = threading.Lock()
        self.requests: Counter[str] = Counter()
        self.bad_signatures = 0
        self.deliveries: dict[str, set[str]] = defaultdict(set)  # mode -> delivery ids
        self.holds: dict[str, list[float]] = defaultdict(list)
        self.open = 0
        self.httpd = _Server((host, 0), _Handler)
        self.httpd.owner = self
        self.url = f"http://{host}:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="hooks", daemon=True)

    def start(self) -> HookReceiver:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def signed(self, body: bytes, key_id: str, timestamp: str | None,
               signature: str | None) -> bool:
        secret = self.secrets.get(key_id)
        if secret is None or not timestamp or not signature:
            return False
        try:
            named = json.loads(body).get("key_id")
        except ValueError:
            return False
        mac = hmac.new(secret, timestamp.encode() + b"." + body, hashlib.sha256).hexdigest()
        return named == key_id and hmac.compare_digest("sha256=" + mac, signature)

    def received(self, mode: str, delivery: str, signed: bool) -> None:
        with self.lock:
            self.requests[mode] += 1
            self.deliveries[mode].add(delivery)
            self.bad_signatures += 0 if signed else 1

    def opened(self, delta: int) -> None:
        with self.lock:
            self.open += delta

    def held(self, mode: str, seconds: float) -> None:
        with self.lock:
            self.holds[mode].append(seconds)

    def delivered_ids(self) -> set[str]:
        with self.lock:
            return set().union(*self.deliveries.values()) if self.deliveries else set()

    def stats(self) -> dict[str, Any]:
        """Per mode: attempts received, distinct deliveries, how long the service held an
        endless answer (max, and how many past the deadline + slack: must be 0)."""
        limit = self.deadline_s + self.slack_s
        with self.lock:
            return {
                "deadline_s": self.deadline_s, "slack_s": self.slack_s,
                "bad_signatures": self.bad_signatures, "open_now": self.open,
                "modes": {m: {
                    "attempts": self.requests[m], "deliveries": len(self.deliveries[m]),
                    "held_max_s": round(max(self.holds[m]), 2) if self.holds[m] else None,
                    "held_past_deadline": sum(1 for h in self.holds[m] if h > limit),
                } for m in MODES},
            }
