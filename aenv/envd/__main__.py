"""``python -m aenv.envd --host H --port P``: run envd.

Inside a guest the init system starts it with ``--guest`` (lets ``/init`` set the clock and
reseed randomness) and ``--default-user user``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import sys
import time
from email.utils import formatdate
from pathlib import Path
from types import FrameType

import uvicorn
from uvicorn.server import ServerState

from . import ENVD_PORT
from .app import create_app
from .guest import GuestHooks
from .state import EnvdState
from .users import ensure_user

# uvicorn's serve loop wakes every 0.1 s to look for a shutdown request and refresh the Date
# header. In an idle guest under emulation every wake-up costs the VMM host CPU (those ten a
# second were half of an idle sandbox's: 2.5 % of a host core, 1.2 % without them), so
# envd's loop sleeps until a signal wakes it, and the Date header is made when a response
# asks for it (once per second at most) instead of on a timer.
STARTUP_FAILURE = 3  # uvicorn's exit status when the server could not start


class _ServerState(ServerState):
    """uvicorn's shared server state whose ``default_headers`` (Date and the configured
    headers, which each response starts with) are made on demand; uvicorn's own refresh
    (``on_tick`` assigns them) is ignored."""

    def __init__(self, config: uvicorn.Config) -> None:
        self._config = config
        self._second = -1
        self._headers: list[tuple[bytes, bytes]] = []
        super().__init__()

    @property
    def default_headers(self) -> list[tuple[bytes, bytes]]:
        now = int(time.time())
        if now != self._second:
            date = [(b"date", formatdate(now, usegmt=True).encode())] \
                if self._config.date_header else []
            self._headers = date + list(getattr(self._config, "encoded_headers", []))
            self._second = now
        return self._headers

    @default_headers.setter
    def default_headers(self, value: list[tuple[bytes, bytes]]) -> None:
        pass


class _Server(uvicorn.Server):
    _wake: asyncio.Event | None = None
    _loop: asyncio.AbstractEventLoop | None = None

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.server_state = _ServerState(config)

    async def main_loop(self) -> None:
        self._loop, self._wake = asyncio.get_running_loop(), asyncio.Event()
        while not await self.on_tick(0):  # only a signal (handle_exit) wakes it
            await self._wake.wait()
            self._wake.clear()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        if self._loop is not None and self._wake is not None:
            self._loop.call_soon_threadsafe(self._wake.set)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m aenv.envd", description=__doc__)
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=ENVD_PORT)
    parser.add_argument("--default-user", default="root", help="user when a request names none")
    parser.add_argument("--default-workdir", default=None)
    parser.add_argument("--guest", action="store_true", help="own the machine: clock, entropy")
    parser.add_argument("--workload-cgroup", type=Path, default=None,
                        help="cgroup v2 directory every started process goes into")
    parser.add_argument("--log-level", default="warning")
    args = parser.parse_args(argv)

    logging.basicConfig(level=args.log_level.upper(), format="envd %(levelname)s %(message)s")
    if args.default_user != "root":
        ensure_user(args.default_user)
    state = EnvdState(default_user=args.default_user, default_workdir=args.default_workdir)
    app = create_app(state, GuestHooks(enabled=args.guest), args.workload_cgroup)
    server = _Server(uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=False,
        loop="auto",
        http="auto",
        lifespan="on",
        timeout_keep_alive=300,
        # Open streams must not keep shutdown (which kills child processes) waiting.
        timeout_graceful_shutdown=2,
    ))
    with contextlib.suppress(KeyboardInterrupt):  # uvicorn re-raises the SIGINT it handled
        server.run()
    if not server.started:
        sys.exit(STARTUP_FAILURE)


if __name__ == "__main__":
    main()
