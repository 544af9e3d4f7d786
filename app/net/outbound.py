"""The one way the service reaches a URL a client named: webhooks and ``audio_url`` fetches.

Without it a ``callback_url`` of ``http://169.254.169.254/latest/meta-data/`` or
``http://127.0.0.1:5432/`` made the service connect inside its own network, and the attempt's
raw outcome (shown in ``webhook.last_error``) turned it into a port scanner for clients. So:

* **Addresses, not names, are judged.** A host is resolved and *every* address it has is checked
  (app/net/addresses.py, :func:`address_problem`): loopback, private, link-local, CGNAT, ULA,
  multicast, reserved, IPv4-mapped/-compatible IPv6, IPv6 that embeds such an IPv4 (6to4,
  NAT64, Teredo) and cloud metadata addresses are refused unless ``outbound.allowed_hosts`` or
  ``allow_private`` says otherwise. ``http://2130706433/`` and ``http://0x7f.1/`` are
  127.0.0.1 to the resolver, so they are refused like it.
* **At connect time, to the address checked.** :meth:`OutboundGuard.check_url` refuses a URL
  when a request names it (a 400 before any upload is read), and the HTTP client's network
  backend resolves and checks again when it connects, then connects to that very address: a name
  that resolved to a public address at submit time and to 127.0.0.1 at delivery (DNS rebinding)
  is refused at delivery. TLS still uses the name (SNI and certificate check), as does ``Host``.
* **Bounded.** No redirects, no proxies from the environment, no connection reuse; one total
  deadline per attempt (resolve, connect, send, answer); at most ``max_answer_bytes`` of a
  webhook's answer is read (a receiver trickling an endless body holds nothing); requests in
  flight are capped in all, per destination *address*, per API key and per key at one address,
  and granted fairly between keys (app/net/slots.py).
* **Coarse errors.** Clients see a category (``refused``, ``timeout``, ``connect_failed``...),
  never an address, a port's state or exception text; the log has the detail.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import ssl
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpcore
import httpx

from app.config import OutboundSettings
from app.errors import BadRequest
from app.net.addresses import (
    HostRules,
    IPAddress,
    address_problem,
    literal_ip,
    system_resolver,
)
from app.net.slots import Key, Slots

log = logging.getLogger(__name__)

Resolver = Callable[[str, int], Awaitable[list[str]]]
RESOLVE_TIMEOUT_S = 5.0
USER_AGENT = "batchscribe/1"


class Refused(Exception):
    """The destination is not allowed (the detail is for the log, never for the client)."""


class OutboundError(Exception):
    """A failed outbound request: ``category`` for the log and the code, :attr:`public` (all
    a client is told), ``detail`` for the log only."""

    def __init__(self, category: str, detail: str = "") -> None:
        super().__init__(f"{category}: {detail}" if detail else category)
        self.category = category
        self.detail = detail

    @property
    def public(self) -> str:
        return public_category(self.category)


# What a client may learn of a failed request: the guard refused it, the URL is unusable, the
# slots are busy, or the destination could not be reached. A closed port (connect_failed), an
# open one that speaks no HTTP (protocol_error, tls_failed) and one that never answers
# (timeout) all read "unreachable": the categories must not scan ports for a client.
PUBLIC_CATEGORIES = frozenset({"refused", "invalid_url", "busy"})


def public_category(category: str) -> str:
    return category if category in PUBLIC_CATEGORIES else "unreachable"


@dataclass(frozen=True)
class Answer:
    status: int
    headers: httpx.Headers
    body: bytes  # at most the read cap


class OutboundGuard:
    """Checks destinations and makes bounded requests to them (one per app, shared)."""

    def __init__(self, settings: OutboundSettings, resolver: Resolver | None = None,
                 ssl_context: ssl.SSLContext | None = None) -> None:
        self.settings = settings
        self.rules = HostRules.parse(settings.allowed_hosts)
        self._resolve = resolver or system_resolver
        self.slots = Slots(settings.max_in_flight, settings.max_per_host, settings.max_per_key,
                           settings.max_per_host_per_key)
        self.cut_offs: Counter[tuple[str, str]] = Counter()  # (kind, rule) -> requests cut off
        pool = httpcore.AsyncConnectionPool(
            ssl_context=ssl_context or httpx.create_ssl_context(),
            max_keepalive_connections=0,  # a connection per request: nothing lingers in a pool
            # The slots below cap requests; httpcore's own default (10 connections) made every
            # 11th request wait for one of ten slow ones, whatever tenant it was for.
            max_connections=settings.max_in_flight,
            network_backend=_GuardedBackend(self),
        )
        transport = httpx.AsyncHTTPTransport(trust_env=False)
        # httpx builds its pool without a network-backend option: ours replaces it, so every
        # connection goes through _GuardedBackend. The transport's request and error mapping stay.
        transport._pool = pool
        self.client = httpx.AsyncClient(
            transport=transport, follow_redirects=False, trust_env=False,
            headers={"User-Agent": USER_AGENT, "Accept-Encoding": "identity"},
            timeout=httpx.Timeout(None, connect=settings.connect_timeout_s),
        )

    async def aclose(self) -> None:
        await self.client.aclose()

    # ---- judging destinations ------------------------------------------------------------------
    async def addresses(self, host: str, port: int) -> list[IPAddress]:
        """Resolve ``host`` and check every address; raises :class:`Refused`."""
        name_ok = self.rules.name_listed(host)
        ip = literal_ip(host)
        if ip is not None:
            found = [ip]
        else:
            try:
                async with asyncio.timeout(RESOLVE_TIMEOUT_S):
                    found = [ipaddress.ip_address(a.split("%")[0])
                             for a in await self._resolve(host, port)]
            except (OSError, TimeoutError, ValueError, UnicodeError) as exc:
                raise Refused(f"{host!r} does not resolve: {exc}") from None
            if not found:
                raise Refused(f"{host!r} has no address")
        for a in found:
            listed = self.rules.address_listed(a)
            if not self.rules.empty and not (name_ok or listed):
                raise Refused(f"{host!r} ({a}) is not in outbound.allowed_hosts")
            problem = address_problem(a)
            if problem is None or listed:
                continue
            if problem == "metadata" or not (name_ok or self.settings.allow_private):
                raise Refused(f"{host!r} resolves to {a} ({problem})")
        return found

    async def check_url(self, url: str, field: str) -> str:
        """The submit-time check: a 400 naming ``field`` unless ``url`` is an http(s) URL whose
        host is allowed. The answer is the same whatever the reason (an unknown name, a private
        address, a listed-only service): it must not tell a client about the network."""
        url = url.strip()
        try:
            parts = urlsplit(url)
            port = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError:
            raise BadRequest(f"{field} is not a valid URL", field=field) from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise BadRequest(f"{field} must be an absolute http(s) URL", field=field)
        if any(ord(c) < 0x21 or ord(c) == 0x7F for c in url):
            raise BadRequest(f"{field} contains spaces or control characters", field=field)
        try:
            httpx.URL(url)
        except (httpx.InvalidURL, ValueError):
            raise BadRequest(f"{field} is not a valid URL", field=field) from None
        try:
            await self.addresses(parts.hostname, port)
        except Refused as exc:
            log.info("outbound URL refused", extra={"field": field, "reason": str(exc)})
            raise BadRequest(
                f"{field} is not allowed: its host must resolve to public addresses (or be "
                "listed in this service's outbound.allowed_hosts)", field=field,
                cause="destination_refused") from None
        return url

    # ---- in-flight caps ------------------------------------------------------------------------
    def free(self) -> int:
        return self.slots.free()

    def cut_off(self, kind: str, rule: str) -> None:
        """Count a request this service cut off by one of its rules (the metrics read it)."""
        self.cut_offs[(kind, rule)] += 1

    async def destination(self, url: str) -> str:
        """The slot key of ``url``'s host: the first address it resolves to (checked), so the
        names of one address share its slots (raises :class:`OutboundError` ``refused``)."""
        parts = urlsplit(url)
        host = (parts.hostname or "").lower()
        try:
            port = parts.port or (443 if parts.scheme == "https" else 80)
            return f"addr:{(await self.addresses(host, port))[0]}"
        except (Refused, ValueError) as exc:
            raise OutboundError("refused", str(exc)) from None

    @asynccontextmanager
    async def slot(self, key: Key, dest: str, wait_s: float = 0.0,
                   kind: str = "fetch") -> AsyncIterator[None]:
        """Hold one slot for ``key`` at ``dest``, waiting up to ``wait_s`` for it; raises
        :class:`OutboundError` ``busy`` when none came."""
        if not await self.slots.acquire(key, dest, wait_s, kind):
            raise OutboundError("busy", f"outbound slots for {dest!r} at their caps")
        try:
            yield
        finally:
            self.slots.release(key, dest, kind)

    # ---- requests --------------------------------------------------------------------------------
    async def send(self, method: str, url: str, *, deadline_s: float, max_bytes: int,
                   content: bytes | None = None, headers: dict[str, str] | None = None,
                   key: Key = None, wait_s: float = 0.0, kind: str = "webhook") -> Answer:
        """One bounded request: at most ``max_bytes`` of the body is read, all within
        ``deadline_s``; raises :class:`OutboundError` with a coarse category."""
        body = bytearray()
        got: list[httpx.Response] = []

        async def keep(chunk: bytes) -> bool:
            body.extend(chunk[: max_bytes - len(body)])
            return len(body) < max_bytes

        try:
            async with self.stream(method, url, deadline_s=deadline_s, content=content,
                                   headers=headers, key=key, wait_s=wait_s, kind=kind) as resp:
                got.append(resp)
                if max_bytes > 0:
                    await read_body(resp, keep)
        except OutboundError as exc:
            # The status arrived and then the body trickled past the deadline: the answer is
            # known, only its (optional) body was cut short.
            if exc.category != "timeout" or not got:
                raise
        return Answer(got[0].status_code, got[0].headers, bytes(body))

    @asynccontextmanager
    async def stream(self, method: str, url: str, *, deadline_s: float,
                     content: bytes | None = None, headers: dict[str, str] | None = None,
                     key: Key = None, wait_s: float = 0.0, answer_s: float | None = None,
                     kind: str = "fetch") -> AsyncIterator[httpx.Response]:
        """The response with its body unread, inside one total deadline that also covers what
        the caller reads (errors as :class:`OutboundError`), holding a slot of ``key``'s at the
        URL's address (waiting up to ``wait_s`` for one; the deadline starts once it holds
        one). The answer's headers must come within ``answer_s`` too (the deadline if None)."""
        async with self.slot(key, await self.destination(url), wait_s, kind):
            try:
                async with asyncio.timeout(deadline_s), contextlib.AsyncExitStack() as stack:
                    try:
                        async with asyncio.timeout(answer_s):
                            resp = await stack.enter_async_context(self.client.stream(
                                method, url, content=content, headers=headers))
                    except (httpx.HTTPError, TimeoutError, Refused):
                        raise
                    except Exception as exc:  # anything else the request itself raised:
                        # anyio 4 raised AttributeError (getpeername of a socket the peer had
                        # just reset) from inside httpcore's connect, and the job read "internal
                        # error". A failed request, whatever the library says.
                        raise OutboundError("failed", f"{type(exc).__name__}: {exc}") from None
                    yield resp
            except (httpx.HTTPError, TimeoutError, Refused) as exc:
                # The request's own failures; the caller's exceptions pass through untouched.
                raise classify(exc, deadline_s) from None


async def read_body(resp: httpx.Response, sink: Callable[[bytes], Awaitable[bool]]) -> None:
    """Feed raw body chunks (no decompression: no bomb) to ``sink`` until it returns False."""
    async for chunk in resp.aiter_raw():
        if not await sink(chunk):
            return


def classify(exc: BaseException, deadline_s: float) -> OutboundError:
    """An exception from a request, as a coarse category plus a detail for the log."""
    cause = exc.__cause__ or exc.__context__
    if isinstance(exc, Refused):
        return OutboundError("refused", str(exc))
    if isinstance(exc, TimeoutError | httpx.TimeoutException):
        return OutboundError("timeout", f"no complete answer within {deadline_s:g} s")
    if isinstance(exc, httpx.ConnectError):
        if isinstance(cause, ssl.SSLError) or "SSL" in str(exc) or "certificate" in str(exc):
            return OutboundError("tls_failed", str(exc))
        return OutboundError("connect_failed", str(exc))
    if isinstance(exc, httpx.ProtocolError | httpx.ReadError | httpx.WriteError):
        return OutboundError("protocol_error", str(exc))
    if isinstance(exc, httpx.InvalidURL | httpx.UnsupportedProtocol):
        return OutboundError("invalid_url", str(exc))
    return OutboundError("failed", f"{type(exc).__name__}: {exc}")


class _GuardedBackend(httpcore.AsyncNetworkBackend):
    """httpcore's network layer with the check in the only place that cannot be bypassed:
    the connect. Resolves, checks every address, connects to a checked one."""

    def __init__(self, guard: OutboundGuard) -> None:
        self.guard = guard
        self.base = httpcore.AnyIOBackend()

    async def connect_tcp(self, host: str, port: int, timeout: float | None = None,
                          local_address: str | None = None,
                          socket_options: Any = None) -> httpcore.AsyncNetworkStream:
        addresses = await self.guard.addresses(host, port)
        last: Exception | None = None
        for ip in addresses:
            try:
                return await self.base.connect_tcp(str(ip), port, timeout=timeout,
                                                   local_address=local_address,
                                                   socket_options=socket_options)
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as exc:
                last = exc
        assert last is not None
        raise last

    async def connect_unix_socket(self, path: str, timeout: float | None = None,
                                  socket_options: Any = None) -> httpcore.AsyncNetworkStream:
        raise Refused("unix sockets are never reached")

    async def sleep(self, seconds: float) -> None:
        await self.base.sleep(seconds)
