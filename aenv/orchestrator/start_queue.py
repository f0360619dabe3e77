"""A fair queue of sandbox creates behind the node's start limit.

RL workers create sandboxes in bursts (``asyncio.gather`` of 64 creates). A node starts at
most ``limit`` at once (each start is a VMM, a restore and an envd ``/init`` competing for
the same cores); a create that arrives while ``limit`` are starting waits here, first come
first served, instead of being refused. It is refused (429 with ``Retry-After``) only when
the queue already holds ``max_waiting`` creates, or when it waited ``timeout`` seconds
without its turn: the request's own deadline. The client's timeout is not on the wire (the
E2B SDKs send none), so the deadline is the server's ``AENV_START_QUEUE_TIMEOUT``, whose
default stays under the SDKs' default request timeout (60 s) so that a refused create is
answered while its client still listens. A waiter whose client went away (``gone``
answers true, polled while it waits) leaves the queue at once.

A turn, once granted, is handed straight to the oldest waiter when its holder finishes, so
a create that arrives later can never overtake one that waits.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from .errors import LimitReached, OrchestratorError

# How often a waiter asks whether its client is still there.
GONE_POLL_S = 0.25
# Weight of the newest start in the running mean that Retry-After is estimated from.
_EWMA = 0.2


class ClientGone(OrchestratorError):
    """The client closed the connection while its create waited in the queue. Nobody
    reads the answer; 499 is what proxies log for it."""

    status = 499


@dataclass(eq=False)
class _Waiter:
    size: tuple[int, int]  # (vCPUs, MiB): counted against the budget while queued
    granted: asyncio.Future[None] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future())


class StartQueue:
    """``limit`` starts at once, up to ``max_waiting`` more waiting in arrival order, each
    for at most ``timeout`` seconds."""

    def __init__(self, limit: int, max_waiting: int, timeout: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.limit = limit
        self.max_waiting = max_waiting
        self.timeout = timeout
        self.active = 0
        self._clock = clock
        self._waiters: deque[_Waiter] = deque()
        self._mean_start_s = 1.0  # until a start was timed

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def queued_sizes(self) -> list[tuple[int, int]]:
        """(vCPUs, MiB) of every waiting create, for the budget check of a newcomer."""
        return [w.size for w in self._waiters]

    def retry_after(self) -> int:
        """Whole seconds until a create arriving now would likely get its turn."""
        ahead = self.waiting + 1
        return max(1, math.ceil(self._mean_start_s * ahead / max(self.limit, 1)))

    @contextlib.asynccontextmanager
    async def turn(self, size: tuple[int, int] = (0, 0), *, timeout: float | None = None,
                   gone: Callable[[], Awaitable[bool]] | None = None
                   ) -> AsyncIterator[float]:
        """Hold one of the ``limit`` starts for the block; yields the seconds waited."""
        waited = await self._acquire(size, self.timeout if timeout is None else timeout, gone)
        started = self._clock()
        try:
            yield waited
        finally:
            took = self._clock() - started
            self._mean_start_s += _EWMA * (took - self._mean_start_s)
            self._release()

    async def _acquire(self, size: tuple[int, int], timeout: float,
                       gone: Callable[[], Awaitable[bool]] | None) -> float:
        if self.active < self.limit and not self._waiters:
            self.active += 1
            return 0.0
        if len(self._waiters) >= self.max_waiting:
            raise LimitReached(
                f"{self.active} sandboxes are starting on this node and {self.waiting} more "
                f"are queued (at most {self.max_waiting}); try again later",
                retry_after=self.retry_after())
        waiter = _Waiter(size)
        self._waiters.append(waiter)
        t0 = self._clock()
        deadline = t0 + timeout
        try:
            while True:
                remaining = deadline - self._clock()
                if remaining <= 0:
                    raise LimitReached(
                        f"waited {timeout:g} s for one of this node's {self.limit} starts "
                        f"({self.waiting - 1} still queued behind); try again later",
                        retry_after=self.retry_after())
                wait = remaining if gone is None else min(remaining, GONE_POLL_S)
                # asyncio.wait, not wait_for: it neither cancels the grant on a timeout nor
                # (Python 3.11's wait_for) swallows a cancellation that races the grant.
                await asyncio.wait((waiter.granted,), timeout=wait)
                if waiter.granted.done():
                    return self._clock() - t0
                if gone is not None and await gone():
                    raise ClientGone("the client went away while its create was queued")
        except BaseException:
            if waiter.granted.done() and not waiter.granted.cancelled():
                self._release()  # granted as it gave up: hand the turn on
            else:
                waiter.granted.cancel()
                self._waiters.remove(waiter)
            raise

    def _release(self) -> None:
        """End one start: the oldest waiter takes its place, or the count goes down."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.granted.done():
                waiter.granted.set_result(None)
                return
        self.active -= 1
