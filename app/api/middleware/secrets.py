"""Short-lived client secrets for live transcription, and who a WebSocket handshake is.

Browsers cannot set ``Authorization`` on a WebSocket, so OpenAI's Realtime API mints ephemeral
keys (``POST /v1/realtime/client_secrets``, answered ``{value, expires_at, session}``) that a
page's JavaScript sends as the subprotocol ``openai-insecure-api-key.<token>``. The same here:
a token is ``ek_<payload>.<mac>``, the payload (tenant, expiry) signed with HMAC-SHA256 under
``live.client_secret_key`` (or a random key per process), so checking one needs no store and
says nothing to a guesser. It opens live sessions only: the key check takes it on WebSocket
handshakes and nowhere else. As on OpenAI's API, the ``session`` a secret is minted for (checked
first, app/live/protocol.py ``parse_session``) is signed into it and is the session a socket
opened with it starts as: a page need not send the config it was given.

A handshake's credential, first found wins: the ``Authorization: Bearer`` header (an API key,
checked as on every route), the ``openai-insecure-api-key.<token>`` subprotocol (a client
secret, or an API key as OpenAI's own browser clients send it), then a ``client_secret`` query
parameter (client secrets only: a query string reaches access logs, an API key must not).

Issue 51 found three holes, closed here and in the key check (keys.py):

* uvicorn's handshake line logged the query string, secret and all, and the secret worked for
  any number of sessions in its lifetime (up to 2 h): :class:`QuerySecretMiddleware`, the
  outermost layer, moves it out of the query string into the scope before anything (uvicorn's
  access line included, which reads the same scope) sees it;
* a secret kept working after its API key was removed from the configuration: a grant counts
  only while its tenant is one of the configured keys' (:meth:`ClientSecrets.grant`'s caller);
* whoever held a secret could name any ``callback_url`` on the socket and receive genuinely
  signed deliveries for the key: a socket opened with a secret gets the ``callback_url`` signed
  into it when it was minted (``POST /v1/realtime/client_secrets`` with ``callback_url``), and
  no other.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, urlencode

from starlette.types import ASGIApp, Receive, Scope, Send

from app.config import LiveSettings

PREFIX = "ek_"
SUBPROTOCOL_KEY = "openai-insecure-api-key."
QUERY_PARAM = "client_secret"


@dataclass(frozen=True)
class Minted:
    value: str
    expires_at: int


@dataclass(frozen=True)
class Grant:
    """What a valid client secret says: the tenant it was minted for, the session, and the
    ``callback_url`` its sessions' transcripts are delivered to (None: none)."""

    owner: str | None
    session: dict[str, Any] | None = None
    callback_url: str | None = None


class ClientSecrets:
    """Mints and checks client secrets (one instance per app, on ``app.state``)."""

    def __init__(self, settings: LiveSettings) -> None:
        key = settings.client_secret_key
        self._key = key.get_secret_value().encode() if key else secrets.token_bytes(32)
        self.ttl_s = settings.client_secret_ttl_s

    def mint(self, owner: str | None, ttl_s: int | None = None,
             session: dict[str, Any] | None = None, callback_url: str | None = None) -> Minted:
        expires = int(time.time()) + (ttl_s or self.ttl_s)
        claims: dict[str, Any] = {"o": owner, "e": expires, "n": secrets.token_hex(8)}
        if session:
            claims["s"] = session
        if callback_url:
            claims["c"] = callback_url
        payload = _b64(json.dumps(claims, separators=(",", ":")).encode())
        return Minted(f"{PREFIX}{payload}.{self._mac(payload)}", expires)

    def grant(self, token: str) -> Grant | None:
        """What a token this service minted and not yet expired grants; None for any other."""
        if not token.startswith(PREFIX) or "." not in token:
            return None
        payload, _, mac = token[len(PREFIX):].partition(".")
        if not hmac.compare_digest(mac, self._mac(payload)):
            return None
        try:
            data = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
            if int(data["e"]) < time.time():
                return None
            owner, session, callback = data["o"], data.get("s"), data.get("c")
        except (ValueError, KeyError, TypeError, AttributeError):
            return None
        return Grant(owner if isinstance(owner, str) else None,
                     session if isinstance(session, dict) else None,
                     callback if isinstance(callback, str) else None)

    def grant_of(self, scope: Scope) -> Grant | None:
        """The grant of the client secret a handshake came with, found where the key check
        looks first (the ``Authorization`` header, as the ``openai`` SDK sends a secret given
        as its api_key; the subprotocol; the query's, moved into the scope by
        :class:`QuerySecretMiddleware`); None when that is an API key or nothing. Checked again
        here, so keyless services, which check no credential, honour it too."""
        sub, query = handshake_tokens(scope)
        token = bearer_token(scope) or sub or query
        return self.grant(token) if token is not None and is_secret(token) else None

    def _mac(self, payload: str) -> str:
        return _b64(hmac.new(self._key, payload.encode(), hashlib.sha256).digest())


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def bearer_token(scope: Scope) -> str | None:
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
            return None
    return None


def is_secret(token: str) -> bool:
    return token.startswith(PREFIX)


def handshake_tokens(scope: Scope) -> tuple[str | None, str | None]:
    """(the subprotocol's token, the query parameter's client secret) of a WebSocket handshake;
    the latter as :class:`QuerySecretMiddleware` moved it out of the query string."""
    sub = next((p[len(SUBPROTOCOL_KEY):] for p in scope.get("subprotocols", ())
                if p.startswith(SUBPROTOCOL_KEY)), None)
    query = scope.get(SCOPE_KEY)
    return sub or None, query if isinstance(query, str) and is_secret(query) else None


SCOPE_KEY = "batchscribe.client_secret"


class QuerySecretMiddleware:
    """Outermost on WebSocket handshakes: the ``client_secret`` query parameter moves from the
    query string into ``scope["batchscribe.client_secret"]``, in place (uvicorn writes its
    access line from this same scope dict, as it does for the path key in keys.py), so no log
    line, error body or metric ever holds it."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket" and QUERY_PARAM.encode() in scope.get("query_string", b""):
            pairs = parse_qsl(scope["query_string"].decode("latin-1"), keep_blank_values=True)
            secret = next((v for k, v in pairs if k == QUERY_PARAM), None)
            scope["query_string"] = urlencode(
                [(k, v) for k, v in pairs if k != QUERY_PARAM]).encode("latin-1")
            if secret:
                scope[SCOPE_KEY] = secret
        await self.app(scope, receive, send)
