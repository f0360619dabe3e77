"""``python -m aenv.interpreter --host H --port P``: run the code-interpreter server.

In the ``code-interpreter-v1`` template the start command runs it as the template's user in
``/home/user``, so its kernels run as that user there too.
"""

from __future__ import annotations

import argparse
import logging
import os

import uvicorn

from . import JUPYTER_PORT
from .kernels import ENVD_ENVS_URL, Kernels
from .server import create_app


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m aenv.interpreter", description=__doc__)
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=JUPYTER_PORT)
    parser.add_argument("--cwd", default="/home/user", help="a context's default directory")
    parser.add_argument("--languages", default="python",
                        help="comma-separated languages whose default context starts at once")
    parser.add_argument("--envd-envs-url", default=ENVD_ENVS_URL,
                        help="where the sandbox's env vars come from ('' for nowhere)")
    parser.add_argument("--jupyter-path", default="",
                        help="a directory put first on JUPYTER_PATH (its kernels/ are found)")
    parser.add_argument("--preload", default=None,
                        help="python run (hidden) in the default python context at start")
    parser.add_argument("--warm-up", action="store_true",
                        help="run one cell through the HTTP API before /health answers 200")
    parser.add_argument("--log-level", default="warning")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper())
    if args.jupyter_path:
        os.environ["JUPYTER_PATH"] = os.pathsep.join(
            p for p in (args.jupyter_path, os.environ.get("JUPYTER_PATH", "")) if p)
    cwd = args.cwd if os.path.isdir(args.cwd) else os.getcwd()
    kernels = Kernels(cwd, args.envd_envs_url or None)
    languages = tuple(x for x in args.languages.split(",") if x)
    app = create_app(kernels, languages, args.preload,
                     warm_up_port=args.port if args.warm_up else None)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                timeout_graceful_shutdown=5)


if __name__ == "__main__":
    main()
