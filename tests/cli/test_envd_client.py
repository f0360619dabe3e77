"""aenv.client.envd through the aenv proxy: the process calls the CLI builds on."""

from __future__ import annotations

import contextlib

import httpx
import pytest

from aenv.client.envd import EnvdClient, EnvdError, PtySize


@pytest.fixture
async def envd(server, sandbox_id: str):
    info = httpx.get(f"{server.url}/sandboxes/{sandbox_id}",
                     headers={"X-API-KEY": server.server.api_key}).json()
    client = EnvdClient.through_proxy(server.url, sandbox_id, info["envdAccessToken"])
    yield client
    await client.aclose()


async def test_send_input_and_close_stdin_feed_a_process(envd: EnvdClient) -> None:
    events = envd.start("/bin/cat", [], stdin=True)
    async with contextlib.aclosing(events):
        pid = (await anext(events)).pid
        await envd.send_input(pid, b"hello\n")
        await envd.close_stdin(pid)
        out = b"".join([e.data async for e in events if e.kind == "stdout"])
    assert out == b"hello\n"


async def test_stream_input_feeds_a_pty_in_order(envd: EnvdClient) -> None:
    events = envd.start("/bin/bash", ["-c", "read a; read b; echo \"got $a $b\""],
                        pty=PtySize(cols=80, rows=24), stdin=None)

    async def keys():
        for chunk in (b"one\r", b"two\r"):
            yield chunk

    async with contextlib.aclosing(events):
        pid = (await anext(events)).pid
        await envd.stream_input(pid, keys(), pty=True)
        seen = b""
        async for e in events:
            seen += e.data
            if e.kind == "end":
                assert e.exit_code == 0
    assert b"got one two" in seen


async def test_kill_ends_the_process_and_reports_unknown_pids(envd: EnvdClient) -> None:
    events = envd.start("/bin/bash", ["-c", "sleep 60"])
    async with contextlib.aclosing(events):
        pid = (await anext(events)).pid
        assert await envd.kill(pid) is True
        (end,) = [e async for e in events if e.kind == "end"]
    assert end.exit_code == -1 and end.status == "signal: killed"
    assert await envd.kill(pid) is False


async def test_a_killed_sandbox_answers_unavailable_not_found(envd: EnvdClient, server,
                                                               sandbox_id: str) -> None:
    httpx.delete(f"{server.url}/sandboxes/{sandbox_id}",
                 headers={"X-API-KEY": server.server.api_key}, timeout=30)
    with pytest.raises(EnvdError) as exc:
        await envd.run("true")
    assert exc.value.code == "unavailable" and "was not found" in exc.value.message
