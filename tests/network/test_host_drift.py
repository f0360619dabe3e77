"""The host table comes back when something removes or changes it (``nft flush ruleset``,
a firewall reload), or slots stop being handed out with a clear error; the tables inside
slot namespaces are out of reach of any such flush."""

from __future__ import annotations

import socket
import subprocess
import time

import pytest
from pyroute2 import IPRoute

from aenv.network import HostTableError, NetworkError, host, nft
from aenv.network import netns as ns

from .helpers import (
    CTR_GATEWAY_IP,
    METADATA_IP,
    OPEN,
    Listener,
    Server,
    blocked,
    connect,
    ns_socket,
)

pytestmark = pytest.mark.net

@pytest.fixture
def no_background_checks(monkeypatch):
    """Only acquire checks the host table: the filler's periodic check would otherwise
    restore it before a test has seen it gone."""
    monkeypatch.setattr(host, "CHECK_INTERVAL", 3600.0)


def _delete_host_table(table: str) -> None:
    nft.apply(f"delete table inet {table}\n")


def _has_host_table(table: str) -> bool:
    return ("inet", table) in nft.list_tables()


class Sink(Server):
    """A host service on ``ip`` that keeps its connection open and records what arrives."""

    backlog = 4

    def __init__(self, ip: str) -> None:
        self.received = b""
        self._conns: list[socket.socket] = []
        super().__init__(None, ip, 0)

    def _serve(self) -> None:
        try:
            conn, _ = self.sock.accept()
        except OSError:
            return
        self._conns.append(conn)
        try:
            while chunk := conn.recv(256):
                self.received += chunk
        except OSError:
            pass

    def close(self) -> None:
        for c in self._conns:
            try:
                c.shutdown(socket.SHUT_RDWR)  # wakes the recv; a close alone would not
            except OSError:
                pass
            c.close()
        super().close()


def test_a_deleted_host_table_is_back_before_the_next_acquire_returns(
        no_background_checks, pool_factory, make_guest, host_address):
    pool = pool_factory()
    guest = make_guest(pool.acquire())
    ip, port = host_address.ip, host_address.listener.port
    assert blocked(guest.netns, ip, port)
    _delete_host_table(pool.addressing.table)
    assert connect(guest.netns, ip, port).startswith("host ")  # isolation is gone
    pool.acquire()
    assert _has_host_table(pool.addressing.table)
    assert blocked(guest.netns, ip, port)


def test_the_pool_restores_a_deleted_host_table_without_being_asked(
        monkeypatch, pool_factory, make_guest, host_address):
    monkeypatch.setattr(host, "CHECK_INTERVAL", 0.2)
    pool = pool_factory()
    guest = make_guest(pool.acquire())
    _delete_host_table(pool.addressing.table)
    deadline = time.monotonic() + 5
    while not _has_host_table(pool.addressing.table) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _has_host_table(pool.addressing.table)
    assert blocked(guest.netns, host_address.ip, host_address.listener.port)


def test_a_changed_host_table_is_loaded_again(no_background_checks, pool_factory, make_guest,
                                              host_address):
    pool = pool_factory()
    guest = make_guest(pool.acquire())
    table = pool.addressing.table
    ip, port = host_address.ip, host_address.listener.port
    loaded = nft.list_table("inet", table)
    nft.apply(f"insert rule inet {table} prerouting accept\n"
              f"insert rule inet {table} input accept\n")
    assert connect(guest.netns, ip, port).startswith("host ")
    pool.acquire()
    assert nft.list_table("inet", table) == loaded
    assert blocked(guest.netns, ip, port)


def test_connections_guests_opened_while_the_table_was_gone_do_not_survive_it(
        no_background_checks, pool_factory, make_guest, host_address):
    pool = pool_factory()
    guest = make_guest(pool.acquire())
    sink = Sink(host_address.ip)
    conn = ns_socket(guest.netns)
    try:
        _delete_host_table(pool.addressing.table)
        conn.settimeout(2)
        conn.connect((host_address.ip, sink.port))
        conn.sendall(b"during ")
        deadline = time.monotonic() + 2
        while sink.received != b"during " and time.monotonic() < deadline:
            time.sleep(0.02)
        assert sink.received == b"during "
        pool.acquire()
        try:
            conn.sendall(b"after")
        except OSError:
            pass
        time.sleep(1.0)
        assert sink.received == b"during "
    finally:
        conn.close()
        sink.close()


class TableSquatter:
    """Another program holding a table of aenv's name that only it may change (nft's
    ``owner`` flag): what aenv's restore then meets is the kernel refusing it."""

    def __init__(self, table: str) -> None:
        self.proc = subprocess.Popen([nft.binary(), "-i"], stdin=subprocess.PIPE,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     text=True)
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"add table inet {table} {{ flags owner; }}\n")
        self.proc.stdin.flush()
        deadline = time.monotonic() + 5
        while not _has_host_table(table) and time.monotonic() < deadline:
            time.sleep(0.02)

    def close(self) -> None:
        self.proc.kill()  # the kernel drops an owner's table with its netlink socket
        self.proc.wait()


def test_acquire_stops_with_a_clear_error_while_the_host_table_cannot_be_restored(
        no_background_checks, pool_factory):
    pool = pool_factory()
    table = pool.addressing.table
    _delete_host_table(table)
    squatter = TableSquatter(table)
    try:
        with pytest.raises(HostTableError) as e:
            pool.acquire()
        assert isinstance(e.value, NetworkError)
        assert f"inet {table}" in str(e.value) and "no network slot" in str(e.value)
        assert pool.stats()["leased"] == 0
    finally:
        squatter.close()
    deadline = time.monotonic() + 5
    while _has_host_table(table) and time.monotonic() < deadline:
        time.sleep(0.02)
    pool.acquire()  # the name is free again: restored, and slots go out again
    assert _has_host_table(table)


# -- inside a container: flushes and a gateway that moves --------------------------------


def test_a_flush_of_the_hosts_ruleset_leaves_the_slot_tables_alone(in_container, make_guest):
    """``nft flush ruleset`` acts on one network namespace: the one aenv runs in."""
    box, a = in_container.box, in_container.addressing
    slot = in_container.make_slot(1, OPEN)
    guest = make_guest(slot)
    before = nft.list_table("inet", a.table, netns=slot.netns)
    box.run(lambda: nft.apply("flush ruleset\n"))
    assert box.run(nft.list_tables) == []
    assert nft.list_table("inet", a.table, netns=slot.netns) == before
    assert blocked(guest.netns, METADATA_IP, 80)  # the slot alone still refuses it


def test_a_new_default_gateway_is_refused_after_the_next_periodic_check(
        monkeypatch, in_container, make_guest, settings):
    monkeypatch.setattr(host, "CHECK_INTERVAL", 0.2)
    from aenv.network import SlotPool

    box = in_container.box
    new_gateway = CTR_GATEWAY_IP.rsplit(".", 1)[0] + ".3"

    def add_gateway() -> None:
        with IPRoute() as ipr:
            ipr.addr("add", index=ipr.link_lookup(ifname="br0")[0], address=new_gateway,
                     prefixlen=24)

    ns.run_in(box.outer, add_gateway)
    lis = Listener(box.outer, new_gateway, 0, "new-gateway")
    pool = SlotPool(settings, warm_size=0)
    box.run(pool.start)  # its filler thread lives in the container's namespace too
    try:
        guest = make_guest(box.run(lambda: pool.acquire(OPEN)))
        assert connect(guest.netns, new_gateway, lis.port).startswith("new-gateway ")

        def move_default_route() -> None:
            with IPRoute() as ipr:
                ipr.route("replace", dst="0.0.0.0/0", gateway=new_gateway)

        box.run(move_default_route)
        deadline = time.monotonic() + 5
        while not blocked(guest.netns, new_gateway, lis.port, timeout=0.3) and \
                time.monotonic() < deadline:
            time.sleep(0.1)
        assert blocked(guest.netns, new_gateway, lis.port)
        guest.close()
    finally:
        lis.close()
        box.run(pool.close)


def test_the_host_table_check_acts_in_the_namespace_it_is_called_from(in_container):
    """Run from the container's namespace, a check finds and restores the table there and
    touches nothing on the real host."""
    box, a = in_container.box, in_container.addressing
    table = box.run(lambda: host.HostTable(a))
    box.run(table.load)
    assert box.run(table.check) is False
    box.run(lambda: nft.apply(f"delete table inet {a.table}\n"))
    assert box.run(table.check) is True
    assert ("inet", a.table) in box.run(nft.list_tables)
    assert not _has_host_table(a.table)  # nothing of it on the real host
