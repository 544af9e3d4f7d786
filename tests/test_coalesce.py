"""Upload bodies reach the form parser in blocks (app/api/middleware/coalesce.py): every byte
in order, a disconnect passed on at once, other requests untouched, and Starlette's spooled
file written once per block instead of once per socket read."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.types import Message

from app.api.middleware.coalesce import BLOCK, CoalesceBody, coalescing


def feeder(messages: Iterable[Message]) -> Any:
    queue = list(messages)

    async def receive() -> Message:
        return queue.pop(0)

    return receive


def body(chunk: bytes, more: bool) -> Message:
    return {"type": "http.request", "body": chunk, "more_body": more}


async def drain(receive: Any) -> list[Message]:
    out = []
    while True:
        m = await receive()
        out.append(m)
        if m["type"] != "http.request" or not m.get("more_body", False):
            return out


async def test_small_messages_are_joined_into_blocks_in_order() -> None:
    chunks = [bytes([k]) * 300 for k in range(10)]
    msgs = [body(c, k < 9) for k, c in enumerate(chunks)]
    out = await drain(coalescing(feeder(msgs), block=1000))
    assert [len(m["body"]) for m in out] == [1200, 1200, 600]
    assert [m["more_body"] for m in out] == [True, True, False]
    assert b"".join(m["body"] for m in out) == b"".join(chunks)


async def test_a_large_message_and_a_whole_body_pass_as_they_are() -> None:
    big = body(b"x" * 2000, True)
    last = body(b"y", False)
    out = await drain(coalescing(feeder([big, last]), block=1000))
    assert out[0] is big and out[1] is last
    whole = body(b"z" * 10, False)
    assert (await drain(coalescing(feeder([whole]), block=1000))) == [whole]


async def test_a_disconnect_is_passed_on_at_once() -> None:
    msgs = [body(b"a" * 10, True), {"type": "http.disconnect"}]
    out = await drain(coalescing(feeder(msgs), block=1000))
    assert out == [{"type": "http.disconnect"}]


def upload_app() -> Starlette:
    async def upload(request: Request) -> JSONResponse:
        form = await request.form()
        f = form["file"]
        assert isinstance(f, UploadFile)
        data = await f.read()
        return JSONResponse({"bytes": len(data), "sum": sum(data[::4096])})

    return Starlette(routes=[Route("/transcribe", upload, methods=["POST"]),
                             Route("/other", upload, methods=["POST"])])


@pytest.mark.parametrize(("path", "coalesced"), [("/transcribe", True), ("/other", False)])
async def test_the_spooled_file_is_written_once_per_block(
        monkeypatch: pytest.MonkeyPatch, path: str, coalesced: bool) -> None:
    """4 MiB sent as 64 KiB socket reads: 64 writes to the spooled file without the layer (and
    on a route that is not an upload), a handful with it; the file arrives whole either way."""
    writes: list[int] = []
    original = UploadFile.write

    async def counted(self: UploadFile, data: bytes) -> None:
        writes.append(len(data))
        await original(self, data)

    monkeypatch.setattr(UploadFile, "write", counted)
    payload = bytes(range(256)) * (4 * 4096)  # 4 MiB
    boundary = "b0undary"
    head = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; "
            f"filename=\"a.wav\"\r\nContent-Type: audio/wav\r\n\r\n").encode()
    raw = head + payload + f"\r\n--{boundary}--\r\n".encode()

    async def stream() -> Any:
        for i in range(0, len(raw), 65536):
            yield raw[i:i + 65536]

    transport = httpx.ASGITransport(app=CoalesceBody(upload_app()))
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        r = await client.post(path, content=stream(), headers={
            "content-type": f"multipart/form-data; boundary={boundary}"})
    assert r.status_code == 200, r.text
    assert r.json() == {"bytes": len(payload), "sum": sum(payload[::4096])}
    assert sum(writes) == len(payload)
    if coalesced:
        assert len(writes) <= len(raw) // BLOCK + 2, writes
    else:
        assert len(writes) >= len(raw) // 65536 - 1, len(writes)
