"""Forgetting connection-tracking state, so a reused slot index starts with none.

Inside a slot namespace every entry belongs to that slot, so it is flushed whole. On the
host only entries whose original source is the slot's host address matter: they are the
masqueraded egress flows of the guest, through which an outside peer of the previous
sandbox could otherwise keep reaching whichever sandbox gets the index next. (Host-originated
flows to the host address are not reachable from a guest: the slot refuses egress to aenv's
own ranges.) A dump walks the whole host table in the kernel, about 10 ms on a default-sized
table, so there is one per slot teardown and none on creation. ``flush_flows`` is for
after the host table had to be restored: the flows guests opened to the host while it was
gone would otherwise live on as established connections. All functions act in the
calling thread's network namespace.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable, Iterable

from pyroute2 import Conntrack
from pyroute2.conntrack import ConntrackEntry
from pyroute2.netlink.exceptions import NetlinkError
from pyroute2.netlink.nfnetlink.nfctsocket import NFCTAttrTuple


def flush_all() -> None:
    with Conntrack() as ct:
        ct.flush()


def _delete(ct: Conntrack, entries: list[ConntrackEntry]) -> int:
    deleted = 0
    for entry in entries:
        try:
            ct.delete(entry)
            deleted += 1
        except NetlinkError:  # expired meanwhile
            pass
    return deleted


def flush_source(ip: str) -> int:
    """Delete every IPv4 entry whose original source is ``ip``; returns how many."""
    with Conntrack(nfgen_family=socket.AF_INET) as ct:
        # The kernel filters the dump by address (Linux >= 5.8).
        return _delete(ct, list(ct.dump_entries(tuple_orig=NFCTAttrTuple(saddr=ip))))


def flush_flows(src_cidr: str, is_destination: Callable[[str], bool]) -> int:
    """Delete every IPv4 entry whose original source lies in ``src_cidr`` and whose
    original destination ``is_destination`` accepts (one dump of the whole table)."""
    net = ipaddress.IPv4Network(src_cidr)

    def matches(e: ConntrackEntry) -> bool:
        src, dst = e.tuple_orig.saddr, e.tuple_orig.daddr
        return bool(src and dst) and ipaddress.IPv4Address(src) in net and is_destination(dst)

    with Conntrack(nfgen_family=socket.AF_INET) as ct:
        return _delete(ct, [e for e in ct.dump_entries() if matches(e)])


def flush_sources_in(cidr: str, keep: Iterable[str] = ()) -> int:
    """Delete every IPv4 entry whose original source lies in ``cidr`` but is not one of
    ``keep`` (start-up clean-up: one dump of the whole table, filtered here)."""
    net = ipaddress.IPv4Network(cidr)
    kept = set(keep)

    def stale(e: ConntrackEntry) -> bool:
        src = e.tuple_orig.saddr
        return bool(src) and src not in kept and ipaddress.IPv4Address(src) in net

    with Conntrack(nfgen_family=socket.AF_INET) as ct:
        return _delete(ct, [e for e in ct.dump_entries() if stale(e)])
