"""Optional API keys (``Authorization: Bearer <key>``), configured by their SHA-256 only.

Clients of whisper-asr-webservice's API (Bazarr) take a base URL and send no header: for
``/asr`` and ``/detect-language`` the key may instead lead the path, ``/key/<key>/asr`` (the
base URL ``http://host:8000/key/<key>``); it is cut from the request before anything logs it.

The service never stores a key: the settings hold ``sha256(key)`` hex digests, a request's key
is hashed and compared in constant time. The caller's tenant ("owner") is a short prefix of that
digest; every job row carries it and the door (app/jobs/door.py) answers 404 for other
tenants' jobs, so a key can neither read, cancel nor list another key's jobs, nor learn that
they exist. With no keys configured the middleware is not installed and every caller is the one
tenant ``None``.

This is a pure ASGI middleware on purpose: it answers 401 before the body is read, so an
unauthenticated client cannot make the service spool an upload.

Without keys the service is open to whoever reaches it, so it is open only on purpose:
:func:`exposure_problem` makes ``python -m app`` refuse to bind a non-loopback address without
keys unless ``SECURITY__ALLOW_ANONYMOUS=true`` (and, however the app is served, uvicorn or
gunicorn running ``create_app`` directly, :class:`LoopbackHostMiddleware` answers 503 to every
request that reached it on a non-loopback address), and it serves
keyless requests only when their ``Host`` names a loopback address (or a configured trusted
host): a web page that rebinds its own name to 127.0.0.1 still sends its own name as ``Host``,
so it cannot read ``GET /jobs`` from a browser on the service's machine.
"""

from __future__ import annotations

import fnmatch
import hashlib
import hmac
import ipaddress
import logging
from typing import Any

from fastapi import FastAPI
from starlette.types import ASGIApp, Receive, Scope, Send

from app.api.errors import MisdirectedHost, OpenWithoutKeys, Unauthorized, edge_reply
from app.api.middleware.secrets import ClientSecrets, bearer_token, handshake_tokens, is_secret
from app.config import SecuritySettings, Settings
from app.errors import NotFound
from app.web import PAGE_PATHS

log = logging.getLogger(__name__)
OWNER_CHARS = 16  # 64 bits of the digest: unique among any realistic number of keys
REALM = "batchscribe"
# The API description is public on purpose (it holds no data), so clients and tools can read it.
DOC_PATHS = frozenset({"/openapi.json", "/docs"})  # its assets: PAGE_PATHS
HEALTH_PATHS = frozenset({"/healthz", "/readyz"})
METRICS_PATHS = frozenset({"/metrics"})


LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost"})


def is_loopback(host: str) -> bool:
    """``host`` (a name or an address, IPv6 with or without brackets) is this machine only."""
    h = host.strip().strip("[]").lower().rstrip(".")
    if h in LOOPBACK_NAMES or h.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False


def exposure_problem(settings: Settings) -> str | None:
    """Why the service must not start as configured (one line naming the setting), or None.

    Bound beyond loopback without keys, every client on the network would be the same tenant:
    list every job, read every transcript, cancel anything.
    """
    sec = settings.security
    if sec.api_key_sha256 or sec.allow_anonymous or is_loopback(settings.host):
        return None
    return (f"refusing to start: BATCHSCRIBE_HOST={settings.host} is reachable from other "
            "machines and no API keys are configured, so anyone could read and cancel every "
            "job. Set BATCHSCRIBE_SECURITY__API_KEY_SHA256 (sha256 hex of each key), or "
            "BATCHSCRIBE_SECURITY__ALLOW_ANONYMOUS=true to serve everyone on purpose.")


def host_header(scope: Scope) -> str:
    for name, value in scope.get("headers", ()):
        if name == b"host":
            host = value.decode("latin-1").strip()
            if host.startswith("["):  # [::1]:8000
                return host[: host.find("]") + 1] if "]" in host else host
            return host.rsplit(":", 1)[0] if host.count(":") == 1 else host
    return ""


OPEN_WITHOUT_KEYS = ("this service has no API keys and was reached on an address other "
                     "machines can use; its operator must set BATCHSCRIBE_SECURITY__API_KEY_SHA256 "
                     "or BATCHSCRIBE_SECURITY__ALLOW_ANONYMOUS=true")


def reached_beyond_loopback(scope: Scope) -> bool:
    """The request came in on a non-loopback address of this machine: the socket is bound
    beyond loopback (``uvicorn app.main:create_app --factory --host 0.0.0.0`` or gunicorn,
    which never run :func:`exposure_problem`). ASGI's ``server`` is the connection's local
    address; a name there (test clients) or a Unix socket says nothing, and is not refused."""
    server = scope.get("server")
    if not server or not isinstance(server[0], str):
        return False
    try:
        return not ipaddress.ip_address(server[0].strip("[]")).is_loopback
    except ValueError:
        return False


class LoopbackHostMiddleware:
    """Keyless mode: 421 unless the ``Host`` header names a loopback address or a trusted host;
    503 for every request that reached the service on a non-loopback address unless
    ``allow_anonymous`` (the start-up refusal of ``python -m app``, however the app is served).

    Health, metrics and docs stay reachable by any name (probes use the pod's address)."""

    def __init__(self, app: ASGIApp, trusted: list[str], open_: frozenset[str],
                 allow_anonymous: bool = False) -> None:
        self.app = app
        self.trusted = [t.strip().lower() for t in trusted if t.strip()]
        self.open = open_
        self.allow_anonymous = allow_anonymous
        self.warned = False

    def allowed(self, host: str) -> bool:
        h = host.lower().rstrip(".")
        return is_loopback(h) or any(fnmatch.fnmatchcase(h, t) for t in self.trusted)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        if not self.allow_anonymous and reached_beyond_loopback(scope):
            if not self.warned:
                self.warned = True
                log.critical("refusing every request: %s", OPEN_WITHOUT_KEYS)
            if scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 1008})
                return
            await edge_reply(OpenWithoutKeys(OPEN_WITHOUT_KEYS), scope["path"]).send(
                send, close=True)
            return
        if scope["type"] == "websocket":  # a live socket: the same Host rule, no key to cut
            if self.allowed(host_header(scope)):
                await self.app(scope, receive, send)
            else:
                refusal = MisdirectedHost("this service has no API keys and answers only "
                                          "requests addressed to localhost")
                await edge_reply(refusal, scope["path"]).deny(scope, send)
            return
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        # A key in the path (a Bazarr base URL kept from a keyed set-up) is cut before anything
        # logs it and then ignored, as a header's key is here; off its two routes it is a 404.
        if path_key(scope) is not None and scope["path"] not in PATH_KEY_ROUTES:
            await edge_reply(NotFound(PATH_KEY_ONLY, path=scope["path"]), scope["path"]).send(send)
            return
        if scope["path"] in self.open or self.allowed(host_header(scope)):
            await self.app(scope, receive, send)
            return
        err = MisdirectedHost(
            "this service has no API keys and answers only requests addressed to localhost; "
            "configure keys, or list this name in BATCHSCRIBE_SECURITY__TRUSTED_HOSTS")
        await edge_reply(err, scope["path"]).send(send)


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

    @property
    def owners(self) -> frozenset[str]:
        return frozenset(owner_of(d) for d in self.digests)

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


KEY_PREFIX = "/key/"
# Routes that take a key in the path: whisper-asr-webservice's, whose clients (Bazarr) set a base
# URL and send no header. A key in a URL can reach proxies' logs, so nowhere else.
PATH_KEY_ROUTES = frozenset({"/asr", "/detect-language"})
PATH_KEY_ONLY = ("a key in the path is taken only by /asr and /detect-language (clients that "
                 "cannot send a header)")


def path_key(scope: Scope) -> str | None:
    """``/key/<key>/<route>``: the key, with the scope's path set to ``/<route>`` in place.

    In place, because uvicorn writes its access log from this same scope dict: the key never
    reaches a log line, an error body or a metric label, whatever the answer."""
    path: str = scope["path"]
    if not path.startswith(KEY_PREFIX):
        return None
    key, _, rest = path[len(KEY_PREFIX):].partition("/")
    scope["path"] = "/" + rest
    scope["raw_path"] = scope["path"].encode()
    return key


class ApiKeyMiddleware:
    """Sets ``request.state.owner`` from a valid key; anything else gets a JSON 401."""

    def __init__(self, app: ASGIApp, keys: KeyRing, open_: frozenset[str],
                 secrets: ClientSecrets | None = None) -> None:
        self.app = app
        self.keys = keys
        self.open = open_
        self.secrets = secrets

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":
            await self._websocket(scope, receive, send)
            return
        if scope["type"] != "http" or scope["path"] in self.open:
            await self.app(scope, receive, send)
            return
        in_path = path_key(scope)
        if in_path is not None and scope["path"] not in PATH_KEY_ROUTES:
            err = Unauthorized(f"{PATH_KEY_ONLY}; send 'Authorization: Bearer <key>'",
                               scheme="Bearer")
            await self._send(send, err, scope["path"], f'Bearer realm="{REALM}"')
            return
        token = in_path or bearer_token(scope)
        owner = self.keys.owner(token) if token else None
        if owner is None:
            await self._deny(send, scope["path"], invalid=token is not None)
            return
        # Starlette's request.state is a view of scope["state"] (uvicorn fills it per request).
        scope.setdefault("state", {})["owner"] = owner
        await self.app(scope, receive, send)

    async def _websocket(self, scope: Scope, receive: Receive, send: Send) -> None:
        """A handshake: the header's key, else the subprotocol's token (a client secret or a
        key), else the query's client secret (app/api/middleware/secrets.py); 401 otherwise."""
        sub, query = handshake_tokens(scope)
        token = bearer_token(scope) or sub or query
        owner = None
        if token is not None and is_secret(token) and self.secrets is not None:
            grant = self.secrets.grant(token)
            # Only while its key is still configured: a removed key's secrets stop working.
            valid_owner = grant is not None and grant.owner in self.keys.owners
            owner = grant.owner if grant is not None else None
        else:
            owner = self.keys.owner(token) if token else None
            valid_owner = owner is not None
        if not valid_owner:
            err = Unauthorized("the API key or client secret is not valid" if token else
                               "an API key is required: send 'Authorization: Bearer <key>', or "
                               "a client secret as the subprotocol 'openai-insecure-api-key.<secret>'",
                               scheme="Bearer")
            await edge_reply(err, scope["path"]).deny(
                scope, send, [(b"www-authenticate", f'Bearer realm="{REALM}"'.encode())])
            return
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
        await ApiKeyMiddleware._send(send, err, path, challenge)

    @staticmethod
    async def _send(send: Send, err: Unauthorized, path: str, challenge: str) -> None:
        await edge_reply(err, path).send(send, extra=[(b"www-authenticate", challenge.encode())])


def install_security(app: FastAPI, settings: SecuritySettings,
                     secrets: ClientSecrets | None = None) -> None:
    """Add the key check (only when keys are configured) and describe it in the OpenAPI spec;
    without keys, the Host check against DNS rebinding."""
    if not settings.api_key_sha256:
        app.add_middleware(LoopbackHostMiddleware, trusted=settings.trusted_hosts,
                           open_=open_paths(settings), allow_anonymous=settings.allow_anonymous)
        return
    app.add_middleware(ApiKeyMiddleware, keys=KeyRing(settings.api_key_sha256),
                       open_=open_paths(settings), secrets=secrets)
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
