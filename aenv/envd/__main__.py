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
from pathlib import Path
from types import FrameType

import uvicorn

from . import ENVD_PORT
from .app import create_app
from .guest import GuestHooks
from .state import EnvdState
from .users import ensure_user

# uvicorn's serve loop wakes every 0.1 s to look for a shutdown request and refresh the Date
# header. In an idle guest under emulation those wake-ups were half of what its VMM spends
# (2.5 % of a host core per idle sandbox, 1.2 % without them), so envd refreshes once a
# second and a signal wakes the loop at once.
TICK_S = 1.0
STARTUP_FAILURE = 3  # uvicorn's exit status when the server could not start


class _Server(uvicorn.Server):
    _wake: asyncio.Event | None = None
    _loop: asyncio.AbstractEventLoop | None = None

    async def main_loop(self) -> None:
        self._loop, self._wake = asyncio.get_running_loop(), asyncio.Event()
        while not await self.on_tick(0):  # counter 0: on_tick refreshes the Date header
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), TICK_S)

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
