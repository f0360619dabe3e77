"""The ``process.Process`` Connect service: start, stream, signal and feed processes.

Each RPC resolves what it names (the user from HTTP Basic auth or the default user, the
process by pid or tag), delegates to the registry and handles, and turns their refusals
(``errors.ProcessError``) into ``ConnectError``s with the matching code. Errors of a stream
raised before its first event arrive in the end-of-stream frame, as connect-go sends them.

Start's Connect-Timeout-Ms is the process's lifetime (SIGKILL when it passes, whether or not
a client is still attached); a client disconnect only ends the stream. Connect's
Connect-Timeout-Ms only bounds its stream.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from contextlib import aclosing, contextmanager
from pathlib import Path
from typing import Any

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from connectrpc.request import RequestContext
from protobuf import Oneof

from ..proto import process_pb
from ..state import EnvdState
from ..users import UnknownUser, User, basic_auth_user
from .errors import InvalidRequest, ProcessError, ProcessNotFound, UnsupportedSignal
from .handle import ProcessHandle
from .launch import plan, seal_inherited_descriptors
from .registry import ProcessRegistry, parse_selector
from .stream import exited_events, keepalive_interval, process_events

_SIGNALS = {
    process_pb.Signal.SIGKILL: signal.SIGKILL,
    process_pb.Signal.SIGTERM: signal.SIGTERM,
}
# SendSignal(SIGKILL) answers once the process is reaped (a client that checks `kill -0`
# right after must not find a zombie), waiting at most this long.
_KILL_REAP_WAIT_S = 2.0

Ctx = RequestContext[Any, Any]
_StreamStart = process_pb.StreamInputRequest.StartEvent
_StreamData = process_pb.StreamInputRequest.DataEvent


def _start_response(event: process_pb.ProcessEvent) -> process_pb.StartResponse:
    return process_pb.StartResponse(event=event)


def _connect_response(event: process_pb.ProcessEvent) -> process_pb.ConnectResponse:
    return process_pb.ConnectResponse(event=event)


@contextmanager
def _as_connect_errors() -> Iterator[None]:
    try:
        yield
    except ProcessError as e:
        raise ConnectError(e.code, str(e)) from e
    except UnknownUser as e:
        raise ConnectError(Code.UNAUTHENTICATED, str(e)) from e


class ProcessService:
    def __init__(self, state: EnvdState, workload_cgroup: Path | None = None) -> None:
        """``workload_cgroup``: where started processes go (``aenv.envd.cgroups``)."""
        self.state = state
        self.workload_cgroup = workload_cgroup
        self.registry = ProcessRegistry()
        seal_inherited_descriptors()

    async def shutdown(self) -> None:
        """Kill every child (app shutdown)."""
        await self.registry.shutdown()

    # --- streams -------------------------------------------------------------------------

    async def start(self, request: process_pb.StartRequest,
                    ctx: Ctx) -> AsyncIterator[process_pb.StartResponse]:
        with _as_connect_errors():
            user = self._user(ctx)
            spec = plan(request, user, self.state.process_env(), self.state.default_workdir,
                        self.workload_cgroup)
            tag = request.tag if request.has_field("tag") else None
            assert request.process is not None  # plan() checked
            # One instant for both: the process is killed and the stream ends with
            # deadline_exceeded (see stream.py).
            deadline = _deadline(ctx)
            handle, subscription = self.registry.start(spec, request.process, tag, deadline)
        events = process_events(subscription, handle.pid, _start_response,
                                keepalive_interval(ctx.request_headers), deadline,
                                lambda: handle.killed_at_deadline)
        async with aclosing(events):  # its finally detaches the subscription, now
            async for response in events:
                yield response

    async def connect(self, request: process_pb.ConnectRequest,
                      ctx: Ctx) -> AsyncIterator[process_pb.ConnectResponse]:
        events: AsyncGenerator[process_pb.ConnectResponse, None] | None = None
        with _as_connect_errors():
            selector = parse_selector(request.process)
            try:
                handle = self.registry.find(selector)
            except ProcessNotFound:
                exited = self.registry.find_exited(selector)
                if exited is None:
                    raise
                # an async generator: nothing of it runs before the first iteration
                events = exited_events(exited.pid, exited.status, _connect_response)
        if events is None:
            events = process_events(handle.fanout.subscribe(), handle.pid, _connect_response,
                                    keepalive_interval(ctx.request_headers), _deadline(ctx))
        async with aclosing(events):
            async for response in events:
                yield response

    # --- unary ---------------------------------------------------------------------------

    async def list(self, request: process_pb.ListRequest,
                   ctx: Ctx) -> process_pb.ListResponse:
        return process_pb.ListResponse(processes=[
            process_pb.ProcessInfo(config=h.config, pid=h.pid, tag=h.tag)
            for h in self.registry.live()
        ])

    async def send_signal(self, request: process_pb.SendSignalRequest,
                          ctx: Ctx) -> process_pb.SendSignalResponse:
        with _as_connect_errors():
            handle = self.registry.find(parse_selector(request.process))
            signum = _SIGNALS.get(request.signal)
            if signum is None:
                raise UnsupportedSignal(f"invalid signal: {_signal_name(request.signal)}")
            handle.signal(signum)
        if signum == signal.SIGKILL:
            await handle.wait_finished(_KILL_REAP_WAIT_S)
        return process_pb.SendSignalResponse()

    async def send_input(self, request: process_pb.SendInputRequest,
                         ctx: Ctx) -> process_pb.SendInputResponse:
        with _as_connect_errors():
            handle = self.registry.find(parse_selector(request.process))
            await _write_input(handle, request.input)
        return process_pb.SendInputResponse()

    async def stream_input(self, requests: AsyncIterator[process_pb.StreamInputRequest],
                           ctx: Ctx) -> process_pb.StreamInputResponse:
        with _as_connect_errors():
            handle = None
            async for message in requests:
                # the value patterns only narrow the type: each field has one message type
                match message.event:
                    case Oneof(field="start", value=_StreamStart() as start):
                        handle = self.registry.find(parse_selector(start.process))
                    case Oneof(field="data", value=_StreamData() as data):
                        if handle is None:
                            raise InvalidRequest("input stream must open with a start event")
                        await _write_input(handle, data.input)
                    case Oneof(field="keepalive"):
                        pass
                    case _:
                        raise InvalidRequest("input stream event must be start, data or "
                                             "keepalive")
        return process_pb.StreamInputResponse()

    async def close_stdin(self, request: process_pb.CloseStdinRequest,
                          ctx: Ctx) -> process_pb.CloseStdinResponse:
        with _as_connect_errors():
            self.registry.find(parse_selector(request.process)).close_stdin()
        return process_pb.CloseStdinResponse()

    async def update(self, request: process_pb.UpdateRequest,
                     ctx: Ctx) -> process_pb.UpdateResponse:
        with _as_connect_errors():
            handle = self.registry.find(parse_selector(request.process))
            if request.pty is not None:
                size = request.pty.size or process_pb.PTY.Size()
                handle.resize(size.cols, size.rows)
        return process_pb.UpdateResponse()

    # --- helpers -------------------------------------------------------------------------

    def _user(self, ctx: Ctx) -> User:
        name = basic_auth_user(ctx.request_headers.get("authorization"))
        return User.lookup(name or self.state.default_user)


async def _write_input(handle: ProcessHandle, data: process_pb.ProcessInput | None) -> None:
    chosen = data.input if data is not None else None
    if chosen is None:
        raise InvalidRequest("input must carry stdin or pty bytes")
    if chosen.field == "stdin":
        await handle.write_stdin(chosen.value)
    else:
        await handle.write_pty(chosen.value)


def _deadline(ctx: Ctx) -> float | None:
    """Connect-Timeout-Ms as a ``loop.time()``; absent or 0 means none, as connect-go and
    upstream read it."""
    if ctx.request_headers.get("connect-timeout-ms", "0").strip() in ("", "0"):
        return None
    remaining_ms = ctx.timeout_ms
    if remaining_ms is None:
        return None
    return asyncio.get_running_loop().time() + remaining_ms / 1000


def _signal_name(value: object) -> str:
    name = getattr(value, "name", None)
    return f"SIGNAL_{name}" if name else str(value)
