"""A Start stream whose process was killed for its deadline ends with ``deadline_exceeded``,
never with the kill's end event, even when the kill's timer fired a moment before the
loop's clock reached the deadline (uvloop's timers have millisecond resolution). Seen as
``aenv sandbox exec --timeout 1`` exiting 137 instead of 124 in about one run in five."""

from __future__ import annotations

import asyncio

import pytest
from connectrpc.code import Code
from connectrpc.errors import ConnectError

from aenv.envd.process.exit import ExitStatus
from aenv.envd.process.stream import process_events

KILLED = ExitStatus(exit_code=-1, exited=False, status="signal: killed", error=None)


class OneExit:
    """A subscription whose process has just been SIGKILLed: its exit is the next item."""

    def __init__(self) -> None:
        self.items: list[ExitStatus] = [KILLED]

    async def get(self, timeout: float) -> ExitStatus | None:
        return self.items.pop(0) if self.items else None

    def close(self) -> None:
        pass


async def events(killed_at_deadline: bool) -> list[object]:
    deadline = asyncio.get_running_loop().time() + 0.5  # the clock has not reached it
    seen: list[object] = []
    async for event in process_events(OneExit(), 42, lambda e: e, 90, deadline,
                                      lambda: killed_at_deadline):
        seen.append(event)
    return seen


async def test_an_exit_from_the_deadline_kill_is_deadline_exceeded() -> None:
    with pytest.raises(ConnectError) as err:
        await events(killed_at_deadline=True)
    assert err.value.code == Code.DEADLINE_EXCEEDED


async def test_an_exit_of_its_own_before_the_deadline_is_the_end_event() -> None:
    seen = await events(killed_at_deadline=False)
    assert len(seen) == 2  # start, end
