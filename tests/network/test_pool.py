"""SlotPool: warm slots, index allocation, recycling only after cleaning, shutdown."""

from __future__ import annotations

import threading
import time

import pytest
from pyroute2 import IPRoute

from aenv.network import (
    EgressPolicy,
    NetworkError,
    PoolClosedError,
    PoolExhaustedError,
    SlotBusyError,
    SlotPool,
    nft,
)
from aenv.network import netns as ns
from aenv.network import pool as pool_module

from .helpers import (
    GUEST_IP,
    INET_PEER_IP,
    TINY_HOST_CIDR,
    TINY_VETH_CIDR,
    Listener,
    blocked,
    connect,
    make_settings,
)

pytestmark = pytest.mark.net


def test_warm_pool_fills_to_its_size_and_refills_after_acquire(pool_factory):
    pool = pool_factory(warm=2)
    assert pool.wait_warm()
    assert pool.stats()["warm"] == 2
    slot = pool.acquire()
    assert ns.exists(slot.netns)
    assert pool.wait_warm()
    assert pool.stats() | {"capacity": 0} == {"warm": 2, "leased": 1, "cleaning": 0,
                                              "creating": 0, "capacity": 0}


def test_the_filler_waits_for_a_burst_of_acquires_to_end(pool_factory):
    pool = pool_factory(warm=3)
    assert pool.wait_warm()
    for _ in range(3):
        pool.acquire()
        last = time.monotonic()
        time.sleep(0.2)  # a burst: each acquire comes before the filler's quiet period ends
    stats = pool.stats()
    assert stats["warm"] == 0 and stats["creating"] == 0, stats  # nothing made meanwhile
    assert pool.wait_warm()
    assert time.monotonic() - last >= 0.45  # refilled only once the burst went quiet


def test_the_filler_waits_while_a_vm_start_is_in_progress(pool_factory):
    pool = pool_factory(warm=1)
    assert pool.wait_warm()
    with pool.starting():
        pool.acquire()
        time.sleep(1.0)  # twice the quiet period, but the guest is still coming up
        stats = pool.stats()
        assert stats["warm"] == 0 and stats["creating"] == 0, stats
        ended = time.monotonic()
    assert pool.wait_warm()
    assert time.monotonic() - ended >= 0.45  # refilled once the start was over and quiet


@pytest.mark.parametrize("burst", [False, True])
def test_a_forks_starts_hold_the_filler_past_the_deferral_cap(pool_factory, monkeypatch,
                                                              burst):
    """A start holds the filler at most ``_MAX_DEFER_S``; a fan-out's (a fork's children)
    until it is over: under TCG a fork x16 outlasts the cap, and its refill ran during it."""
    monkeypatch.setattr(pool_module, "_MAX_DEFER_S", 0.6)
    pool = pool_factory(warm=1)
    assert pool.wait_warm()
    with pool.starting(burst=burst):
        assert pool.fanning_out() is burst  # what the metrics collector waits on too
        pool.acquire()
        time.sleep(1.6)  # past the cap
        stats = pool.stats()
        ended = time.monotonic()
    assert not pool.fanning_out()
    if burst:
        assert stats["warm"] == 0 and stats["creating"] == 0, stats
        assert pool.wait_warm()
        assert time.monotonic() - ended >= 0.45  # once the fan-out was over and quiet
    else:
        assert stats["warm"] + stats["creating"] == 1, stats  # the cap let it refill


def test_acquire_without_warm_slots_creates_one(pool_factory):
    pool = pool_factory(warm=0)
    slot = pool.acquire(EgressPolicy.build(allow_internet=False))
    assert slot.index == 1
    assert not slot.policy.allow_internet


def test_a_warm_slot_gets_the_requested_policy(pool_factory, make_guest, internet):
    pool = pool_factory(warm=1)
    assert pool.wait_warm()
    slot = pool.acquire(EgressPolicy.build(allow_internet=False))
    guest = make_guest(slot)
    assert blocked(guest.netns, INET_PEER_IP, internet.public.port)


def test_concurrent_acquires_get_distinct_slots(pool_factory):
    pool = pool_factory(warm=2)
    got, errors = [], []

    def take():
        try:
            got.append(pool.acquire())
        except Exception as e:
            errors.append(e)

    threads = [threading.Thread(target=take) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len({s.index for s in got}) == 6
    assert len({s.host_ip for s in got}) == 6


def test_released_slot_comes_back_clean(pool_factory, make_guest, internet):
    # Three slots in all, one kept warm: the released one is the only way to refill.
    pool = pool_factory(warm=1, host_cidr=TINY_HOST_CIDR, veth_cidr=TINY_VETH_CIDR)
    first = pool.acquire(EgressPolicy.build(allow_internet=False))
    others = [pool.acquire() for _ in range(2)]
    # Which index the warm slot got depends on the refill thread; all three are in use.
    assert {first.index} | {s.index for s in others} == {1, 2, 3}
    guest = make_guest(first)
    assert blocked(guest.netns, INET_PEER_IP, internet.public.port)
    guest.close()
    pool.release(first)
    assert pool.wait_warm()
    again = pool.acquire()
    assert again.index == first.index
    assert again.policy.is_default
    guest2 = make_guest(again)
    assert connect(guest2.netns, INET_PEER_IP, internet.public.port).startswith("internet ")


def test_release_refuses_while_a_vmm_holds_the_tap(pool_factory, make_guest):
    pool = pool_factory()
    slot = pool.acquire()
    guest = make_guest(slot)
    with pytest.raises(SlotBusyError):
        pool.release(slot)
    assert pool.stats()["leased"] == 1
    guest.detach()
    pool.release(slot)
    assert pool.stats()["leased"] == 0


def test_released_slots_beyond_the_warm_size_are_destroyed(pool_factory):
    pool = pool_factory(warm=0)
    slot = pool.acquire()
    pool.release(slot)
    assert pool.wait_warm()
    assert not ns.exists(slot.netns)
    assert pool.acquire().index != slot.index  # a never-used index comes first


def test_a_freed_index_is_used_again_once_none_is_fresh_oldest_first(pool_factory):
    pool = pool_factory(warm=0, host_cidr=TINY_HOST_CIDR, veth_cidr=TINY_VETH_CIDR)
    slots = [pool.acquire() for _ in range(pool.addressing.capacity)]
    pool.release(slots[2])
    pool.release(slots[0])
    assert pool.wait_warm()
    assert [pool.acquire().index, pool.acquire().index] == [slots[2].index, slots[0].index]


def test_exhausted_range_raises(pool_factory):
    # A /29 of veth addresses holds three /31 pairs after index 0.
    pool = pool_factory(host_cidr=TINY_HOST_CIDR, veth_cidr=TINY_VETH_CIDR)
    slots = [pool.acquire() for _ in range(pool.addressing.capacity)]
    assert len(slots) == 3
    with pytest.raises(PoolExhaustedError):
        pool.acquire()


def test_released_slots_are_cleaned_by_acquire_while_a_fan_out_holds_the_filler(
        pool_factory, make_guest, internet):
    """Fork rounds back to back hold the filler (a fan-out's starts) and released slots
    waited for it to clean them: 16 more slots in use per round until the range ran out
    (fork x16 nine times in a row on a /24). An acquire that finds no index left cleans a
    released slot itself, and that slot comes back clean, with the policy asked for."""
    pool = pool_factory(host_cidr=TINY_HOST_CIDR, veth_cidr=TINY_VETH_CIDR)
    with pool.starting(burst=True):
        slots = [pool.acquire() for _ in range(pool.addressing.capacity)]
        guest = make_guest(slots[0])
        assert connect(guest.netns, INET_PEER_IP, internet.public.port).startswith("internet ")
        guest.close()
        pool.release(slots[0])
        time.sleep(0.5)
        assert pool.stats()["cleaning"] == 1  # held: the fan-out is still starting
        again = pool.acquire(EgressPolicy.build(allow_internet=False))
        assert again.index == slots[0].index
        guest = make_guest(again)
        assert blocked(guest.netns, INET_PEER_IP, internet.public.port)
        guest.close()
        with pytest.raises(PoolExhaustedError):
            pool.acquire()


def test_adopt_takes_over_a_slot_kept_over_a_restart(tmp_path, make_guest):
    settings = make_settings(tmp_path)
    first = SlotPool(settings)
    first.start()
    slot = first.acquire()
    guest = make_guest(slot)
    lis = Listener(guest.netns, GUEST_IP, 8080, "kept")
    try:
        # The server dies; the next one keeps the slot its store says is still running.
        second = SlotPool(settings)
        second.start(keep=[slot.index])
        try:
            fresh = second.acquire()
            assert fresh.index != slot.index
            adopted = second.adopt(slot.index)
            assert connect(None, adopted.host_ip, 8080).startswith("kept ")
            with pytest.raises(NetworkError):
                second.adopt(slot.index)
        finally:
            lis.close()
            guest.close()
            second.close()
    finally:
        first.close()


def test_close_removes_every_slot_and_the_host_table(tmp_path):
    pool = SlotPool(make_settings(tmp_path), warm_size=2)
    pool.start()
    leased = pool.acquire()
    assert pool.wait_warm()
    pool.close()
    assert not ns.exists(leased.netns)
    prefix = pool.addressing.prefix
    assert not [n for n in ns.list_names() if n.startswith(prefix + "-")]
    with IPRoute() as ipr:
        assert not [link for link in ipr.get_links()
                    if link.get_attr("IFLA_IFNAME").startswith(prefix + "-")]
    assert ("inet", prefix) not in nft.list_tables()
    with pytest.raises(PoolClosedError):
        pool.acquire()


def test_close_keeping_leased_slots_leaves_them_for_the_next_server(tmp_path):
    pool = SlotPool(make_settings(tmp_path), warm_size=2)
    pool.start()
    leased = pool.acquire()
    assert pool.wait_warm()
    warm = [n for n in ns.list_names() if n.startswith(pool.addressing.prefix + "-")
            and n != leased.netns]
    pool.close(keep_leased=True)
    try:
        assert ns.exists(leased.netns)
        assert not any(ns.exists(n) for n in warm)
        assert ("inet", pool.addressing.prefix) in nft.list_tables()
    finally:
        again = SlotPool(make_settings(tmp_path), warm_size=0)
        again.start(keep=[leased.index])
        again.adopt(leased.index)
        again.close()
    assert not ns.exists(leased.netns)


def test_adopting_a_slot_that_is_gone_fails_and_frees_its_index(pool_factory):
    pool = pool_factory()
    with pytest.raises(NetworkError):
        pool.adopt(1)
    assert pool.acquire().index == 1


def test_release_after_close_does_nothing(tmp_path):
    pool = SlotPool(make_settings(tmp_path))
    pool.start()
    slot = pool.acquire()
    pool.close()
    pool.release(slot)
    assert not ns.exists(slot.netns)
