"""The processes envd started: live ones by pid and tag, plus the end of each one that
exited in the last ``RETAIN_EXITED_S`` seconds, so a Connect arriving just after the exit
still learns how it ended.

Tags are optional and unique among live processes, except the reserved ``_system``: the
host's orchestrator tags its own helper processes with it (upstream runs those outside the
user cgroup), possibly several at once. A new process drops any retained end under its pid
or tag, so a later Connect is never served a predecessor's exit.
"""

from __future__ import annotations

import asyncio
import signal
from dataclasses import dataclass

from ..proto import process_pb
from .errors import InvalidRequest, ProcessNotFound, TagInUse
from .exit import ExitStatus
from .fanout import Subscription
from .handle import ProcessHandle
from .launch import LaunchSpec

RETAIN_EXITED_S = 30.0
SYSTEM_TAG = "_system"
_SHUTDOWN_WAIT_S = 5.0

Selector = int | str  # a pid or a tag


@dataclass(frozen=True)
class ExitedProcess:
    pid: int
    tag: str | None
    status: ExitStatus


def parse_selector(msg: process_pb.ProcessSelector | None) -> Selector:
    if msg is None or msg.selector is None:
        raise InvalidRequest("process selector is required: set pid or tag")
    return msg.selector.value


class ProcessRegistry:
    def __init__(self) -> None:
        self._live: dict[int, ProcessHandle] = {}
        self._exited: dict[int, tuple[ExitedProcess, asyncio.TimerHandle]] = {}

    def start(self, spec: LaunchSpec, config: process_pb.ProcessConfig, tag: str | None,
              deadline: float | None) -> tuple[ProcessHandle, Subscription]:
        """Spawn and register a process, subscribed before any of its output is read."""
        if tag is not None and tag != SYSTEM_TAG and self._live_by_tag(tag) is not None:
            raise TagInUse(f"process with tag {tag} already exists")
        handle = ProcessHandle.start(spec, config, tag, deadline)
        subscription = handle.fanout.subscribe()
        self._forget_exited(handle.pid, tag)
        self._live[handle.pid] = handle
        handle.on_finish(self._retire)
        return handle, subscription

    def find(self, selector: Selector) -> ProcessHandle:
        if isinstance(selector, int):
            handle = self._live.get(selector)
            if handle is None:
                raise ProcessNotFound(f"process with pid {selector} not found")
            return handle
        handle = self._live_by_tag(selector)
        if handle is None:
            raise ProcessNotFound(f"process with tag {selector} not found")
        return handle

    def find_exited(self, selector: Selector) -> ExitedProcess | None:
        if isinstance(selector, int):
            entry = self._exited.get(selector)
            return entry[0] if entry else None
        for exited, _ in self._exited.values():
            if exited.tag == selector:
                return exited
        return None

    def live(self) -> list[ProcessHandle]:
        return list(self._live.values())

    async def shutdown(self) -> None:
        """SIGKILL every live process and wait (bounded) until they are reaped."""
        handles = self.live()
        for handle in handles:
            handle.signal(signal.SIGKILL)
        if handles:
            await asyncio.wait([h.finished for h in handles], timeout=_SHUTDOWN_WAIT_S)
        for _, timer in self._exited.values():
            timer.cancel()
        self._exited.clear()

    def _live_by_tag(self, tag: str) -> ProcessHandle | None:
        return next((h for h in self._live.values() if h.tag == tag), None)

    def _retire(self, handle: ProcessHandle) -> None:
        if self._live.get(handle.pid) is not handle:
            return
        del self._live[handle.pid]
        assert handle.status is not None
        exited = ExitedProcess(handle.pid, handle.tag, handle.status)
        timer = asyncio.get_running_loop().call_later(RETAIN_EXITED_S, self._evict, exited)
        self._forget_exited(handle.pid, None)
        self._exited[handle.pid] = (exited, timer)

    def _evict(self, exited: ExitedProcess) -> None:
        entry = self._exited.get(exited.pid)
        if entry is not None and entry[0] is exited:
            del self._exited[exited.pid]

    def _forget_exited(self, pid: int, tag: str | None) -> None:
        stale = [pid] if pid in self._exited else []
        if tag is not None:
            stale += [p for p, (e, _) in self._exited.items() if e.tag == tag and p != pid]
        for p in stale:
            self._exited.pop(p)[1].cancel()
