"""Host-wide networking state that all slots share: IPv4 forwarding and aenv's host table.

``prepare`` is idempotent and run before the first slot is made. It turns on
``net.ipv4.ip_forward`` (a host-wide switch that aenv never turns back off: other software
may rely on it once on) and (re)loads the host table of ``rulesets.host_table``, which
matches slot veths by name pattern, so adding a slot needs no host rule change.

"The host" is the network namespace aenv runs in. Its own addresses need no list (the
host table asks the kernel, ``fib daddr type local``). What lies outside it and is still
the machine aenv runs on, when that namespace is a container's or a pod's, can only
partly be seen from inside: ``outer_host_addresses`` takes the gateways of the default
routes (Docker's bridge address, a pod's CNI gateway), and the caller names the rest
(``host_addresses``: a Kubernetes node's IP, the Docker host's public address).
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterable

from pyroute2 import IPRoute

from . import netns as _netns
from . import nft, rulesets
from .addressing import Addressing

_IP_FORWARD = "/proc/sys/net/ipv4/ip_forward"


def ip_forward_enabled() -> bool:
    with open(_IP_FORWARD) as f:
        return f.read().strip() == "1"


def outer_host_addresses() -> list[str]:
    """The IPv4 gateways of the default routes of the calling thread's namespace (every
    next hop of a multipath one), sorted. Beyond a container's namespace the gateway is
    the outer host itself; on a bare host it is a router no guest needs to talk to."""
    found: set[str] = set()
    with IPRoute() as ipr:
        for route in ipr.get_default_routes(family=socket.AF_INET):
            gateway = route.get_attr("RTA_GATEWAY")
            if gateway:
                found.add(gateway)
            for hop in route.get_attr("RTA_MULTIPATH") or ():
                gateway = hop.get_attr("RTA_GATEWAY")
                if gateway:
                    found.add(gateway)
    return sorted(found, key=ipaddress.IPv4Address)


def refused_addresses(host_addresses: Iterable[str] = ()) -> list[str]:
    """What the host table refuses by list (its own addresses it refuses by type): the
    default gateways and ``host_addresses`` (IPv4 addresses or CIDRs, host bits ignored)."""
    named = [str(ipaddress.IPv4Network(a, strict=False)) for a in host_addresses]
    return [*outer_host_addresses(), *named]


def prepare(addressing: Addressing, host_addresses: Iterable[str] = ()) -> None:
    if not ip_forward_enabled():
        _netns.sysctl("net.ipv4.ip_forward", 1)
    nft.apply(rulesets.host_table(addressing, refused_addresses(host_addresses)))


def remove_table(addressing: Addressing) -> bool:
    """Delete aenv's host table; False if it was not there."""
    if ("inet", addressing.table) not in nft.list_tables():
        return False
    nft.apply(rulesets.delete_table("inet", addressing.table))
    return True
