"""cleanup_leftovers: removes what a crash left, keeps what it is told to, touches nothing else."""

from __future__ import annotations

import subprocess

import pytest
from pyroute2 import IPRoute

from aenv.network import NetworkSlot, cleanup_leftovers, host, nft
from aenv.network import netns as ns
from aenv.network.addressing import Addressing

from .helpers import (
    GUEST_IP,
    HELPER,
    OTHER_HOST_CIDR,
    OTHER_VETH_CIDR,
    PREFIX,
    Listener,
    connect,
    make_settings,
)

pytestmark = pytest.mark.net


def _links() -> set[str]:
    with IPRoute() as ipr:
        return {link.get_attr("IFLA_IFNAME") for link in ipr.get_links()}


def test_cleanup_removes_an_orphaned_slot_and_kills_its_vmm(settings, addressing):
    host.prepare(addressing)
    slot = NetworkSlot.create(addressing, 3)
    vmm = ns.run_in(slot.netns, lambda: subprocess.Popen(["sleep", "60"]))
    netns, veth = slot.netns, slot.host_veth
    del slot  # the server "crashed": nobody remembers the slot
    try:
        report = cleanup_leftovers(settings)
        assert vmm.wait(5) != 0  # killed by a signal
    finally:
        vmm.kill()
        vmm.wait()
    assert report.killed_pids == [vmm.pid]
    assert report.namespaces == [netns]
    assert report.veths == [veth]
    assert report.nft_tables == [f"inet {PREFIX}"]
    assert not ns.exists(netns)
    assert veth not in _links()
    assert ("inet", PREFIX) not in nft.list_tables()


def test_cleanup_leaves_objects_that_are_not_aenvs(settings):
    look_alike_ns = [f"{PREFIX}-ns-x", f"{PREFIX}x-ns-1", f"{HELPER}-ns-1"]
    look_alike_tables = [("inet", f"{PREFIX}x"), ("ip", f"{HELPER}")]
    look_alike_veth = f"{PREFIX}-vx"
    try:
        for name in look_alike_ns:
            ns.create(name, lambda: None)
        for family, table in look_alike_tables:
            nft.apply(f"add table {family} {table}\n")
        with IPRoute() as ipr:
            ipr.link("add", ifname=look_alike_veth, kind="veth", peer=f"{HELPER}q")
        report = cleanup_leftovers(settings)
        assert not report, report.summary()
        assert all(ns.exists(name) for name in look_alike_ns)
        tables = nft.list_tables()
        assert all(t in tables for t in look_alike_tables)
        assert look_alike_veth in _links()
    finally:
        for name in look_alike_ns:
            ns.remove(name)
        for family, table in look_alike_tables:
            if (family, table) in nft.list_tables():
                nft.apply(f"delete table {family} {table}\n")
        with IPRoute() as ipr:
            if ipr.link_lookup(ifname=look_alike_veth):
                ipr.link("del", ifname=look_alike_veth)


def test_cleanup_keeps_the_slots_it_is_told_to(settings, addressing, make_guest):
    host.prepare(addressing)
    kept, lost = NetworkSlot.create(addressing, 1), NetworkSlot.create(addressing, 2)
    guest = make_guest(kept)
    lis = Listener(guest.netns, GUEST_IP, 8080, "kept")
    try:
        report = cleanup_leftovers(settings, keep=[kept.index])
        assert report.namespaces == [lost.netns]
        assert report.nft_tables == []  # the kept slot still needs the host table
        assert connect(None, kept.host_ip, 8080).startswith("kept ")
    finally:
        lis.close()
        guest.close()
        kept.destroy()
        lost.destroy()
        host.remove_table(addressing)


def test_cleanup_of_a_clean_host_reports_nothing(settings):
    assert not cleanup_leftovers(settings)


def test_cleanup_uses_the_configured_prefix_only(tmp_path, settings, addressing):
    other = make_settings(tmp_path, name_prefix=f"{PREFIX}b",
                          host_cidr=OTHER_HOST_CIDR, veth_cidr=OTHER_VETH_CIDR)
    other_a = Addressing(other)
    try:
        host.prepare(other_a)
        slot = NetworkSlot.create(other_a, 1)
        assert not cleanup_leftovers(settings)
        assert ns.exists(slot.netns)
    finally:
        cleanup_leftovers(other)
