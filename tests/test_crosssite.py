"""Issue 38 item 1: a web page on another site cannot make the service do anything.

Through real HTTP on the app with a fake engine: a browser-marked cross-site POST (``Origin``
of another site, ``Sec-Fetch-Site: cross-site``) is refused with a JSON 403 on every route
family, and the same request without ``Origin`` (curl, the SDKs), from the service's own origin
or from an allowed origin is served; a WebSocket handshake from another site is refused.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.routing import WebSocketRoute
from starlette.websockets import WebSocket
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect
from websockets.typing import Origin

from app.api.middleware.origin import CrossSiteGuard
from loadtest.lib.common import free_port
from loadtest.lib.corpus import Clip
from tests.helpers import fake_service, post

EVIL = {"Origin": "https://evil.example", "Sec-Fetch-Site": "cross-site"}
FRONT = "http://front.example:3000"
# route, the file's form field, other fields
ROUTES: list[tuple[str, str, dict[str, str]]] = [
    ("/transcribe", "file", {"language": "en"}),
    ("/v1/audio/transcriptions", "file", {"model": "whisper-1", "language": "en"}),
    ("/asr", "audio_file", {}),
    ("/detect-language", "audio_file", {}),
]


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with fake_service(tmp_path_factory.mktemp("crosssite"),
                      security={"allowed_origins": [FRONT]}) as base:
        yield base


@pytest.fixture(scope="module")
def clip(clips: list[Clip]) -> Clip:
    return min((c for c in clips if c.duration_s > 3), key=lambda c: c.duration_s)


def error_type(r: httpx.Response) -> Any:
    err = r.json()["error"]
    return err.get("code") or err.get("type")  # /v1: OpenAI's shape, the type in "code"


@pytest.mark.parametrize(("route", "field", "data"), ROUTES, ids=[r[0] for r in ROUTES])
def test_cross_site_post_refused_same_request_without_origin_served(
        url: str, clip: Clip, route: str, field: str, data: dict[str, str]) -> None:
    for headers in (EVIL, {"Origin": "https://evil.example"}, {"Sec-Fetch-Site": "cross-site"},
                    {"Origin": "null"}, {"Origin": url.replace("127.0.0.1", "localhost")}):
        with httpx.Client(base_url=url, timeout=60) as c:
            r = post(c, clip.path, route, field=field, data=data, headers=headers)
        assert r.status_code == 403, (headers, r.text)
        assert error_type(r) == "cross_site_refused" and r.headers["x-should-retry"] == "false"
    for headers in ({}, {"Origin": url, "Sec-Fetch-Site": "same-origin"}, {"Origin": url},
                    {"Origin": FRONT, "Sec-Fetch-Site": "cross-site"}):
        with httpx.Client(base_url=url, timeout=60) as c:
            r = post(c, clip.path, route, field=field, data=data, headers=headers)
        assert r.status_code in (200, 202), (headers, r.text)


def test_reads_stay_open_and_delete_is_guarded(url: str) -> None:
    assert httpx.get(url + "/jobs", headers=EVIL).status_code == 200
    assert httpx.get(url + "/", headers=EVIL).status_code == 200  # the page itself
    r = httpx.delete(url + "/jobs/some-id", headers=EVIL)
    assert r.status_code == 403 and error_type(r) == "cross_site_refused"
    assert httpx.delete(url + "/jobs/some-id").status_code == 404


async def echo(ws: WebSocket) -> None:
    await ws.accept()
    await ws.send_text(await ws.receive_text())
    await ws.close()


@pytest.fixture(scope="module")
def socket_url() -> Iterator[str]:
    """A tiny app with one WebSocket route behind the guard (the service's own realtime route
    is guarded by the same middleware, which covers every ``websocket`` scope)."""
    app = CrossSiteGuard(Starlette(routes=[WebSocketRoute("/v1/realtime", echo)]), [FRONT])
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(),
                                           log_config=None, lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    yield f"ws://127.0.0.1:{server.config.port}/v1/realtime"
    server.should_exit = True
    thread.join(10)


def test_websocket_handshake_from_another_site_is_refused(socket_url: str) -> None:
    with pytest.raises(InvalidStatus) as refused:
        connect(socket_url, origin=Origin("https://evil.example"), open_timeout=5)
    assert refused.value.response.status_code == 403
    for origin in (None, FRONT, socket_url.replace("ws://", "http://").rsplit("/v1", 1)[0]):
        with connect(socket_url, origin=origin, open_timeout=5) as ws:  # type: ignore[arg-type]
            ws.send("hi")
            assert ws.recv(timeout=5) == "hi"
