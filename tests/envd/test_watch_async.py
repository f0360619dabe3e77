"""Streaming WatchDir, as the async SDK (and JS) use it: start event, events, keepalives, end."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from e2b import FileNotFoundException, FilesystemEventType, SandboxException

E = FilesystemEventType


async def _until(predicate, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


async def test_watch_dir_streams_create_chmod_write_of_a_new_file(async_sandbox, home_dir):
    events = []
    handle = await async_sandbox.files.watch_dir(home_dir, on_event=events.append)
    await async_sandbox.files.write(f"{home_dir}/f.txt", "content")
    await _until(lambda: len(events) >= 3)
    await asyncio.sleep(0.1)
    assert [(e.name, e.type) for e in events] == [
        ("f.txt", E.CREATE), ("f.txt", E.CHMOD), ("f.txt", E.WRITE)
    ]
    await handle.stop()


async def test_recursive_watch_dir_sees_files_in_a_new_subdirectory(async_sandbox, home_dir):
    events = []
    handle = await async_sandbox.files.watch_dir(home_dir, on_event=events.append, recursive=True)
    await async_sandbox.files.make_dir(f"{home_dir}/sub")
    await async_sandbox.files.write(f"{home_dir}/sub/f.txt", "content")
    await _until(lambda: ("sub/f.txt", E.WRITE) in [(e.name, e.type) for e in events])
    assert events[0].name == "sub" and events[0].type == E.CREATE
    await handle.stop()


async def test_watch_dir_ends_with_an_error_at_its_timeout(async_sandbox, home_dir):
    exits = []
    handle = await async_sandbox.files.watch_dir(
        home_dir, on_event=lambda e: None, on_exit=exits.append, timeout=1
    )
    await _until(lambda: exits, timeout=5)
    assert isinstance(exits[0], Exception)
    await handle.stop()


async def test_watch_dir_of_missing_path_is_file_not_found(async_sandbox, home_dir):
    with pytest.raises(FileNotFoundException):
        await async_sandbox.files.watch_dir(f"{home_dir}/missing", on_event=lambda e: None)


async def test_watch_dir_of_a_file_is_refused(async_sandbox, home_dir):
    await async_sandbox.files.write(f"{home_dir}/f", "x")
    with pytest.raises(SandboxException):
        await async_sandbox.files.watch_dir(f"{home_dir}/f", on_event=lambda e: None)


def _envelopes(raw: bytes) -> list[tuple[int, bytes]]:
    out, i = [], 0
    while i + 5 <= len(raw):
        flags, size = raw[i], int.from_bytes(raw[i + 1 : i + 5], "big")
        out.append((flags, raw[i + 5 : i + 5 + size]))
        i += 5 + size
    return out


@pytest.mark.slow
def test_watch_dir_sends_keepalives_at_the_requested_interval(envd, access_token, home_dir):
    """On the wire: start, then keepalives every Keepalive-Ping-Interval, then the deadline."""
    body = b'{"path":"%s"}' % home_dir.encode()
    response = httpx.post(
        envd.url + "/filesystem.Filesystem/WatchDir",
        content=b"\x00" + len(body).to_bytes(4, "big") + body,
        headers={
            "content-type": "application/connect+json",
            "connect-protocol-version": "1",
            "keepalive-ping-interval": "1",
            "connect-timeout-ms": "2500",
            "x-access-token": access_token,
        },
        timeout=10,
    )
    frames = _envelopes(response.content)
    assert frames[0] == (0, b'{"start":{}}')
    assert frames[1:3] == [(0, b'{"keepalive":{}}')] * 2
    assert frames[-1][0] == 2 and b"deadline_exceeded" in frames[-1][1]
