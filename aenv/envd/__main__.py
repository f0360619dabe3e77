"""``python -m aenv.envd --host H --port P``: run envd.

Inside a guest the init system starts it with ``--guest`` (lets ``/init`` set the clock and
reseed randomness) and ``--default-user user``.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import uvicorn

from .app import create_app
from .guest import GuestHooks
from .state import EnvdState
from .users import ensure_user

DEFAULT_PORT = 49983


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m aenv.envd", description=__doc__)
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT)
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
    uvicorn.run(
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
    )


if __name__ == "__main__":
    main()
