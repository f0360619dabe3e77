"""A sandbox's egress policy: which destinations the guest may open connections to.

Evaluation order, fixed: aenv's own address ranges and the cloud metadata addresses
(``METADATA_ADDRESSES``) are always refused; then ``allow_out`` accepts; then ``deny_out``
refuses; then, when ``allow_internet`` is false, everything else is refused; then private,
loopback, link-local and CGNAT ranges are refused; the rest is allowed. So a private range
is reachable only when listed in ``allow_out``, and ``allow_out`` is an allowlist only
together with ``allow_internet=False`` (or a ``deny_out`` of ``0.0.0.0/0``), as in E2B.
Entries are IPv4 addresses or CIDRs: the guest link is IPv4.

That is the slot's part. Whatever the policy allows, the host table (``rulesets``) then
refuses every address of the host itself, the gateways of the namespace aenv runs in (the
outer host when aenv runs in a container) and the metadata addresses once more, so no
``allow_out`` entry, ``0.0.0.0/0`` included, opens any of them.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass

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


@dataclass(frozen=True)
class EgressPolicy:
    allow_out: tuple[str, ...] = ()
    deny_out: tuple[str, ...] = ()
    allow_internet: bool = True

    @classmethod
    def build(cls, allow_out: Iterable[str] = (), deny_out: Iterable[str] = (),
              allow_internet: bool = True) -> EgressPolicy:
        """Validated and normalised (``1.2.3.4`` becomes ``1.2.3.4/32``); raises PolicyError."""
        return cls(_normalise(allow_out), _normalise(deny_out), bool(allow_internet))

    @property
    def is_default(self) -> bool:
        return self == DEFAULT_POLICY


DEFAULT_POLICY = EgressPolicy()
