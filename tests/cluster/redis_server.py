"""A real ``redis-server`` for tests: on a free loopback port, persistence off, killed at
the end (``running_redis``). Skips the test when Debian's redis-server is not installed
(scripts/setup.sh installs it)."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import free_port


class RedisServer:
    def __init__(self, workdir: Path, port: int | None = None) -> None:
        self.workdir = workdir
        self.port = port or free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    def url(self, db: int = 0) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    def start(self, timeout: float = 10) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            pytest.skip("redis-server is not installed (scripts/setup.sh installs it)")
        self.workdir.mkdir(parents=True, exist_ok=True)
        with open(self.workdir / "redis.log", "ab") as log:  # the child keeps its own fd
            self.proc = subprocess.Popen(
                [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                 "--appendonly", "no", "--dir", str(self.workdir), "--protected-mode", "yes"],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError((self.workdir / "redis.log").read_text()[-2000:])
            with contextlib.suppress(OSError), socket.create_connection(
                    ("127.0.0.1", self.port), 0.2) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return
            time.sleep(0.05)
        raise TimeoutError("redis-server did not start")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None

    def restart_empty(self) -> None:
        """Kill it and start a fresh one on the same port: everything it held is gone."""
        self.stop()
        self.start()


@contextlib.contextmanager
def running_redis(workdir: Path) -> Iterator[RedisServer]:
    srv = RedisServer(workdir)
    try:
        srv.start()
        yield srv
    finally:
        srv.stop()
