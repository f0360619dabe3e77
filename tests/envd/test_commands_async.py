"""``AsyncSandbox.commands`` through the real (async) E2B SDK against envd on the host."""

from __future__ import annotations

import asyncio
import time

import pytest
from e2b import CommandExitException, NotFoundException, SandboxException, TimeoutException


async def pid_alive(sandbox, pid: int) -> bool:
    result = await sandbox.commands.run(f"kill -0 {pid} 2>/dev/null && echo yes || echo no",
                                        user="root")
    return result.stdout.strip() == "yes"


async def test_run_returns_stdout_and_exit_code_zero(async_sandbox) -> None:
    result = await async_sandbox.commands.run("echo hello")
    assert (result.stdout, result.exit_code, result.error) == ("hello\n", 0, None)


async def test_callbacks_receive_stdout_and_stderr(async_sandbox) -> None:
    out: list[str] = []
    err: list[str] = []
    await async_sandbox.commands.run("echo to-out; echo to-err >&2", on_stdout=out.append,
                                     on_stderr=err.append)
    assert ("".join(out), "".join(err)) == ("to-out\n", "to-err\n")


async def test_nonzero_exit_raises_command_exit_exception(async_sandbox) -> None:
    with pytest.raises(CommandExitException) as info:
        await async_sandbox.commands.run("echo bad >&2; exit 5")
    assert (info.value.exit_code, info.value.stderr, info.value.error) == (
        5, "bad\n", "exit status 5")


async def test_background_command_is_listed_then_waited(async_sandbox) -> None:
    handle = await async_sandbox.commands.run("sleep 0.5; echo done", background=True)
    assert handle.pid in {p.pid for p in await async_sandbox.commands.list()}
    assert (await handle.wait()).stdout == "done\n"
    assert handle.pid not in {p.pid for p in await async_sandbox.commands.list()}


async def test_concurrent_commands_each_get_their_own_output(async_sandbox) -> None:
    results = await asyncio.gather(*(async_sandbox.commands.run(f"echo {i}") for i in range(8)))
    assert [r.stdout for r in results] == [f"{i}\n" for i in range(8)]


async def test_stdin_is_echoed_by_cat_after_close(async_sandbox) -> None:
    handle = await async_sandbox.commands.run("cat", background=True, stdin=True)
    await async_sandbox.commands.send_stdin(handle.pid, "Hello, World!")
    await async_sandbox.commands.close_stdin(handle.pid)
    result = await handle.wait()
    assert (result.exit_code, result.stdout) == (0, "Hello, World!")


async def test_send_stdin_without_stdin_is_refused(async_sandbox) -> None:
    handle = await async_sandbox.commands.run("sleep 10", background=True)
    try:
        with pytest.raises(SandboxException, match="stdin not enabled or closed"):
            await async_sandbox.commands.send_stdin(handle.pid, "x")
    finally:
        await handle.kill()


async def test_kill_reaps_the_process_at_once(async_sandbox) -> None:
    handle = await async_sandbox.commands.run("sleep 30", background=True)
    assert await async_sandbox.commands.kill(handle.pid) is True
    assert not await pid_alive(async_sandbox, handle.pid)
    with pytest.raises(CommandExitException) as info:
        await handle.wait()
    assert (info.value.exit_code, info.value.error) == (-1, "signal: killed")


async def test_kill_unknown_pid_returns_false(async_sandbox) -> None:
    assert await async_sandbox.commands.kill(999999) is False


@pytest.mark.slow
async def test_timeout_kills_the_command(async_sandbox) -> None:
    started = time.monotonic()
    with pytest.raises(TimeoutException):
        await async_sandbox.commands.run("sleep 10", timeout=2)
    assert time.monotonic() - started < 8
    deadline = time.monotonic() + 5
    while any(p.args[-1] == "sleep 10" for p in await async_sandbox.commands.list()):
        assert time.monotonic() < deadline, "command outlived its timeout"
        await asyncio.sleep(0.05)


async def test_command_envs_apply_and_do_not_leak(async_sandbox) -> None:
    assert (await async_sandbox.commands.run("echo $FOO", envs={"FOO": "bar"})).stdout == "bar\n"
    assert (await async_sandbox.commands.run("echo ${FOO:-unset}")).stdout == "unset\n"


async def test_root_and_default_user(async_sandbox) -> None:
    assert (await async_sandbox.commands.run("whoami")).stdout == "user\n"
    assert (await async_sandbox.commands.run("echo $HOME", user="root")).stdout == "/root\n"


async def test_connect_streams_output_from_now_on(async_sandbox) -> None:
    seen_early = asyncio.Event()

    def on_stdout(chunk: str) -> None:
        if "early" in chunk:
            seen_early.set()

    handle = await async_sandbox.commands.run("echo early; sleep 1; echo late", background=True,
                                              on_stdout=on_stdout)
    await asyncio.wait_for(seen_early.wait(), 10)
    await handle.disconnect()
    connected = await async_sandbox.commands.connect(handle.pid)
    assert connected.pid == handle.pid
    result = await connected.wait()
    assert "late\n" in result.stdout and "early" not in result.stdout


async def test_connect_to_unknown_pid_raises_not_found(async_sandbox) -> None:
    with pytest.raises(NotFoundException):
        await async_sandbox.commands.connect(999999)


async def test_utf8_sequence_split_at_the_end_becomes_replacement_char(async_sandbox) -> None:
    result = await async_sandbox.commands.run("printf 'a%.0s' $(seq 8191); printf '\\xe2'")
    assert result.stdout == "a" * 8191 + "\ufffd"
