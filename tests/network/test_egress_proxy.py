"""The egress proxy end to end in network namespaces, without a VM: a real slot (its nft
redirect of TCP 80/443 to the listener it made inside its namespace), the stand-in guest
on its tap, and an "internet" namespace with an HTTP server on :80 and a TLS server on
:443 whose certificates come from a test CA. The proxy runs in this process on its own
event loop, as it does in the server.

Shown: an allowed name is reached over HTTP and TLS; a name no entry allows is refused
under deny-by-default (403 over HTTP, the TLS connection closed) and never reaches the
server; ``*.`` wildcards match subdomains but not the apex; a Host that is the server's
address, and a direct connection to another port of it, are refused; a transform's
header with a secret reaches the server, and the guest's bytes never hold the secret;
an unknown secret, or one that would split a header, answers 502; an absolute request
target must name the host its Host does; the listener goes when the policy no longer needs it.
Names and addresses are this file's own: ``aes`` objects in 10.125.0.0/16.
"""

from __future__ import annotations

import asyncio
import os
import socket
import ssl
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from aenv.egress import proxy as proxy_module
from aenv.egress.ca import EgressCA
from aenv.egress.proxy import EgressProxy, Resolver
from aenv.egress.socks import SocksProxy
from aenv.network import NetworkSlot, host, nft
from aenv.network import netns as ns
from aenv.network.addressing import Addressing
from aenv.network.egress_guard import upstream_refused
from aenv.network.policy import DEFAULT_POLICY, EgressPolicy, header_rules
from aenv.store.secrets import SecretsUnavailable

from .egress_world import Guest, Internet, Socks5
from .helpers import Listener, blocked, connect, make_settings

pytestmark = pytest.mark.net

PREFIX = "aes"
INET_HOST_IP, INET_IP = "10.125.2.1", "10.125.2.2"
SECRET = "s3cr3t-token-value"


class World:
    def __init__(self, tmp: Path, inet: Internet) -> None:
        self.addressing = Addressing(make_settings(
            tmp, name_prefix=PREFIX, host_cidr="10.125.0.0/24", veth_cidr="10.125.1.0/24"))
        self.inet, self.site_ca = inet, inet.ca
        self.http, self.https, self.other = inet.http, inet.https, inet.other
        self.node_ca = EgressCA(tmp / "node-ca")
        self.secrets = {"tok": SECRET}
        self.store_down = False
        self.proxy = EgressProxy(self.node_ca, self.secret, resolver=Resolver(inet.hosts),
                                 refused=upstream_refused(self.addressing),
                                 upstream_ca=inet.ca_file)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self.proxy.start(), self.loop).result(5)
        self.slot = NetworkSlot.create(self.addressing, 1, egress=self.proxy)
        self.guest = Guest(self.slot, f"{PREFIX}-g1", INET_IP)

    async def secret(self, name: str) -> str | None:
        if self.store_down:   # a cluster's Redis unreachable (aenv.cluster.shared_secrets)
            raise SecretsUnavailable("ConnectionError: Redis is down")
        return self.secrets.get(name)  # read at each request: a change applies to the next

    def guest_call(self, fn):  # type: ignore[no-untyped-def]
        return ns.run_in(self.guest.netns, fn)

    def trusting(self, ca: EgressCA) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(ca.directory / "ca.pem"))

    def close(self) -> None:
        if getattr(self, "guest", None) is not None:
            self.guest.close()
        if getattr(self, "slot", None) is not None:
            self.slot.destroy()
        asyncio.run_coroutine_threadsafe(self.proxy.close(), self.loop).result(5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    if os.geteuid() != 0 or nft.binary() is None:
        pytest.skip("network tests need root and nft")
    tmp = tmp_path_factory.mktemp("egress")
    addressing = Addressing(make_settings(tmp, name_prefix=PREFIX, host_cidr="10.125.0.0/24",
                                          veth_cidr="10.125.1.0/24"))
    host.prepare(addressing)
    w: World | None = None
    inet: Internet | None = None
    try:
        inet = Internet(tmp, "aes-inet", "aes-i", INET_HOST_IP, INET_IP)
        w = World(tmp, inet)
        yield w
    finally:
        if w is not None:
            w.close()
        if inet is not None:
            inet.close()
        host.remove_table(addressing)
    leftovers = [n for n in ns.list_names() if n.startswith(PREFIX + "-")]
    assert not leftovers, leftovers


POLICY = EgressPolicy.build(
    allow_out=["allowed.aes.test", "api.aes.test", "plain.aes.test", "*.wild.aes.test"],
    deny_out=["0.0.0.0/0"],
    rules=header_rules({
        "api.aes.test": [{"transform": {"headers": {
            "Authorization": "Bearer ${e2b.secrets.tok}"}}}],
        "plain.aes.test": [{"transform": {"headers": {"X-Key": "${e2b.secrets.tok}",
                                                     "User-Agent": "aenv"}}}],
        "denied.aes.test": [{"transform": {"headers": {"X-Key": "${e2b.secrets.nope}"}}}],
    }))


@pytest.fixture
def proxied(world: World) -> Iterator[World]:
    world.slot.set_policy(POLICY)
    world.http.seen.clear()
    world.https.seen.clear()
    yield world
    world.slot.set_policy(DEFAULT_POLICY)


def test_an_allowed_name_is_reached_over_http_and_tls(proxied: World) -> None:
    w = proxied
    assert w.guest.request("allowed.aes.test").endswith(b"ok allowed.aes.test\n")
    out = w.guest.request("allowed.aes.test", port=443, tls=w.trusting(w.site_ca))
    assert out.endswith(b"ok allowed.aes.test\n")  # end to end: the site's own certificate
    assert [h["host"] for h in w.http.seen + w.https.seen] == ["allowed.aes.test"] * 2
    # HTTP goes one request per connection, so every request's Host is judged.
    assert w.http.seen[0]["connection"] == "close"


def counted(kind: str, label: str) -> float:
    metric = proxy_module.CONNECTIONS if kind == "connections" else proxy_module.DNS_QUERIES
    return float(metric.labels(label)._value.get())


def test_a_name_not_allowed_is_refused_and_never_reaches_the_server(proxied: World) -> None:
    w = proxied
    refused, served = counted("connections", "refused"), counted("connections", "served")
    out = w.guest.request("denied.aes.test")
    assert out.startswith(b"HTTP/1.1 403"), out
    with pytest.raises((ssl.SSLError, OSError)):
        w.guest.request("denied.aes.test", port=443, tls=w.trusting(w.site_ca))
    assert w.http.seen == [] and w.https.seen == []
    time.sleep(0.1)
    assert counted("connections", "refused") == refused + 2  # on the server's /metrics
    assert counted("connections", "served") == served


def test_a_wildcard_matches_subdomains_not_the_apex(proxied: World) -> None:
    w = proxied
    assert w.guest.request("a.wild.aes.test").endswith(b"ok a.wild.aes.test\n")
    assert w.guest.request("b.c.wild.aes.test", port=443,
                           tls=w.trusting(w.site_ca)).endswith(b"ok b.c.wild.aes.test\n")
    assert w.guest.request("wild.aes.test").startswith(b"HTTP/1.1 403")


def test_the_servers_address_is_no_way_around_the_names(proxied: World) -> None:
    w = proxied
    assert w.guest.request(INET_IP).startswith(b"HTTP/1.1 403")  # Host: an address
    with pytest.raises(OSError):
        w.guest.request("allowed.aes.test", port=8080)  # another port: the CIDR rules
    assert w.other.seen == [] and w.http.seen == []


def test_without_a_name_the_dialled_address_is_judged(world: World) -> None:
    """TLS without SNI (a client dialling an address) and HTTP/1.0 without Host: the
    address the guest dialled is the name, under the CIDR rules."""
    no_sni = ssl.create_default_context()
    no_sni.check_hostname, no_sni.verify_mode = False, ssl.CERT_NONE

    def tls_by_address() -> bytes:
        with socket.create_connection((INET_IP, 443), timeout=5) as raw, \
                no_sni.wrap_socket(raw) as s:  # no server_hostname: no SNI
            s.sendall(b"GET / HTTP/1.1\r\nHost: allowed.aes.test\r\n\r\n")
            return s.recv(4096)

    def http10() -> bytes:
        with socket.create_connection((INET_IP, 80), timeout=5) as s:
            s.sendall(b"GET / HTTP/1.0\r\n\r\n")
            out = b""
            while chunk := s.recv(4096):
                out += chunk
            return out

    world.slot.set_policy(EgressPolicy.build(allow_out=["allowed.aes.test", f"{INET_IP}/32"],
                                             deny_out=["0.0.0.0/0"]))
    try:
        assert world.guest_call(tls_by_address).startswith(b"HTTP/1.1 200")
        assert world.guest_call(http10).startswith(b"HTTP/1.1 200")
        world.slot.set_policy(POLICY)  # the address is not listed
        with pytest.raises((ssl.SSLError, OSError)):
            world.guest_call(tls_by_address)
        assert world.guest_call(http10).startswith(b"HTTP/1.1 403")
    finally:
        world.slot.set_policy(DEFAULT_POLICY)


def test_an_address_allow_out_lists_is_reached_under_any_name(world: World) -> None:
    """Allowed entries win: a listed address is reached directly, so through the proxy
    too, whatever name the request carries (and only that address is dialled)."""
    world.slot.set_policy(EgressPolicy.build(allow_out=["allowed.aes.test", f"{INET_IP}/32"],
                                             deny_out=["0.0.0.0/0"]))
    world.http.seen.clear()
    try:
        assert world.guest.request("denied.aes.test").endswith(b"ok denied.aes.test\n")
        # The same name dialled at another address is still refused.
        assert world.guest.request("denied.aes.test", to="198.51.100.77").startswith(
            b"HTTP/1.1 403")
        assert [h["host"] for h in world.http.seen] == ["denied.aes.test"]
    finally:
        world.slot.set_policy(DEFAULT_POLICY)


def test_a_transform_sets_headers_the_guest_never_sees(proxied: World) -> None:
    w = proxied
    out = w.guest.request("api.aes.test", port=443, tls=w.trusting(w.node_ca))
    assert out.endswith(b"ok api.aes.test\n")
    assert w.https.seen[-1]["authorization"] == f"Bearer {SECRET}"
    out += w.guest.request("plain.aes.test")
    assert w.http.seen[-1]["x-key"] == SECRET and w.http.seen[-1]["user-agent"] == "aenv"
    assert SECRET.encode() not in out
    # Terminated with the node's CA: a guest that trusts only the site's CA refuses it.
    with pytest.raises(ssl.SSLCertVerificationError):
        w.guest.request("api.aes.test", port=443, tls=w.trusting(w.site_ca))


def test_a_secret_updated_applies_to_the_next_request(proxied: World) -> None:
    w = proxied
    w.secrets["tok"] = "rotated"
    try:
        w.guest.request("plain.aes.test")
        assert w.http.seen[-1]["x-key"] == "rotated"
    finally:
        w.secrets["tok"] = SECRET


def test_an_absolute_target_must_name_the_host_that_was_judged(proxied: World) -> None:
    """A server obeys ``GET http://other/`` over the Host header: the two must agree."""
    def raw(target: str, host: str) -> bytes:
        def go() -> bytes:
            with socket.create_connection((INET_IP, 80), timeout=5) as s:
                s.sendall(f"GET {target} HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
                out = b""
                while chunk := s.recv(65536):
                    out += chunk
                return out
        return proxied.guest_call(go)

    assert raw("http://denied.aes.test/", "allowed.aes.test").startswith(b"HTTP/1.1 403")
    assert raw("http://allowed.aes.test/x", "allowed.aes.test").endswith(
        b"ok allowed.aes.test\n")
    assert [h["host"] for h in proxied.http.seen] == ["allowed.aes.test"]


def test_a_secret_that_would_split_a_header_is_not_sent(proxied: World) -> None:
    proxied.secrets["tok"] = "x\r\nX-Injected: 1"
    try:
        assert proxied.guest.request("plain.aes.test").startswith(b"HTTP/1.1 502")
        assert proxied.http.seen == []
    finally:
        proxied.secrets["tok"] = SECRET


def test_a_secret_store_that_cannot_be_read_answers_502(proxied: World) -> None:
    proxied.store_down = True
    try:
        assert proxied.guest.request("plain.aes.test").startswith(b"HTTP/1.1 502")
        assert proxied.http.seen == []
    finally:
        proxied.store_down = False


def test_a_guest_holds_at_most_so_many_connections(proxied: World,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(proxy_module, "MAX_CONNECTIONS_PER_SLOT", 3)
    before = proxied.proxy.refused

    def go() -> tuple[bytes, int]:
        idle = [socket.create_connection((INET_IP, 80), timeout=5) for _ in range(3)]
        try:
            time.sleep(0.2)  # all three accepted and waiting for their first bytes
            with socket.create_connection((INET_IP, 80), timeout=5) as extra:
                got = extra.recv(100)  # closed at once (without the cap: a 5 s timeout)
            time.sleep(0.1)
            return got, proxied.proxy.refused - before  # the idle ones still open
        finally:
            for s in idle:
                s.close()

    assert proxied.guest_call(go) == (b"", 1)
    time.sleep(0.2)
    assert proxied.guest.request("allowed.aes.test").endswith(b"ok allowed.aes.test\n")


def test_an_unknown_secret_answers_502(world: World) -> None:
    policy = EgressPolicy.build(allow_out=["allowed.aes.test"], deny_out=["0.0.0.0/0"],
                                rules=header_rules({"allowed.aes.test": [
                                    {"transform": {"headers": {"X": "${e2b.secrets.nope}"}}}]}))
    world.slot.set_policy(policy)
    try:
        assert world.guest.request("allowed.aes.test").startswith(b"HTTP/1.1 502")
    finally:
        world.slot.set_policy(DEFAULT_POLICY)


def test_names_without_deny_by_default_follow_the_cidr_rules(world: World) -> None:
    """Only a denied name is refused; another name is reached unless its address is one
    the slot refuses anyway (here: a private address, as a direct connection would be)."""
    world.slot.set_policy(EgressPolicy.build(deny_out=["denied.aes.test"]))
    try:
        assert world.guest.request("denied.aes.test").startswith(b"HTTP/1.1 403")
        out = world.guest.request("allowed.aes.test")
        assert out.startswith(b"HTTP/1.1 403") and b"no address it may reach" in out
    finally:
        world.slot.set_policy(DEFAULT_POLICY)


def _resolve(w: World, name: str, qtype: int = 1, server: str = "8.8.8.8"
             ) -> tuple[int, list[str]]:
    """(rcode, A records) of the guest's UDP query for ``name`` to ``server``:53."""
    labels = b"".join(bytes([len(p)]) + p.encode() for p in name.split(".")) + b"\0"
    q = struct.pack("!HHHHHH", 7, 0x0100, 1, 0, 0, 0) + labels + struct.pack("!HH", qtype, 1)

    def go() -> bytes:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.settimeout(3)
            s.connect((server, 53))  # connected: a reject comes back as an error
            s.send(q)
            return s.recv(4096)
    out = w.guest_call(go)
    count = struct.unpack("!H", out[6:8])[0]
    start = len(q)
    return struct.unpack("!H", out[2:4])[0] & 0xF, [
        ".".join(str(b) for b in out[start + 16 * i + 12:start + 16 * i + 16])
        for i in range(count)]


def test_the_guests_dns_agrees_with_the_policy(proxied: World) -> None:
    """The guest's resolver (8.8.8.8, the default ``dnsServers``) is answered by the node:
    an allowed name with the address the proxy would dial, a refused one NXDOMAIN."""
    assert _resolve(proxied, "allowed.aes.test") == (0, [INET_IP])
    assert _resolve(proxied, "a.wild.aes.test") == (0, [INET_IP])
    assert _resolve(proxied, "denied.aes.test") == (3, [])
    assert _resolve(proxied, "wild.aes.test") == (3, [])
    assert _resolve(proxied, "allowed.aes.test", qtype=28) == (0, [])


def test_dns_servers_are_the_only_resolvers_a_named_policy_opens(world: World) -> None:
    """``dnsServers`` with a domain in ``allowOut``: port 53 of the listed servers passes
    a deny-all (TCP here, to a listener in the "internet"), UDP queries to them are
    answered by the node, and any other resolver (8.8.8.8 here) is refused; ``[]``
    opens none."""
    dns_tcp = Listener(world.inet.netns, INET_IP, 53, "dns")
    try:
        world.slot.set_policy(EgressPolicy.build(
            allow_out=["allowed.aes.test"], deny_out=["0.0.0.0/0"], dns_servers=[INET_IP]))
        assert connect(world.guest.netns, INET_IP, 53).startswith("dns ")
        assert blocked(world.guest.netns, INET_IP, 8080)  # only port 53 of it
        assert _resolve(world, "allowed.aes.test", server=INET_IP) == (0, [INET_IP])
        assert _resolve(world, "denied.aes.test", server=INET_IP) == (3, [])
        with pytest.raises(OSError):  # not listed: the deny-all refuses it, never leaves
            _resolve(world, "allowed.aes.test", server="8.8.8.8")
        world.slot.set_policy(EgressPolicy.build(
            allow_out=["allowed.aes.test"], deny_out=["0.0.0.0/0"], dns_servers=[]))
        assert blocked(world.guest.netns, INET_IP, 53)
        with pytest.raises(OSError):
            _resolve(world, "allowed.aes.test", server=INET_IP)
        # Without a domain in allowOut the servers open nothing (E2B), CIDR rules rule.
        world.slot.set_policy(EgressPolicy.build(
            allow_out=["198.51.100.1"], deny_out=["0.0.0.0/0"], dns_servers=[INET_IP]))
        assert blocked(world.guest.netns, INET_IP, 53)
    finally:
        world.slot.set_policy(DEFAULT_POLICY)
        dns_tcp.close()


def test_the_listener_goes_with_the_policy_that_needed_it(world: World) -> None:
    world.slot.set_policy(POLICY)
    assert world.proxy._servers
    world.slot.set_policy(EgressPolicy.build(deny_out=["0.0.0.0/0"]))
    assert not world.proxy._servers
    with pytest.raises(OSError):  # no redirect: the CIDR rules refuse it
        world.guest.request("allowed.aes.test")
    world.slot.set_policy(DEFAULT_POLICY)


# -- egressProxy: a SOCKS5 proxy of the sandbox's own, in the "internet" ---------------------

SOCKS_PORT, SOCKS_TLS_PORT = 1080, 1443


@pytest.fixture(scope="module")
def socks(world: World) -> Iterator[tuple[Socks5, Socks5]]:
    """A SOCKS5 proxy asking for u/p, and one behind TLS (a certificate from the sites'
    CA for socks.aes.test) asking for nothing."""
    cert, key = world.site_ca.leaf("socks.aes.test")
    pem = world.inet.tmp / "socks.pem"
    pem.write_bytes(cert + key)
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(str(pem))
    plain = Socks5(world.inet.netns, INET_IP, SOCKS_PORT, credentials=("u", "p"))
    secure = Socks5(world.inet.netns, INET_IP, SOCKS_TLS_PORT, tls=tls)
    try:
        yield plain, secure
    finally:
        plain.close()
        secure.close()


def _closed(request) -> bool:  # type: ignore[no-untyped-def]
    """Whether the guest's request got nothing back: a close, or a reset (the node closes
    with the guest's bytes unread)."""
    try:
        return bool(request() == b"")
    except ConnectionResetError:
        return True


def _via(upstream: SocksProxy, *extra: str) -> EgressPolicy:
    return EgressPolicy.build(allow_out=["allowed.aes.test", *extra], deny_out=["0.0.0.0/0"],
                              upstream=upstream)


def test_an_upstream_proxy_carries_what_the_rules_allow(world: World, socks) -> None:
    """Filtering first, then the tunnel: an allowOut name goes as ATYP=domain (80 and
    443), another port of a listed address as ATYP=IPv4; what the rules refuse never
    reaches the proxy."""
    proxy, _ = socks
    proxy.asked.clear()
    world.inet.clear()
    world.slot.set_policy(_via(SocksProxy(INET_IP, SOCKS_PORT, "u", "p"), f"{INET_IP}/32"))
    try:
        assert world.guest.request("allowed.aes.test").endswith(b"ok allowed.aes.test\n")
        assert world.guest.request("allowed.aes.test", port=443,
                                   tls=world.inet.trusting()).endswith(b"ok allowed.aes.test\n")
        assert world.guest.request("x", port=8080).endswith(b"ok x\n")  # not 80/443: raw
        assert proxy.asked == [(3, "allowed.aes.test", 80, "u"),
                               (3, "allowed.aes.test", 443, "u"),
                               (1, INET_IP, 8080, "u")]
        # (Dialled at the listed address a name would be reached: allowed entries win.)
        assert world.guest.request("denied.aes.test", to="198.51.100.7").startswith(
            b"HTTP/1.1 403")
        # An address the rules refuse: accepted by the node, closed at once, never asked.
        assert _closed(lambda: world.guest.request("x", port=8080, to="198.51.100.7"))
        assert len(proxy.asked) == 3
    finally:
        world.slot.set_policy(DEFAULT_POLICY)


def test_an_upstream_proxy_that_fails_fails_closed(world: World, socks) -> None:
    """A proxy that refuses the CONNECT, wrong credentials, or no proxy listening: the
    guest's connection ends and nothing goes straight to the site."""
    proxy, _ = socks
    world.inet.clear()
    try:
        for upstream, refuse in ((SocksProxy(INET_IP, SOCKS_PORT, "u", "p"), True),
                                 (SocksProxy(INET_IP, SOCKS_PORT, "u", "wrong"), False),
                                 (SocksProxy(INET_IP, SOCKS_PORT + 1), False)):
            proxy.refuse = refuse
            world.slot.set_policy(_via(upstream))
            assert _closed(lambda: world.guest.request("allowed.aes.test"))
            assert world.inet.seen() == []
    finally:
        proxy.refuse = False
        world.slot.set_policy(DEFAULT_POLICY)


def test_an_upstream_proxy_over_tls_is_verified(world: World, socks) -> None:
    """TLS to the proxy with its own CA and server name; a CA that does not vouch for it
    fails closed (no plaintext fallback)."""
    _, secure = socks
    secure.asked.clear()
    site_ca = (world.site_ca.directory / "ca.pem").read_text()
    other_ca = (world.node_ca.directory / "ca.pem").read_text()
    try:
        world.slot.set_policy(_via(SocksProxy(INET_IP, SOCKS_TLS_PORT, tls=True,
                                              server_name="socks.aes.test", ca_cert=site_ca)))
        assert world.guest.request("allowed.aes.test").endswith(b"ok allowed.aes.test\n")
        assert secure.asked == [(3, "allowed.aes.test", 80, None)]
        world.slot.set_policy(_via(SocksProxy(INET_IP, SOCKS_TLS_PORT, tls=True,
                                              server_name="socks.aes.test", ca_cert=other_ca)))
        assert _closed(lambda: world.guest.request("allowed.aes.test"))
        assert len(secure.asked) == 1
    finally:
        world.slot.set_policy(DEFAULT_POLICY)


def test_a_transform_goes_through_the_upstream_proxy_too(world: World, socks) -> None:
    """TLS terminated for a transform: the request goes on through the SOCKS tunnel,
    TLS to the site inside it, the secret's header set there."""
    proxy, _ = socks
    proxy.asked.clear()
    world.https.seen.clear()
    world.slot.set_policy(EgressPolicy.build(
        allow_out=["api.aes.test"], deny_out=["0.0.0.0/0"], rules=POLICY.rules,
        upstream=SocksProxy(INET_IP, SOCKS_PORT, "u", "p")))
    try:
        out = world.guest.request("api.aes.test", port=443,
                                  tls=world.trusting(world.node_ca))
        assert out.endswith(b"ok api.aes.test\n") and SECRET.encode() not in out
        assert proxy.asked == [(3, "api.aes.test", 443, "u")]
        assert world.https.seen[-1]["authorization"] == f"Bearer {SECRET}"
    finally:
        world.slot.set_policy(DEFAULT_POLICY)


def test_tcp_dns_to_the_dns_servers_goes_through_the_upstream_proxy(world: World,
                                                                     socks) -> None:
    """What the slot table would let through (port 53 of ``dnsServers`` under a
    deny-all) the proxy lets through too, tunnelled; other ports of that server not."""
    proxy, _ = socks
    proxy.asked.clear()
    dns_tcp = Listener(world.inet.netns, INET_IP, 53, "dns")
    try:
        world.slot.set_policy(EgressPolicy.build(
            allow_out=["allowed.aes.test"], deny_out=["0.0.0.0/0"], dns_servers=[INET_IP],
            upstream=SocksProxy(INET_IP, SOCKS_PORT, "u", "p")))
        assert connect(world.guest.netns, INET_IP, 53).startswith("dns ")
        assert proxy.asked == [(1, INET_IP, 53, "u")]
        assert _closed(lambda: world.guest.request("x", port=8080))
        assert len(proxy.asked) == 1
    finally:
        world.slot.set_policy(DEFAULT_POLICY)
        dns_tcp.close()


def test_a_transform_through_an_upstream_proxy_over_tls(world: World, socks) -> None:
    """TLS to the site inside TLS to the proxy (a transform behind a TLS proxy)."""
    _, secure = socks
    secure.asked.clear()
    world.https.seen.clear()
    site_ca = (world.site_ca.directory / "ca.pem").read_text()
    world.slot.set_policy(EgressPolicy.build(
        allow_out=["api.aes.test"], deny_out=["0.0.0.0/0"], rules=POLICY.rules,
        upstream=SocksProxy(INET_IP, SOCKS_TLS_PORT, tls=True, server_name="socks.aes.test",
                            ca_cert=site_ca)))
    try:
        out = world.guest.request("api.aes.test", port=443, tls=world.trusting(world.node_ca))
        assert out.endswith(b"ok api.aes.test\n"), out
        assert secure.asked == [(3, "api.aes.test", 443, None)]
        assert world.https.seen[-1]["authorization"] == f"Bearer {SECRET}"
    finally:
        world.slot.set_policy(DEFAULT_POLICY)


def test_a_proxy_in_a_private_range_is_not_dialled_unless_listed(world: World, socks) -> None:
    """As the server builds it (``setup.proxy_address_refused``): the test's proxy is in
    10.125/16, private, so without AENV_EGRESS_PROXY_NETWORKS the connection fails closed
    and the proxy is never dialled."""
    from aenv.egress.setup import proxy_address_refused

    proxy, _ = socks
    proxy.asked.clear()
    world.inet.clear()
    saved = world.proxy._proxy_refused
    world.proxy._proxy_refused = proxy_address_refused(world.proxy._refused, None)
    try:
        world.slot.set_policy(_via(SocksProxy(INET_IP, SOCKS_PORT, "u", "p")))
        assert _closed(lambda: world.guest.request("allowed.aes.test"))
        assert proxy.asked == [] and world.inet.seen() == []
        world.proxy._proxy_refused = proxy_address_refused(world.proxy._refused,
                                                           "10.125.2.0/24")
        assert world.guest.request("allowed.aes.test").endswith(b"ok allowed.aes.test\n")
    finally:
        world.proxy._proxy_refused = saved
        world.slot.set_policy(DEFAULT_POLICY)
