"""The event sequence of a Start or Connect stream.

Order, as every SDK expects it: exactly one ``start{pid}``; then output chunks in read order
(raw bytes, never re-encoded), with a ``keepalive`` after every ``Keepalive-Ping-Interval``
seconds of silence (90 s when the header is absent or unusable); exactly one ``end`` after
the last chunk; then connectrpc writes the end-of-stream frame. A stream whose deadline
(its Connect-Timeout-Ms) passes ends with ``deadline_exceeded`` instead, as connect-go's
handler context does: Start's process is SIGKILLed at that same instant, and its end event,
necessarily later, is not sent.

The generator owns its subscription and closes it however the stream ends, including a
client disconnect (connectrpc then closes the generator); the process keeps running.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable
from typing import Literal, TypeAlias, TypeVar, cast

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from connectrpc.request import Headers
from protobuf import Oneof

from ..proto import process_pb
from .exit import ExitStatus
from .fanout import Subscription

DEFAULT_KEEPALIVE_S = 90.0

Event = process_pb.ProcessEvent
Response = TypeVar("Response", process_pb.StartResponse, process_pb.ConnectResponse)
# DataEvent.output as the generated message declares it: one Oneof per output field
_Output: TypeAlias = (Oneof[Literal["stdout"], bytes] | Oneof[Literal["stderr"], bytes]
                      | Oneof[Literal["pty"], bytes])


def keepalive_interval(headers: Headers) -> float:
    try:
        seconds = int(headers.get("keepalive-ping-interval", ""))
    except ValueError:
        return DEFAULT_KEEPALIVE_S
    return float(seconds) if seconds > 0 else DEFAULT_KEEPALIVE_S


def start_event(pid: int) -> Event:
    start: Oneof[Literal["start"], Event.StartEvent] = Oneof("start", Event.StartEvent(pid=pid))
    return Event(event=start)


def end_event(status: ExitStatus) -> Event:
    end: Oneof[Literal["end"], Event.EndEvent] = Oneof("end", Event.EndEvent(
        exit_code=status.exit_code, exited=status.exited, status=status.status,
        error=status.error,
    ))
    return Event(event=end)


def data_event(kind: str, data: bytes) -> Event:
    """A chunk of output; ``kind`` is the field the fanout read it for (``stdout``,
    ``stderr`` or ``pty``)."""
    output = cast(_Output, Oneof(kind, data))
    chunk: Oneof[Literal["data"], Event.DataEvent] = Oneof("data", Event.DataEvent(output=output))
    return Event(event=chunk)


_KEEPALIVE_EVENT: Oneof[Literal["keepalive"], Event.KeepAlive] = Oneof("keepalive",
                                                                       Event.KeepAlive())
_KEEPALIVE = Event(event=_KEEPALIVE_EVENT)


async def process_events(
    subscription: Subscription,
    pid: int,
    wrap: Callable[[Event], Response],
    keepalive_s: float,
    deadline: float | None = None,
    killed_at_deadline: Callable[[], bool] = lambda: False,
) -> AsyncGenerator[Response, None]:
    """Stream a live process. ``deadline`` is a ``loop.time()`` value or None;
    ``killed_at_deadline`` says whether the process was killed for it (Start's own
    deadline), which can happen a moment before the loop's clock reaches it."""
    loop = asyncio.get_running_loop()
    try:
        yield wrap(start_event(pid))
        next_keepalive = loop.time() + keepalive_s
        while True:
            now = loop.time()
            if deadline is not None and now >= deadline:
                raise ConnectError(Code.DEADLINE_EXCEEDED, "context deadline exceeded")
            wake_at = next_keepalive if deadline is None else min(next_keepalive, deadline)
            item = await subscription.get(wake_at - now)
            if deadline is not None and (loop.time() >= deadline or killed_at_deadline()):
                # past the deadline nothing more is sent, not even the end
                raise ConnectError(Code.DEADLINE_EXCEEDED, "context deadline exceeded")
            if item is None:
                if loop.time() >= next_keepalive:
                    yield wrap(_KEEPALIVE)
                    next_keepalive = loop.time() + keepalive_s
                continue
            if isinstance(item, ExitStatus):
                yield wrap(end_event(item))
                return
            kind, data = item
            yield wrap(data_event(kind, data))
            next_keepalive = loop.time() + keepalive_s
    finally:
        subscription.close()


async def exited_events(pid: int, status: ExitStatus,
                        wrap: Callable[[Event], Response]) -> AsyncGenerator[Response, None]:
    """Replay a recently exited process: its start, then its stored end."""
    yield wrap(start_event(pid))
    yield wrap(end_event(status))
