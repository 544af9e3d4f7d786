"""Live transcription over WebSocket: OpenAI's Realtime API with ``intent=transcription``.

``GET /v1/realtime?intent=transcription`` (WebSocket): this module only moves messages between
the socket and the core (``Door.live``, app/jobs/live.py, which runs
:class:`app.live.session.LiveSession`). The caller is the key middleware's (app/api/middleware):
an ``Authorization`` header, or a client secret in the ``openai-insecure-api-key.<secret>``
subprotocol or the ``client_secret`` query parameter, for browsers. It is an ordinary FastAPI
WebSocket route, so every ASGI middleware of the app sees its ``websocket`` scope.

``POST /v1/realtime/client_secrets``: a short-lived token for that socket, in the shape of
OpenAI's ephemeral keys (``{value, expires_at, session}``); it opens live sessions only.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Annotated, Any

from fastapi import APIRouter, Body, Depends, Request, WebSocket
from starlette.websockets import WebSocketDisconnect

from app.api.deps import Caller, caller
from app.api.middleware.secrets import SUBPROTOCOL_KEY, ClientSecrets
from app.api.openai import OpenAIRoute
from app.api.schemas import ErrorBody
from app.errors import BadRequest
from app.jobs.door import Door, LiveCall

router = APIRouter(tags=["live"], route_class=OpenAIRoute)  # errors in OpenAI's shape
INTENTS = ("transcription",)
CLOSE_WAIT_S = 5.0
MAX_URL = 2048  # the jobs table's callback_url column
JOB_HEADER = "x-batchscribe-job"


def pick_subprotocol(offered: list[str]) -> str | None:
    """The subprotocol to answer with: Chromium fails a handshake that offered some and got
    none back, so ``realtime`` (what OpenAI's browser clients offer) when offered, else any
    offered one but the key's (it would echo the secret), else that one."""
    if not offered:
        return None
    if "realtime" in offered:
        return "realtime"
    plain = [p for p in offered if not p.startswith(SUBPROTOCOL_KEY)]
    return plain[0] if plain else offered[0]


@router.websocket("/v1/realtime")
async def realtime(ws: WebSocket, intent: str | None = None,
                   callback_url: str | None = None) -> None:
    door: Door = ws.app.state.door
    owner = ws.scope.get("state", {}).get("owner")
    subprotocol = pick_subprotocol(list(ws.scope.get("subprotocols", ())))

    async def accept(headers: dict[str, str]) -> None:
        await ws.accept(subprotocol, headers=[(k.encode(), v.encode()) for k, v in headers.items()])

    async def receive() -> str | bytes | None:
        msg = await ws.receive()
        if msg["type"] == "websocket.disconnect":
            return None
        return msg.get("text") if msg.get("text") is not None else msg.get("bytes") or b""

    async def send(event: dict[str, Any]) -> None:
        await ws.send_text(json.dumps(event, separators=(",", ":")))

    refusal = (("invalid_intent", f"only intent=transcription is served here, not {intent!r}")
               if intent not in INTENTS else
               ("not_ready", "the model is not loaded yet, or the service is shutting down")
               if not door.ready else None)
    if refusal is not None:  # accepted to say why: a refused handshake shows only a status
        await accept({})
        await send({"type": "error", "event_id": None, "error": {
            "type": "invalid_request_error", "code": refusal[0], "message": refusal[1],
            "param": "intent" if refusal[0] == "invalid_intent" else None, "event_id": None}})
        await ws.close(1008)
        return
    signer: ClientSecrets = ws.app.state.client_secrets
    grant = signer.grant_of(ws.scope)
    if grant is not None:  # a client secret: only the callback_url signed into it
        if callback_url is not None and callback_url != grant.callback_url:
            await accept({})
            await send({"type": "error", "event_id": None, "error": {
                "type": "invalid_request_error", "code": "invalid_value",
                "message": "a socket opened with a client secret delivers only to the "
                "callback_url the secret was minted with (POST /v1/realtime/client_secrets "
                "with callback_url)", "param": "callback_url", "event_id": None}})
            await ws.close(1008)
            return
        callback_url = grant.callback_url
    try:
        end = await door.live(LiveCall(owner, accept, receive, send, callback_url,
                                       session=grant.session if grant is not None else None))
    except WebSocketDisconnect:
        return
    # The client closed first (or stopped reading: the close frame cannot go out, and the
    # handler must not wait on a client that never reads; the server drops the connection).
    with contextlib.suppress(RuntimeError, WebSocketDisconnect, TimeoutError):
        async with asyncio.timeout(CLOSE_WAIT_S):
            await ws.close(end.code)


@router.post("/v1/realtime/client_secrets",
             responses={c: {"model": ErrorBody} for c in (400, 401, 403, 422)})
async def client_secrets(
    request: Request, who: Annotated[Caller, Depends(caller)],
    body: Annotated[dict[str, Any] | None, Body()] = None,
) -> dict[str, Any]:
    """A short-lived token for ``/v1/realtime`` (a browser's WebSocket cannot send the key):
    OpenAI's ephemeral-key answer, ``{value, expires_at, session}``. ``expires_after.seconds``
    (10-7200) sets its lifetime, as on OpenAI's API. ``session`` (a transcription session, as
    in ``session.update``) is checked now (400 naming the field) and is the session a socket
    opened with the secret starts as; the answer's ``session`` shows it, defaults filled in.
    ``callback_url`` (this service's): where its sessions' transcripts are delivered (checked
    when a socket opens); a socket opened with the secret takes no other."""
    body = body or {}
    door: Door = request.app.state.door
    signer: ClientSecrets = request.app.state.client_secrets
    after = body.get("expires_after") or {}
    seconds = after.get("seconds") if isinstance(after, dict) else None
    ttl_s = seconds if isinstance(seconds, int) and 10 <= seconds <= 7200 else None
    carried, opened = door.live_session(body.get("session") or {"type": "transcription"})
    callback = body.get("callback_url")
    if callback is not None and (not isinstance(callback, str) or len(callback) > MAX_URL):
        raise BadRequest(f"callback_url must be a URL of at most {MAX_URL} characters",
                         field="callback_url")
    minted = signer.mint(who.owner, ttl_s, carried if "session" in body else None,
                         callback or None)
    return {"value": minted.value, "expires_at": minted.expires_at, "session": opened}
