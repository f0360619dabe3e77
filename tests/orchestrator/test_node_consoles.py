"""The node holds every running guest's console log to its bound, in the background."""

from __future__ import annotations

import asyncio
import types

from aenv.config import Settings
from aenv.orchestrator import node as node_mod
from aenv.runtime import console


async def test_running_guests_console_logs_are_cut_in_the_background(tmp_path, monkeypatch):
    monkeypatch.setattr(node_mod, "CONSOLE_CHECK_S", 0.02)
    machines = node_mod.NodeMachines(Settings(home=tmp_path))
    logs = [tmp_path / "flooded.log", tmp_path / "quiet.log"]
    logs[0].write_bytes(b"x" * (console.MAX_BYTES + 100_000))
    logs[1].write_bytes(b"booted\n")
    machines._running = {log.stem: types.SimpleNamespace(vm=types.SimpleNamespace(
        console_log=log)) for log in logs}
    task = asyncio.create_task(machines._bound_consoles())
    try:
        for _ in range(100):
            await asyncio.sleep(0.02)
            if logs[0].stat().st_size <= console.KEEP_BYTES + 4096:
                break
    finally:
        task.cancel()
    assert console.KEEP_BYTES <= logs[0].stat().st_size <= console.KEEP_BYTES + 4096
    assert logs[1].read_bytes() == b"booted\n"
