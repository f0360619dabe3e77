"""A small async client for envd: health, ``/init``, metrics, uploads and processes.

It speaks Connect's JSON protocol directly (envelopes of 1 flag byte + 4-byte length +
JSON), which is all the host needs; the E2B SDK is a test dependency only. The same client
talks to an envd directly (the orchestrator, at the VM's host address) or through the aenv
proxy (the CLI): ``EnvdClient.through_proxy`` adds the ``E2b-Sandbox-Id`` /
``E2b-Sandbox-Port`` routing headers to every request.

Processes: ``start`` streams a process's events (start, output, end) as ``ProcessEvent``s;
``run`` and ``start_background`` are built on it. Input goes either one request per chunk
(``send_input``) or over one long client stream (``stream_input``); PTYs are resized with
``resize`` (``Update``) and processes killed with ``kill``. Errors are ``EnvdError`` with
the Connect code when envd (or the proxy) gave one.
"""

from __future__ import annotations

import asyncio
import base64
import codecs
import contextlib
import json
import struct
import time
from collections.abc import AsyncIterable, AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from .http import plain_client

ENVD_PORT = 49983
# Seconds of silence after which envd sends a keepalive on Start/Connect, and after which
# ``stream_input`` sends one (the SDK's value): long-idle shells stay open through proxies.
KEEPALIVE_S = 50
_END_STREAM = 0x02
# Plain HTTP statuses (a proxy's, or envd's auth middleware's) as Connect codes, the way
# the SDK maps them (spec 4.1).
_HTTP_CODES = {400: "invalid_argument", 401: "unauthenticated", 403: "permission_denied",
               404: "not_found", 409: "already_exists", 413: "resource_exhausted",
               429: "resource_exhausted", 499: "canceled", 500: "internal",
               501: "unimplemented", 502: "unavailable", 503: "unavailable",
               504: "deadline_exceeded", 505: "unimplemented"}


class EnvdError(Exception):
    """envd answered with an error, or not at all. ``code`` is the Connect code
    (``not_found``, ``unavailable``, ...) when the answer carried one."""

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(f"{code}: {message}" if code else message)
        self.code = code
        self.message = message


@dataclass
class CommandResult:
    exit_code: int
    stdout: str
    stderr: str
    error: str | None = None


@dataclass(frozen=True)
class PtySize:
    cols: int
    rows: int


@dataclass(frozen=True)
class ProcessEvent:
    """One event of a process stream. ``kind`` is ``start`` (``pid`` set), ``stdout``,
    ``stderr`` or ``pty`` (``data`` set), or ``end`` (``exit_code``, ``exited``,
    ``status`` and ``error`` set; ``exit_code`` is -1 when a signal ended the process)."""

    kind: str
    pid: int = 0
    data: bytes = b""
    exit_code: int = 0
    exited: bool = True
    status: str = ""
    error: str | None = None


def envelope(message: dict[str, Any], flags: int = 0) -> bytes:
    data = json.dumps(message, separators=(",", ":")).encode()
    return struct.pack(">BI", flags, len(data)) + data


async def read_envelopes(stream: AsyncIterator[bytes]) -> AsyncIterator[tuple[int, dict]]:
    buf = b""
    async for chunk in stream:
        buf += chunk
        while len(buf) >= 5:
            flags, size = struct.unpack(">BI", buf[:5])
            if len(buf) < 5 + size:
                break
            payload, buf = buf[5:5 + size], buf[5 + size:]
            yield flags, json.loads(payload) if payload else {}


def _error_from_body(status: int, body: bytes) -> EnvdError:
    """A Connect error body (string ``code``), an E2B-style one (integer ``code``, e.g. the
    proxy's 502 "The sandbox was not found") or plain text."""
    try:
        data = json.loads(body)
    except ValueError:
        data = None
    if isinstance(data, dict):
        code = data.get("code")
        message = str(data.get("message") or body[:200].decode(errors="replace"))
        if isinstance(code, str) and code:
            return EnvdError(message, code)
        return EnvdError(message, _HTTP_CODES.get(code if isinstance(code, int) else status,
                                                   "unknown"))
    text = body[:200].decode(errors="replace").strip() or f"HTTP {status}"
    return EnvdError(text, _HTTP_CODES.get(status, "unknown"))


def _event(message: dict[str, Any]) -> ProcessEvent | None:
    event = message.get("event") or {}
    if "start" in event:
        return ProcessEvent("start", pid=int(event["start"].get("pid", 0)))
    if "data" in event:
        for stream, b64 in event["data"].items():
            return ProcessEvent(stream, data=base64.b64decode(b64))
        return None
    if "end" in event:
        end = event["end"]
        return ProcessEvent("end", exit_code=int(end.get("exitCode", 0)),
                            exited=bool(end.get("exited", False)),
                            status=end.get("status", ""), error=end.get("error"))
    return None  # keepalive


def _selector(pid: int) -> dict[str, Any]:
    return {"process": {"pid": pid}}


def _input(data: bytes, pty: bool) -> dict[str, str]:
    return {"pty" if pty else "stdin": base64.b64encode(data).decode()}


class EnvdClient:
    def __init__(self, base_url: str, token: str | None = None, *,
                 client: httpx.AsyncClient | None = None,
                 headers: dict[str, str] | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.token = token
        self.extra_headers = dict(headers or {})
        self._own = client is None
        self.http = client or plain_client(timeout=httpx.Timeout(30.0, connect=2.0))

    @classmethod
    def through_proxy(cls, server_url: str, sandbox_id: str, token: str | None, *,
                      port: int = ENVD_PORT) -> EnvdClient:
        """A client for one sandbox's envd reached through an aenv server's proxy."""
        return cls(server_url, token,
                   headers={"E2b-Sandbox-Id": sandbox_id, "E2b-Sandbox-Port": str(port)})

    async def aclose(self) -> None:
        if self._own:
            await self.http.aclose()

    def _headers(self, user: str | None = None, extra: dict[str, str] | None = None) -> dict:
        h = {**self.extra_headers, **(extra or {})}
        if self.token:
            h["X-Access-Token"] = self.token
        if user:
            h["Authorization"] = "Basic " + base64.b64encode(f"{user}:".encode()).decode()
        return h

    async def wait_healthy(self, timeout: float, interval: float = 0.02,
                           alive: Callable[[], bool] | None = None) -> float:
        """Poll ``/health`` until 204; returns seconds waited. ``alive`` lets the caller
        stop early when the VM died."""
        start = time.monotonic()
        deadline = start + timeout
        while True:
            try:
                r = await self.http.get(self.base_url + "/health", headers=self.extra_headers,
                                        timeout=0.5)
                if r.status_code == 204:
                    return time.monotonic() - start
            except httpx.HTTPError:
                pass
            if alive is not None and not alive():
                raise EnvdError("the VM exited before envd answered")
            if time.monotonic() >= deadline:
                raise EnvdError(f"envd did not answer /health within {timeout:.0f}s")
            await asyncio.sleep(interval)

    async def init(self, *, access_token: str | None, env_vars: dict[str, str],
                   default_user: str | None = "user", default_workdir: str | None = None,
                   current_token: str | None = None, entropy: bytes | None = None,
                   wait: float = 0.0, alive: Callable[[], bool] | None = None) -> None:
        """``POST /init``. With ``wait`` > 0 it also waits for envd to accept: a failed
        connect is retried for that long (every 20 ms, stopping early once ``alive`` says
        the VM is gone). Only connects are retried — a request that never connected was
        never sent — so /init, which hands over the token, is applied exactly once. This
        spares a restored guest a separate ``/health`` round trip."""
        body: dict[str, Any] = {"envVars": env_vars}
        if access_token is not None:
            body["accessToken"] = access_token
        if default_user:
            body["defaultUser"] = default_user
        if default_workdir:
            body["defaultWorkdir"] = default_workdir
        if entropy:
            body["entropy"] = base64.b64encode(entropy).decode()
        headers = dict(self.extra_headers)
        if current_token:
            headers["X-Access-Token"] = current_token
        deadline = time.monotonic() + wait
        while True:
            body["timestamp"] = _now_rfc3339()  # the clock envd sets: fresh per attempt
            try:
                r = await self.http.post(self.base_url + "/init", json=body, headers=headers,
                                         timeout=httpx.Timeout(30.0, connect=1.0))
                break
            except (httpx.ConnectError, httpx.ConnectTimeout):
                if alive is not None and not alive():
                    raise EnvdError("the VM exited before envd answered") from None
                if time.monotonic() >= deadline:
                    raise
                await asyncio.sleep(0.02)
        if r.status_code != 204:
            raise EnvdError(f"/init answered {r.status_code}: {r.text[:200]}")
        self.token = access_token

    async def metrics(self) -> dict[str, Any]:
        r = await self.http.get(self.base_url + "/metrics", headers=self._headers(), timeout=5)
        r.raise_for_status()
        return r.json()

    # -- processes ------------------------------------------------------------------------

    async def start(self, cmd: str, args: list[str] | None = None, *, user: str | None = None,
                    cwd: str | None = None, envs: dict[str, str] | None = None,
                    pty: PtySize | None = None, stdin: bool | None = False,
                    timeout: float | None = None) -> AsyncIterator[ProcessEvent]:
        """Start a process and yield its events; the first is ``start``, the last ``end``.

        ``timeout`` bounds the process's lifetime (envd kills it then); None means no
        limit, and no read deadline either, so an idle shell can stay open. ``stdin``
        None leaves it unset, which envd takes as an open pipe (the SDK's PTY request).
        Closing the generator closes the stream; the process keeps running.
        """
        process: dict[str, Any] = {"cmd": cmd, "args": list(args or [])}
        if envs:
            process["envs"] = envs
        if cwd:
            process["cwd"] = cwd
        body: dict[str, Any] = {"process": process}
        if pty is not None:
            body["pty"] = {"size": {"cols": pty.cols, "rows": pty.rows}}
        if stdin is not None:
            body["stdin"] = stdin
        extra = {"Content-Type": "application/connect+json", "Connect-Protocol-Version": "1",
                 "Keepalive-Ping-Interval": str(KEEPALIVE_S)}
        if timeout:
            extra["Connect-Timeout-Ms"] = str(int(timeout * 1000))
        read_timeout = timeout + 5 if timeout else None
        async with self.http.stream(
            "POST", self.base_url + "/process.Process/Start", content=envelope(body),
            headers=self._headers(user, extra),
            timeout=httpx.Timeout(read_timeout, connect=5),
        ) as r:
            if r.status_code != 200:
                raise _error_from_body(r.status_code, await r.aread())
            ended = False
            async for flags, msg in read_envelopes(r.aiter_bytes()):
                if flags & _END_STREAM:
                    if msg.get("error"):
                        err = msg["error"]
                        raise EnvdError(str(err.get("message", "")), err.get("code"))
                    break
                event = _event(msg)
                if event is not None:
                    ended = ended or event.kind == "end"
                    yield event
            if not ended:
                raise EnvdError("the process stream ended without an end event", "unavailable")

    async def run(self, cmd: str, *, user: str | None = None, cwd: str | None = None,
                  envs: dict[str, str] | None = None, timeout: float = 600,
                  on_output: Callable[[str, str], None] | None = None) -> CommandResult:
        """Run ``cmd`` with ``bash -l -c`` and wait for it; ``on_output(stream, text)``
        sees output as it arrives."""
        out: dict[str, list[str]] = {"stdout": [], "stderr": []}
        decoders = {k: codecs.getincrementaldecoder("utf-8")(errors="replace") for k in out}
        end: ProcessEvent | None = None
        events = self.start("/bin/bash", ["-l", "-c", cmd], user=user, cwd=cwd, envs=envs,
                            timeout=timeout)
        async with contextlib.aclosing(events):
            async for event in events:
                if event.kind in out:
                    text = decoders[event.kind].decode(event.data)
                    out[event.kind].append(text)
                    if on_output and text:
                        on_output(event.kind, text)
                elif event.kind == "end":
                    end = event
        assert end is not None  # start() raises when the stream has no end event
        return CommandResult(end.exit_code, "".join(out["stdout"]), "".join(out["stderr"]),
                             end.error)

    async def start_background(self, cmd: str, *, user: str | None = None,
                               cwd: str | None = None,
                               envs: dict[str, str] | None = None) -> int:
        """Start ``cmd`` with no lifetime limit and return its pid once envd reports the
        start; closing the stream does not stop the process."""
        events = self.start("/bin/bash", ["-l", "-c", cmd], user=user, cwd=cwd, envs=envs)
        async with contextlib.aclosing(events):
            async for event in events:
                if event.kind == "start":
                    return event.pid
        raise EnvdError("the process stream ended before the start event")

    async def _unary(self, method: str, body: dict[str, Any]) -> dict[str, Any]:
        r = await self.http.post(
            f"{self.base_url}/process.Process/{method}", content=json.dumps(body).encode(),
            headers=self._headers(None, {"Content-Type": "application/json",
                                         "Connect-Protocol-Version": "1"}))
        if r.status_code != 200:
            raise _error_from_body(r.status_code, r.content)
        return r.json() if r.content else {}

    async def send_input(self, pid: int, data: bytes, *, pty: bool = False) -> None:
        """One ``SendInput`` request: stdin bytes, or keystrokes for a PTY process."""
        await self._unary("SendInput", {**_selector(pid), "input": _input(data, pty)})

    async def stream_input(self, pid: int, chunks: AsyncIterable[bytes], *,
                           pty: bool = False, keepalive: float = KEEPALIVE_S) -> None:
        """Forward ``chunks`` over one ``StreamInput`` client stream until they run out.

        One request carries every chunk, so a keystroke costs one envelope on an open
        connection rather than a request; a keepalive goes out after ``keepalive``
        seconds without input.
        """
        async def body() -> AsyncIterator[bytes]:
            yield envelope({"start": _selector(pid)})
            it = aiter(chunks)
            pending: asyncio.Future | None = None
            try:
                while True:
                    if pending is None:
                        pending = asyncio.ensure_future(anext(it))
                    done, _ = await asyncio.wait({pending}, timeout=keepalive)
                    if not done:
                        yield envelope({"keepalive": {}})
                        continue
                    try:
                        data = pending.result()
                    except StopAsyncIteration:
                        return
                    pending = None
                    if data:
                        yield envelope({"data": {"input": _input(data, pty)}})
            finally:
                if pending is not None and not pending.done():
                    pending.cancel()

        r = await self.http.post(
            self.base_url + "/process.Process/StreamInput", content=body(),
            headers=self._headers(None, {"Content-Type": "application/connect+json",
                                         "Connect-Protocol-Version": "1"}),
            timeout=httpx.Timeout(None, connect=5))
        if r.status_code != 200:
            raise _error_from_body(r.status_code, r.content)
        async for flags, msg in read_envelopes(_once(r.content)):
            if flags & _END_STREAM and msg.get("error"):
                err = msg["error"]
                raise EnvdError(str(err.get("message", "")), err.get("code"))

    async def close_stdin(self, pid: int) -> None:
        await self._unary("CloseStdin", _selector(pid))

    async def resize(self, pid: int, size: PtySize) -> None:
        """Set a PTY process's window size (``Update``)."""
        await self._unary("Update", {**_selector(pid),
                                     "pty": {"size": {"cols": size.cols, "rows": size.rows}}})

    async def kill(self, pid: int) -> bool:
        """SIGKILL the process; False when envd knows no such process."""
        try:
            await self._unary("SendSignal", {**_selector(pid), "signal": "SIGNAL_SIGKILL"})
        except EnvdError as e:
            if e.code == "not_found":
                return False
            raise
        return True

    # -- files ----------------------------------------------------------------------------

    async def upload(self, remote_path: str, local: Path, *, user: str | None = None) -> None:
        """Stream a local file to ``remote_path`` in the guest (octet-stream ``/files``)."""

        async def chunks() -> AsyncIterator[bytes]:
            with open(local, "rb") as f:
                while block := f.read(1 << 20):
                    yield block

        params = {"path": remote_path}
        if user:
            params["username"] = user
        r = await self.http.post(self.base_url + "/files", params=params, content=chunks(),
                                 headers=self._headers(None, {
                                     "Content-Type": "application/octet-stream"}),
                                 timeout=httpx.Timeout(None, connect=5))
        if r.status_code != 200:
            raise EnvdError(f"upload of {remote_path} answered {r.status_code}: {r.text[:200]}")


async def _once(data: bytes) -> AsyncIterator[bytes]:
    yield data


def _now_rfc3339() -> str:
    from datetime import UTC, datetime

    return datetime.now(UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")
