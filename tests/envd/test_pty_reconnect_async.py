"""Reconnecting to a PTY through the real (async) E2B SDK: what the new handler receives.

As upstream envd: a Connect gets the output the process produces from the moment it is
attached, in order, then the end; output produced while no stream was attached is not kept
for a later Connect. E2B's own ``test_connect_to_pty`` (async, and the JS ``ptyConnect``)
relies on the shell printing its first prompt and the first command's output within the
0.3 s it waits before disconnecting; under QEMU TCG an interactive login bash needs about
0.2-0.5 s just to reach its prompt, so that output is produced while detached and the
first handler never sees it. The shell here is made that slow on purpose
(``PROMPT_COMMAND``) to pin down both halves of that behaviour.
"""

from __future__ import annotations

import asyncio
import os
import uuid

from e2b.sandbox.commands.command_handle import PtySize

# Longer than the 0.3 s the E2B test waits before it disconnects.
SLOW_PROMPT = {"PROMPT_COMMAND": "sleep 0.6"}


async def _wait_for_file(path: str, timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not os.path.exists(path):
        assert loop.time() < deadline, f"{path} did not appear"
        await asyncio.sleep(0.05)


async def test_reconnected_handler_gets_output_produced_after_it_attached(async_sandbox) -> None:
    marker = f"/tmp/aenv-t-pty-{uuid.uuid4().hex[:10]}"
    first, second = bytearray(), bytearray()
    pty = async_sandbox.pty
    try:
        terminal = await pty.create(PtySize(80, 24), on_data=first.extend,
                                    envs={"FOO": "bar", **SLOW_PROMPT})
        await pty.send_stdin(terminal.pid, f"echo first-$FOO; : > {marker}\n".encode())
        await asyncio.sleep(0.3)  # as the E2B test: the shell has not prompted yet
        await terminal.disconnect()
        await _wait_for_file(marker)  # the first command ran, with nothing attached
        await asyncio.sleep(0.2)  # and envd has read its output off the terminal

        again = await pty.connect(terminal.pid, on_data=second.extend)
        await pty.send_stdin(terminal.pid, b"echo second-$FOO\nexit\n")
        result = await asyncio.wait_for(again.wait(), 30)
    finally:
        if os.path.exists(marker):
            os.unlink(marker)

    assert again.pid == terminal.pid
    assert result.exit_code == 0
    assert b"first-$FOO" in first  # the terminal's echo of the typed line arrived ...
    assert b"first-bar" not in first  # ... its output came after the disconnect
    assert b"first-bar" not in second  # and is not replayed to the next Connect
    assert b"second-bar" in second
