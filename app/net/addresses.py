"""Which addresses the service may connect to when a client names a URL (the outbound guard,
app/net/outbound.py, resolves a host and judges every address it has here), and the operator's
``outbound.allowed_hosts`` parsed."""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["METADATA", "HostRules", "IPAddress", "Network", "address_problem", "literal_ip",
           "system_resolver"]

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network

# Instance metadata services: AWS/GCP/Azure/OpenStack (and AWS's IPv6 one), Alibaba, Azure's
# wireserver (a public address!), Oracle; AWS ECS/EKS task credentials (169.254.170.2, and
# 169.254.170.23 for EKS Pod Identity). Refused even with allow_private.
METADATA = frozenset(ipaddress.ip_address(a) for a in (
    "169.254.169.254", "fd00:ec2::254", "100.100.100.200", "168.63.129.16", "192.0.0.192",
    "169.254.170.2", "169.254.170.23"))
NAT64 = ipaddress.ip_network("64:ff9b::/96")


def address_problem(ip: IPAddress) -> str | None:
    """Why the service must not connect to ``ip`` by default; None for a public unicast one."""
    if ip in METADATA:
        return "metadata"
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return "ipv4_mapped"
        if int(ip) >> 32 == 0:  # ::a.b.c.d (IPv4-compatible, deprecated), ::, ::1
            return "ipv4_compatible"
        embedded = ip.sixtofour or (ip.teredo[1] if ip.teredo else None)
        if ip in NAT64:
            embedded = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
        if embedded is not None and address_problem(embedded) is not None:
            return "embedded_private"
        if ip.is_site_local:
            return "private"
    if ip.is_multicast:
        return "multicast"
    if ip.is_loopback:
        return "loopback"
    if not ip.is_global or ip.is_private or ip.is_reserved or ip.is_unspecified or ip.is_link_local:
        return "private"
    return None


@dataclass(frozen=True)
class HostRules:
    """``allowed_hosts`` parsed: exact names, '.domain' suffixes, and address networks."""

    names: frozenset[str]
    suffixes: tuple[str, ...]
    networks: tuple[Network, ...]

    @classmethod
    def parse(cls, entries: Sequence[str]) -> HostRules:
        names, suffixes, nets = set(), [], []
        for raw in entries:
            e = raw.strip().lower().rstrip(".")
            if not e:
                continue
            try:
                nets.append(ipaddress.ip_network(e.strip("[]"), strict=False))
                continue
            except ValueError:
                pass
            if e.startswith("."):
                suffixes.append(e)
            else:
                names.add(e)
        return cls(frozenset(names), tuple(suffixes), tuple(nets))

    @property
    def empty(self) -> bool:
        return not (self.names or self.suffixes or self.networks)

    def name_listed(self, host: str) -> bool:
        h = host.lower().rstrip(".")
        return h in self.names or any(h == s[1:] or h.endswith(s) for s in self.suffixes)

    def address_listed(self, ip: IPAddress) -> bool:
        return any(ip.version == n.version and ip in n for n in self.networks)


async def system_resolver(host: str, port: int) -> list[str]:
    """The addresses ``getaddrinfo`` gives (glibc also reads '2130706433' or '0x7f.1' as IPv4)."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [str(info[4][0]) for info in infos]


def literal_ip(host: str) -> IPAddress | None:
    try:
        return ipaddress.ip_address(host.strip("[]").split("%")[0])
    except ValueError:
        return None
