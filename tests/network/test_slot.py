"""A network slot end to end: a stand-in guest behind tap0, the host, a fake internet."""

from __future__ import annotations

import os

import pytest
from pyroute2 import IPRoute
from pyroute2.netlink.exceptions import NetlinkError

from aenv.network import GUEST_IP, EgressPolicy, NetnsError, NetworkSlot, SlotBusyError, nft
from aenv.network import netns as ns
from aenv.network.conntrack import flush_source
from aenv.network.guest_link import TAP_MAC

from .helpers import (
    HELPER,
    INET_HOST_IP,
    INET_PEER_IP,
    INET_PRIVATE_IP,
    INET_PRIVATE_NET,
    Listener,
    attach_tap,
    blocked,
    connect,
)

pytestmark = pytest.mark.net


def test_host_reaches_a_guest_listener_through_the_host_address(make_slot, make_guest):
    slot = make_slot(1)
    guest = make_guest(slot)
    lis = Listener(guest.netns, GUEST_IP, 0, "guest1")
    try:
        answer = connect(None, slot.host_ip, lis.port)
    finally:
        lis.close()
    tag, peer = answer.split()
    assert tag == "guest1"
    assert peer == slot.addresses.veth_host_ip  # no NAT of the source on the way in


def test_two_slots_with_the_same_guest_ip_answer_independently(make_slot, make_guest):
    a, b = make_slot(1), make_slot(2)
    listeners = [Listener(make_guest(s).netns, GUEST_IP, 8080, f"guest{s.index}")
                 for s in (a, b)]
    try:
        assert connect(None, a.host_ip, 8080).startswith("guest1 ")
        assert connect(None, b.host_ip, 8080).startswith("guest2 ")
    finally:
        for lis in listeners:
            lis.close()


def test_guest_cannot_reach_another_slots_host_address(make_slot, make_guest):
    a, b = make_slot(1), make_slot(2)
    guest_a = make_guest(a)
    lis_b = Listener(make_guest(b).netns, GUEST_IP, 8080, "guest2")
    try:
        assert connect(None, b.host_ip, 8080).startswith("guest2 ")  # B itself is up
        assert blocked(guest_a.netns, b.host_ip, 8080)
        assert blocked(guest_a.netns, b.addresses.veth_ns_ip, 8080)
    finally:
        lis_b.close()


def test_host_firewall_drops_slot_to_slot_even_past_the_namespace_rules(make_slot, make_guest):
    """Traffic made inside slot A's namespace (not by its guest) skips A's forward rules;
    the host's forward chain must still stop it before slot B."""
    a, b = make_slot(1), make_slot(2)
    lis_b = Listener(make_guest(b).netns, GUEST_IP, 8080, "guest2")
    try:
        assert connect(None, b.host_ip, 8080).startswith("guest2 ")
        assert blocked(a.netns, b.host_ip, 8080)
    finally:
        lis_b.close()


def test_guest_cannot_reach_host_services(make_slot, make_guest, internet, addressing):
    slot = make_slot(1)
    guest = make_guest(slot)
    # A listener on every host address (the slot's own veth IP and the host's "uplink"),
    # and one in the slot's namespace on its end of the tap (the guest's gateway).
    lis = Listener(None, "0.0.0.0", 0, "host")
    gateway = Listener(slot.netns, TAP_IP_OF_NETNS, 0, "slot")
    try:
        assert connect(None, INET_HOST_IP, lis.port).startswith("host ")  # it does listen
        assert blocked(guest.netns, slot.addresses.veth_host_ip, lis.port)
        assert blocked(guest.netns, INET_HOST_IP, lis.port)  # not a private range
        assert blocked(guest.netns, TAP_IP_OF_NETNS, gateway.port)
        # Control: with the slot's input rule lifted for that port, the same connection
        # gets its answer, so what refused it above was the firewall, not an empty port.
        nft.apply(f"add rule inet {addressing.table} input tcp dport {gateway.port} accept\n",
                  netns=slot.netns)
        assert connect(guest.netns, TAP_IP_OF_NETNS, gateway.port) == f"slot {GUEST_IP}"
    finally:
        gateway.close()
        lis.close()


TAP_IP_OF_NETNS = "169.254.0.22"


def test_guest_egress_is_masqueraded_by_the_host(make_slot, make_guest, internet):
    slot = make_slot(1)
    guest = make_guest(slot)
    tag, peer = connect(guest.netns, INET_PEER_IP, internet.public.port).split()
    assert tag == "internet"
    assert peer == INET_HOST_IP  # neither the guest's 169.254.0.21 nor the host address


def test_private_ranges_are_refused_unless_allowed(make_slot, make_guest, internet):
    slot = make_slot(1)
    guest = make_guest(slot)
    port = internet.private.port
    assert connect(None, INET_PRIVATE_IP, port).startswith("private ")  # reachable from host
    assert blocked(guest.netns, INET_PRIVATE_IP, port)
    slot.set_policy(EgressPolicy.build(allow_out=[INET_PRIVATE_NET]))
    assert connect(guest.netns, INET_PRIVATE_IP, port).startswith("private ")


def test_deny_out_refuses_a_destination(make_slot, make_guest, internet):
    slot = make_slot(1, policy=EgressPolicy.build(deny_out=[INET_PEER_IP]))
    guest = make_guest(slot)
    assert blocked(guest.netns, INET_PEER_IP, internet.public.port)
    slot.set_policy(EgressPolicy())
    assert connect(guest.netns, INET_PEER_IP, internet.public.port).startswith("internet ")


def test_without_internet_only_allow_out_is_reachable(make_slot, make_guest, internet):
    slot = make_slot(1)
    guest = make_guest(slot)
    slot.set_policy(EgressPolicy.build(allow_out=[INET_PRIVATE_IP], allow_internet=False))
    assert blocked(guest.netns, INET_PEER_IP, internet.public.port)
    assert connect(guest.netns, INET_PRIVATE_IP, internet.private.port).startswith("private ")


def test_allow_out_cannot_open_aenvs_own_ranges(make_slot, make_guest, addressing):
    a, b = make_slot(1), make_slot(2)
    guest_a = make_guest(a)
    lis_b = Listener(make_guest(b).netns, GUEST_IP, 8080, "guest2")
    try:
        a.set_policy(EgressPolicy.build(allow_out=["0.0.0.0/0"]))
        assert blocked(guest_a.netns, b.host_ip, 8080)
    finally:
        lis_b.close()


def test_tap_is_persistent_owned_and_has_the_fixed_mac(make_slot):
    uid, gid = 4321, 4322
    slot = make_slot(1, tap_uid=uid, tap_gid=gid)

    def tap_info():
        with IPRoute() as ipr:
            link = ipr.get_links(ifname=slot.tap_name)[0]
        data = link.get_attr("IFLA_LINKINFO").get_attr("IFLA_INFO_DATA")
        return (link.get_attr("IFLA_ADDRESS"), data.get_attr("IFLA_TUN_OWNER"),
                data.get_attr("IFLA_TUN_GROUP"), data.get_attr("IFLA_TUN_PERSIST"))

    assert ns.run_in(slot.netns, tap_info) == (TAP_MAC, uid, gid, 1)


def _attach_as(netns: str, tap: str, uid: int) -> int:
    """Exit code of a child that opens /dev/net/tun, drops to ``uid`` and attaches ``tap``
    (the tap owner is checked at attach time; /dev/net/tun itself may be root-only)."""

    def child() -> int:
        pid = os.fork()
        if pid == 0:  # pragma: no cover - runs in the child
            code = 1
            try:
                fd = os.open("/dev/net/tun", os.O_RDWR)
                os.setgid(uid)
                os.setuid(uid)
                attach_tap(fd, tap)
                code = 0
            finally:
                os._exit(code)
        return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])

    return ns.run_in(netns, child)


def test_only_the_tap_owner_can_attach_to_it(make_slot):
    slot = make_slot(1, tap_uid=4321, tap_gid=4321)
    assert _attach_as(slot.netns, slot.tap_name, 4321) == 0
    assert _attach_as(slot.netns, slot.tap_name, 4322) != 0


def test_reset_refuses_while_the_tap_is_held(make_slot, make_guest):
    slot = make_slot(1)
    guest = make_guest(slot)
    assert slot.tap_attached()
    with pytest.raises(SlotBusyError):
        slot.reset()
    guest.detach()
    assert not slot.tap_attached()
    slot.reset()


def test_reset_restores_the_default_policy_and_forgets_connections(make_slot, make_guest,
                                                                     internet):
    slot = make_slot(1, policy=EgressPolicy.build(allow_internet=False))
    guest = make_guest(slot)
    assert blocked(guest.netns, INET_PEER_IP, internet.public.port)
    slot.set_policy(EgressPolicy())
    connect(guest.netns, INET_PEER_IP, internet.public.port)
    guest.detach()
    slot.reset()
    assert slot.policy.is_default
    assert flush_source(slot.host_ip) == 0  # nothing left on the host for its address

    def count() -> int:
        from pyroute2 import Conntrack
        with Conntrack() as ct:
            return ct.count()

    assert ns.run_in(slot.netns, count) == 0


def test_destroy_removes_namespace_veth_and_route(make_slot):
    slot = make_slot(1)
    slot.destroy()
    assert not ns.exists(slot.netns)
    with IPRoute() as ipr:
        assert not ipr.link_lookup(ifname=slot.host_veth)
        assert slot.host_ip not in [r.get_attr("RTA_DST") for r in ipr.get_routes()]
    slot.destroy()  # idempotent


def test_a_failed_creation_removes_only_what_it_made(make_slot, make_guest, addressing):
    slot = make_slot(1)
    lis = Listener(make_guest(slot).netns, GUEST_IP, 8080, "guest1")
    try:
        with pytest.raises(NetnsError):
            NetworkSlot.create(addressing, 1)  # the netns name is taken
        assert connect(None, slot.host_ip, 8080).startswith("guest1 ")  # still intact
    finally:
        lis.close()


def test_a_creation_failing_half_way_leaves_nothing(make_slot, addressing):
    with IPRoute() as ipr:  # occupy the host veth name of slot 2
        ipr.link("add", ifname=addressing.slot(2).host_veth, kind="veth",
                 peer=f"{HELPER}p")
    try:
        with pytest.raises(NetlinkError):
            NetworkSlot.create(addressing, 2)
        assert not ns.exists(addressing.slot(2).netns)
    finally:
        with IPRoute() as ipr:
            ipr.link("del", ifname=addressing.slot(2).host_veth)
