"""The realtime family's routes (the family: app/api/realtime/__init__.py): the socket's moves
handed to the core (``Door.live``), and the client secrets that open it from a browser."""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Annotated, Any

from fastapi import APIRouter, Body, Depends, Request, WebSocket
from starlette.websockets import WebSocketDisconnect

from app.api.deps import Caller, caller
from app.api.errors import ErrorBody, OpenAIRoute, socket_error
from app.api.middleware.secrets import ClientSecrets
from app.api.realtime.protocol import (
    SIGNED_CALLBACK_ONLY,
    handshake_refusal,
    pick_subprotocol,
    secret_callback,
    secret_ttl_s,
)
from app.jobs.door import Door, LiveCall

router = APIRouter(tags=["live"], route_class=OpenAIRoute)  # errors in OpenAI's shape
CLOSE_WAIT_S = 5.0


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

    async def refuse(code: str, message: str, param: str | None) -> None:
        """Accepted to say why (a refused handshake shows only a status), then closed."""
        await accept({})
        await send(socket_error(code, message, param))
        await ws.close(1008)

    refusal = handshake_refusal(intent, door.ready)
    if refusal is not None:
        await refuse(*refusal)
        return
    signer: ClientSecrets = ws.app.state.client_secrets
    grant = signer.grant_of(ws.scope)
    if grant is not None:  # a client secret: only the callback_url signed into it
        if callback_url is not None and callback_url != grant.callback_url:
            await refuse("invalid_value", SIGNED_CALLBACK_ONLY, "callback_url")
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
    ttl_s = secret_ttl_s(body)
    carried, opened = door.live_session(body.get("session") or {"type": "transcription"})
    callback = secret_callback(body)
    minted = signer.mint(who.owner, ttl_s, carried if "session" in body else None, callback)
    return {"value": minted.value, "expires_at": minted.expires_at, "session": opened}
