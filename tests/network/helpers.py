"""Stand-ins for network tests: unique names, sockets in namespaces, a guest, an internet.

Everything runs on this machine only, inside namespaces made here. The session uses its own
name prefix and address ranges (derived from the pid), so it never touches the objects of
a running aenv or of another test session.

The stand-in guest is what a VMM would be: it opens the slot's ``tap0`` and relays frames
to a tap in a namespace of its own, where ``169.254.0.21`` (with the fixed guest MAC) lives.
Taps without offloads on both ends carry complete frames with computed checksums, so the
relay is two ``read``/``write`` calls.
"""


from __future__ import annotations

import fcntl
import os
import select
import socket
import struct
import threading
from pathlib import Path

from pyroute2 import IPRoute

from aenv.config import Settings
from aenv.network import GUEST_IP, GUEST_MAC, TAP_IP, EgressPolicy, NetworkSlot
from aenv.network import netns as ns

_K = os.getpid() % 100
PREFIX = f"at{os.getpid() % 100000:05d}"   # aenv objects of this session
HELPER = f"hx{os.getpid() % 100000:05d}"   # test-only objects (guests, the fake internet)
HOST_CIDR = f"10.{100 + _K}.0.0/24"
VETH_CIDR = f"10.{100 + _K}.1.0/24"
# A second aenv on the same host, and a range with room for three slots only.
OTHER_HOST_CIDR = f"10.{100 + _K}.2.0/24"
OTHER_VETH_CIDR = f"10.{100 + _K}.3.0/24"
TINY_HOST_CIDR = f"10.{100 + _K}.4.0/29"
TINY_VETH_CIDR = f"10.{100 + _K}.4.8/29"
# The fake internet: a /30 of TEST-NET-2 per session, and a private /24 behind it.
INET_HOST_IP = f"198.51.100.{4 * (_K % 60) + 1}"
INET_PEER_IP = f"198.51.100.{4 * (_K % 60) + 2}"
INET_PRIVATE_NET = f"192.168.{200 + _K % 50}.0/24"
INET_PRIVATE_IP = f"192.168.{200 + _K % 50}.1"
# Stands for one of the host's own public addresses (TEST-NET-3, on a dummy link).
HOST_PUBLIC_IP = f"203.0.113.{_K + 1}"
# aenv inside a container: the container's address, its gateway (the outer host's bridge
# address) and an internet address beyond it; all inside namespaces of the test.
CTR_IP = f"172.31.{_K}.2"
CTR_GATEWAY_IP = f"172.31.{_K}.1"
REMOTE_IP = f"203.0.113.{_K + 101}"
METADATA_IP = "169.254.169.254"

OPEN = EgressPolicy.build(allow_out=["0.0.0.0/0"])  # a slot whose guest may reach anything

_TUNSETIFF = 0x400454CA
_IFF_TAP = 0x0002
_IFF_NO_PI = 0x1000


def make_settings(tmp: Path, **overrides: object) -> Settings:
    """Settings of this session: its own prefix and ranges, no warm slots unless asked."""
    fields: dict[str, object] = {"home": tmp, "host_cidr": HOST_CIDR, "veth_cidr": VETH_CIDR,
                                 "name_prefix": PREFIX, "warm_slots": 0}
    fields.update(overrides)
    return Settings(**fields)  # type: ignore[arg-type]


# -- sockets in namespaces ---------------------------------------------------------------


def ns_socket(netns: str | None, kind: int = socket.SOCK_STREAM,
              mark: int | None = None) -> socket.socket:
    """A socket living in ``netns`` (None: the host), with ``SO_MARK`` ``mark`` if given."""
    def make() -> socket.socket:
        s = socket.socket(socket.AF_INET, kind)
        if mark is not None:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_MARK, mark)
        return s

    return make() if netns is None else ns.run_in(netns, make)


class Server:
    """A TCP listener on ``ip``:``port`` in ``netns`` (None: the host) whose ``_serve`` runs in
    a thread; ``close`` stops it."""

    backlog = 16

    def __init__(self, netns: str | None, ip: str, port: int) -> None:
        self.sock = ns_socket(netns)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((ip, port))
        self.sock.listen(self.backlog)
        self.port = self.sock.getsockname()[1]
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        self._thread.join(2)


class ThreadedServer(Server):
    """A ``Server`` that serves each connection in a thread of its own (``_one``), so that a
    slow or stuck client does not hold the others up."""

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn: socket.socket) -> None:
        raise NotImplementedError


class Listener(Server):
    """TCP server answering every connection with ``<tag> <peer address>``."""

    def __init__(self, netns: str | None, ip: str, port: int, tag: str) -> None:
        self.tag = tag
        super().__init__(netns, ip, port)

    def _serve(self) -> None:
        while True:
            try:
                conn, peer = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.sendall(f"{self.tag} {peer[0]}\n".encode())


def connect(netns: str | None, ip: str, port: int, timeout: float = 3.0,
            mark: int | None = None) -> str:
    """Connect from ``netns`` and return the listener's answer; raises OSError if blocked."""
    s = ns_socket(netns, mark=mark)
    s.settimeout(timeout)
    try:
        s.connect((ip, port))
        data = b""
        while not data.endswith(b"\n"):
            chunk = s.recv(256)
            if not chunk:
                break
            data += chunk
        return data.decode().strip()
    finally:
        s.close()


def blocked(netns: str | None, ip: str, port: int, timeout: float = 1.0,
            mark: int | None = None) -> bool:
    try:
        connect(netns, ip, port, timeout, mark)
    except OSError:
        return True
    return False


# -- the stand-in guest ------------------------------------------------------------------


def attach_tap(fd: int, name: str) -> None:
    """Attach an open /dev/net/tun descriptor to the tap ``name`` (creating it if new)."""
    fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH22x", name.encode(), _IFF_TAP | _IFF_NO_PI))


def open_tap(name: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_CLOEXEC)
    try:
        attach_tap(fd, name)
    except OSError:
        os.close(fd)
        raise
    return fd


class FakeGuest:
    """A guest for ``slot``: holds its tap like a VMM and answers on GUEST_IP."""

    def __init__(self, slot: NetworkSlot, netns: str | None = None) -> None:
        self.slot = slot
        self.netns = netns or f"{HELPER}-g{slot.index}"
        self._fds: list[int] = []
        self._stop_r, self._stop_w = os.pipe()
        try:
            self._fds.append(ns.create(self.netns, self._setup))
            self._fds.append(ns.run_in(slot.netns, lambda: open_tap(slot.tap_name)))
        except BaseException:
            self.close()
            raise
        self._thread = threading.Thread(target=self._relay, daemon=True)
        self._thread.start()

    def _setup(self) -> int:
        ns.sysctl("net.ipv6.conf.all.disable_ipv6", 1)
        ns.sysctl("net.ipv6.conf.default.disable_ipv6", 1)
        fd = open_tap("eth0")
        with IPRoute() as ipr:
            ipr.link("set", index=1, state="up")
            eth = ipr.link_lookup(ifname="eth0")[0]
            ipr.link("set", index=eth, address=GUEST_MAC, state="up")
            ipr.addr("add", index=eth, address=GUEST_IP, prefixlen=30)
            ipr.route("add", dst="0.0.0.0/0", gateway=TAP_IP)
        return fd

    def _relay(self) -> None:
        guest, tap = self._fds
        peer = {guest: tap, tap: guest}
        while True:
            ready, _, _ = select.select([guest, tap, self._stop_r], [], [])
            if self._stop_r in ready:
                return
            for fd in ready:
                try:
                    os.write(peer[fd], os.read(fd, 65536))
                except OSError:
                    pass  # a frame the other side refused; like a lossy wire

    def detach(self) -> None:
        """Stop relaying and let go of the slot's tap (as a VMM exiting would)."""
        if hasattr(self, "_thread") and self._thread.is_alive():
            os.write(self._stop_w, b"x")
            self._thread.join(2)
        for fd in self._fds:
            os.close(fd)
        self._fds.clear()

    def close(self) -> None:
        """Detach and remove the guest's namespace. Idempotent."""
        if self._stop_r < 0:
            return
        self.detach()
        os.close(self._stop_r)
        os.close(self._stop_w)
        self._stop_r = self._stop_w = -1
        ns.remove(self.netns)


# -- the fake internet -------------------------------------------------------------------


class FakeInternet:
    """A namespace reached from the host through a veth, holding a public (TEST-NET-2)
    address and a private one, each with its own listener."""

    netns = f"{HELPER}-inet"
    host_veth = f"{HELPER}i"

    def __init__(self) -> None:
        host_fd = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        try:
            ns.create(self.netns, lambda: self._setup(host_fd))
        except BaseException:
            self._remove()
            raise
        finally:
            os.close(host_fd)
        with IPRoute() as ipr:
            v = ipr.link_lookup(ifname=self.host_veth)[0]
            ipr.addr("add", index=v, address=INET_HOST_IP, prefixlen=30)
            ipr.link("set", index=v, state="up")
            ipr.route("add", dst=INET_PRIVATE_NET, gateway=INET_PEER_IP, oif=v)
        self.public = Listener(self.netns, INET_PEER_IP, 0, "internet")
        self.private = Listener(self.netns, INET_PRIVATE_IP, 0, "private")

    def _setup(self, host_fd: int) -> None:
        with IPRoute() as ipr:
            ipr.link("set", index=1, state="up")
            ipr.link("add", ifname="eth0", kind="veth",
                     peer={"ifname": self.host_veth, "net_ns_fd": host_fd})
            eth = ipr.link_lookup(ifname="eth0")[0]
            ipr.addr("add", index=eth, address=INET_PEER_IP, prefixlen=30)
            ipr.addr("add", index=1, address=INET_PRIVATE_IP, prefixlen=24)
            ipr.link("set", index=eth, state="up")

    def _remove(self) -> None:
        with IPRoute() as ipr:
            if ipr.link_lookup(ifname=self.host_veth):
                ipr.link("del", ifname=self.host_veth)
        ns.remove(self.netns)

    def close(self) -> None:
        self.public.close()
        self.private.close()
        self._remove()


# -- the host's own addresses, and aenv inside a container -------------------------------


class DummyAddress:
    """``ip`` on a link of its own in the host namespace (one of "the host's own addresses",
    added after aenv started), with a listener on it; removed by ``close``. The link is a
    veth pair with both ends on the host (the kernel here has no dummy links)."""

    link = f"{HELPER}d"

    def __init__(self, ip: str = HOST_PUBLIC_IP) -> None:
        self.ip = ip
        with IPRoute() as ipr:
            ipr.link("add", ifname=self.link, kind="veth", peer=f"{HELPER}e")
            try:
                idx = ipr.link_lookup(ifname=self.link)[0]
                ipr.addr("add", index=idx, address=ip, prefixlen=32)
                ipr.link("set", index=idx, state="up")
                self.listener = Listener(None, ip, 0, "host")
            except BaseException:
                ipr.link("del", ifname=self.link)
                raise

    def close(self) -> None:
        self.listener.close()
        with IPRoute() as ipr:
            if ipr.link_lookup(ifname=self.link):
                ipr.link("del", ifname=self.link)


class ContainerHost:
    """aenv's view from inside a container, built from two namespaces: ``netns`` is the
    container's (where aenv runs: host table, slot veths, routes), ``outer`` the machine
    around it, the container's default gateway. The outer namespace holds the gateway
    address (the outer host's bridge, as docker0), an address that stands for the internet
    beyond it (``REMOTE_IP``) and a fake cloud metadata service at 169.254.169.254, each
    with a listener; port 80 for the metadata one.

    ``run(fn)`` runs ``fn`` in the container's namespace; threads it starts (a pool's
    filler) stay there. Nothing of it is in the host namespace but the two names."""

    netns = f"{HELPER}-ctr"
    outer = f"{HELPER}-out"

    def __init__(self) -> None:
        self.listeners: dict[str, Listener] = {}
        try:
            ctr_fd = ns.create(self.netns, self._setup_container)
            try:
                ns.create(self.outer, lambda: self._setup_outer(ctr_fd))
            finally:
                os.close(ctr_fd)
            self.run(self._route_container)
            for name, ip, port in (("gateway", CTR_GATEWAY_IP, 0),
                                   ("remote", REMOTE_IP, 0),
                                   ("metadata", METADATA_IP, 80)):
                self.listeners[name] = Listener(self.outer, ip, port, name)
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _setup_container() -> int:
        with IPRoute() as ipr:
            ipr.link("set", index=1, state="up")
        return os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)

    @staticmethod
    def _setup_outer(ctr_fd: int) -> None:
        with IPRoute() as ipr:
            ipr.link("set", index=1, state="up")
            ipr.link("add", ifname="br0", kind="veth",
                     peer={"ifname": "eth0", "net_ns_fd": ctr_fd})
            br = ipr.link_lookup(ifname="br0")[0]
            ipr.addr("add", index=br, address=CTR_GATEWAY_IP, prefixlen=24)
            ipr.link("set", index=br, state="up")
            for ip in (REMOTE_IP, METADATA_IP):
                ipr.addr("add", index=1, address=ip, prefixlen=32)

    @staticmethod
    def _route_container() -> None:
        with IPRoute() as ipr:
            eth = ipr.link_lookup(ifname="eth0")[0]
            ipr.addr("add", index=eth, address=CTR_IP, prefixlen=24)
            ipr.link("set", index=eth, state="up")
            ipr.route("add", dst="0.0.0.0/0", gateway=CTR_GATEWAY_IP)

    def run(self, fn):  # type: ignore[no-untyped-def]
        return ns.run_in(self.netns, fn)

    def close(self) -> None:
        for lis in self.listeners.values():
            lis.close()
        self.listeners.clear()
        ns.remove(self.outer)  # the veth pair dies with the namespaces
        ns.remove(self.netns)
