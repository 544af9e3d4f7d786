"""The HTTP edge (issue 48 item 3): errors are plain core types given their HTTP status,
headers and body in one place (app/api/errors.py), with the bytes clients always got; the web
framework stays inside app/api and app/main.py (pyproject.toml's "web" contract, checked whole
here); and a job is followed one way, through the event hub: every wait and every stream on a
job reads it once per change, and a live session kept as a job ends as every job does
(``jobs_finished``, the end hooks)."""

from __future__ import annotations

import asyncio
import base64
import importlib
import json
import pkgutil
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

import app
from app.api.errors import STATUS, Reply, Unauthorized, edge_reply, reply_for
from app.api.openai import stream as openai_stream
from app.errors import BadRequest, Overloaded, ServiceError
from app.jobs.events import EventHub, Subscription
from app.live.audio import encode_pcm16
from tests.conftest import ROOT
from tests.helpers import fake_service, value, wait_until

websockets = pytest.importorskip("websockets")
from websockets.asyncio.client import connect  # noqa: E402

BOUND = 20.0


# ---- errors: declared at the core or the edge, mapped in one table --------------------------------
def _subclasses(cls: type[ServiceError]) -> Iterator[type[ServiceError]]:
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def test_every_error_is_declared_at_the_core_or_the_edge_and_has_a_status() -> None:
    """A new error type gets its status from the table (itself or a parent other than the
    base), never a silent 500; and it lives in app/errors.py (raised by the core) or
    app/api/errors.py (raised by the edge), where a reader finds every one."""
    for mod in pkgutil.walk_packages(app.__path__, "app."):
        if not mod.name.startswith("app.jobs.migrations"):
            importlib.import_module(mod.name)
    found = list(_subclasses(ServiceError))
    assert len(found) >= 20
    for cls in found:
        assert cls.__module__ in ("app.errors", "app.api.errors"), cls
        assert any(c in STATUS for c in cls.__mro__ if c is not ServiceError), cls
        assert not hasattr(cls, "status_code") and not hasattr(cls, "headers"), cls  # plain
    with pytest.raises(TypeError, match="retry_after and no_retry"):  # raised the old way
        BadRequest("no", headers={"x-should-retry": "false"})


def test_the_web_contract_names_every_module_outside_the_edge() -> None:
    """pyproject.toml's "web" contract lists its source modules: a package added to app/ later
    must be in the list, or it could import FastAPI unchecked."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    [web] = [c for c in config["contracts"] if c["id"] == "web"]
    assert set(web["forbidden_modules"]) == {"fastapi", "starlette"}
    root = ROOT / "app"
    top = {f"app.{p.stem}" for p in root.glob("*.py") if p.stem != "__init__"} | \
          {f"app.{p.parent.name}" for p in root.glob("*/__init__.py")}
    assert set(web["source_modules"]) == top - {"app.api", "app.main"}


async def _sent(reply: Reply, **kw: Any) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    messages: list[dict[str, Any]] = []

    async def send(message: Any) -> None:
        messages.append(message)

    await reply.send(send, **kw)
    return messages[0]["status"], messages[0]["headers"], messages[1]["body"]


async def test_errors_render_to_the_bytes_clients_always_got() -> None:
    """Bodies recorded from the service before errors left app/errors.py (the same requests
    answered byte for byte after it, 55 of them: status, headers, body)."""
    overloaded = Overloaded("the queue holds 0 s of audio (limit 3 s); retry in about 1 s",
                            retry_after=1, retry_after_s=1, backlog_s=0.0, limit_s=3.0,
                            limit="max_backlog_s")
    status, headers, body = await _sent(edge_reply(overloaded, "/transcribe"), close=True)
    assert status == 429 and (b"retry-after", b"1") in headers and \
        (b"connection", b"close") in headers
    assert body == (b'{"error": {"type": "overloaded", "message": "the queue holds 0 s of audio '
                    b'(limit 3 s); retry in about 1 s", "retry_after_s": 1, "backlog_s": 0.0, '
                    b'"limit_s": 3.0, "limit": "max_backlog_s"}}')
    routed = reply_for(overloaded, openai=True).response()
    assert routed.status_code == 429 and routed.headers["retry-after"] == "1"
    assert routed.body == (b'{"error":{"message":"the queue holds 0 s of audio (limit 3 s); '
                           b'retry in about 1 s","type":"rate_limit_error","param":null,'
                           b'"code":"overloaded"}}')
    key = Unauthorized("an API key is required: send 'Authorization: Bearer <key>'",
                       scheme="Bearer")
    status, headers, body = await _sent(edge_reply(key, "/v1/models"),
                                        extra=[(b"www-authenticate", b'Bearer realm="x"')])
    assert status == 401 and headers[-1] == (b"www-authenticate", b'Bearer realm="x"')
    assert json.loads(body) == {"error": {
        "message": "an API key is required: send 'Authorization: Bearer <key>'",
        "type": "authentication_error", "param": None, "code": "unauthorized"}}
    ids = reply_for(BadRequest("at most 100 ids per request", field="ids", no_retry=True))
    answer = ids.response()
    assert answer.status_code == 400 and answer.headers["x-should-retry"] == "false"
    assert answer.body == (b'{"error":{"type":"bad_request","message":"at most 100 ids per '
                           b'request","field":"ids"}}')


# ---- following a job: one reader, however many follow it ------------------------------------------
@dataclass
class Row:
    status: str = "running"
    result: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    id: str = "j"
    windows_done: int = 0
    windows_total: int | None = 3
    audio_seconds: float = 9.0

    @property
    def ended(self) -> bool:
        return self.status in ("done", "failed", "cancelled")


@dataclass
class Door:
    """What the waits and the /v1 stream use of the door, over a real hub."""

    hub: EventHub
    texts: list[str]
    stopped: bool = False

    def follow(self, job_id: str, owner: str | None) -> Subscription:
        return self.hub.follow(job_id, owner)

    def finished_texts(self, job_id: str, start: int) -> list[str] | None:
        return self.texts[start:]

    async def cancel(self, job_id: str, owner: str | None) -> None:
        raise AssertionError("a stream that ends with its job cancels nothing")


async def test_waits_and_streams_on_one_job_read_it_once_per_change() -> None:
    """200 followers of one job (100 waits of ?wait=true, /asr or /v1, and 100 /v1 streams):
    the store is read once per change, not once per follower (the /v1 streams each read it on
    every change before, the waits every 15 s and at the end)."""
    row, reads = Row(), 0

    async def read(job_id: str) -> Any:
        nonlocal reads
        reads += 1
        return row

    hub = EventHub(10, read)
    door = Door(hub, [])
    waits = [asyncio.create_task(hub.wait("j", 60)) for _ in range(100)]

    async def stream() -> list[bytes]:
        return [c async for c in openai_stream.transcript_events(door, "j", None)]  # type: ignore[arg-type]

    streams = [asyncio.create_task(stream()) for _ in range(100)]
    await asyncio.sleep(0.05)
    for k, text in enumerate(("One.", "Two.", "Three.")):
        door.texts.append(text)
        row.windows_done = k + 1
        hub.changed("j")
        await asyncio.sleep(0.02)
    row.status, row.result = "done", {"text": "One. Two. Three."}
    hub.ended("j", "done", None)
    await asyncio.wait_for(asyncio.gather(*waits), BOUND)
    got = await asyncio.wait_for(asyncio.gather(*streams), BOUND)
    deltas = [json.loads(c[6:])["delta"] for c in got[0] if b"text.delta" in c]
    assert deltas == ["One.", " Two.", " Three."], got[0]
    assert all(g == got[0] for g in got)
    assert reads <= 6, reads  # the first read, three changes, the end (and one that coalesced)
    assert not hub.feeds and not hub.streams  # every follower released


async def test_the_end_of_a_job_is_told_once_counted_and_heard() -> None:
    from app.metrics import Metrics

    metrics = Metrics()
    heard: list[tuple[str, str]] = []

    async def read(job_id: str) -> None:
        return None

    hub = EventHub(10, read, metrics)
    hub.on_end.append(lambda job_id, status: heard.append((job_id, status)))
    hub.ended("upload", "done", created_at=0.0)
    hub.ended("session", "done")  # a live session kept as a job: no submit-to-finish latency
    assert heard == [("upload", "done"), ("session", "done")]
    assert metrics.jobs_finished.labels("done")._value.get() == 2
    assert metrics.job_latency.labels("done")._sum.get() > 0  # the upload's alone


def test_a_live_session_kept_as_a_job_is_counted_as_a_finished_job(tmp_path: Path) -> None:
    """Through the whole app: the session's end goes through the runner's hub, so
    ``jobs_finished`` counts it (it used to reach the webhooks only) while ``job_latency``
    (submit to finish) leaves a session's length out."""
    with fake_service(tmp_path) as url:
        job_id = asyncio.run(_one_session(url))
        with httpx.Client(base_url=url, timeout=BOUND) as c:
            def counted() -> bool:  # the row is written as the session winds down
                return value(c.get("/metrics").text, "batchscribe_jobs_finished_total",
                             status="done") >= 1

            assert wait_until(counted, BOUND, 0.05), "the kept session was not counted"
            assert c.get(f"/jobs/{job_id}").json()["status"] == "done"
            text = c.get("/metrics").text
    assert value(text, "batchscribe_jobs_finished_total", status="done") == 1
    assert value(text, "batchscribe_job_latency_seconds_count", status="done") == 0


async def _one_session(url: str) -> str:
    ws_url = url.replace("http://", "ws://") + "/v1/realtime?intent=transcription"
    pcm = encode_pcm16(np.zeros(12_000, np.float32))  # 0.5 s at 24 kHz
    async with connect(ws_url) as ws:
        assert ws.response is not None
        job_id = ws.response.headers["x-batchscribe-job"]
        await ws.send(json.dumps({"type": "session.update", "session": {
            "type": "transcription", "audio": {"input": {"turn_detection": None}}}}))
        await ws.send(json.dumps({"type": "input_audio_buffer.append",
                                  "audio": base64.b64encode(pcm).decode()}))
        await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
        async with asyncio.timeout(BOUND):
            while json.loads(await ws.recv())["type"] != \
                    "conversation.item.input_audio_transcription.completed":
                pass
    return str(job_id)
