"""The outbound guard (app/net/outbound.py), against real sockets on this machine; DNS is a stub.

Covers: which addresses are refused, the submit-time check, the connect-time check (DNS
rebinding), that the connection goes to the checked address while TLS and Host keep the name,
no redirects, one total deadline, the answer-size cap, the in-flight caps and coarse errors.
"""

from __future__ import annotations

import asyncio
import ipaddress
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import pytest
import trustme

from app.config import OutboundSettings
from app.errors import BadRequest
from app.net.outbound import OutboundError, OutboundGuard, address_problem
from loadtest.lib.hostile_inputs import SSRF_URLS

# The URLs the issue reported accepted (202) with webhooks on.
PUBLIC = "93.184.216.34"


@dataclass
class Seen:
    requests: list[bytes] = field(default_factory=list)
    sni: list[str | None] = field(default_factory=list)
    closed_after: list[float] = field(default_factory=list)


Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@asynccontextmanager
async def tcp_server(handler: Handler, seen: Seen, tls: ssl.SSLContext | None = None,
                     host: str = "127.0.0.1") -> AsyncIterator[int]:
    """A raw HTTP/1.1 server on a free port; records each request head and connection time."""
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        start = time.monotonic()
        try:
            seen.requests.append(await reader.readuntil(b"\r\n\r\n"))
            await handler(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            seen.closed_after.append(time.monotonic() - start)
            writer.close()

    if tls is not None:
        tls.sni_callback = lambda sock, name, ctx: seen.sni.append(name)  # type: ignore[assignment,misc]
    server = await asyncio.start_server(serve, host, 0, ssl=tls)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()


async def ok(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello")
    await writer.drain()


def stub(*answers: list[str]) -> Callable[[str, int], Awaitable[list[str]]]:
    """A resolver answering each call with the next list (the last one repeats)."""
    calls: list[str] = []

    async def resolve(host: str, port: int) -> list[str]:
        calls.append(host)
        return answers[min(len(calls), len(answers)) - 1]
    return resolve


def guard(resolver: Callable[[str, int], Awaitable[list[str]]] | None = None,
          ssl_context: ssl.SSLContext | None = None, **kw: object) -> OutboundGuard:
    return OutboundGuard(OutboundSettings(**kw), resolver=resolver, ssl_context=ssl_context)  # type: ignore[arg-type]


@pytest.mark.parametrize("address,problem", [
    ("169.254.169.254", "metadata"), ("fd00:ec2::254", "metadata"), ("168.63.129.16", "metadata"),
    ("100.100.100.200", "metadata"), ("169.254.170.2", "metadata"),
    ("169.254.170.23", "metadata"), ("127.0.0.1", "loopback"), ("::1", "ipv4_compatible"),
    ("10.0.0.1", "private"), ("172.16.5.4", "private"), ("192.168.1.1", "private"),
    ("100.64.0.1", "private"), ("169.254.1.1", "private"), ("fe80::1", "private"),
    ("fd12:3456::1", "private"), ("fec0::1", "private"), ("0.0.0.0", "private"),
    ("::ffff:127.0.0.1", "ipv4_mapped"), ("::ffff:93.184.216.34", "ipv4_mapped"),
    ("::127.0.0.1", "ipv4_compatible"), ("2002:7f00:1::1", "embedded_private"),
    ("64:ff9b::a00:1", "embedded_private"), ("224.0.0.251", "multicast"), ("ff02::1", "multicast"),
    ("240.0.0.1", "private"), ("255.255.255.255", "private"),
    (PUBLIC, None), ("2606:4700:4700::1111", None), ("2002:5db8:d822::1", None),
])
def test_address_problems(address: str, problem: str | None) -> None:
    assert address_problem(ipaddress.ip_address(address)) == problem


async def test_every_reported_ssrf_url_is_refused_at_submit() -> None:
    g = guard()  # the real resolver: 2130706433 and localhost are 127.0.0.1 to getaddrinfo
    try:
        for url in (*SSRF_URLS, "http://0x7f.1/", "http://127.1:8000/", "http://[::1]/",
                    "http://[fd00:ec2::254]/", "ftp://example.com/", "http:///x", "//x/y"):
            with pytest.raises(BadRequest) as info:
                await g.check_url(url, "callback_url")
            err = info.value
            assert err.details["field"] == "callback_url"
            # The same words whatever the reason: nothing about addresses or ports leaks.
            for leak in ("127.", "169.254", "10.0", "::", "5432", "loopback", "private"):
                assert leak not in err.message, (url, err.message)
    finally:
        await g.aclose()


async def test_a_name_is_judged_by_all_its_addresses() -> None:
    g = guard(stub(["93.184.216.34", "10.1.2.3"]))  # one private address is enough to refuse
    with pytest.raises(BadRequest):
        await g.check_url("https://mixed.example/hook", "callback_url")
    g = guard(stub(["169.254.169.254"]))  # a name for the metadata service
    with pytest.raises(BadRequest):
        await g.check_url("http://metadata.google.internal/", "callback_url")
    g = guard(stub([PUBLIC]))
    assert await g.check_url(" https://hooks.example/h ", "callback_url") == "https://hooks.example/h"


async def test_allowed_hosts_and_allow_private() -> None:
    listed = guard(stub(["10.9.8.7"]), allowed_hosts=["hooks.internal", ".corp.example",
                                                      "192.168.7.0/24"])
    assert await listed.check_url("http://hooks.internal/h", "f")  # listed: private is fine
    assert await listed.check_url("http://a.b.corp.example/h", "f")
    assert await listed.check_url("http://192.168.7.20:9000/h", "f")  # a listed network
    for url in ("http://other.example/h", "http://xcorp.example/h", "http://192.168.8.1/h"):
        with pytest.raises(BadRequest):
            await listed.check_url(url, "f")  # a list: nothing else, public or not
    meta = guard(stub(["169.254.169.254"]), allowed_hosts=["hooks.internal"], allow_private=True)
    with pytest.raises(BadRequest):  # metadata stays refused: a name does not unlock it
        await meta.check_url("http://hooks.internal/h", "f")
    private = guard(stub(["10.9.8.7"]), allow_private=True)
    assert await private.check_url("http://anything.internal/h", "f")
    for meta_ip in ("169.254.169.254", "169.254.170.2", "169.254.170.23"):  # ECS/EKS credentials
        with pytest.raises(BadRequest):
            await private.check_url(f"http://{meta_ip}/", "f")


async def test_dns_rebinding_is_refused_where_the_connection_is_made() -> None:
    """Public when the URL was submitted, 127.0.0.1 when the request is sent: refused, and
    the local server never sees a connection."""
    seen = Seen()
    async with tcp_server(ok, seen) as port:
        g = guard(stub([PUBLIC], ["127.0.0.1"]))
        url = f"http://rebind.example:{port}/hook"
        assert await g.check_url(url, "callback_url") == url
        with pytest.raises(OutboundError) as info:
            await g.send("POST", url, content=b"{}", deadline_s=5, max_bytes=100)
        assert info.value.category == "refused"
        await asyncio.sleep(0.1)
    assert seen.requests == []


async def test_connects_to_the_checked_address_with_the_name_for_tls_and_host() -> None:
    ca = trustme.CA()
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("hooks.test").configure_cert(server_ctx)
    client_ctx = ssl.create_default_context()
    ca.configure_trust(client_ctx)
    seen = Seen()
    async with tcp_server(ok, seen, tls=server_ctx) as port:
        g = guard(stub(["127.0.0.1"]), ssl_context=client_ctx, allowed_hosts=["hooks.test",
                                                                              "other.test"])
        answer = await g.send("GET", f"https://hooks.test:{port}/x", deadline_s=5, max_bytes=100)
        assert answer.status == 200 and answer.body == b"hello"
        assert seen.sni == ["hooks.test"]  # SNI: the name, though we dialled 127.0.0.1
        assert f"host: hooks.test:{port}".encode() in seen.requests[0].lower()
        # The certificate is checked against the name too: another name on that address fails.
        with pytest.raises(OutboundError) as info:
            await g.send("GET", f"https://other.test:{port}/x", deadline_s=5, max_bytes=100)
        assert info.value.category == "tls_failed"
        await g.aclose()


async def test_redirects_are_not_followed() -> None:
    seen_target = Seen()
    async with tcp_server(ok, seen_target) as target:
        async def redirect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.write(f"HTTP/1.1 302 Found\r\nLocation: http://127.0.0.1:{target}/\r\n"
                         "Content-Length: 0\r\n\r\n".encode())
            await writer.drain()

        async with tcp_server(redirect, Seen()) as port:
            g = guard(allowed_hosts=["localhost"])
            answer = await g.send("GET", f"http://localhost:{port}/", deadline_s=5, max_bytes=10)
            assert answer.status == 302
    assert seen_target.requests == []


async def test_a_trickling_head_ends_at_the_deadline() -> None:
    async def trickle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\n")
        for _ in range(600):  # a header byte every 0.1 s, for a minute
            writer.write(b"X")
            await writer.drain()
            await asyncio.sleep(0.1)

    seen = Seen()
    async with tcp_server(trickle, seen) as port:
        g = guard(allowed_hosts=["127.0.0.1"])
        start = time.monotonic()
        with pytest.raises(OutboundError) as info:
            await g.send("POST", f"http://127.0.0.1:{port}/", content=b"{}", deadline_s=1.0,
                         max_bytes=4096)
        took = time.monotonic() - start
    assert info.value.category == "timeout" and str(info.value).startswith("timeout")
    assert took < 5, took  # a hang guard: the deadline is 1 s, the receiver wanted 60


async def test_an_endless_body_is_read_only_up_to_the_cap() -> None:
    sent = 0

    async def endless(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal sent
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        chunk = b"1000\r\n" + b"x" * 4096 + b"\r\n"
        while sent < 1 << 30:
            writer.write(chunk)
            sent += 4096
            await writer.drain()

    async def trickled_body(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n")
        for _ in range(600):
            writer.write(b"x")
            await writer.drain()
            await asyncio.sleep(0.1)

    async with tcp_server(endless, Seen()) as port:
        g = guard(allowed_hosts=["127.0.0.1"])
        answer = await g.send("POST", f"http://127.0.0.1:{port}/", content=b"{}",
                              deadline_s=10, max_bytes=4096)
        assert answer.status == 200 and len(answer.body) == 4096
    assert sent < 64 << 20, sent  # the server was cut off, not drained
    async with tcp_server(trickled_body, Seen()) as port:
        start = time.monotonic()
        answer = await g.send("POST", f"http://127.0.0.1:{port}/", content=b"{}",
                              deadline_s=1.0, max_bytes=4096)
        assert answer.status == 200 and len(answer.body) < 100  # the status counts; body cut
        assert time.monotonic() - start < 5
    await g.aclose()


async def test_errors_are_coarse_categories() -> None:
    g = guard(allowed_hosts=["127.0.0.1"], connect_timeout_s=2)
    async with tcp_server(ok, Seen()) as port:
        pass  # closed again: nothing listens on that port now
    with pytest.raises(OutboundError) as info:
        await g.send("GET", f"http://127.0.0.1:{port}/", deadline_s=5, max_bytes=10)
    assert info.value.category == "connect_failed"

    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"SSH-2.0-OpenSSH_9.6\r\n\r\n")
        await writer.drain()

    async with tcp_server(garbage, Seen()) as port:
        with pytest.raises(OutboundError) as info:
            await g.send("GET", f"http://127.0.0.1:{port}/", deadline_s=5, max_bytes=10)
    assert info.value.category == "protocol_error"
    await g.aclose()


async def test_in_flight_caps() -> None:
    """Caps in all and per destination address (names resolving to one address share it);
    per key and fairness between keys: tests/test_outbound_slots.py."""
    async def one_address(host: str, port: int) -> list[str]:
        return [PUBLIC]

    g = guard(one_address, max_in_flight=3, max_per_host=2, max_per_host_per_key=2)
    a, a_again = await g.destination("http://a.example/"), await g.destination("http://A.example/")
    assert a == a_again == f"addr:{PUBLIC}"
    held = [await g.slots.acquire(None, a) for _ in range(3)]
    assert held == [True, True, False]  # per destination
    assert await g.slots.acquire(None, "addr:198.51.100.7") is True
    assert await g.slots.acquire(None, "addr:198.51.100.8") is False  # in all
    assert g.free() == 0
    for dest in (a, a, "addr:198.51.100.7"):
        g.slots.release(None, dest)
    assert g.free() == 3 and not g.slots.by_key()
