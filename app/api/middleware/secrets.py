"""Short-lived client secrets for live transcription, and who a WebSocket handshake is.

Browsers cannot set ``Authorization`` on a WebSocket, so OpenAI's Realtime API mints ephemeral
keys (``POST /v1/realtime/client_secrets``, answered ``{value, expires_at, session}``) that a
page's JavaScript sends as the subprotocol ``openai-insecure-api-key.<token>``. The same here:
a token is ``ek_<payload>.<mac>``, the payload (tenant, expiry) signed with HMAC-SHA256 under
``live.client_secret_key`` (or a random key per process), so checking one needs no store and
says nothing to a guesser. It opens live sessions only: the key check takes it on WebSocket
handshakes and nowhere else.

A handshake's credential, first found wins: the ``Authorization: Bearer`` header (an API key,
checked as on every route), the ``openai-insecure-api-key.<token>`` subprotocol (a client
secret, or an API key as OpenAI's own browser clients send it), then a ``client_secret`` query
parameter (client secrets only: a query string reaches access logs, an API key must not).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
import time
from dataclasses import dataclass
from urllib.parse import parse_qs

from starlette.types import Scope

from app.config import LiveSettings

PREFIX = "ek_"
SUBPROTOCOL_KEY = "openai-insecure-api-key."
QUERY_PARAM = "client_secret"


@dataclass(frozen=True)
class Minted:
    value: str
    expires_at: int


class ClientSecrets:
    """Mints and checks client secrets (one instance per app, on ``app.state``)."""

    def __init__(self, settings: LiveSettings) -> None:
        key = settings.client_secret_key
        self._key = key.get_secret_value().encode() if key else secrets.token_bytes(32)
        self.ttl_s = settings.client_secret_ttl_s

    def mint(self, owner: str | None, ttl_s: int | None = None) -> Minted:
        expires = int(time.time()) + (ttl_s or self.ttl_s)
        payload = _b64(json.dumps({"o": owner, "e": expires, "n": secrets.token_hex(8)},
                                  separators=(",", ":")).encode())
        return Minted(f"{PREFIX}{payload}.{self._mac(payload)}", expires)

    def owner(self, token: str) -> tuple[bool, str | None]:
        """(valid, tenant): a token this service minted and not yet expired."""
        if not token.startswith(PREFIX) or "." not in token:
            return False, None
        payload, _, mac = token[len(PREFIX):].partition(".")
        if not hmac.compare_digest(mac, self._mac(payload)):
            return False, None
        try:
            data = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
            if int(data["e"]) < time.time():
                return False, None
            owner = data["o"]
        except (ValueError, KeyError, TypeError):
            return False, None
        return True, owner if isinstance(owner, str) else None

    def _mac(self, payload: str) -> str:
        return _b64(hmac.new(self._key, payload.encode(), hashlib.sha256).digest())


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def is_secret(token: str) -> bool:
    return token.startswith(PREFIX)


def handshake_tokens(scope: Scope) -> tuple[str | None, str | None]:
    """(the subprotocol's token, the query parameter's client secret) of a WebSocket handshake."""
    sub = next((p[len(SUBPROTOCOL_KEY):] for p in scope.get("subprotocols", ())
                if p.startswith(SUBPROTOCOL_KEY)), None)
    query = parse_qs(scope.get("query_string", b"").decode("latin-1")).get(QUERY_PARAM, [None])[0]
    return sub or None, query if query and is_secret(query) else None
