"""Guest readiness: /health polling, console marker stamps, the boot phase breakdown."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from aenv.runtime.base import BootError
from aenv.runtime.ready import BootPhases, ConsoleWatcher, wait_for_envd


async def health_server(statuses: list[int], answered: list[tuple[int, float]] | None = None
                        ) -> tuple[asyncio.Server, str]:
    """Answers /health with the given statuses in turn, then 204 forever; appends
    ``(status, monotonic time just before the answer was sent)`` to ``answered``."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await reader.readuntil(b"\r\n\r\n"):
            code = statuses.pop(0) if statuses else 204
            if answered is not None:
                answered.append((code, time.monotonic()))
            writer.write(f"HTTP/1.1 {code} X\r\ncontent-length: 0\r\n\r\n".encode())
            await writer.drain()

    async def guarded(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            await handle(r, w)
        except (asyncio.IncompleteReadError, ConnectionError):
            w.close()

    server = await asyncio.start_server(guarded, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}"


async def test_wait_for_envd_returns_once_health_answers_204() -> None:
    """It polls past the errors, stops at the first 204, and returns when that 204 came:
    after the server sent it and before the call returned."""
    answered: list[tuple[int, float]] = []
    server, url = await health_server([503, 502], answered)
    async with server:
        t = await wait_for_envd(url, timeout=5)
        returned = time.monotonic()
        await asyncio.sleep(0.1)  # it polls no more once it has its 204
    assert [code for code, _ in answered] == [503, 502, 204]
    sent_204 = answered[-1][1]
    assert sent_204 <= t <= returned


async def test_wait_for_envd_times_out_with_a_boot_error() -> None:
    server, url = await health_server([503] * 1000)
    async with server:
        with pytest.raises(BootError, match="not healthy"):
            await wait_for_envd(url, timeout=0.3)


class DeadVM:
    vm_id = "dead"

    def __init__(self, console: Path) -> None:
        self.console_log = console

    def is_alive(self) -> bool:
        return False


async def test_wait_for_envd_fails_fast_with_the_console_when_the_vmm_died(tmp_path) -> None:
    console = tmp_path / "console.log"
    console.write_text("Kernel panic - not syncing\n")
    t0 = time.monotonic()
    with pytest.raises(BootError) as err:
        dead = DeadVM(console)
        await wait_for_envd("http://127.0.0.1:9", timeout=10, vm=dead)  # type: ignore[arg-type]
    assert time.monotonic() - t0 < 1
    assert "Kernel panic" in err.value.console_tail


async def test_console_watcher_stamps_each_marker_when_it_appears(tmp_path: Path) -> None:
    console = tmp_path / "console.log"
    console.write_bytes(b"")
    async with ConsoleWatcher(console) as w:
        with open(console, "ab", buffering=0) as f:
            f.write(b"[    0.1] kernel noise\naenv-initrd: start 0.81\naenv-init: sta")
            await asyncio.sleep(0.1)
            t_mid = time.monotonic()
            f.write(b"rt 1.20\r\naenv-init: envd-exec 1.50\n")
            await asyncio.sleep(0.1)
    assert set(w.seen) == {"aenv-initrd:start", "aenv-init:start", "aenv-init:envd-exec"}
    assert w.seen["aenv-initrd:start"][0] < t_mid <= w.seen["aenv-init:start"][0]
    assert w.seen["aenv-init:start"][1] == 1.20


def test_boot_phases_add_up_to_the_total() -> None:
    seen = {"aenv-initrd:start": (10.9, 0.8), "aenv-init:envd-exec": (11.6, 1.5)}
    p = BootPhases.from_stamps(started_at=10.0, qmp_ready=0.05, seen=seen, healthy_at=12.4)
    assert p.vmm_to_qmp == 0.05 and p.guest_uptime_at_init == 0.8
    parts = p.vmm_to_qmp + p.kernel_to_init + p.init_to_envd_exec + p.envd_exec_to_health
    assert parts == pytest.approx(p.total) and p.total == pytest.approx(2.4)


def test_boot_phases_need_the_markers() -> None:
    with pytest.raises(ValueError, match="markers missing"):
        BootPhases.from_stamps(started_at=0, qmp_ready=0, seen={}, healthy_at=1)
