"""``EnvdClient`` against a hostile envd: every call ends by its deadline, no answer is
buffered past its cap, and the connection is closed afterwards.

The fake envd is a raw asyncio HTTP/1.1 listener on 127.0.0.1 that reads one request and
then misbehaves as each test asks; it notes when the client hangs up. Every call is wrapped
in a guard (``_GUARD_S``) so a client without limits fails the test instead of hanging it.
"""

from __future__ import annotations

import asyncio
import base64
import struct
import time
import tracemalloc
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from aenv.client import envd as envd_module
from aenv.client.envd import EnvdClient, EnvdError, envelope, read_envelopes

_GUARD_S = 4.0
Behaviour = Callable[[asyncio.StreamWriter], Awaitable[None]]


class HostileEnvd:
    """Reads one request per connection, then runs ``behaviour`` on the writer; ``hung_up``
    is set once the client closes the connection."""

    def __init__(self, behaviour: Behaviour) -> None:
        self.behaviour = behaviour
        self.hung_up = asyncio.Event()
        self.requests: list[bytes] = []
        self.sent = 0
        self.server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task] = set()

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aenter__(self) -> HostileEnvd:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        for task in self._tasks:
            task.cancel()
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._tasks.add(asyncio.current_task())  # type: ignore[arg-type]
        head = await reader.readuntil(b"\r\n\r\n")
        length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), 0)
        await reader.readexactly(length)
        self.requests.append(head)
        watcher = asyncio.ensure_future(self._watch(reader))
        try:
            await self.behaviour(writer)
        except ConnectionError:  # a write after the client closed its end
            self.hung_up.set()
        except asyncio.CancelledError:
            pass
        finally:
            watcher.cancel()
            writer.close()

    async def _watch(self, reader: asyncio.StreamReader) -> None:
        await reader.read()  # b"" when the client closes its end
        self.hung_up.set()


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


_STREAM_HEAD = (b"HTTP/1.1 200 OK\r\nContent-Type: application/connect+json\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n")


async def _trickle_forever(writer: asyncio.StreamWriter, data: bytes,
                           every: float = 0.2) -> None:
    """One byte of ``data`` (repeated without end) per ``every`` seconds, each its own
    HTTP chunk."""
    while True:
        for byte in data:
            writer.write(_chunk(bytes([byte])))
            await writer.drain()
            await asyncio.sleep(every)


async def _guarded(call: Awaitable[Any]) -> float:
    """Await ``call`` under the guard; the seconds it took."""
    t0 = time.monotonic()
    await asyncio.wait_for(call, _GUARD_S)
    return time.monotonic() - t0


async def _refused(client: EnvdClient, call: Awaitable[Any]) -> tuple[EnvdError, float]:
    """Await ``call`` (of ``client``) under the guard, expecting an ``EnvdError``, then close
    ``client``: the error and the seconds from the call to the client being closed."""
    t0 = time.monotonic()
    try:
        with pytest.raises(EnvdError) as err:
            await _guarded(call)
    finally:
        await client.aclose()
    return err.value, time.monotonic() - t0


async def _keepalives_forever(writer: asyncio.StreamWriter) -> None:
    """A stream that is never more than begun: its head, then keepalive envelopes a byte at a
    time."""
    writer.write(_STREAM_HEAD)
    await _trickle_forever(writer, envelope({"event": {"keepalive": {}}}))


async def test_run_ends_by_its_timeout_when_envd_trickles_forever() -> None:
    async with HostileEnvd(_keepalives_forever) as fake:
        client = EnvdClient(fake.url)
        err, took = await _refused(client, client.run("sync", timeout=0.5))
        assert took < 0.5 + 0.5
        assert err.code == "deadline_exceeded"
        await asyncio.wait_for(fake.hung_up.wait(), 1.0)


async def test_a_4_gib_envelope_is_refused_before_it_is_buffered() -> None:
    async def huge(writer: asyncio.StreamWriter) -> None:
        writer.write(_STREAM_HEAD)
        writer.write(_chunk(struct.pack(">BI", 0, 0xFFFFFFFF)))
        block = _chunk(b"\0" * 65536)
        for _ in range(1024):  # 64 MiB as fast as the client reads it
            writer.write(block)
            await writer.drain()
            fake.sent += 65536
        await asyncio.sleep(3600)

    async with HostileEnvd(huge) as fake:
        client = EnvdClient(fake.url)
        t0 = time.monotonic()
        tracemalloc.start()
        try:
            with pytest.raises(EnvdError) as err:
                await _guarded(client.run("cat /dev/zero", timeout=30))
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
            await client.aclose()
        assert err.value.code == "resource_exhausted"
        assert peak < 8 << 20, f"{peak} bytes allocated for a refused envelope"
        assert fake.sent < 16 << 20
        assert time.monotonic() - t0 < 2.0
        await asyncio.wait_for(fake.hung_up.wait(), 1.0)


async def test_init_ends_by_its_deadline_when_envd_trickles_the_answer(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(envd_module, "INIT_TIMEOUT_S", 0.5, raising=False)

    async def trickle(writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 204 No Content\r\n")
        while True:  # headers that never end
            for byte in b"X-Pad: aaaaaaaaaaaaaaaa\r\n":
                writer.write(bytes([byte]))
                await writer.drain()
                await asyncio.sleep(0.2)

    async with HostileEnvd(trickle) as fake:
        client = EnvdClient(fake.url)
        err, took = await _refused(client, client.init(access_token="tok", env_vars={}))
        assert took < 0.5 + 0.5
        assert err.code == "deadline_exceeded"
        assert client.token is None  # a token is only taken once envd accepted it
        await asyncio.wait_for(fake.hung_up.wait(), 1.0)


async def test_an_endless_plain_body_is_cut_at_its_cap() -> None:
    async def endless(writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n")
        block = _chunk(b" " * 65536)
        while True:
            writer.write(block)
            await writer.drain()
            fake.sent += 65536

    async with HostileEnvd(endless) as fake:
        client = EnvdClient(fake.url)
        err, _ = await _refused(client, client.metrics())
        assert err.code == "resource_exhausted"
        assert fake.sent < 16 << 20
        await asyncio.wait_for(fake.hung_up.wait(), 1.0)


async def test_metrics_ends_by_its_deadline_when_envd_trickles(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(envd_module, "METRICS_TIMEOUT_S", 0.5, raising=False)

    async def trickle(writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n")
        await _trickle_forever(writer, b" ")

    async with HostileEnvd(trickle) as fake:
        client = EnvdClient(fake.url)
        err, _ = await _refused(client, client.metrics())
        assert err.code == "deadline_exceeded"


async def test_wait_healthy_gives_up_on_a_trickling_health_check() -> None:
    async def trickle(writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 204 No Content\r\n")
        await _trickle_forever(writer, b"X-Pad: aaaa\r\n")

    async with HostileEnvd(trickle) as fake:
        client = EnvdClient(fake.url)
        _, took = await _refused(client, client.wait_healthy(1.0))
        assert took < 1.0 + 1.0


async def test_many_envelopes_in_one_chunk_are_read_in_linear_time() -> None:
    """Four times the envelopes cost about four times the CPU, not sixteen (copying the
    rest of the buffer after each envelope did: 10.5 s for 100,000). CPU time of this
    process, not wall time, so a loaded host does not make it fail."""
    keepalive = envelope({"event": {"keepalive": {}}})
    last = envelope({"event": {"data": {"stdout": "QQ=="}}})

    async def cost(n: int) -> float:
        async def one_chunk():
            yield keepalive * n + last

        # Counted, not kept: a list of 50,000 dicts makes the garbage collector's passes,
        # not the reader, grow faster than linearly.
        t0 = time.process_time()
        count, final = 0, None
        async for _, message in read_envelopes(one_chunk()):
            count, final = count + 1, message
        spent = time.process_time() - t0
        assert count == n + 1 and final == {"event": {"data": {"stdout": "QQ=="}}}
        return spent

    small = min([await cost(12_500) for _ in range(3)])
    large = min([await cost(50_000) for _ in range(3)])
    assert large < 8 * max(small, 1e-3), (small, large)


async def test_envelopes_split_into_tiny_chunks_arrive_whole() -> None:
    data = envelope({"a": "x" * 1000}) + envelope({"b": 1}, flags=2)

    async def tiny_chunks():
        for i in range(0, len(data), 7):
            yield data[i:i + 7]

    got = [item async for item in read_envelopes(tiny_chunks())]
    assert got == [(0, {"a": "x" * 1000}), (2, {"b": 1})]


async def test_a_non_object_envelope_is_an_envd_error() -> None:
    async def chunks():
        yield struct.pack(">BI", 0, 2) + b"[]"

    with pytest.raises(EnvdError) as err:
        [msg async for _, msg in read_envelopes(chunks())]
    assert err.value.code == "internal"


async def test_run_keeps_a_bounded_part_of_a_flood_of_output(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(envd_module, "RUN_KEEP_BYTES", 100 << 10, raising=False)
    chunk = base64.b64encode(b"x" * (32 << 10)).decode()

    async def flood(writer: asyncio.StreamWriter) -> None:
        writer.write(_STREAM_HEAD)
        writer.write(_chunk(envelope({"event": {"start": {"pid": 7}}})))
        for _ in range(32):  # 1 MiB of stdout
            writer.write(_chunk(envelope({"event": {"data": {"stdout": chunk}}})))
        writer.write(_chunk(envelope({"event": {"end": {"exitCode": 0, "exited": True}}})))
        writer.write(_chunk(envelope({}, flags=2)) + b"0\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(3600)

    seen: list[int] = []
    async with HostileEnvd(flood) as fake:
        client = EnvdClient(fake.url)
        try:
            result = await asyncio.wait_for(
                client.run("yes", timeout=10, on_output=lambda _, text: seen.append(len(text))),
                _GUARD_S)
        finally:
            await client.aclose()
    assert result.exit_code == 0 and result.truncated
    assert len(result.stdout) == 96 << 10  # three whole chunks fit in 100 KiB
    assert sum(seen) == 1 << 20


async def test_start_background_gives_up_when_no_start_event_comes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(envd_module, "START_EVENT_TIMEOUT_S", 0.5, raising=False)
    async with HostileEnvd(_keepalives_forever) as fake:
        client = EnvdClient(fake.url)
        err, took = await _refused(client, client.start_background("sleep infinity"))
        assert took < 0.5 + 0.5
        assert err.code == "deadline_exceeded" and "start event" in err.message


async def test_an_unlimited_stream_ends_when_envd_falls_silent(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(envd_module, "STREAM_IDLE_S", 0.5, raising=False)

    async def started_then_trickle(writer: asyncio.StreamWriter) -> None:
        writer.write(_STREAM_HEAD + _chunk(envelope({"event": {"start": {"pid": 7}}})))
        await _trickle_forever(writer, envelope({"event": {"keepalive": {}}}))

    async with HostileEnvd(started_then_trickle) as fake:
        client = EnvdClient(fake.url)
        kinds: list[str] = []

        async def follow() -> None:
            async for event in client.start("/bin/bash", pty=envd_module.PtySize(80, 24),
                                            stdin=None):
                kinds.append(event.kind)

        err, _ = await _refused(client, follow())
        assert kinds == ["start"]
        assert err.code == "deadline_exceeded" and "keepalive" in err.message
