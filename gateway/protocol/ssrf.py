"""Webhook target policy: which URLs and resolved addresses the gateway may POST to.

PROTOCOL 6.2 and 12.8. A webhook URL is chosen by whoever creates a subscription, and the
gateway runs inside a private network: without these checks a subscription could make it
call cloud metadata endpoints, Redis, or any internal service. The URL is checked when the
subscription is created (check_url) and every answer of the resolver is checked again when
a delivery connects (check_addresses), so a name re-pointed at a private address later
(DNS rebinding) is still refused. Operators exempt their own development or in-cluster
targets with an allow list; the empty policy is strict.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeAlias
from urllib.parse import urlsplit

from .errors import coded

IPAddress: TypeAlias = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork: TypeAlias = ipaddress.IPv4Network | ipaddress.IPv6Network

MAX_URL_CHARS = 2048
_LABEL = r"[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?"
_HOST_NAME = re.compile(rf"\A(?:{_LABEL}\.)*{_LABEL}\Z")  # after IDNA: ASCII labels only
_ALLOW_NAME = re.compile(rf"\A(?:\*\.)?(?:{_LABEL}\.)*{_LABEL}\Z")
# A last label that resolvers may read as a number ("2130706433", "0x7f.1", "127.1"): a real
# top-level domain is never numeric, so such a host is an IP literal in disguise.
_NUMERIC_LABEL = re.compile(r"\A(?:0x[0-9a-f]*|[0-9]+)\Z")

_V4_BLOCKED = tuple(
    ipaddress.IPv4Network(n)
    for n in (
        "0.0.0.0/8",  # "this network"; 0.0.0.0 reaches the local host on Linux
        "10.0.0.0/8",
        "100.64.0.0/10",  # carrier-grade NAT
        "127.0.0.0/8",
        "169.254.0.0/16",  # link-local, including the 169.254.169.254 metadata endpoint
        "172.16.0.0/12",
        "192.0.0.0/24",  # IETF protocol assignments
        "192.0.2.0/24",  # documentation (TEST-NET-1)
        "192.88.99.0/24",  # 6to4 relay anycast
        "192.168.0.0/16",
        "198.18.0.0/15",  # benchmarking
        "198.51.100.0/24",  # documentation (TEST-NET-2)
        "203.0.113.0/24",  # documentation (TEST-NET-3)
        "224.0.0.0/4",  # multicast
        "240.0.0.0/4",  # reserved, and 255.255.255.255 broadcast
    )
)
_V6_BLOCKED = tuple(
    ipaddress.IPv6Network(n)
    for n in (
        "::/96",  # unspecified, loopback, and the deprecated IPv4-compatible form
        "64:ff9b:1::/48",  # local-use NAT64 (RFC 8215)
        "100::/64",  # discard-only
        "2001::/23",  # IETF protocol assignments, including Teredo 2001::/32
        "2001:db8::/32",  # documentation
        "3fff::/20",  # documentation (RFC 9637)
        "fc00::/7",  # unique local
        "fe80::/10",  # link-local
        "fec0::/10",  # deprecated site-local
        "ff00::/8",  # multicast
    )
)
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")


@dataclass(frozen=True)
class TargetPolicy:
    """Targets exempt from the checks: they may use http:// and private or loopback addresses.

    ``hosts`` are lowercase names matched exactly; ``*.example`` matches any subdomain of
    ``example`` (not ``example`` itself). The empty policy exempts nothing.
    """

    networks: tuple[IPNetwork, ...] = ()
    hosts: tuple[str, ...] = ()

    def allows_host(self, host: str) -> bool:
        host = host.lower().rstrip(".")
        for name in self.hosts:
            if name.startswith("*."):
                if host.endswith(name[1:]) and len(host) > len(name) - 1:
                    return True
            elif host == name:
                return True
        return False

    def allows_address(self, ip: IPAddress) -> bool:
        candidates = [ip]
        embedded = _embedded_v4(ip)
        if embedded is not None:
            candidates.append(embedded)
        return any(c in network for c in candidates for network in self.networks)


def parse_allow_list(text: str) -> TargetPolicy:
    """A policy from a comma-separated setting: networks ("127.0.0.0/8"), addresses ("::1",
    taken as /32 or /128), host names ("localhost") and subdomain wildcards ("*.svc.local").

    A network with host bits set ("10.0.0.1/8") is refused: it is usually a typo.
    """
    networks: list[IPNetwork] = []
    hosts: list[str] = []
    for raw in text.split(","):
        entry = raw.strip().lower()
        if not entry:
            continue
        try:
            networks.append(ipaddress.ip_network(entry))
            continue
        except ValueError as exc:
            if "/" in entry or _looks_numeric(entry) or ":" in entry:
                raise ValueError(
                    f"webhook allow list: bad network or address {raw.strip()!r}: {exc}"
                ) from None
        if not _ALLOW_NAME.match(entry.rstrip(".")):
            raise ValueError(
                f"webhook allow list: {raw.strip()!r} is neither an IP network, an address, "
                "a host name nor '*.' followed by a domain"
            )
        hosts.append(entry.rstrip("."))
    return TargetPolicy(networks=tuple(networks), hosts=tuple(hosts))


def _looks_numeric(host: str) -> bool:
    last = host.rstrip(".").rsplit(".", 1)[-1]
    return bool(_NUMERIC_LABEL.match(last))


def _embedded_v4(ip: IPAddress) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 address carries (mapped, 6to4, NAT64), which is where a
    connection to it may end up."""
    if isinstance(ip, ipaddress.IPv4Address):
        return None
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip.sixtofour is not None:
        return ip.sixtofour
    if ip in _NAT64:
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return None


def _public(ip: IPAddress) -> bool:
    if isinstance(ip, ipaddress.IPv4Address):
        blocked: Sequence[IPNetwork] = _V4_BLOCKED
    else:
        embedded = _embedded_v4(ip)
        if embedded is not None:
            return _public(embedded)
        blocked = _V6_BLOCKED
    if any(ip in network for network in blocked):
        return False
    # ipaddress's own registry view as a second opinion (it tracks IANA's special ranges).
    return ip.is_global and not (ip.is_multicast or ip.is_reserved or ip.is_link_local or ip.is_loopback)


def address_allowed(ip: IPAddress, host: str, policy: TargetPolicy) -> bool:
    """Whether the gateway may connect to ``ip`` (an address of ``host``): public addresses
    yes; private, loopback, link-local, multicast, reserved, documentation and shared
    ranges, and IPv6 forms wrapping such IPv4 addresses, only when the policy allows them."""
    return _public(ip) or policy.allows_address(ip) or policy.allows_host(host)


def _rejected(message: str) -> Exception:
    return coded(400, "WEBHOOK_URL_REJECTED", message)


def check_url(url: str, policy: TargetPolicy) -> tuple[str, int]:
    """The host and port of an acceptable webhook URL, or 400 WEBHOOK_URL_REJECTED.

    https only, except for targets the policy allows; no credentials or fragment in the URL;
    an IP-literal host must be public unless allowed; numeric hosts in the forms resolvers
    accept besides dotted quads ("2130706433", "0x7f.1", "0177.0.0.1") are refused outright.
    The host comes back IDNA-encoded and lowercased (an IPv6 literal without brackets).
    """
    if not isinstance(url, str) or len(url) > MAX_URL_CHARS:
        raise _rejected(f"webhook.url must be a string of at most {MAX_URL_CHARS} characters")
    if any(ord(c) < 0x21 or ord(c) == 0x7F or c == "\\" for c in url):
        # Backslashes too: WHATWG parsers read them as '/', urllib does not.
        raise _rejected("webhook.url must not contain whitespace, control characters or backslashes")
    try:
        parts = urlsplit(url)
        port = parts.port
        hostname = parts.hostname
    except ValueError:
        raise _rejected("webhook.url is not a valid URL") from None
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https"):
        raise _rejected("webhook.url must use https")
    if "@" in parts.netloc:
        raise _rejected("webhook.url must not contain credentials")
    if "#" in url:
        raise _rejected("webhook.url must not contain a fragment")
    if not hostname:
        raise _rejected("webhook.url must name a host")
    if port is None:
        port = 443 if scheme == "https" else 80
    elif port == 0:
        raise _rejected("webhook.url has an invalid port")

    ip: IPAddress | None = None
    if "%" in hostname:
        raise _rejected("webhook.url must not use an IPv6 zone")
    if ":" in hostname:
        try:
            ip = ipaddress.IPv6Address(hostname)
        except ValueError:
            raise _rejected("webhook.url has an invalid IPv6 host") from None
        host = ip.compressed
    else:
        try:
            host = hostname.rstrip(".").encode("idna").decode("ascii").lower()
        except UnicodeError:
            raise _rejected("webhook.url has an invalid host name") from None
        if not _HOST_NAME.match(host):
            raise _rejected("webhook.url has an invalid host name")
        if _looks_numeric(host):
            try:
                ip = ipaddress.IPv4Address(host)
            except ValueError:
                raise _rejected("webhook.url host must be a dotted-quad IPv4 address or a name") from None

    if ip is not None:
        if not address_allowed(ip, host, policy):
            raise _rejected(f"webhook.url must not target a private, loopback or local address: {host}")
        exempt = policy.allows_address(ip)
    else:
        exempt = policy.allows_host(host)
        if not exempt and (host == "localhost" or host.endswith(".localhost")):
            raise _rejected("webhook.url must not target localhost")
    if scheme == "http" and not exempt:
        raise _rejected("webhook.url must use https")
    return host, port


def check_addresses(host: str, addresses: Sequence[str], policy: TargetPolicy) -> list[str]:
    """The resolved addresses of ``host`` a delivery may connect to: all of them, or 400
    WEBHOOK_URL_REJECTED when the answer is empty or holds any refused address (an answer
    mixing public and private addresses is a rebinding attempt, not half-usable)."""
    if not addresses:
        raise _rejected(f"webhook host {host} did not resolve")
    allowed = []
    for text in addresses:
        try:
            ip = ipaddress.ip_address(text.split("%", 1)[0])
        except ValueError:
            raise _rejected(f"webhook host {host} resolved to an invalid address") from None
        if not address_allowed(ip, host, policy):
            raise _rejected(f"webhook host {host} resolves to a private, loopback or local address")
        allowed.append(ip.compressed)
    return allowed
