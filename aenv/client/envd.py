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

Limits. The guest's root can replace envd, so nothing it sends is trusted to end or to be
small. Every call has a wall-clock deadline over the whole call (connect, headers and every
body byte; httpx's own timeouts restart on each read, so a byte a second would hold them
forever), and every answer a byte cap; the constants below give the values and why. Past
its deadline a call raises ``EnvdError(code="deadline_exceeded")``, past its cap
``EnvdError(code="resource_exhausted")``, on a malformed answer ``EnvdError(code="internal")``;
either way its connection is closed, never reused.

- ``run(cmd, timeout=T)`` ends by ``T + min(END_GRACE_S, T / 4)`` and keeps
  ``RUN_KEEP_BYTES`` of each output stream (``CommandResult.truncated`` says there was more).
- A stream without ``timeout`` has no overall deadline (an interactive shell stays open),
  but its first event must come within ``START_EVENT_TIMEOUT_S``, and every stream must
  then complete an envelope at least every ``STREAM_IDLE_S`` (envd's keepalives do).
- ``init(wait=W)`` ends by ``W + INIT_TIMEOUT_S``; ``wait_healthy(timeout)`` by its timeout
  plus its poll interval; ``metrics``, the unary calls and ``upload`` by their constants.
- ``stream_input`` lasts as long as its caller's input; once that ends, envd has
  ``UNARY_TIMEOUT_S`` to answer.
- Requests ask for ``Accept-Encoding: identity`` and a compressed answer is refused, so a
  cap on the bytes read is a cap on the bytes held.
"""

from __future__ import annotations

import asyncio
import base64
import codecs
import contextlib
import json
import struct
import time
from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from ..envd import ENVD_PORT
from .http import plain_client

# Seconds of silence after which envd sends a keepalive on Start/Connect, and after which
# ``stream_input`` sends one (the SDK's value): long-idle shells stay open through proxies.
KEEPALIVE_S = 50

# Deadlines, in seconds, each over a whole call; read when a call starts, so a test or an
# operator can change them. envd answers all of these in milliseconds; the values leave a
# slow guest (TCG emulation, a loaded host) one to two orders of magnitude of room.
HEALTH_PROBE_TIMEOUT_S = 0.5  # one /health probe; wait_healthy keeps probing to its timeout
INIT_TIMEOUT_S = 10.0  # /init once connected; init(wait=W) adds W for connect retries
METRICS_TIMEOUT_S = 5.0  # one /metrics sample, the collector's interval
UNARY_TIMEOUT_S = 30.0  # SendInput, CloseStdin, Update, SendSignal
START_EVENT_TIMEOUT_S = 30.0  # a Start stream's headers and its first event, start{pid}
# A stream must complete an envelope this often: envd sends a keepalive after every
# Keepalive-Ping-Interval (we send KEEPALIVE_S; 90 s when absent) of silence.
STREAM_IDLE_S = 2.0 * KEEPALIVE_S
# run(timeout=T): envd ends the process and the stream at T (deadline_exceeded); the host
# waits this much longer for that answer, a quarter of T for short timeouts.
END_GRACE_S = 5.0
# An upload may take UPLOAD_BASE_S plus one second per UPLOAD_MIN_RATE bytes: a guest
# taking files slower than 1 MiB/s over its own tap device is stuck, not slow.
UPLOAD_BASE_S = 60.0
UPLOAD_MIN_RATE = 1 << 20

# Byte caps. One Connect message: envd's output events carry at most 32 KiB of stdout
# (about 44 KiB as base64 JSON); 4 MiB is also gRPC's default receive limit.
MAX_ENVELOPE_BYTES = 4 << 20
MAX_BODY_BYTES = 1 << 20  # a plain answer: /init's, a unary call's, an upload's, an error
METRICS_MAX_BYTES = 64 << 10  # /metrics is one object of about 300 bytes
# run() keeps this much of each output stream in its result: a guest can send output as
# fast as the host reads it for all of ``timeout``, and no host caller reads more.
RUN_KEEP_BYTES = 16 << 20
_IDENTITY = {"Accept-Encoding": "identity"}
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
    """``run``'s outcome. ``stdout`` and ``stderr`` keep the first ``RUN_KEEP_BYTES`` of
    each stream; ``truncated`` says that more was sent (``on_output`` saw all of it)."""

    exit_code: int
    stdout: str
    stderr: str
    error: str | None = None
    truncated: bool = False


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


async def read_envelopes(stream: AsyncIterator[bytes], max_size: int | None = None,
                         ) -> AsyncGenerator[tuple[int, dict[str, Any]], None]:
    """The Connect envelopes in ``stream``, as (flags, JSON object) pairs.

    A message that claims more than ``max_size`` bytes (``MAX_ENVELOPE_BYTES`` by default)
    is refused as soon as its length is read, before any of it is buffered; a compressed,
    non-JSON or non-object message is refused too. The buffer is consumed by offset and
    compacted once per chunk, so reading is linear in the bytes however they are split.
    """
    cap = MAX_ENVELOPE_BYTES if max_size is None else max_size
    buf = bytearray()
    async for chunk in stream:
        buf += chunk
        pos = 0
        while len(buf) - pos >= 5:
            flags, size = struct.unpack_from(">BI", buf, pos)
            if size > cap:
                raise EnvdError(f"a Connect message of {size} bytes exceeds the limit of "
                                f"{cap}", "resource_exhausted")
            if len(buf) - pos - 5 < size:
                break
            payload = buf[pos + 5:pos + 5 + size]
            pos += 5 + size
            yield flags, _message(flags, payload)
        del buf[:pos]


def _message(flags: int, payload: bytearray) -> dict[str, Any]:
    if flags & 0x01:
        raise EnvdError("a compressed Connect message, which was not asked for", "internal")
    if not payload:
        return {}
    try:
        message = json.loads(payload)
    except (ValueError, RecursionError):
        raise EnvdError("a Connect message that is not JSON", "internal") from None
    if not isinstance(message, dict):
        raise EnvdError("a Connect message that is not a JSON object", "internal")
    return message


@contextlib.asynccontextmanager
async def _deadline(when: float | None, message: str) -> AsyncIterator[asyncio.Timeout]:
    """``asyncio.timeout_at(when)`` (a ``loop.time()`` value, None for none yet) whose
    expiry raises ``EnvdError(message, "deadline_exceeded")``."""
    try:
        async with asyncio.timeout_at(when) as timeout:
            yield timeout
    except TimeoutError:
        raise EnvdError(message, "deadline_exceeded") from None


def _check_identity(r: httpx.Response, what: str) -> None:
    encoding = r.headers.get("content-encoding", "").strip().lower()
    if encoding not in ("", "identity"):
        raise EnvdError(f"{what} answered with Content-Encoding {encoding}, which was not "
                        f"asked for", "internal")


async def _read_body(r: httpx.Response, cap: int, what: str) -> bytes:
    """The body of ``r``, refused once it passes ``cap`` bytes (or says it will)."""
    _check_identity(r, what)
    declared = r.headers.get("content-length", "").strip()
    too_big = EnvdError(f"{what} answered more than {cap} bytes", "resource_exhausted")
    if declared.isdigit() and int(declared) > cap:
        raise too_big
    body = bytearray()
    async for chunk in r.aiter_raw():
        body += chunk
        if len(body) > cap:
            raise too_big
    return bytes(body)


@dataclass(frozen=True)
class _Answer:
    status: int
    body: bytes

    def text(self) -> str:
        return self.body[:200].decode(errors="replace")

    def json(self, what: str) -> Any:
        try:
            return json.loads(self.body) if self.body else {}
        except (ValueError, RecursionError):
            raise EnvdError(f"{what} answered something that is not JSON", "internal") from None


def _grace(timeout: float) -> float:
    return min(END_GRACE_S, timeout / 4)


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


def _checked_event(message: dict[str, Any]) -> ProcessEvent | None:
    """``_event``, with a malformed event (wrong types, bad base64) an ``EnvdError``."""
    try:
        return _event(message)
    except (ValueError, TypeError, AttributeError, KeyError, OverflowError):
        raise EnvdError("envd sent a malformed process event", "internal") from None


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

    def _headers(self, user: str | None = None,
                 extra: dict[str, str] | None = None) -> dict[str, str]:
        h = {**self.extra_headers, **_IDENTITY, **(extra or {})}
        if self.token:
            h["X-Access-Token"] = self.token
        if user:
            h["Authorization"] = "Basic " + base64.b64encode(f"{user}:".encode()).decode()
        return h

    async def _call(self, method: str, path: str, *, what: str, seconds: float,
                    max_bytes: int = MAX_BODY_BYTES, until: float | None = None,
                    **request: Any) -> _Answer:
        """One plain request whose answer is read whole, all by ``until`` (a ``loop.time()``
        value; now + ``seconds`` when None) and within ``max_bytes``. Connect errors are
        httpx's, as before: ``init`` retries on them."""
        if until is None:
            until = asyncio.get_running_loop().time() + seconds
        async with _deadline(until, f"{what} did not answer within {seconds:g}s"), \
                self.http.stream(method, self.base_url + path, **request) as r:
            return _Answer(r.status_code, await _read_body(r, max_bytes, what))

    async def wait_healthy(self, timeout: float, interval: float = 0.02,
                           alive: Callable[[], bool] | None = None) -> float:
        """Poll ``/health`` until 204; returns seconds waited. ``alive`` lets the caller
        stop early when the VM died. Each probe is bounded by ``HEALTH_PROBE_TIMEOUT_S``
        and by what is left of ``timeout``."""
        start = time.monotonic()
        deadline = start + timeout
        headers = {**self.extra_headers, **_IDENTITY}
        while True:
            probe = min(HEALTH_PROBE_TIMEOUT_S, max(deadline - time.monotonic(), 0.05))
            try:
                r = await self._call("GET", "/health", what="/health", seconds=probe,
                                     headers=headers)
                if r.status == 204:
                    return time.monotonic() - start
            except (httpx.HTTPError, EnvdError):
                pass
            if alive is not None and not alive():
                raise EnvdError("the VM exited before envd answered")
            if time.monotonic() >= deadline:
                raise EnvdError(f"envd did not answer /health within {timeout:.0f}s",
                                "deadline_exceeded")
            await asyncio.sleep(interval)

    async def init(self, *, access_token: str | None, env_vars: dict[str, str],
                   default_user: str | None = "user", default_workdir: str | None = None,
                   current_token: str | None = None, entropy: bytes | None = None,
                   ca_bundle: str | None = None,
                   wait: float = 0.0, alive: Callable[[], bool] | None = None,
                   timeout: float | None = None,
                   volume_mounts: list[dict[str, str]] | None = None,
                   volume_modules: bool = False) -> None:
        """``POST /init``. With ``wait`` > 0 it also waits for envd to accept: a failed
        connect is retried for that long (every 20 ms, stopping early once ``alive`` says
        the VM is gone). Only connects are retried — a request that never connected was
        never sent — so /init, which hands over the token, is applied exactly once. This
        spares a restored guest a separate ``/health`` round trip.

        The whole call ends by ``wait`` + ``timeout`` (``INIT_TIMEOUT_S`` when None):
        ``EnvdError(code="deadline_exceeded")`` after that, whatever envd sends."""
        body: dict[str, Any] = {"envVars": env_vars}
        if access_token is not None:
            body["accessToken"] = access_token
        if default_user:
            body["defaultUser"] = default_user
        if default_workdir:
            body["defaultWorkdir"] = default_workdir
        if entropy:
            body["entropy"] = base64.b64encode(entropy).decode()
        if ca_bundle:
            body["caBundle"] = ca_bundle
        if volume_mounts:
            body["volumeMounts"] = volume_mounts  # [{name, path, nfsTarget}] (envd.mounts)
        if volume_modules:
            body["volumeModules"] = True  # load the NFS client now (envd.mounts)
        headers = {**self.extra_headers, **_IDENTITY}
        if current_token:
            headers["X-Access-Token"] = current_token
        loop = asyncio.get_running_loop()
        budget = INIT_TIMEOUT_S if timeout is None else timeout
        retry_until = loop.time() + wait
        until = retry_until + budget
        while True:
            body["timestamp"] = _now_rfc3339()  # the clock envd sets: fresh per attempt
            try:
                r = await self._call("POST", "/init", what="/init", seconds=wait + budget,
                                     until=until, json=body, headers=headers,
                                     timeout=httpx.Timeout(None, connect=1.0))
                break
            except (httpx.ConnectError, httpx.ConnectTimeout):
                if alive is not None and not alive():
                    raise EnvdError("the VM exited before envd answered") from None
                if loop.time() >= retry_until:
                    raise
                await asyncio.sleep(0.02)
        if r.status != 204:
            raise EnvdError(f"/init answered {r.status}: {r.text()}")
        self.token = access_token

    async def metrics(self, timeout: float | None = None) -> dict[str, Any]:
        """``GET /metrics`` as envd sent it (a JSON object; its fields are the caller's to
        check), within ``timeout`` (``METRICS_TIMEOUT_S`` when None) and
        ``METRICS_MAX_BYTES``."""
        seconds = METRICS_TIMEOUT_S if timeout is None else timeout
        r = await self._call("GET", "/metrics", what="/metrics", seconds=seconds,
                             max_bytes=METRICS_MAX_BYTES, headers=self._headers())
        if r.status != 200:
            raise _error_from_body(r.status, r.body)
        data = r.json("/metrics")
        if not isinstance(data, dict):
            raise EnvdError("/metrics answered something that is not a JSON object",
                            "internal")
        return data

    # -- processes ------------------------------------------------------------------------

    async def start(self, cmd: str, args: list[str] | None = None, *, user: str | None = None,
                    cwd: str | None = None, envs: dict[str, str] | None = None,
                    pty: PtySize | None = None, stdin: bool | None = False,
                    timeout: float | None = None) -> AsyncGenerator[ProcessEvent, None]:
        """Start a process and yield its events; the first is ``start``, the last ``end``.

        ``timeout`` bounds the process's lifetime (envd kills it then) and the stream's,
        which ends by ``timeout`` plus a grace (see the module's limits). None means no
        limit, so an idle shell can stay open; envd's keepalives must still arrive.
        ``stdin`` None leaves it unset, which envd takes as an open pipe (the SDK's PTY
        request). Closing the generator closes the stream; the process keeps running.
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
        loop = asyncio.get_running_loop()
        end_by = loop.time() + timeout + _grace(timeout) if timeout else None
        late = f"the process stream did not end within {timeout or 0:g}s"

        def limit(seconds: float, message: str) -> tuple[float, str]:
            """The earlier of ``seconds`` from now and the stream's end, and its message."""
            when = loop.time() + seconds
            return (end_by, late) if end_by is not None and end_by <= when else (when, message)

        first = limit(START_EVENT_TIMEOUT_S,
                      f"envd sent no start event within {START_EVENT_TIMEOUT_S:g}s")
        request = self.http.build_request(
            "POST", self.base_url + "/process.Process/Start", content=envelope(body),
            headers=self._headers(user, extra), timeout=httpx.Timeout(None, connect=5))
        async with _deadline(*first):
            r = await self.http.send(request, stream=True)
        envelopes = read_envelopes(r.aiter_raw())
        try:
            if r.status_code != 200:
                async with _deadline(*first):
                    raise _error_from_body(r.status_code,
                                           await _read_body(r, MAX_BODY_BYTES, "Start"))
            _check_identity(r, "Start")
            ended = False
            next_by = first
            idle = f"envd sent nothing, not even a keepalive, for {STREAM_IDLE_S:g}s"
            while True:
                async with _deadline(*next_by):
                    item = await anext(envelopes, None)
                if item is None:
                    break
                flags, msg = item
                if flags & _END_STREAM:
                    if msg.get("error"):
                        err = msg["error"]
                        if not isinstance(err, dict):
                            raise EnvdError(str(err)[:200], "unknown")
                        raise EnvdError(str(err.get("message", ""))[:1000],
                                        str(err.get("code") or "unknown"))
                    break
                event = _checked_event(msg)
                if event is not None:
                    ended = ended or event.kind == "end"
                    yield event
                # Counted from when the reading resumes: time the caller spends between
                # events is not envd's silence.
                next_by = limit(STREAM_IDLE_S, idle)
            if not ended:
                raise EnvdError("the process stream ended without an end event", "unavailable")
        finally:
            await envelopes.aclose()
            await r.aclose()

    async def run(self, cmd: str, *, user: str | None = None, cwd: str | None = None,
                  envs: dict[str, str] | None = None, timeout: float = 600,
                  on_output: Callable[[str, str], None] | None = None) -> CommandResult:
        """Run ``cmd`` with ``bash -l -c`` and wait for it; ``on_output(stream, text)``
        sees output as it arrives. Ends by ``timeout`` + ``min(END_GRACE_S, timeout / 4)``
        whatever envd does: ``EnvdError(code="deadline_exceeded")`` then."""
        out: dict[str, list[str]] = {"stdout": [], "stderr": []}
        kept = dict.fromkeys(out, 0)
        truncated = False
        decoders = {k: codecs.getincrementaldecoder("utf-8")(errors="replace") for k in out}
        end: ProcessEvent | None = None
        events = self.start("/bin/bash", ["-l", "-c", cmd], user=user, cwd=cwd, envs=envs,
                            timeout=timeout)
        async with contextlib.aclosing(events):
            async for event in events:
                if event.kind in out:
                    text = decoders[event.kind].decode(event.data)
                    if kept[event.kind] + len(event.data) <= RUN_KEEP_BYTES:
                        kept[event.kind] += len(event.data)
                        out[event.kind].append(text)
                    else:
                        kept[event.kind] = RUN_KEEP_BYTES + 1  # keep no later chunk either
                        truncated = True
                    if on_output and text:
                        on_output(event.kind, text)
                elif event.kind == "end":
                    end = event
        assert end is not None  # start() raises when the stream has no end event
        return CommandResult(end.exit_code, "".join(out["stdout"]), "".join(out["stderr"]),
                             end.error, truncated)

    async def start_background(self, cmd: str, *, user: str | None = None,
                               cwd: str | None = None,
                               envs: dict[str, str] | None = None) -> int:
        """Start ``cmd`` with no lifetime limit and return its pid once envd reports the
        start (within ``START_EVENT_TIMEOUT_S``); closing the stream does not stop the
        process."""
        events = self.start("/bin/bash", ["-l", "-c", cmd], user=user, cwd=cwd, envs=envs)
        async with contextlib.aclosing(events):
            async for event in events:
                if event.kind == "start":
                    return event.pid
        raise EnvdError("the process stream ended before the start event")

    async def _unary(self, method: str, body: dict[str, Any]) -> dict[str, Any]:
        r = await self._call(
            "POST", f"/process.Process/{method}", what=method, seconds=UNARY_TIMEOUT_S,
            content=json.dumps(body).encode(),
            headers=self._headers(None, {"Content-Type": "application/json",
                                         "Connect-Protocol-Version": "1"}))
        if r.status != 200:
            raise _error_from_body(r.status, r.body)
        data = r.json(method)
        return data if isinstance(data, dict) else {}

    async def send_input(self, pid: int, data: bytes, *, pty: bool = False) -> None:
        """One ``SendInput`` request: stdin bytes, or keystrokes for a PTY process."""
        await self._unary("SendInput", {**_selector(pid), "input": _input(data, pty)})

    async def stream_input(self, pid: int, chunks: AsyncIterable[bytes], *,
                           pty: bool = False, keepalive: float = KEEPALIVE_S) -> None:
        """Forward ``chunks`` over one ``StreamInput`` client stream until they run out.

        One request carries every chunk, so a keystroke costs one envelope on an open
        connection rather than a request; a keepalive goes out after ``keepalive``
        seconds without input. The call lasts as long as ``chunks``; once they run out,
        envd has ``UNARY_TIMEOUT_S`` to answer.
        """
        loop = asyncio.get_running_loop()

        async def body() -> AsyncIterator[bytes]:
            yield envelope({"start": _selector(pid)})
            it = aiter(chunks)
            pending: asyncio.Future[bytes] | None = None
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
                        answer_within.reschedule(loop.time() + UNARY_TIMEOUT_S)
                        return
                    pending = None
                    if data:
                        yield envelope({"data": {"input": _input(data, pty)}})
            finally:
                if pending is not None and not pending.done():
                    pending.cancel()

        late = f"StreamInput was not answered within {UNARY_TIMEOUT_S:g}s of the input's end"
        async with _deadline(None, late) as answer_within, self.http.stream(
            "POST", self.base_url + "/process.Process/StreamInput", content=body(),
            headers=self._headers(None, {"Content-Type": "application/connect+json",
                                         "Connect-Protocol-Version": "1"}),
            timeout=httpx.Timeout(None, connect=5),
        ) as r:
            content = await _read_body(r, MAX_BODY_BYTES, "StreamInput")
        if r.status_code != 200:
            raise _error_from_body(r.status_code, content)
        async for flags, msg in read_envelopes(_once(content)):
            if flags & _END_STREAM and isinstance(msg.get("error"), dict):
                err = msg["error"]
                raise EnvdError(str(err.get("message", ""))[:1000],
                                str(err.get("code") or "unknown"))

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

    async def upload(self, remote_path: str, local: Path, *, user: str | None = None,
                     timeout: float | None = None) -> None:
        """Stream a local file to ``remote_path`` in the guest (octet-stream ``/files``),
        within ``timeout``: by default ``UPLOAD_BASE_S`` plus a second per
        ``UPLOAD_MIN_RATE`` bytes of the file."""

        async def chunks() -> AsyncIterator[bytes]:
            with open(local, "rb") as f:
                while block := f.read(1 << 20):
                    yield block

        if timeout is None:
            timeout = UPLOAD_BASE_S + local.stat().st_size / UPLOAD_MIN_RATE
        params = {"path": remote_path}
        if user:
            params["username"] = user
        what = f"upload of {remote_path}"
        r = await self._call("POST", "/files", what=what, seconds=timeout, params=params,
                             content=chunks(),
                             headers=self._headers(None, {
                                 "Content-Type": "application/octet-stream"}),
                             timeout=httpx.Timeout(None, connect=5))
        if r.status != 200:
            raise EnvdError(f"{what} answered {r.status}: {r.text()}")


async def _once(data: bytes) -> AsyncIterator[bytes]:
    yield data


def _now_rfc3339() -> str:
    from datetime import UTC, datetime

    return datetime.now(UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")
