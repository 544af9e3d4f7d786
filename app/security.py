"""Optional API keys (``Authorization: Bearer <key>``), configured by their SHA-256 only.

The service never stores a key: the settings hold ``sha256(key)`` hex digests, a request's key
is hashed and compared in constant time. The caller's tenant ("owner") is a short prefix of that
digest; every job row carries it and :func:`app.api.deps.load_job` answers 404 for other
tenants' jobs, so a key can neither read, cancel nor list another key's jobs, nor learn that
they exist. With no keys configured the middleware is not installed and every caller is the one
tenant ``None``.

This is a pure ASGI middleware on purpose: it answers 401 before the body is read, so an
unauthenticated client cannot make the service spool an upload.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from typing import Any

from fastapi import FastAPI
from starlette.types import ASGIApp, Receive, Scope, Send

from app.config import SecuritySettings
from app.errors import ServiceError
from app.web import PAGE_PATHS

OWNER_CHARS = 16  # 64 bits of the digest: unique among any realistic number of keys
REALM = "batchscribe"
# The API description is public on purpose (it holds no data), so clients and tools can read it.
DOC_PATHS = frozenset({"/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"})
HEALTH_PATHS = frozenset({"/healthz", "/readyz"})
METRICS_PATHS = frozenset({"/metrics"})


class Unauthorized(ServiceError):
    status_code = 401
    error_type = "unauthorized"


def key_digest(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def owner_of(digest: str) -> str:
    """The tenant id stored on jobs: a prefix of the key's digest, never the key itself."""
    return digest[:OWNER_CHARS]


class KeyRing:
    """The configured digests; ``owner(key)`` is None for a key that is not one of them."""

    def __init__(self, digests: list[str]) -> None:
        self.digests = [d.lower() for d in digests]
        owners = [owner_of(d) for d in self.digests]
        if len(set(owners)) != len(set(self.digests)):
            raise ValueError("two API key digests share an owner prefix; use different keys")

    def owner(self, key: str) -> str | None:
        presented = key_digest(key)
        found = None
        for d in self.digests:  # compare with every digest: the time taken says nothing
            if hmac.compare_digest(presented, d):
                found = d
        return owner_of(found) if found else None


def open_paths(settings: SecuritySettings) -> frozenset[str]:
    paths = set(DOC_PATHS) | PAGE_PATHS  # the page at / is public like /docs; its calls carry a key
    if settings.open_health:
        paths |= HEALTH_PATHS
    if settings.open_metrics:
        paths |= METRICS_PATHS
    return frozenset(paths)


def bearer_token(scope: Scope) -> str | None:
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
            return None
    return None


class ApiKeyMiddleware:
    """Sets ``request.state.owner`` from a valid key; anything else gets a JSON 401."""

    def __init__(self, app: ASGIApp, keys: KeyRing, open_: frozenset[str]) -> None:
        self.app = app
        self.keys = keys
        self.open = open_

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open:  # no websocket routes exist
            await self.app(scope, receive, send)
            return
        token = bearer_token(scope)
        owner = self.keys.owner(token) if token else None
        if owner is None:
            await self._deny(send, scope["path"], invalid=token is not None)
            return
        # Starlette's request.state is a view of scope["state"] (uvicorn fills it per request).
        scope.setdefault("state", {})["owner"] = owner
        await self.app(scope, receive, send)

    @staticmethod
    async def _deny(send: Send, path: str, invalid: bool) -> None:
        if invalid:
            err = Unauthorized("the API key is not valid", scheme="Bearer")
            challenge = f'Bearer realm="{REALM}", error="invalid_token"'
        else:
            err = Unauthorized("an API key is required: send 'Authorization: Bearer <key>'",
                               scheme="Bearer")
            challenge = f'Bearer realm="{REALM}"'
        body = json.dumps(err.body_for(path)).encode()
        await send({"type": "http.response.start", "status": err.status_code, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"www-authenticate", challenge.encode()),
        ]})
        await send({"type": "http.response.body", "body": body})


def install_security(app: FastAPI, settings: SecuritySettings) -> None:
    """Add the key check (only when keys are configured) and describe it in the OpenAPI spec."""
    if not settings.api_key_sha256:
        return
    app.add_middleware(ApiKeyMiddleware, keys=KeyRing(settings.api_key_sha256),
                       open_=open_paths(settings))
    default_openapi = app.openapi
    public = open_paths(settings)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        spec = default_openapi()
        spec.setdefault("components", {}).setdefault("securitySchemes", {})["apiKey"] = {
            "type": "http", "scheme": "bearer", "description": "An API key as a bearer token.",
        }
        unauthorized = {"description": "Missing or invalid API key",
                        "content": {"application/json": {"schema": {
                            "$ref": "#/components/schemas/ErrorBody"}}}}
        for path, ops in spec.get("paths", {}).items():
            if path in public:
                continue
            for op in ops.values():
                op["security"] = [{"apiKey": []}]
                op.setdefault("responses", {})["401"] = unauthorized
        app.openapi_schema = spec
        return spec

    app.openapi = openapi  # type: ignore[method-assign]
