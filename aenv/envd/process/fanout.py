"""Fan-out of one process's output to the streams attached to it (Start and Connect).

Buffering policy: bounded and lossless for attached streams. Each ``Subscription`` holds at
most ``SUBSCRIBER_LIMIT`` bytes of output. While any attached subscription is at the limit the
process's readers stop reading (``blocked`` tells them so), its pipe fills and the process
blocks in ``write()``; reading resumes as soon as every subscription is below the limit. A slow
client therefore slows the process it watches, never envd or other clients, and memory per
process stays under the limit plus one chunk per output pipe (chunks are shared by reference
between subscriptions). Upstream envd behaves the same way through unbuffered Go channels.

Output published while nothing is attached is dropped, as upstream does. The final
``ExitStatus`` is appended past the limit: the end of a stream must never be refused.
Single-threaded: everything here runs on the event loop.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable

from .exit import ExitStatus

SUBSCRIBER_LIMIT = 1 << 20

# ("stdout" | "stderr" | "pty", raw bytes as read)
Chunk = tuple[str, bytes]


class Subscription:
    """One stream's FIFO of output chunks followed by the process's ``ExitStatus``."""

    def __init__(self, fanout: OutputFanout) -> None:
        self._fanout = fanout
        self._items: deque[Chunk | ExitStatus] = deque()
        self._bytes = 0
        self._waiter: asyncio.Future[None] | None = None
        self._closed = False

    @property
    def full(self) -> bool:
        return self._bytes >= SUBSCRIBER_LIMIT

    async def get(self, timeout: float) -> Chunk | ExitStatus | None:
        """The next item, or None when nothing arrived within ``timeout`` seconds."""
        if not self._items:
            loop = asyncio.get_running_loop()
            self._waiter = waiter = loop.create_future()
            timer = loop.call_later(max(timeout, 0.0), _wake, waiter)
            try:
                await waiter
            finally:
                timer.cancel()
                self._waiter = None
            if not self._items:
                return None
        item = self._items.popleft()
        if isinstance(item, tuple):
            was_full = self.full
            self._bytes -= len(item[1])
            if was_full and not self.full:
                self._fanout._drained()
        return item

    def close(self) -> None:
        """Detach from the process; idempotent. Called when the stream ends for any reason."""
        if not self._closed:
            self._closed = True
            self._fanout._detach(self)
            self._items.clear()
            self._bytes = 0

    def _put(self, item: Chunk | ExitStatus, size: int) -> None:
        self._items.append(item)
        self._bytes += size
        if self._waiter is not None:
            _wake(self._waiter)


class OutputFanout:
    """The set of subscriptions of one process. ``on_drain`` is called when the fan-out stops
    being ``blocked`` so the owner can resume reading."""

    def __init__(self, on_drain: Callable[[], None]) -> None:
        self._subs: list[Subscription] = []
        self._end: ExitStatus | None = None
        self._on_drain = on_drain

    def subscribe(self) -> Subscription:
        """Attach a stream: it receives output published from now on. Once the process has
        ended, the subscription holds just the ``ExitStatus``."""
        sub = Subscription(self)
        if self._end is not None:
            sub._put(self._end, 0)
        else:
            self._subs.append(sub)
        return sub

    @property
    def blocked(self) -> bool:
        return any(s.full for s in self._subs)

    def publish(self, kind: str, data: bytes) -> None:
        item = (kind, data)
        for sub in self._subs:
            sub._put(item, len(data))

    def finish(self, status: ExitStatus) -> None:
        """Append the end to every subscription; later subscribers get only the end."""
        self._end = status
        subs, self._subs = self._subs, []
        for sub in subs:
            sub._put(status, 0)

    def _drained(self) -> None:
        if self._end is None and not self.blocked:
            self._on_drain()

    def _detach(self, sub: Subscription) -> None:
        if sub in self._subs:
            self._subs.remove(sub)
            if sub.full:
                self._drained()


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)
