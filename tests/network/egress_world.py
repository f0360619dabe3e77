"""An "internet" for egress tests: a namespace reached from the host through a veth, with
an HTTP server on :80, a TLS server on :443 (a certificate per name from a test CA, chosen
by SNI) and a plain one on :8080, each recording the request headers it got. Also the
hosts file that points the test names at it, for the egress proxy's resolver.
Nothing here is a test; names and addresses come from the caller."""

from __future__ import annotations

import os
import socket
import ssl
import struct
import threading
from pathlib import Path

from pyroute2 import IPRoute

from aenv.egress.ca import EgressCA
from aenv.network import NetworkSlot
from aenv.network import netns as ns

from .helpers import FakeGuest, ThreadedServer, ns_socket

NAMES = ("allowed.aes.test", "api.aes.test", "plain.aes.test", "wild.aes.test",
         "a.wild.aes.test", "b.c.wild.aes.test", "denied.aes.test")


class Echo(ThreadedServer):
    """HTTP/1 on ``ip``:``port`` in ``netns`` (TLS with ``tls``): answers 200 ``ok <host>``
    and records the headers of every request in ``seen``."""

    def __init__(self, netns: str, ip: str, port: int, tls: ssl.SSLContext | None = None
                 ) -> None:
        self.tls, self.seen = tls, []
        super().__init__(netns, ip, port)

    def _one(self, conn: socket.socket) -> None:
        try:
            if self.tls is not None:
                conn = self.tls.wrap_socket(conn, server_side=True)
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = conn.recv(4096)
                if not chunk:
                    return
                data += chunk
            lines = data.split(b"\r\n\r\n")[0].decode().split("\r\n")[1:]
            headers = {k.strip().lower(): v.strip() for k, _, v in
                       (line.partition(":") for line in lines)}
            self.seen.append(headers)
            body = f"ok {headers.get('host')}\n".encode()
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n"
                         % len(body) + body)
        except (OSError, ssl.SSLError):
            pass
        finally:
            conn.close()


class Socks5(ThreadedServer):
    """A SOCKS5 proxy (RFC 1928; RFC 1929 when ``credentials`` are set; TLS with ``tls``)
    on ``ip``:``port`` in ``netns``, connecting from there. ``asked`` records every
    CONNECT as (ATYP, host, port, username); ``refuse`` makes it answer 'connection
    refused' (5) without connecting."""

    def __init__(self, netns: str, ip: str, port: int, *,
                 credentials: tuple[str, str] | None = None,
                 tls: ssl.SSLContext | None = None) -> None:
        self.netns, self.credentials, self.tls = netns, credentials, tls
        self.asked: list[tuple[int, str, int, str | None]] = []
        self.refuse = False
        super().__init__(netns, ip, port)

    @staticmethod
    def _read(conn: socket.socket, n: int) -> bytes:
        out = b""
        while len(out) < n:
            chunk = conn.recv(n - len(out))
            if not chunk:
                raise ConnectionError("closed")
            out += chunk
        return out

    def _one(self, conn: socket.socket) -> None:
        up: socket.socket | None = None
        try:
            if self.tls is not None:
                conn = self.tls.wrap_socket(conn, server_side=True)
            version, n = self._read(conn, 2)
            methods = self._read(conn, n)
            want = 2 if self.credentials else 0
            if version != 5 or want not in methods:
                conn.sendall(b"\x05\xff")
                return
            conn.sendall(bytes([5, want]))
            user = None
            if want == 2:
                _, ulen = self._read(conn, 2)
                user = self._read(conn, ulen).decode()
                password = self._read(conn, self._read(conn, 1)[0]).decode()
                ok = (user, password) == self.credentials
                conn.sendall(b"\x01\x00" if ok else b"\x01\x01")
                if not ok:
                    return
            _, cmd, _, atyp = self._read(conn, 4)
            if atyp == 1:
                host = socket.inet_ntoa(self._read(conn, 4))
            else:
                host = self._read(conn, self._read(conn, 1)[0]).decode()
            port = struct.unpack("!H", self._read(conn, 2))[0]
            self.asked.append((atyp, host, port, user))
            if cmd != 1 or self.refuse:
                conn.sendall(b"\x05\x05\x00\x01" + bytes(6))
                return
            target = INET_HOSTS.get(host, host)  # the proxy's own "remote DNS"
            up = ns_socket(self.netns)
            up.settimeout(5)
            up.connect((target, port))
            up.settimeout(None)
            conn.sendall(b"\x05\x00\x00\x01" + bytes(6))
            threading.Thread(target=_copy, args=(up, conn), daemon=True).start()
            _copy(conn, up)
        except (OSError, ssl.SSLError, ConnectionError, ValueError):
            pass
        finally:
            if up is not None:
                up.close()
            conn.close()


def _copy(src: socket.socket, dst: socket.socket) -> None:
    try:
        while chunk := src.recv(65536):
            dst.sendall(chunk)
        dst.shutdown(socket.SHUT_WR)
    except (OSError, ssl.SSLError):
        pass


# What the proxy resolves names to (set by ``Internet``).
INET_HOSTS: dict[str, str] = {}


class Guest(FakeGuest):
    """The stand-in guest (``helpers.FakeGuest``) in the namespace ``netns``; requests
    go to ``target`` unless told otherwise."""

    def __init__(self, slot: NetworkSlot, netns: str, target: str) -> None:
        self.target = target  # before FakeGuest sets up the namespace
        super().__init__(slot, netns)

    def request(self, host: str, *, port: int = 80, tls: ssl.SSLContext | None = None,
                to: str | None = None, sni: str | None = None) -> bytes:
        """The raw answer to ``GET /`` with ``Host: host`` sent from the guest to
        ``to``:``port`` (the slot redirects 80/443 whatever the address)."""
        def go() -> bytes:
            s = socket.create_connection((to or self.target, port), timeout=5)
            try:
                if tls is not None:
                    s = tls.wrap_socket(s, server_hostname=sni or host)
                s.sendall(f"GET / HTTP/1.1\r\nHost: {host}\r\nUser-Agent: t\r\n\r\n".encode())
                out = b""
                while chunk := s.recv(65536):
                    out += chunk
                return out
            finally:
                s.close()
        return ns.run_in(self.netns, go)


class Internet:
    def __init__(self, tmp: Path, netns: str, veth: str, host_ip: str, ip: str) -> None:
        self.tmp, self.netns, self.veth, self.host_ip, self.ip = tmp, netns, veth, host_ip, ip
        self.ca = EgressCA(tmp / "site-ca")  # the sites' own CA
        self.ca_file = tmp / "site-ca" / "ca.pem"
        self.hosts = tmp / "hosts"
        self.hosts.write_text(f"{ip} {' '.join(NAMES)}\n")
        INET_HOSTS.update({name: ip for name in NAMES})
        self.servers: list[Echo] = []
        try:
            self._up()
            self.http = self._echo(80)
            self.https = self._echo(443, self._site_tls())
            self.other = self._echo(8080)
        except BaseException:
            self.close()
            raise

    def _echo(self, port: int, tls: ssl.SSLContext | None = None) -> Echo:
        server = Echo(self.netns, self.ip, port, tls)
        self.servers.append(server)
        return server

    def _site_tls(self) -> ssl.SSLContext:
        contexts = {}
        for name in NAMES:
            cert, key = self.ca.leaf(name)
            pem = self.tmp / f"{name}.pem"
            pem.write_bytes(cert + key)
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(str(pem))
            contexts[name] = ctx
        site = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        site.load_cert_chain(str(self.tmp / f"{NAMES[0]}.pem"))

        def pick(sock: ssl.SSLObject, name: str | None, _: object) -> None:
            if name in contexts:
                sock.context = contexts[name]
        site.sni_callback = pick  # type: ignore[assignment]
        return site

    def trusting(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.ca_file))

    def _up(self) -> None:
        host_fd = os.open("/proc/thread-self/ns/net", os.O_RDONLY)

        def inside() -> None:
            with IPRoute() as ipr:
                ipr.link("set", index=1, state="up")
                ipr.link("add", ifname="eth0", kind="veth",
                         peer={"ifname": self.veth, "net_ns_fd": host_fd})
                eth = ipr.link_lookup(ifname="eth0")[0]
                ipr.addr("add", index=eth, address=self.ip, prefixlen=30)
                ipr.link("set", index=eth, state="up")
        try:
            ns.create(self.netns, inside)
        finally:
            os.close(host_fd)
        with IPRoute() as ipr:
            v = ipr.link_lookup(ifname=self.veth)[0]
            ipr.addr("add", index=v, address=self.host_ip, prefixlen=30)
            ipr.link("set", index=v, state="up")

    def seen(self) -> list[dict[str, str]]:
        return [h for s in self.servers for h in s.seen]

    def clear(self) -> None:
        for s in self.servers:
            s.seen.clear()

    def close(self) -> None:
        for s in self.servers:
            s.close()
        with IPRoute() as ipr:
            if ipr.link_lookup(ifname=self.veth):
                ipr.link("del", ifname=self.veth)
        ns.remove(self.netns)
