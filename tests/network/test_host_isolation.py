"""Guests never reach the host itself: its own addresses (whatever they are and whenever
they appeared), ports it publishes by DNAT, and (when aenv runs in a container) the
outer host and cloud metadata, whatever ``allow_out`` says."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from aenv.network import EgressPolicy, NetworkSlot, host

from .helpers import (
    CTR_GATEWAY_IP,
    HELPER,
    INET_PEER_IP,
    METADATA_IP,
    OPEN,
    REMOTE_IP,
    ContainerHost,
    FakeGuest,
    blocked,
    connect,
)

pytestmark = pytest.mark.net

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


# -- aenv inside a container -------------------------------------------------------------


@pytest.fixture
def guest_in_container(in_container, make_guest) -> Callable[..., FakeGuest]:
    def make(policy: EgressPolicy = OPEN) -> FakeGuest:
        return make_guest(in_container.make_slot(1, policy))
    return make


def test_a_guest_in_a_container_reaches_the_internet_beyond_its_gateway(in_container,
                                                                        guest_in_container):
    guest = guest_in_container(EgressPolicy())
    port = in_container.box.listeners["remote"].port
    assert connect(guest.netns, REMOTE_IP, port).startswith("remote ")


def test_cloud_metadata_is_refused_even_when_allow_out_lists_everything(in_container,
                                                                       guest_in_container):
    guest = guest_in_container(OPEN)
    assert connect(in_container.box.netns, METADATA_IP, 80).startswith("metadata ")
    assert blocked(guest.netns, METADATA_IP, 80)


def test_the_containers_gateway_is_refused_even_when_allow_out_lists_everything(
        in_container, guest_in_container):
    """The gateway of the namespace aenv runs in is the outer host (docker0's address)."""
    guest = guest_in_container(OPEN)
    port = in_container.box.listeners["gateway"].port
    assert connect(in_container.box.netns, CTR_GATEWAY_IP, port).startswith("gateway ")
    assert blocked(guest.netns, CTR_GATEWAY_IP, port)


def test_addresses_named_as_the_outer_hosts_are_refused(addressing, make_guest):
    """What aenv cannot see from inside (a Kubernetes node's IP, the Docker host's public
    address) can be named; here the internet stand-in plays that part."""
    box = ContainerHost()
    slot = None
    try:
        box.run(lambda: host.prepare(addressing, host_addresses=[REMOTE_IP]))
        slot = box.run(lambda: NetworkSlot.create(addressing, 1, policy=OPEN))
        guest = make_guest(slot)
        assert blocked(guest.netns, REMOTE_IP, box.listeners["remote"].port)
        guest.close()
    finally:
        if slot is not None:
            box.run(slot.destroy)
        box.run(lambda: host.remove_table(addressing))
        box.close()
