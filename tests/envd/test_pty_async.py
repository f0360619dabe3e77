"""``AsyncSandbox.pty`` through the real (async) E2B SDK."""

from __future__ import annotations

import asyncio

from e2b.sandbox.commands.command_handle import PtySize


async def test_shell_sees_envs_and_exit_ends_it_with_zero(async_sandbox) -> None:
    out = bytearray()
    handle = await async_sandbox.pty.create(PtySize(rows=24, cols=80), on_data=out.extend,
                                            envs={"ABC": "123"})
    await async_sandbox.pty.send_stdin(handle.pid, b"echo $ABC\nexit\n")
    result = await handle.wait()
    assert result.exit_code == 0
    assert b"123" in out


async def test_resize_changes_tput_cols(async_sandbox) -> None:
    out = bytearray()
    handle = await async_sandbox.pty.create(PtySize(rows=24, cols=80), on_data=out.extend)
    await async_sandbox.pty.resize(handle.pid, PtySize(rows=30, cols=100))
    await async_sandbox.pty.send_stdin(handle.pid, b"tput cols\nexit\n")
    await handle.wait()
    assert b"100\r\n" in out


async def test_kill_reaps_the_shell_at_once(async_sandbox) -> None:
    handle = await async_sandbox.pty.create(PtySize(rows=24, cols=80), on_data=lambda _: None)
    assert await async_sandbox.pty.kill(handle.pid) is True
    alive = await async_sandbox.commands.run(
        f"kill -0 {handle.pid} 2>/dev/null && echo yes || echo no", user="root")
    assert alive.stdout == "no\n"


async def test_connect_gets_output_of_the_same_pid(async_sandbox) -> None:
    handle = await async_sandbox.pty.create(PtySize(rows=24, cols=80), on_data=lambda _: None)
    await handle.disconnect()
    out = bytearray()
    connected = await async_sandbox.pty.connect(handle.pid, on_data=out.extend)
    assert connected.pid == handle.pid
    await async_sandbox.pty.send_stdin(handle.pid, b"echo AFTER-$((40+2))\nexit\n")
    assert (await asyncio.wait_for(connected.wait(), 30)).exit_code == 0
    assert b"AFTER-42" in out
