"""Cross-site refusal: a web page on another site cannot make this service do anything.

Without keys (the default on loopback) any page the user visits could ``fetch(
"http://127.0.0.1:8000/transcribe", {method: "POST", mode: "no-cors", body: form})``: the
browser sends it (a "simple" request needs no preflight), and the Host check
(keys.py) stops DNS rebinding, not this. Browsers say where a request comes from: ``Origin``
on every non-GET request and on WebSocket handshakes, and ``Sec-Fetch-Site`` (``same-origin``,
``same-site``, ``cross-site``, ``none``) on all of them; a page can forge neither.

:class:`CrossSiteGuard` refuses (403, the service's JSON error) every state-changing request
(any method but GET, HEAD, OPTIONS) and every WebSocket handshake that a browser marks as coming
from another origin, unless that origin is in ``security.allowed_origins``. A request without
``Origin`` and ``Sec-Fetch-Site`` (curl, the SDKs, Bazarr) is not a browser's and is served;
the service's own page sends its own origin, and is served. It is a pure ASGI class covering the
``http`` and ``websocket`` scopes, so a socket route added later is guarded without a line.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from starlette.types import ASGIApp, Receive, Scope, Send

from app.api.errors import CrossSiteRefused, edge_reply

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
DEFAULT_PORTS = {"http": 80, "https": 443, "ws": 80, "wss": 443}


REFUSAL = ("a web page on another site may not send this request (its Origin or Sec-Fetch-Site "
           "names another site); list that origin in BATCHSCRIBE_SECURITY__ALLOWED_ORIGINS to "
           "serve it")


def header(scope: Scope, name: bytes) -> str | None:
    for k, v in scope.get("headers", ()):
        if k == name:
            return str(v.decode("latin-1").strip())
    return None


def netloc(scheme: str, hostport: str) -> str:
    """``host:port`` with the scheme's default port written out, lower case."""
    h = hostport.strip().lower().rstrip(".")
    if h.endswith("]") or ":" not in h or (h.count(":") > 1 and not h.startswith("[")):
        return f"{h}:{DEFAULT_PORTS.get(scheme, 80)}"
    return h


def origin_netloc(origin: str) -> str | None:
    try:
        parts = urlsplit(origin)
    except ValueError:
        return None
    if parts.scheme not in ("http", "https") or not parts.netloc:
        return None
    return netloc(parts.scheme, parts.netloc.rsplit("@", 1)[-1])


def same_origin(scope: Scope, origin: str) -> bool:
    """The origin names the host this request was addressed to (``Host``, or a proxy's
    ``X-Forwarded-Host``: a page cannot set either on a request it sends elsewhere)."""
    mine = origin_netloc(origin)
    if mine is None:
        return False
    scheme = urlsplit(origin).scheme
    for name in (b"host", b"x-forwarded-host"):
        value = header(scope, name)
        if value and any(netloc(scheme, v) == mine for v in value.split(",")):
            return True
    return False


def cross_site(scope: Scope, allowed: frozenset[str]) -> bool:
    """A browser says this request comes from a page of another origin not allowed here."""
    origin = header(scope, b"origin")
    fetch_site = (header(scope, b"sec-fetch-site") or "").lower()
    if origin is not None and origin.lower().rstrip("/") in allowed:
        return False
    if fetch_site == "cross-site":
        return True
    if fetch_site in ("same-origin", "none"):  # the service's own page; a typed address
        return False
    if origin is None:
        return False  # not a browser's request (curl, SDKs), or a same-origin GET
    return not same_origin(scope, origin)  # "null" (sandboxed, file://) is never the same


class CrossSiteGuard:
    """403 for a browser's state-changing request or WebSocket handshake from another site."""

    def __init__(self, app: ASGIApp, allowed_origins: list[str]) -> None:
        self.app = app
        self.allowed = frozenset(o.lower().rstrip("/") for o in allowed_origins)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        guarded = (kind == "websocket"
                   or (kind == "http" and scope.get("method", "GET") not in SAFE_METHODS))
        if not guarded or not cross_site(scope, self.allowed):
            await self.app(scope, receive, send)
            return
        reply = edge_reply(CrossSiteRefused(REFUSAL), scope["path"])
        if kind == "http":
            await reply.send(send, close=True)
            return
        await reply.deny(scope, send)  # the same JSON 403 where the server can send one
