"""``NetworkSlot``: one sandbox's network namespace, tap, veth pair, addresses and rules.

Inside the namespace ``<prefix>-ns-<i>``: ``lo`` up; the persistent tap ``tap0`` at
169.254.0.22/30 with a fixed MAC and a permanent neighbour entry for the guest (see
``guest_link``), ready for a VMM started in the namespace to open; ``eth0``, the namespace
end of a veth pair, with the upper address of the slot's /31 and a default route to the
host end; IPv6 off; the slot's nft table (``rulesets.slot_table``). On the host: the veth's
host end ``<prefix>-v<i>`` with the lower /31 address, and a /32 route for the slot's host
address via the namespace end. The host table shared by all slots is ``host.prepare``'s job.

A policy that ``needs_proxy`` (domain names, header transforms, an upstream SOCKS5
proxy) gets a listening socket made inside the namespace on ``TAP_IP:EGRESS_PORT`` (and a
UDP one for the guest's DNS), handed to the slot's ``EgressHook`` (the node's egress
proxy) before the redirect to it is loaded, and taken back after the redirect is gone;
without a hook such a policy is refused.

Creating and destroying use netlink (pyroute2) and one ``nft`` process; no other process
is spawned. A slot is only ever destroyed or reset by its owner: callers stop the VMM first
(``reset`` refuses while the tap is attached).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Protocol

from pyroute2 import IPRoute
from pyroute2.netlink.exceptions import NetlinkError
from pyroute2.netlink.rtnl.ndmsg import states as _nud

from . import conntrack, nft, rulesets
from . import netns as _netns
from .addressing import Addressing, SlotAddresses
from .errors import NetworkError, SlotBusyError
from .guest_link import (
    GUEST_IP,
    GUEST_MAC,
    LINK_PREFIXLEN,
    NS_VETH_NAME,
    TAP_IP,
    TAP_MAC,
    TAP_NAME,
)
from .policy import DEFAULT_POLICY, EgressPolicy

log = logging.getLogger("aenv.network")


class EgressHook(Protocol):
    """Who serves the egress listeners of slots (``aenv.egress.proxy.EgressProxy``)."""

    def attach(self, key: str, sock: socket.socket, policy: Callable[[], EgressPolicy],
               dns: socket.socket | None = None) -> None: ...

    def detach(self, key: str) -> None: ...

_ENODEV = 19

# Set before any device exists in a new namespace, so devices inherit the defaults.
_NS_SYSCTLS = (
    ("net.ipv6.conf.all.disable_ipv6", 1),
    ("net.ipv6.conf.default.disable_ipv6", 1),
    # The guest must not spoof: tap0 only accepts sources routed back through tap0.
    ("net.ipv4.conf.all.rp_filter", 1),
    ("net.ipv4.conf.default.rp_filter", 1),
    ("net.ipv4.ip_forward", 1),
)

_TAP_FLAGS = {"no_pi": True, "vnet_hdr": True, "one_queue": False, "multi_queue": False}


class NetworkSlot:
    """A ready network slot. Build with ``create`` (new) or ``attach`` (left by a previous
    run of the server); the pool does both. Attributes are what a runtime driver needs."""

    def __init__(self, addressing: Addressing, addrs: SlotAddresses,
                 policy: EgressPolicy, egress: EgressHook | None = None) -> None:
        self._a = addressing
        self._addrs = addrs
        self._policy = policy
        self._lock = threading.Lock()
        self._destroyed = False
        self.egress = egress
        self._proxied = False

    # -- what callers use ------------------------------------------------------------------

    @property
    def index(self) -> int:
        return self._addrs.index

    @property
    def netns(self) -> str:
        return self._addrs.netns

    @property
    def netns_path(self) -> str:
        return str(_netns.path(self._addrs.netns))

    @property
    def host_ip(self) -> str:
        """Where the host reaches the guest (any port, DNAT-ed to the guest)."""
        return self._addrs.host_ip

    @property
    def host_veth(self) -> str:
        return self._addrs.host_veth

    @property
    def addresses(self) -> SlotAddresses:
        return self._addrs

    tap_name = TAP_NAME
    guest_ip = GUEST_IP
    guest_mac = GUEST_MAC

    @property
    def policy(self) -> EgressPolicy:
        return self._policy

    def __repr__(self) -> str:
        return f"NetworkSlot(index={self.index}, netns={self.netns!r}, host_ip={self.host_ip})"

    # -- lifecycle -------------------------------------------------------------------------

    @classmethod
    def create(cls, addressing: Addressing, index: int, *,
               policy: EgressPolicy = DEFAULT_POLICY,
               tap_uid: int | None = None, tap_gid: int | None = None,
               egress: EgressHook | None = None) -> NetworkSlot:
        """Build slot ``index`` from nothing. On failure what this call made is removed
        (and nothing else: a name that already exists is left alone)."""
        t0 = time.perf_counter()
        addrs = addressing.slot(index)
        slot = cls(addressing, addrs, DEFAULT_POLICY if policy.needs_proxy else policy,
                   egress)
        made: set[str] = set()
        host_fd = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        try:
            _netns.create(addrs.netns,
                          lambda: slot._setup_inside(host_fd, tap_uid, tap_gid, made))
            slot._setup_host()
            if policy.needs_proxy:
                slot.set_policy(policy)
        except BaseException:
            slot._teardown(veth="veth" in made, namespace="netns" in made)
            raise
        finally:
            os.close(host_fd)
        log.debug("slot create index=%d netns=%s host_ip=%s ms=%.1f", index, addrs.netns,
                  addrs.host_ip, (time.perf_counter() - t0) * 1000)
        return slot

    @classmethod
    def attach(cls, addressing: Addressing, index: int,
               policy: EgressPolicy = DEFAULT_POLICY,
               egress: EgressHook | None = None) -> NetworkSlot:
        """Adopt slot ``index`` as a previous server process left it (its VMM still running),
        re-applying ``policy`` so the rules match what the caller recorded."""
        addrs = addressing.slot(index)
        if not _netns.exists(addrs.netns):
            raise NetworkError(f"slot {index}: netns {addrs.netns} does not exist")
        with IPRoute() as ipr:
            if not ipr.link_lookup(ifname=addrs.host_veth):
                raise NetworkError(f"slot {index}: host veth {addrs.host_veth} does not exist")
        slot = cls(addressing, addrs, DEFAULT_POLICY, egress)
        slot.set_policy(policy, force=True)
        return slot

    def set_policy(self, policy: EgressPolicy, *, force: bool = False) -> None:
        """Replace the egress policy (one nft transaction). Connections already open are
        kept; new ones follow the new policy."""
        with self._lock:
            self._check_alive()
            if policy == self._policy and not force:
                return
            if policy.needs_proxy and not self._proxied:
                self._egress_on()  # listening before anything is redirected to it
            nft.apply(rulesets.policy_update(self._a, policy), netns=self.netns)
            self._policy = policy
            if not policy.needs_proxy and self._proxied:
                self._egress_off()

    def _egress_on(self) -> None:
        if self.egress is None:
            raise NetworkError("domain egress rules and transforms need the node's egress "
                               "proxy, which this slot pool was not given")

        def listen() -> tuple[socket.socket, socket.socket]:
            tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
            udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            try:
                tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                tcp.bind((TAP_IP, rulesets.EGRESS_PORT))
                tcp.listen(128)
                udp.bind((TAP_IP, rulesets.EGRESS_DNS_PORT))
            except BaseException:
                tcp.close()
                udp.close()
                raise
            return tcp, udp

        tcp, udp = _netns.run_in(self.netns, listen)
        self.egress.attach(self.netns, tcp, lambda: self._policy, udp)
        self._proxied = True

    def _egress_off(self) -> None:
        if self._proxied and self.egress is not None:
            self._proxied = False
            try:
                self.egress.detach(self.netns)
            except Exception:
                log.exception("slot %d: egress listener not detached", self.index)

    def tap_attached(self) -> bool:
        """True while some process (a VMM) holds the tap open: its carrier is then up."""
        def carrier() -> bool:
            with IPRoute() as ipr:
                links = ipr.get_links(ifname=TAP_NAME)
                return bool(links and links[0].get_attr("IFLA_CARRIER"))
        return _netns.run_in(self.netns, carrier)

    def reset(self) -> None:
        """Make the slot as good as new for its next sandbox: default policy, no conntrack
        state in the namespace or on the host. Raises SlotBusyError while the tap is held."""
        with self._lock:
            self._check_alive()

            def inside() -> None:
                with IPRoute() as ipr:
                    links = ipr.get_links(ifname=TAP_NAME)
                    if not links:
                        raise NetworkError(f"slot {self.index}: {TAP_NAME} is gone")
                    if links[0].get_attr("IFLA_CARRIER"):
                        raise SlotBusyError(self.index)
                if not self._policy.is_default:
                    nft.apply(rulesets.policy_update(self._a, DEFAULT_POLICY))
                conntrack.flush_all()

            _netns.run_in(self.netns, inside)
            self._policy = DEFAULT_POLICY
            self._egress_off()
            conntrack.flush_source(self.host_ip)

    def destroy(self) -> None:
        """Remove the slot from the host. Idempotent. A VMM still running inside keeps the
        namespace alive until it exits, so stop it first."""
        with self._lock:
            if self._destroyed:
                return
            t0 = time.perf_counter()
            self._egress_off()
            self._teardown()
            self._destroyed = True
        log.debug("slot destroy index=%d ms=%.1f", self.index, (time.perf_counter() - t0) * 1000)

    # -- internals -------------------------------------------------------------------------

    def _check_alive(self) -> None:
        if self._destroyed:
            raise NetworkError(f"slot {self.index} was destroyed")

    def _setup_inside(self, host_fd: int, tap_uid: int | None, tap_gid: int | None,
                      made: set[str]) -> None:
        """Runs in a thread inside the new namespace; records in ``made`` what exists."""
        made.add("netns")
        s = self._addrs
        for key, value in _NS_SYSCTLS:
            _netns.sysctl(key, value, missing_ok=key.startswith("net.ipv6."))
        with IPRoute() as ipr:
            ipr.link("set", index=1, state="up")  # lo is always ifindex 1 in a new netns
            # pyroute2 creates the tap with ioctls on /dev/net/tun in this very thread,
            # hence inside the namespace. Persistent: it outlives this fd, a VMM reopens it.
            tap_args: dict[str, object] = {"ifr": _TAP_FLAGS}
            if tap_uid is not None:
                tap_args["uid"] = tap_uid
            if tap_gid is not None:
                tap_args["gid"] = tap_gid
            ipr.link("add", ifname=TAP_NAME, kind="tuntap", mode="tap", **tap_args)
            tap = ipr.link_lookup(ifname=TAP_NAME)[0]
            ipr.link("set", index=tap, address=TAP_MAC, state="up")
            ipr.addr("add", index=tap, address=TAP_IP, prefixlen=LINK_PREFIXLEN)
            ipr.neigh("add", dst=GUEST_IP, lladdr=GUEST_MAC, ifindex=tap,
                      state=_nud["permanent"])
            # The peer is born directly in the host namespace: no move, no rename.
            ipr.link("add", ifname=NS_VETH_NAME, kind="veth",
                     peer={"ifname": s.host_veth, "net_ns_fd": host_fd})
            made.add("veth")
            eth = ipr.link_lookup(ifname=NS_VETH_NAME)[0]
            ipr.addr("add", index=eth, address=s.veth_ns_ip, prefixlen=31)
            ipr.link("set", index=eth, state="up")
            ipr.route("add", dst="0.0.0.0/0", gateway=s.veth_host_ip)
        # Spawned from this thread, nft runs inside the namespace.
        nft.apply(rulesets.slot_table(self._a, s, self._policy))

    def _setup_host(self) -> None:
        s = self._addrs
        # No IPv6 link-local on the host end: nothing aenv does there speaks IPv6.
        _netns.sysctl(f"net.ipv6.conf.{s.host_veth}.disable_ipv6", 1, missing_ok=True)
        with IPRoute() as ipr:
            veth = ipr.link_lookup(ifname=s.host_veth)[0]
            ipr.addr("add", index=veth, address=s.veth_host_ip, prefixlen=31)
            ipr.link("set", index=veth, state="up")
            ipr.route("add", dst=f"{s.host_ip}/32", gateway=s.veth_ns_ip, oif=veth)

    def _teardown(self, *, veth: bool = True, namespace: bool = True) -> None:
        """Delete the host veth (its peer and the /32 route go with it), forget the host's
        conntrack entries of the guest's egress, and drop the namespace (tap0 dies with it)."""
        s = self._addrs
        if veth:
            with IPRoute() as ipr:
                try:
                    ipr.link("del", ifname=s.host_veth)
                except NetlinkError as e:
                    if e.code != _ENODEV:
                        raise
            conntrack.flush_source(s.host_ip)
        if namespace:
            _netns.remove(s.netns)
