"""Guests never reach the host itself: its own addresses (whatever they are and whenever
they appeared), ports it publishes by DNAT, and (when aenv runs in a container) the
outer host and cloud metadata, whatever ``allow_out`` says."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from aenv.network import EgressPolicy

from .helpers import (
    HELPER,
    INET_PEER_IP,
    DummyAddress,
    blocked,
    connect,
)

pytestmark = pytest.mark.net

OPEN = EgressPolicy.build(allow_out=["0.0.0.0/0"])


@pytest.fixture
def host_address() -> Iterator[DummyAddress]:
    """One of the host's own public addresses, added after aenv's host table was loaded."""
    addr = DummyAddress()
    yield addr
    addr.close()


@pytest.fixture
def published_port(host_address, internet) -> Iterator[int]:
    """What ``docker run -p`` does: the host's address, port 8081, DNAT-ed to a listener
    elsewhere (here the fake internet's), by a table that is not aenv's."""
    from aenv.network import nft

    table = f"{HELPER}-dnat"
    nft.apply(f"""table ip {table} {{
    chain prerouting {{
        type nat hook prerouting priority dstnat; policy accept;
        ip daddr {host_address.ip} tcp dport 8081 dnat to {INET_PEER_IP}:{internet.public.port}
    }}
}}
""")
    yield 8081
    nft.apply(f"delete table ip {table}\n")


@pytest.mark.parametrize("policy", [EgressPolicy(), OPEN], ids=["default", "allow-all"])
def test_guest_cannot_reach_an_address_the_host_gained_after_start(make_slot, make_guest,
                                                                    host_address, policy):
    guest = make_guest(make_slot(1, policy=policy))
    assert connect(None, host_address.ip, host_address.listener.port).startswith("host ")
    assert blocked(guest.netns, host_address.ip, host_address.listener.port)


@pytest.mark.parametrize("policy", [EgressPolicy(), OPEN], ids=["default", "allow-all"])
def test_guest_cannot_reach_a_port_the_host_publishes_by_dnat(make_slot, make_guest, internet,
                                                              published_port, host_address,
                                                              policy):
    guest = make_guest(make_slot(1, policy=policy))
    # What the port leads to is itself reachable: only the way through the host is shut.
    assert connect(guest.netns, INET_PEER_IP, internet.public.port).startswith("internet ")
    assert blocked(guest.netns, host_address.ip, published_port)
