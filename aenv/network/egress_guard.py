"""Where the egress proxy may never connect on a guest's behalf, whatever the name it was
given resolves to: the host's own addresses (any interface, asked of the kernel at each
check by binding to the address), loopback and "this network", aenv's host and veth
ranges, the cloud metadata addresses and the host-side addresses the host table refuses
(``host.refused_addresses``). The proxy connects from the host namespace, so the host
table, which guards what comes from slot veths, does not see these connections.
"""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import socket
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

from .addressing import Addressing
from .host import refused_addresses
from .policy import METADATA_ADDRESSES


def _is_local(ip: str) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.bind((ip, 0))
        except OSError as e:
            return e.errno != errno.EADDRNOTAVAIL
    return True


def _off_the_loop(fn: Callable[[], list[str]]) -> list[str]:
    """``fn()``, in a worker thread when this thread runs an event loop: pyroute2's
    synchronous calls drive a loop of their own, which fails inside a running one (a
    ``Server`` built in an async test or fixture)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return fn()
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(fn).result()


def upstream_refused(addressing: Addressing,
                     host_addresses: Iterable[str] = ()) -> Callable[[str], bool]:
    named = list(host_addresses)
    nets = [ipaddress.IPv4Network(n) for n in (
        "0.0.0.0/8", "127.0.0.0/8", "224.0.0.0/3", str(addressing.host_net),
        str(addressing.veth_net), *METADATA_ADDRESSES,
        *_off_the_loop(lambda: refused_addresses(named)))]

    def refused(address: str) -> bool:
        try:
            ip = ipaddress.IPv4Address(address)
        except ValueError:
            return True
        return any(ip in n for n in nets) or _is_local(address)

    return refused
