"""A sandbox's egress policy: which destinations the guest may open connections to.

Evaluation order, fixed: aenv's own address ranges and the cloud metadata addresses
(``METADATA_ADDRESSES``) are always refused; then ``allow_out`` accepts; then ``deny_out``
refuses; then, when ``allow_internet`` is false, everything else is refused; then private,
loopback, link-local and CGNAT ranges are refused; the rest is allowed. So a private range
is reachable only when listed in ``allow_out``, and ``allow_out`` is an allowlist only
together with ``allow_internet=False`` (or a ``deny_out`` of ``0.0.0.0/0``), as in E2B.
Entries are IPv4 addresses or CIDRs (the guest link is IPv4) or domain names.

Domain entries (``example.com``, ``*.example.com``) and header transforms (``rules``) are
enforced by the node's egress proxy (``aenv.egress``): a policy with any of them
(``needs_proxy``) has the guest's TCP 80 and 443 redirected to it inside the slot, and the
proxy decides by the HTTP Host or TLS SNI name with ``decide_name``. Everything else the
guest sends stays under the CIDR rules above.

``dns_servers`` (E2B's ``dnsServers``, default ``8.8.8.8``, may be empty) are the resolvers
the guest may ask when ``allow_out`` names a domain: port 53 (UDP and TCP) to them passes
the CIDR rules (``dns_opened``). A proxied slot answers the guest's UDP queries to them
itself (the node's DNS, consistent with the proxy); queries to any other address follow
the CIDR rules like any packet.

``upstream`` (E2B's ``egressProxy``, ``aenv.egress.socks``): a SOCKS5 proxy every TCP
connection the policy allows goes through instead of straight out. Such a policy
``needs_proxy`` too, and all of the guest's TCP is redirected to the node's egress proxy,
which judges it first (names on 80 and 443, the CIDR rules elsewhere) and tunnels it
after; nothing goes direct, and when the SOCKS proxy fails the connection does.

That is the slot's part. Whatever the policy allows, the host table (``rulesets``) then
refuses every address of the host itself, the gateways of the namespace aenv runs in (the
outer host when aenv runs in a container) and the metadata addresses once more, so no
``allow_out`` entry, ``0.0.0.0/0`` included, opens any of them.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ..egress.socks import SocksProxy
from .errors import PolicyError

# Refused unless allow_out names them (the guest must not wander into the host's networks).
PRIVATE_RANGES: tuple[str, ...] = (
    "0.0.0.0/8",
    "10.0.0.0/8",
    "100.64.0.0/10",
    "127.0.0.0/8",
    "169.254.0.0/16",
    "172.16.0.0/12",
    "192.168.0.0/16",
    "224.0.0.0/3",  # multicast and the reserved 240/4
)

# Cloud instance metadata and credential services, refused before ``allow_out``: they hand
# out the host's credentials to whoever asks from the host's network. 169.254.169.254 is
# AWS, GCP, Azure, OpenStack, Oracle, DigitalOcean; 169.254.170.2 AWS ECS task credentials;
# 169.254.170.23 EKS Pod Identity; 100.100.100.200 Alibaba Cloud. (AWS's IPv6 ones,
# fd00:ec2::254 and fd00:ec2::23, are out of reach: slots carry IPv4 only.)
METADATA_ADDRESSES: tuple[str, ...] = (
    "169.254.169.254/32",
    "169.254.170.2/32",
    "169.254.170.23/32",
    "100.100.100.200/32",
)


# E2B's default for ``dnsServers``: what the guest's /etc/resolv.conf names.
DEFAULT_DNS_SERVERS: tuple[str, ...] = ("8.8.8.8",)
MAX_DNS_SERVERS = 10

_LABEL = re.compile(r"^[a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?$")


def domain_pattern(raw: str) -> str | None:
    """``raw`` lower-cased if it is a domain name or ``*.``-wildcard, else None (an IP or
    CIDR, or garbage for ``_normalise`` to refuse). A bare ``*`` is not a pattern."""
    entry = raw.strip().lower().rstrip(".")
    name = entry[2:] if entry.startswith("*.") else entry
    labels = name.split(".")
    if len(name) > 253 or len(labels) < 1 or not all(_LABEL.match(label) for label in labels):
        return None
    if all(label.isdigit() for label in labels):  # an IP address written short
        return None
    if "/" in entry or not any(c.isalpha() for c in name):
        return None
    return entry


def match_pattern(patterns: Iterable[str], name: str) -> str | None:
    """The pattern that matches ``name`` best: an exact name beats any wildcard, then the
    longest wildcard suffix wins; ``*.a.b`` matches ``x.a.b`` and ``x.y.a.b``, not ``a.b``."""
    name = name.lower().rstrip(".")
    best: str | None = None
    for p in patterns:
        if p == name:
            return p
        if p.startswith("*.") and name.endswith(p[1:]) and (best is None or len(p) > len(best)):
            best = p
    return best


def _split(entries: Iterable[str]) -> tuple[list[str], tuple[str, ...]]:
    """(IP/CIDR entries, domain patterns)."""
    cidrs: list[str] = []
    domains: list[str] = []
    for raw in entries:
        pattern = domain_pattern(str(raw))
        if pattern is None:
            cidrs.append(str(raw))
        elif pattern not in domains:
            domains.append(pattern)
    return cidrs, tuple(domains)


def _normalise(entries: Iterable[str]) -> tuple[str, ...]:
    out: list[str] = []
    for raw in entries:
        entry = str(raw).strip()
        try:
            net = ipaddress.ip_network(entry, strict=False)
        except ValueError:
            raise PolicyError(entry, "not an IP address or CIDR") from None
        if net.version != 4:
            raise PolicyError(entry, "only IPv4 is routed to guests")
        text = str(net)
        if text not in out:
            out.append(text)
    return tuple(out)


def _dns(servers: Iterable[str]) -> tuple[str, ...]:
    out: list[str] = []
    for raw in servers:
        entry = str(raw).strip()
        try:
            ip = ipaddress.IPv4Address(entry)
        except ValueError:
            raise PolicyError(entry, "a DNS server is an IPv4 address") from None
        if str(ip) not in out:
            out.append(str(ip))
    if len(out) > MAX_DNS_SERVERS:
        raise PolicyError(",".join(out), f"at most {MAX_DNS_SERVERS} DNS servers")
    return tuple(out)


@dataclass(frozen=True)
class HeaderRule:
    """``rules[pattern]`` of a create: the headers its transforms set, in order (a later
    rule's header of the same name wins). Values may hold ``${e2b.secrets.<name>}``."""

    pattern: str
    headers: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class EgressPolicy:
    allow_out: tuple[str, ...] = ()
    deny_out: tuple[str, ...] = ()
    allow_internet: bool = True
    allow_domains: tuple[str, ...] = ()
    deny_domains: tuple[str, ...] = ()
    rules: tuple[HeaderRule, ...] = ()
    dns_servers: tuple[str, ...] = DEFAULT_DNS_SERVERS
    upstream: SocksProxy | None = None

    @classmethod
    def build(cls, allow_out: Iterable[str] = (), deny_out: Iterable[str] = (),
              allow_internet: bool = True,
              rules: Iterable[HeaderRule] = (),
              dns_servers: Iterable[str] | None = None,
              upstream: SocksProxy | None = None) -> EgressPolicy:
        """Validated and normalised (``1.2.3.4`` becomes ``1.2.3.4/32``, names lower
        case; ``dns_servers`` None is the default, 8.8.8.8); raises PolicyError."""
        allow_cidrs, allow_domains = _split(allow_out)
        deny_cidrs, deny_domains = _split(deny_out)
        return cls(_normalise(allow_cidrs), _normalise(deny_cidrs), bool(allow_internet),
                   allow_domains, deny_domains, tuple(rules),
                   DEFAULT_DNS_SERVERS if dns_servers is None else _dns(dns_servers),
                   upstream)

    @property
    def is_default(self) -> bool:
        return self == DEFAULT_POLICY

    @property
    def needs_proxy(self) -> bool:
        """Names, transforms or an upstream proxy: the guest's HTTP(S) (with an upstream,
        all its TCP) must go through the node's egress proxy."""
        return bool(self.allow_domains or self.deny_domains or self.rules or self.upstream)

    @property
    def dns_opened(self) -> tuple[str, ...]:
        """The resolvers port 53 is open to whatever the CIDR rules say: ``dns_servers``
        when ``allow_out`` names a domain (E2B), else none."""
        return self.dns_servers if self.allow_domains else ()

    @property
    def deny_by_default(self) -> bool:
        """Nothing but what ``allow_out`` lists is reachable."""
        return not self.allow_internet or "0.0.0.0/0" in self.deny_out

    def ip_allowed(self, address: str) -> bool:
        """The slot table's verdict on a new connection to ``address``, in its order."""
        ip = ipaddress.IPv4Address(address)
        if any(ip in ipaddress.IPv4Network(n) for n in METADATA_ADDRESSES):
            return False
        if any(ip in ipaddress.IPv4Network(n) for n in self.allow_out):
            return True
        if any(ip in ipaddress.IPv4Network(n) for n in self.deny_out):
            return False
        if not self.allow_internet:
            return False
        return not any(ip in ipaddress.IPv4Network(n) for n in PRIVATE_RANGES)

    def tcp_allowed(self, address: str, port: int) -> bool:
        """The slot table's verdict on a new TCP connection to ``address``:``port``:
        ``ip_allowed``, and port 53 of ``dns_opened`` (metadata aside)."""
        if port == 53 and address in self.dns_opened and \
                not any(ipaddress.IPv4Address(address) in ipaddress.IPv4Network(n)
                        for n in METADATA_ADDRESSES):
            return True
        return self.ip_allowed(address)

    def ip_listed(self, address: str) -> bool:
        """Whether ``allow_out`` names ``address`` (a CIDR of it), which opens it whatever
        the rest says (metadata aside)."""
        ip = ipaddress.IPv4Address(address)
        return any(ip in ipaddress.IPv4Network(n) for n in self.allow_out) and \
            not any(ip in ipaddress.IPv4Network(n) for n in METADATA_ADDRESSES)

    def decide_name(self, name: str) -> NameVerdict:
        """What the proxy does with a connection to ``name`` (Host or SNI): an allowed
        entry wins over a denied one, as in E2B; a name no entry names follows the CIDR
        rules (refused when they deny by default; else allowed, each address it resolves
        to still judged by ``ip_allowed``)."""
        try:
            ipaddress.IPv4Address(name)
        except ValueError:
            pass
        else:
            return NameVerdict(self.ip_allowed(name), explicit=False)
        if match_pattern(self.allow_domains, name):
            return NameVerdict(True, explicit=True)
        if match_pattern(self.deny_domains, name) or self.deny_by_default:
            return NameVerdict(False, explicit=False)
        return NameVerdict(True, explicit=False)

    def headers_for(self, name: str) -> tuple[tuple[str, str], ...]:
        """The headers of the one rule set whose pattern matches ``name`` best (rule sets
        are not merged)."""
        best = match_pattern((r.pattern for r in self.rules), name)
        for r in self.rules:
            if r.pattern == best:
                return r.headers
        return ()


@dataclass(frozen=True)
class NameVerdict:
    allowed: bool
    # An allowOut name: its addresses are reached even in private ranges (the caller
    # named it); others must pass ``ip_allowed`` like a direct connection.
    explicit: bool


DEFAULT_POLICY = EgressPolicy()


_HEADER_NAME = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]{1,256}$")
PLACEHOLDER_PREFIX = "${e2b."
SECRET_PLACEHOLDER = re.compile(r"\$\{e2b\.secrets\.([^{}\s]+)\}")


def header_rules(rules: Mapping[str, Any] | None) -> tuple[HeaderRule, ...]:
    """``network.rules`` of a create or update (``{pattern: [{"transform": {"headers":
    {name: value}}}, ...]}``) as ``HeaderRule``s; raises PolicyError. Only
    ``${e2b.secrets.<name>}`` placeholders are known (workload identity tokens are not)."""
    out: list[HeaderRule] = []
    for raw, items in (rules or {}).items():
        pattern = domain_pattern(str(raw))
        if pattern is None:
            raise PolicyError(str(raw), "rule keys are domain names or *.wildcards")
        if not isinstance(items, list):
            raise PolicyError(str(raw), "a rule set is a list of rules")
        headers: dict[str, tuple[str, str]] = {}
        for item in items:
            transform = item.get("transform") if isinstance(item, dict) else None
            if not isinstance(item, dict) or (transform is not None
                                              and not isinstance(transform, dict)):
                raise PolicyError(str(raw), "a rule is {\"transform\": {\"headers\": {...}}}")
            for name, value in ((transform or {}).get("headers") or {}).items():
                if not isinstance(value, str) or not _HEADER_NAME.match(str(name)) or \
                        any(c in value for c in "\r\n\0"):
                    raise PolicyError(str(raw), f"header {name!r} is not a valid header")
                rest = SECRET_PLACEHOLDER.sub("", value)
                if PLACEHOLDER_PREFIX in rest:
                    raise PolicyError(str(raw), f"header {name!r}: only ${{e2b.secrets.<name>}}"
                                      " placeholders are supported")
                headers[str(name).lower()] = (str(name), value)
        out.append(HeaderRule(pattern, tuple(headers.values())))
    return tuple(out)
