"""Issue 38 item 5: the refusal to serve without keys beyond loopback holds however the app
is started: uvicorn serving ``create_app`` as a factory on 0.0.0.0 (never through
``python -m app``'s start-up check) refuses every request that reaches it on a non-loopback
address, while loopback and a service with keys or ``allow_anonymous`` are served."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import uvicorn
from fastapi import FastAPI

from app.main import create_app
from loadtest.lib.common import free_port
from tests.conftest import need
from tests.fakes import FakeEngine
from tests.helpers import fake_settings

SETTINGS: dict[str, dict[str, object]] = {}


def factory() -> FastAPI:
    """What ``uvicorn app.main:create_app --factory`` builds, on a fake engine and a test's
    settings (uvicorn calls it: ``factory=True``)."""
    return create_app(fake_settings(**SETTINGS["now"]), engine_factory=lambda s: FakeEngine())  # type: ignore[arg-type]


def own_address() -> str | None:
    """A non-loopback address of this machine, if it has one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # no packet is sent: this picks the outgoing interface
            addr = str(s.getsockname()[0])
        except OSError:
            return None
    return None if addr.startswith("127.") or addr == "0.0.0.0" else addr


@contextmanager
def serve_factory(port: int) -> Iterator[None]:
    config = uvicorn.Config(factory, factory=True, host="0.0.0.0",
                            port=port, log_config=None, lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        assert thread.is_alive(), "the app did not start"
        time.sleep(0.05)
    try:
        yield
    finally:
        server.should_exit = True
        thread.join(30)


@pytest.mark.parametrize("security", [{}, {"allow_anonymous": True}], ids=["keyless", "anonymous"])
def test_factory_on_all_addresses_without_keys_refuses(tmp_path: Path, security: dict) -> None:
    addr = own_address()
    need(addr, "no non-loopback address on this machine")
    port = free_port()
    SETTINGS["now"] = {"tmp": tmp_path, "security": {**security, "trusted_hosts": ["*"]}}
    with serve_factory(port):
        for path in ("/jobs", "/healthz", "/"):
            r = httpx.get(f"http://{addr}:{port}{path}", timeout=10)
            if security:
                assert r.status_code == 200, (path, r.text)
                continue
            assert r.status_code == 503, (path, r.text)
            assert r.json()["error"]["type"] == "open_without_keys"
            assert "API_KEY_SHA256" in r.json()["error"]["message"]
        # On loopback the same process serves: only this machine reaches it there.
        assert httpx.get(f"http://127.0.0.1:{port}/jobs", timeout=10).status_code == 200
