"""The start queue (aenv/orchestrator/start_queue.py): creates beyond the start limit wait
in arrival order, each up to its deadline; a full queue and an expired wait are 429s with a
Retry-After; a waiter whose client went away leaves, and a turn is never lost or skipped."""

from __future__ import annotations

import asyncio

import pytest

from aenv.orchestrator.errors import LimitReached
from aenv.orchestrator.start_queue import ClientGone, StartQueue


async def hold(q: StartQueue, name: str, order: list[str], release: asyncio.Event,
               **kw: object) -> float:
    async with q.turn(**kw) as waited:  # type: ignore[arg-type]
        order.append(name)
        await release.wait()
        return waited


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_waiters_start_in_arrival_order_as_turns_free() -> None:
    q = StartQueue(limit=2, max_waiting=10, timeout=10)
    order: list[str] = []
    gates = {n: asyncio.Event() for n in "abcdef"}
    tasks = {}
    for n in "abcdef":
        tasks[n] = asyncio.create_task(hold(q, n, order, gates[n]))
        await settle()
    assert order == ["a", "b"] and q.active == 2 and q.waiting == 4
    gates["b"].set()
    await settle()
    assert order == ["a", "b", "c"]
    # A newcomer cannot overtake the queue even when a turn is free at that moment.
    gates["a"].set()
    late = asyncio.create_task(hold(q, "late", order, asyncio.Event()))
    await settle()
    assert order == ["a", "b", "c", "d"] and q.waiting == 3
    for n in "cdef":
        gates[n].set()
        await settle()
    assert order == ["a", "b", "c", "d", "e", "f", "late"]
    assert tasks["a"].result() == 0.0 and tasks["f"].result() > 0
    late.cancel()
    await asyncio.gather(late, return_exceptions=True)
    assert q.active == 0 and q.waiting == 0


async def test_a_full_queue_is_refused_with_retry_after() -> None:
    q = StartQueue(limit=1, max_waiting=2, timeout=10)
    release = asyncio.Event()
    order: list[str] = []
    tasks = [asyncio.create_task(hold(q, str(i), order, release)) for i in range(3)]
    await settle()
    assert q.active == 1 and q.waiting == 2
    with pytest.raises(LimitReached, match="queued") as e:
        async with q.turn():
            pass
    assert e.value.status == 429 and e.value.retry_after >= 1
    release.set()
    await asyncio.gather(*tasks)
    assert order == ["0", "1", "2"] and q.active == 0


async def test_a_wait_past_its_deadline_is_refused_and_leaves_the_queue() -> None:
    q = StartQueue(limit=1, max_waiting=10, timeout=0.05)
    release = asyncio.Event()
    first = asyncio.create_task(hold(q, "a", [], release))
    await settle()
    with pytest.raises(LimitReached, match="waited") as e:
        async with q.turn():
            pass
    assert e.value.retry_after >= 1 and q.waiting == 0 and q.active == 1
    # A request's own, shorter deadline wins over the queue's.
    long_q = StartQueue(limit=1, max_waiting=10, timeout=30)
    other = asyncio.create_task(hold(long_q, "x", [], release))
    await settle()
    with pytest.raises(LimitReached):
        async with long_q.turn(timeout=0.05):
            pass
    release.set()
    await asyncio.gather(first, other)
    assert q.active == 0 and long_q.active == 0


async def test_a_waiter_whose_client_went_away_leaves_and_the_next_moves_up() -> None:
    q = StartQueue(limit=1, max_waiting=10, timeout=10)
    release = asyncio.Event()
    order: list[str] = []
    gone = False

    async def client_gone() -> bool:
        return gone

    first = asyncio.create_task(hold(q, "a", order, release))
    await settle()
    leaver = asyncio.create_task(hold(q, "leaver", order, release, gone=client_gone))
    await settle()
    stayer = asyncio.create_task(hold(q, "b", order, release))
    await settle()
    assert q.waiting == 2
    gone = True
    with pytest.raises(ClientGone):
        await leaver
    assert q.waiting == 1
    release.set()
    await asyncio.gather(first, stayer)
    assert order == ["a", "b"] and q.active == 0 and q.waiting == 0


async def test_a_cancelled_waiter_loses_no_turn() -> None:
    """Cancelled while waiting (the server's task torn down), or just as its turn was
    handed to it: either way the next waiter gets the turn and the count stays true."""
    q = StartQueue(limit=1, max_waiting=10, timeout=10)
    release = asyncio.Event()
    order: list[str] = []
    first = asyncio.create_task(hold(q, "a", order, release))
    await settle()
    doomed = asyncio.create_task(hold(q, "doomed", order, release))
    handed = asyncio.create_task(hold(q, "handed", order, release))
    last = asyncio.create_task(hold(q, "last", order, release))
    await settle()
    doomed.cancel()
    await asyncio.gather(doomed, return_exceptions=True)
    assert q.waiting == 2
    # "a" ends: the turn is handed to "handed", which is cancelled before it runs.
    gate_a = release
    gate_a.set()
    await first
    assert q.waiting == 1 and "handed" not in order  # granted, not yet running
    handed.cancel()
    await asyncio.gather(handed, last, return_exceptions=True)
    assert order == ["a", "last"]
    assert q.active == 0 and q.waiting == 0


async def test_queued_sizes_count_against_the_budget() -> None:
    q = StartQueue(limit=1, max_waiting=10, timeout=10)
    release = asyncio.Event()
    tasks = [asyncio.create_task(hold(q, "a", [], release, size=(1, 512))),
             asyncio.create_task(hold(q, "b", [], release, size=(2, 1024)))]
    await settle()
    assert q.queued_sizes() == [(2, 1024)]
    release.set()
    await asyncio.gather(*tasks)
    assert q.queued_sizes() == []
