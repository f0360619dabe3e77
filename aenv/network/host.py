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

Isolation rests on the host table staying loaded, and anything with root on the host can
remove it: ``nft flush ruleset``, a firewall reload, an admin's script. ``HostTable`` keeps
what it loaded and ``check`` compares: the kernel's ruleset generation first (unchanged
since the table was last seen intact: done, in microseconds), otherwise nft's listing of
the table against the one taken right after loading it. A table that is gone or differs is
loaded again, and the flows guests opened to the host meanwhile are forgotten; if loading
fails, ``check`` raises ``HostTableError``. ``SlotPool`` checks before it hands out or
makes a slot and, with ``refresh`` (gateways re-read, ip_forward re-checked), every
``CHECK_INTERVAL`` seconds in its background thread. Between a removal and the next check
(at most that interval, or the next acquire) guests are not isolated from the host; slot
tables live in their own namespaces and no host-side flush reaches them.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import threading
from collections.abc import Iterable

from pyroute2 import IPRoute
from pyroute2.netlink.exceptions import NetlinkError

from . import conntrack, nft, rulesets
from . import netns as _netns
from .addressing import Addressing
from .errors import HostTableError, NetworkError, NftError

log = logging.getLogger("aenv.network")

_IP_FORWARD = "/proc/sys/net/ipv4/ip_forward"
CHECK_INTERVAL = 2.0  # seconds between SlotPool's background checks of the host table


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


def prepare(addressing: Addressing, host_addresses: Iterable[str] = (), *,
            server_mark: int | None = None) -> None:
    """Load the host table once, unwatched (``HostTable`` for a table that is kept)."""
    HostTable(addressing, host_addresses, server_mark=server_mark).load()


def _local_addresses() -> set[str]:
    with IPRoute() as ipr:
        return {a.get_attr("IFA_LOCAL") or a.get_attr("IFA_ADDRESS")
                for a in ipr.get_addr(family=socket.AF_INET)}


class HostTable:
    """aenv's host table as this process loaded it, and the check that it still is.
    Thread-safe; acts in the namespace of the calling thread (make and check it from the
    same one)."""

    def __init__(self, addressing: Addressing, host_addresses: Iterable[str] = (), *,
                 server_mark: int | None = None) -> None:
        """``server_mark``: see ``rulesets.host_table`` and ``access``."""
        self._a = addressing
        self._named = tuple(host_addresses)
        self._server_mark = server_mark
        self._lock = threading.Lock()
        self._ruleset: str | None = None  # what was loaded
        self._listing = ""  # nft's listing of it, taken right after loading
        self._generation: int | None = None  # ruleset generation when last seen intact

    @property
    def ruleset(self) -> str | None:
        return self._ruleset

    def load(self) -> None:
        """Turn ip_forward on and (re)load the table. Raises NftError."""
        with self._lock:
            self._load(self._expected())

    def check(self, *, refresh: bool = False) -> bool:
        """Make sure the table is loaded as it was; True when it had to be loaded again.
        ``refresh``: also re-read the default gateways (reloading when they changed) and
        turn ip_forward back on if something turned it off. Raises HostTableError."""
        with self._lock:
            if self._ruleset is None:
                raise NetworkError("the host table was never loaded")
            if refresh and not ip_forward_enabled():
                log.warning("net.ipv4.ip_forward was turned off; turning it on again")
                _netns.sysctl("net.ipv4.ip_forward", 1)
            ruleset = self._expected() if refresh else self._ruleset
            if ruleset == self._ruleset:
                if self._intact():
                    return False
                log.error("aenv's host table 'inet %s' was removed or changed by something "
                          "else; loading it again", self._a.table)
            else:
                log.info("the default gateways changed; reloading aenv's host table")
            try:
                self._load(ruleset)
            except (NftError, OSError) as e:
                raise HostTableError(self._a.table, e) from e
            self._forget_guest_flows_to_host()
            return True

    def remove(self) -> bool:
        with self._lock:
            self._ruleset = None
            return remove_table(self._a)

    def _expected(self) -> str:
        return rulesets.host_table(self._a, refused_addresses(self._named), self._server_mark)

    def _load(self, ruleset: str) -> None:
        if not ip_forward_enabled():
            _netns.sysctl("net.ipv4.ip_forward", 1)
        nft.apply(ruleset)
        generation = nft.generation()
        self._listing = nft.list_table("inet", self._a.table)
        self._ruleset, self._generation = ruleset, generation

    def _intact(self) -> bool:
        generation = nft.generation()
        if generation is not None and generation == self._generation:
            return True
        try:
            listing = nft.list_table("inet", self._a.table)
        except NftError:  # no such table
            return False
        if listing != self._listing:
            return False
        self._generation = generation
        return True

    def _forget_guest_flows_to_host(self) -> None:
        """Flows opened from slots to the host while the table was not there would go on
        as established connections, which the table lets through: delete them."""
        local = _local_addresses()
        refused = [ipaddress.IPv4Network(c) for c in refused_addresses(self._named)]

        def to_host(dst: str) -> bool:
            ip = ipaddress.IPv4Address(dst)
            return dst in local or any(ip in net for net in refused)

        try:
            n = conntrack.flush_flows(str(self._a.host_net), to_host)
        except (OSError, NetlinkError) as e:
            log.warning("could not forget guests' flows to the host: %s", e)
            return
        if n:
            log.warning("forgot %d flows guests opened to the host meanwhile", n)


def remove_table(addressing: Addressing) -> bool:
    """Delete aenv's host table; False if it was not there."""
    if ("inet", addressing.table) not in nft.list_tables():
        return False
    nft.apply(rulesets.delete_table("inet", addressing.table))
    return True
