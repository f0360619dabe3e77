"""The node's egress CA (made once, key 0600, leaves that verify for their name only), the
proxy's resolver (hosts file first, re-read when it changes) and where the proxy may
never connect."""

from __future__ import annotations

import asyncio
import os
import socket
import ssl
import stat
import time
from pathlib import Path

import pytest

from aenv.config import Settings
from aenv.egress.ca import EgressCA
from aenv.egress.proxy import Resolver
from aenv.network.addressing import Addressing
from aenv.network.egress_guard import upstream_refused


def test_the_ca_is_made_once_and_its_key_kept_private(tmp_path: Path) -> None:
    ca = EgressCA(tmp_path / "ca")
    assert stat.S_IMODE((tmp_path / "ca" / "ca-key.pem").stat().st_mode) == 0o600
    again = EgressCA(tmp_path / "ca")
    assert again.pem == ca.pem


def test_a_leaf_verifies_for_its_name_and_no_other(tmp_path: Path) -> None:
    ca = EgressCA(tmp_path / "ca")
    server = ca.server_context("api.example.com")
    assert ca.server_context("api.example.com") is server  # made once per name
    client = ssl.create_default_context(cafile=str(tmp_path / "ca" / "ca.pem"))

    def handshake(name: str) -> None:
        c_in, c_out, s_in, s_out = (ssl.MemoryBIO() for _ in range(4))
        c = client.wrap_bio(c_in, c_out, server_hostname=name)
        s = server.wrap_bio(s_in, s_out, server_side=True)
        for _ in range(10):
            for side in (c, s):
                try:
                    side.do_handshake()
                except ssl.SSLWantReadError:
                    pass
            s_in.write(c_out.read())
            c_in.write(s_out.read())
        c.do_handshake()

    handshake("api.example.com")
    with pytest.raises(ssl.SSLCertVerificationError):
        handshake("other.example.com")
    assert not list((tmp_path / "ca").glob("*.pem.*")) and \
        sorted(p.name for p in (tmp_path / "ca").iterdir()) == ["ca-key.pem", "ca.pem"]


def test_the_hosts_file_comes_first_and_is_reread(tmp_path: Path) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text("10.9.9.9 a.test b.test  # comment\n10.9.9.8 a.test\n")
    r = Resolver(hosts)
    assert asyncio.run(r.resolve("a.test")) == ["10.9.9.9", "10.9.9.8"]
    time.sleep(0.01)
    hosts.write_text("10.7.7.7 b.test\n")
    os.utime(hosts, (time.time() + 5, time.time() + 5))
    assert asyncio.run(r.resolve("b.test")) == ["10.7.7.7"]
    assert asyncio.run(r.resolve("localhost")) == ["127.0.0.1"]  # then the system's
    assert asyncio.run(Resolver().resolve("no-such-name.invalid")) == []


def test_the_proxy_never_dials_the_host_or_aenvs_ranges(tmp_path: Path) -> None:
    refused = upstream_refused(Addressing(Settings(home=tmp_path, host_cidr="10.201.0.0/24",
                                                   veth_cidr="10.202.0.0/24")))
    for ip in ("127.0.0.1", "0.0.0.0", "10.201.0.5", "10.202.0.9", "169.254.169.254",
               "224.0.0.1", "not-an-ip"):
        assert refused(ip), ip
    assert not refused("93.184.216.34")
    assert not refused("10.99.99.99")  # private, but the slot's CIDR rules judge that
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # no packet: only picks the source address
        except OSError:
            pytest.skip("no default route: no address of the host to try")
        assert refused(s.getsockname()[0])  # one of the host's own addresses
