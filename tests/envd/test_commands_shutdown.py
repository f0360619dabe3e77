"""envd takes its children down with it when it shuts down."""

from __future__ import annotations

import json
import os
import signal
import time

import httpx

from tests.conftest import Envd


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _start_and_detach(url: str, cmd: str) -> int:
    """Start ``cmd``, read its pid, drop the stream; a 1 s keepalive lets envd notice."""
    body = json.dumps({"process": {"cmd": "/bin/sh", "args": ["-c", cmd]}}).encode()
    headers = {"content-type": "application/connect+json", "connect-protocol-version": "1",
               "keepalive-ping-interval": "1"}
    with httpx.stream("POST", url + "/process.Process/Start", headers=headers,
                      content=b"\x00" + len(body).to_bytes(4, "big") + body) as r:
        head = r.iter_raw().__next__()
    size = int.from_bytes(head[1:5], "big")
    return json.loads(head[5:5 + size])["event"]["start"]["pid"]


def test_shutdown_kills_running_children(envd_factory) -> None:
    envd: Envd = envd_factory()
    pid = _start_and_detach(envd.url, "exec sleep 60")
    try:
        assert _alive(pid)
        time.sleep(1.5)  # past one keepalive: the dropped stream is gone
        os.kill(envd.proc.pid, signal.SIGTERM)  # envd only, not its process group
        envd.proc.wait(10)
        deadline = time.monotonic() + 5
        while _alive(pid):
            assert time.monotonic() < deadline, "child outlived envd"
            time.sleep(0.05)
    finally:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
