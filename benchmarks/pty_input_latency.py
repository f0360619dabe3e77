"""Keystroke-to-echo latency of a PTY: StreamInput (one open client stream) vs SendInput
(one request per key), the choice behind ``aenv sandbox shell``.

Run: ``.venv/bin/python benchmarks/pty_input_latency.py [--n 300]`` against an envd started
here, or add ``--through-server`` to create a sandbox on the aenv server named by
``AENV_URL``/``AENV_API_KEY`` and go through its proxy (what the CLI does). Each key is one
byte typed into ``cat`` on a PTY; the time runs until its echo arrives on the output
stream. Prints one JSON object (milliseconds).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aenv.client.api import ApiClient
from aenv.client.envd import EnvdClient, PtySize
from benchmarks._common import Envd, emit, summary


async def keystrokes(envd: EnvdClient, mode: str, n: int) -> list[float]:
    events = envd.start("/bin/cat", [], pty=PtySize(cols=80, rows=24), stdin=None)
    async with contextlib.aclosing(events):
        pid = (await anext(events)).pid
        queue: asyncio.Queue[bytes | None] = asyncio.Queue()

        async def typed():
            while (key := await queue.get()) is not None:
                yield key

        forward = (asyncio.create_task(envd.stream_input(pid, typed(), pty=True))
                   if mode == "stream_input" else None)
        times = []
        for i in range(n):
            key = b"abcdefghij"[i % 10:i % 10 + 1]
            start = time.perf_counter()
            if forward is not None:
                queue.put_nowait(key)
            else:
                await envd.send_input(pid, key, pty=True)
            while True:
                event = await anext(events)
                if event.kind == "pty" and key in event.data:
                    break
            times.append((time.perf_counter() - start) * 1000)
        if forward is not None:
            queue.put_nowait(None)
            await forward
        await envd.kill(pid)
    return times


async def measure(envd: EnvdClient, n: int) -> dict:
    out: dict = {}
    for mode in ("stream_input", "send_input", "stream_input", "send_input"):
        out.setdefault(mode, []).extend(await keystrokes(envd, mode, n))
    return {mode: summary(ms) for mode, ms in out.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=300, help="keys per round (2 rounds)")
    parser.add_argument("--through-server", action="store_true")
    args = parser.parse_args()
    if not args.through_server:
        with Envd() as e:
            envd = EnvdClient(e.url, e.token)
            result = asyncio.run(measure(envd, args.n))
        emit({"path": "direct envd", **result})
        return
    url, key = os.environ["AENV_URL"], os.environ["AENV_API_KEY"]
    with ApiClient(url, key) as api:
        sid = api.create_sandbox("base")["sandboxID"]
        try:
            token = api.get_sandbox(sid).get("envdAccessToken")
            result = asyncio.run(measure(EnvdClient.through_proxy(url, sid, token), args.n))
        finally:
            api.kill_sandbox(sid)
    emit({"path": "aenv proxy", **result})


if __name__ == "__main__":
    main()
