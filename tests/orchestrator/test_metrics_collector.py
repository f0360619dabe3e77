"""``MetricsCollector``: one guest's bad ``/metrics`` answer costs that guest its sample,
never the others' and never the collector's loop.

Each fake envd is an asyncio HTTP listener on its own loopback address (127.83.0.N, one port
for all, as every VM's envd listens on the same port at its own address) answering
``/metrics`` with a fixed body or a trickle.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable

import pytest

from aenv.orchestrator import metrics as metrics_module
from aenv.orchestrator.metrics import MetricsCollector
from aenv.store import Database, SandboxRecord, SandboxStore

# The per-sample deadline the tests set: long enough that a good fake answers in time on a
# loaded 2-core CI host (0.5 s was not), far below the guard that catches a collector waiting
# on a bad guest for ever.
_SAMPLE_S = 1.5
_GUARD_S = 8.0
Answer = Callable[[asyncio.StreamWriter], Awaitable[None]]

GOOD = {"ts": 1_700_000_000, "cpu_count": 2, "cpu_used_pct": 12.5, "mem_total": 1 << 30,
        "mem_used": 1 << 28, "mem_cache": 1 << 20, "disk_used": 1 << 30, "disk_total": 1 << 32}


def _json(body: bytes) -> Answer:
    async def answer(writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body))
        await writer.drain()
    return answer


async def _trickle(writer: asyncio.StreamWriter) -> None:
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                 b"Transfer-Encoding: chunked\r\n\r\n")
    while True:
        writer.write(b"1\r\n \r\n")
        await writer.drain()
        await asyncio.sleep(0.2)


async def _endless(writer: asyncio.StreamWriter) -> None:
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 4294967296\r\n\r\n")
    while True:
        writer.write(b" " * 65536)
        await writer.drain()


BAD_ANSWERS: dict[str, Answer] = {
    "a list": _json(b"[]"),
    "a string": _json(b'"metrics"'),
    "not json": _json(b"<html>"),
    "a huge number": _json(json.dumps({**GOOD, "mem_used": 10 ** 400}).encode()),
    "an infinite number": _json(json.dumps({**GOOD, "disk_used": 1e400}).encode()),
    "NaN": _json(json.dumps({**GOOD, "cpu_used_pct": float("nan")}).encode()),
    "a negative value": _json(json.dumps({**GOOD, "mem_total": -1}).encode()),
    "a timestamp past year 9999": _json(json.dumps({**GOOD, "ts": 10 ** 12}).encode()),
    "a string field": _json(json.dumps({**GOOD, "cpu_count": "2"}).encode()),
    "cpu over 100 %": _json(json.dumps({**GOOD, "cpu_used_pct": 1e9}).encode()),
    "used above total": _json(json.dumps({**GOOD, "mem_used": 1 << 40}).encode()),
    "a trickle": _trickle,
    "an endless body": _endless,
}


class FakeEnvds:
    """One listener per address, all on the same port."""

    def __init__(self) -> None:
        self.port = 0
        self.servers: list[asyncio.Server] = []
        self.tasks: set[asyncio.Task] = set()

    async def add(self, answer: Answer) -> str:
        host = f"127.83.0.{len(self.servers) + 1}"

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self.tasks.add(asyncio.current_task())  # type: ignore[arg-type]
            try:
                await reader.readuntil(b"\r\n\r\n")
                await answer(writer)
            except (ConnectionError, asyncio.CancelledError, asyncio.IncompleteReadError):
                pass
            finally:
                writer.close()

        server = await asyncio.start_server(serve, host, self.port)
        self.port = server.sockets[0].getsockname()[1]
        self.servers.append(server)
        return host

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        for server in self.servers:
            server.close()
            await server.wait_closed()


def _running(store: SandboxStore, sandbox_id: str, host_ip: str,
             vm_pid: int | None = None) -> None:
    now = time.time()
    store.insert(SandboxRecord(id=sandbox_id, template_id="base", state="running",
                               client_id="c", started_at=now, end_at=now + 3600, cpu_count=2,
                               memory_mb=1024, disk_size_mb=4096, host_ip=host_ip,
                               envd_token="tok", vm_pid=vm_pid))


@pytest.fixture
async def world(monkeypatch: pytest.MonkeyPatch):
    fakes = FakeEnvds()
    store = SandboxStore(Database(":memory:"))
    monkeypatch.setattr(metrics_module, "SAMPLE_TIMEOUT_S", _SAMPLE_S, raising=False)
    yield fakes, store
    await fakes.close()


async def _collector(fakes: FakeEnvds, store: SandboxStore, monkeypatch: pytest.MonkeyPatch,
                     **kwargs: float) -> MetricsCollector:
    monkeypatch.setattr(metrics_module, "ENVD_PORT", fakes.port)
    return MetricsCollector(store, **kwargs)


@pytest.mark.parametrize("bad", list(BAD_ANSWERS))
async def test_one_bad_guest_costs_only_its_own_sample(
        world, bad: str, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    fakes, store = world
    _running(store, "good1", await fakes.add(_json(json.dumps(GOOD).encode())))
    _running(store, "bad", await fakes.add(BAD_ANSWERS[bad]))
    _running(store, "good2", await fakes.add(_json(json.dumps(GOOD).encode())))
    collector = await _collector(fakes, store, monkeypatch)
    t0 = time.monotonic()
    try:
        with caplog.at_level(logging.DEBUG, "aenv.metrics"):
            await asyncio.wait_for(collector.collect_once(), _GUARD_S)
    finally:
        await collector.close()
    assert time.monotonic() - t0 < 2 * _SAMPLE_S
    for good in ("good1", "good2"):
        [sample] = collector.samples(good, None, None)
        assert sample["memUsed"] == 1 << 28 and sample["cpuUsedPct"] == 12.5
        assert sample["timestamp"] == "2023-11-14T22:13:20Z"
    assert collector.samples("bad", None, None) == []
    assert any("bad" in r.getMessage() for r in caplog.records)


async def test_the_loop_keeps_collecting_past_a_bad_guest(
        world, monkeypatch: pytest.MonkeyPatch) -> None:
    fakes, store = world
    _running(store, "good", await fakes.add(_json(json.dumps(GOOD).encode())))
    _running(store, "list", await fakes.add(BAD_ANSWERS["a list"]))
    _running(store, "huge", await fakes.add(BAD_ANSWERS["a huge number"]))
    collector = await _collector(fakes, store, monkeypatch, interval=0.05)
    await collector.start()
    try:
        await asyncio.sleep(0.6)
        assert collector._task is not None and not collector._task.done()
        assert len(collector.samples("good", None, None)) >= 3
    finally:
        await collector.close()


async def test_the_loop_survives_a_failing_store(world, monkeypatch: pytest.MonkeyPatch) -> None:
    fakes, store = world
    _running(store, "good", await fakes.add(_json(json.dumps(GOOD).encode())))
    collector = await _collector(fakes, store, monkeypatch, interval=0.05)
    real = store.in_states
    calls = 0

    def flaky(states):
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("database is locked")
        return real(states)

    monkeypatch.setattr(store, "in_states", flaky)
    await collector.start()
    try:
        await asyncio.sleep(0.4)
        assert collector._task is not None and not collector._task.done()
        assert collector.samples("good", None, None)
    finally:
        await collector.close()


def _counted(answer: Answer, asks: list[str], name: str) -> Answer:
    async def counted(writer: asyncio.StreamWriter) -> None:
        asks.append(name)
        await answer(writer)
    return counted


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def test_an_idle_guest_is_asked_once_then_its_answer_repeated(
        world, monkeypatch: pytest.MonkeyPatch) -> None:
    """Idle is the VMM's host CPU between rounds (read on the host, not by asking the
    guest): below ``IDLE_CPU_MS_PER_S`` a guest that answered is not asked again, and each
    round repeats its answer with a fresh timestamp and the VMM's CPU as ``cpuUsedPct``; a
    busy one, or one whose VMM is unknown, is asked every round."""
    fakes, store = world
    asks: list[str] = []
    good = _json(json.dumps(GOOD).encode())
    _running(store, "idle", await fakes.add(_counted(good, asks, "idle")), vm_pid=1001)
    _running(store, "busy", await fakes.add(_counted(good, asks, "busy")), vm_pid=1002)
    _running(store, "unknown", await fakes.add(_counted(good, asks, "unknown")))
    cpu = {1001: 0.0, 1002: 0.0}
    monkeypatch.setattr(metrics_module, "vmm_cpu_s", lambda pid: cpu.get(pid))
    clock = _Clock()
    collector = await _collector(fakes, store, monkeypatch, clock=clock)
    rounds = 12
    try:
        for _ in range(rounds):
            cpu[1001] += 0.01  # 10 ms of CPU in 5 s: 2 ms/s, idle
            cpu[1002] += 10.0  # seconds of CPU between two rounds: never idle
            clock.now += 5.0
            await asyncio.wait_for(collector.collect_once(), _GUARD_S)
    finally:
        await collector.close()
    assert asks.count("busy") == asks.count("unknown") == rounds
    assert asks.count("idle") == 1
    idle = collector.samples("idle", None, None)
    assert len(idle) == rounds
    assert idle[0] == collector.samples("busy", None, None)[0]  # the guest's own answer
    for repeat in idle[1:]:
        assert repeat["timestampUnix"] >= int(time.time()) - 60  # the host's clock
        assert repeat["cpuUsedPct"] == 0.1  # 2 ms/s of one of 2 vCPUs' 1000 ms/s each
        assert repeat["memUsed"] == GOOD["mem_used"]
        assert repeat["diskTotal"] == GOOD["disk_total"]


async def test_an_idle_guest_is_asked_again_when_it_works_or_its_answer_is_old(
        world, monkeypatch: pytest.MonkeyPatch) -> None:
    fakes, store = world
    asks: list[str] = []
    _running(store, "idle", await fakes.add(_counted(_json(json.dumps(GOOD).encode()), asks,
                                                     "idle")), vm_pid=1001)
    cpu = {1001: 0.0}
    monkeypatch.setattr(metrics_module, "vmm_cpu_s", lambda pid: cpu.get(pid))
    clock = _Clock()
    collector = await _collector(fakes, store, monkeypatch, clock=clock)

    async def round_(seconds: float = 5.0, cpu_s: float = 0.0) -> None:
        cpu[1001] += cpu_s
        clock.now += seconds
        await asyncio.wait_for(collector.collect_once(), _GUARD_S)

    try:
        await round_()
        await round_()
        assert len(asks) == 1
        await round_(cpu_s=2.0)  # 400 ms/s: the guest ran something
        assert len(asks) == 2
        # after repeats, the answer's cpuUsedPct is the VMM's over the round
        await round_()
        await round_(cpu_s=1.0)
        assert len(asks) == 3
        assert collector.samples("idle", None, None)[-1]["cpuUsedPct"] == 10.0
        await round_(seconds=metrics_module.REFRESH_S)
        assert len(asks) == 4
        await round_()
        assert len(asks) == 4
    finally:
        await collector.close()


async def test_a_guest_whose_answer_failed_is_asked_again(
        world, monkeypatch: pytest.MonkeyPatch) -> None:
    fakes, store = world
    asks: list[str] = []
    answers = [_json(json.dumps(GOOD).encode()), BAD_ANSWERS["a list"]]

    async def answer(writer: asyncio.StreamWriter) -> None:
        await answers[min(len(asks), len(answers)) - 1](writer)

    _running(store, "sb", await fakes.add(_counted(answer, asks, "sb")), vm_pid=1001)
    monkeypatch.setattr(metrics_module, "vmm_cpu_s", lambda pid: 0.0)
    clock = _Clock()
    collector = await _collector(fakes, store, monkeypatch, clock=clock)
    try:
        for _ in range(2):
            clock.now += 5.0
            await asyncio.wait_for(collector.collect_once(), _GUARD_S)
        assert len(asks) == 1
        clock.now += metrics_module.REFRESH_S  # asked: a bad answer this time
        await asyncio.wait_for(collector.collect_once(), _GUARD_S)
        clock.now += 5.0  # asked again, not repeated from the answer before the bad one
        await asyncio.wait_for(collector.collect_once(), _GUARD_S)
        assert len(asks) == 3
    finally:
        await collector.close()


async def test_no_guest_is_asked_while_a_fan_out_starts(
        world, monkeypatch: pytest.MonkeyPatch) -> None:
    """While a fork's children start (``hold``: the slot pool's fan-out signal) the guests
    already running are not asked — an idle one's answer is still repeated from the host's
    side — and each is asked at the first round after; a hold longer than ``HOLD_MAX_S``
    lets one round through."""
    fakes, store = world
    asks: list[str] = []
    good = _json(json.dumps(GOOD).encode())
    _running(store, "idle", await fakes.add(_counted(good, asks, "idle")), vm_pid=1001)
    cpu = {1001: 0.0}
    monkeypatch.setattr(metrics_module, "vmm_cpu_s", lambda pid: cpu.get(pid))
    clock = _Clock()
    fanning_out = False
    collector = await _collector(fakes, store, monkeypatch, clock=clock)
    collector.hold = lambda: fanning_out

    async def round_(seconds: float = 5.0) -> None:
        clock.now += seconds
        await asyncio.wait_for(collector.collect_once(), _GUARD_S)

    try:
        await round_()
        await round_()  # asked once, then idle: repeated
        assert asks == ["idle"] and len(collector.samples("idle", None, None)) == 2
        fanning_out = True
        _running(store, "child", await fakes.add(_counted(good, asks, "child")), vm_pid=1002)
        await round_()
        await round_()
        assert asks == ["idle"], "a guest was asked during the fan-out"
        assert collector.samples("child", None, None) == []
        assert len(collector.samples("idle", None, None)) == 4  # repeats go on
        fanning_out = False
        await round_()
        assert asks == ["idle", "child"] and len(collector.samples("child", None, None)) == 1
        fanning_out = True
        await round_()
        await round_(seconds=metrics_module.HOLD_MAX_S)  # held too long: this round asks
        assert asks == ["idle", "child", "child"]
        await round_()
        assert asks == ["idle", "child", "child"]  # and holds again
    finally:
        await collector.close()
