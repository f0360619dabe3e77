"""Fixtures for network-slot tests (see ``helpers`` for the stand-ins they build).

A session-level check fails loudly if any namespace, link or nft table of this session's
prefixes is left at the end, and removes them so a failing run does not leak either.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from pyroute2 import IPRoute

from aenv.config import Settings
from aenv.network import EgressPolicy, NetworkSlot, SlotPool, cleanup_leftovers, host, nft
from aenv.network import netns as ns
from aenv.network.addressing import Addressing

from .helpers import (
    HELPER,
    PREFIX,
    ContainerHost,
    DummyAddress,
    FakeGuest,
    FakeInternet,
    make_settings,
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if os.geteuid() != 0 or nft.binary() is None:
        skip = pytest.mark.skip(reason="network tests need root and nft")
        here = Path(__file__).parent
        for item in items:
            if "net" in item.keywords and here in item.path.parents:
                item.add_marker(skip)


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return make_settings(tmp_path)


@pytest.fixture
def addressing(settings: Settings) -> Addressing:
    return Addressing(settings)


@pytest.fixture
def host_table(addressing: Addressing) -> Iterator[Addressing]:
    """aenv's host table (and ip_forward) for tests that make slots by hand."""
    host.prepare(addressing)
    yield addressing
    host.remove_table(addressing)


@pytest.fixture
def make_slot(host_table: Addressing) -> Iterator[Callable[..., NetworkSlot]]:
    made: list[NetworkSlot] = []

    def make(index: int, **kw: object) -> NetworkSlot:
        slot = NetworkSlot.create(host_table, index, **kw)  # type: ignore[arg-type]
        made.append(slot)
        return slot

    yield make
    for slot in made:
        slot.destroy()


@pytest.fixture
def make_guest() -> Iterator[Callable[[NetworkSlot], FakeGuest]]:
    guests: list[FakeGuest] = []

    def make(slot: NetworkSlot) -> FakeGuest:
        g = FakeGuest(slot)
        guests.append(g)
        return g

    yield make
    for g in guests:
        g.close()


@pytest.fixture
def internet() -> Iterator[FakeInternet]:
    inet = FakeInternet()
    yield inet
    inet.close()


@pytest.fixture
def host_address() -> Iterator[DummyAddress]:
    """One of the host's own public addresses, added after aenv's host table was loaded."""
    addr = DummyAddress()
    yield addr
    addr.close()


@pytest.fixture
def pool_factory(tmp_path: Path) -> Iterator[Callable[..., SlotPool]]:
    pools: list[SlotPool] = []

    def make(warm: int = 0, server_only: bool = False, **overrides: object) -> SlotPool:
        pool = SlotPool(make_settings(tmp_path, **overrides), warm_size=warm,
                        server_only=server_only)
        pools.append(pool)
        pool.start()
        return pool

    yield make
    for pool in pools:
        pool.close()


@dataclass
class InContainer:
    """aenv's host table loaded inside a ``ContainerHost``, and slots made there."""

    box: ContainerHost
    addressing: Addressing
    slots: list[NetworkSlot] = field(default_factory=list)

    def make_slot(self, index: int, policy: EgressPolicy = EgressPolicy()) -> NetworkSlot:
        slot = self.box.run(lambda: NetworkSlot.create(self.addressing, index, policy=policy))
        self.slots.append(slot)
        return slot


@pytest.fixture
def in_container(addressing: Addressing) -> Iterator[InContainer]:
    box = ContainerHost()
    ctx = InContainer(box, addressing)
    try:
        box.run(lambda: host.prepare(addressing))
        yield ctx
    finally:
        for slot in ctx.slots:
            box.run(slot.destroy)
        box.run(lambda: host.remove_table(addressing))
        box.close()


def _leftovers() -> list[str]:
    found = [f"netns {n}" for n in ns.list_names() if n.startswith((PREFIX, HELPER))]
    with IPRoute() as ipr:
        found += [f"link {link.get_attr('IFLA_IFNAME')}" for link in ipr.get_links()
                  if link.get_attr("IFLA_IFNAME").startswith((PREFIX, HELPER))]
    found += [f"nft table {f} {t}" for f, t in nft.list_tables()
              if t.startswith((PREFIX, HELPER))]
    return found


@pytest.fixture(scope="session", autouse=True)
def no_network_leftovers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Fails the session if any test left a namespace, link or table of this session;
    removes them so a failing run does not leak either."""
    yield
    if os.geteuid() != 0 or nft.binary() is None:
        return
    left = _leftovers()
    if left:
        cleanup_leftovers(make_settings(tmp_path_factory.mktemp("cleanup")))
        for name in ns.list_names():
            if name.startswith((PREFIX, HELPER)):
                ns.remove(name)
        with IPRoute() as ipr:
            for link in ipr.get_links():
                if link.get_attr("IFLA_IFNAME").startswith((PREFIX, HELPER)):
                    ipr.link("del", index=link["index"])
        for family, table in nft.list_tables():
            if table.startswith((PREFIX, HELPER)):
                nft.apply(f"delete table {family} {table}\n")
        pytest.fail(f"network tests left these behind: {left}", pytrace=False)
