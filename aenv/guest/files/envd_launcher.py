#!/usr/bin/python3 -S
"""envd's entry point in a guest (``/opt/aenv/bin/envd``, ``/.aenv/bin/envd`` on the tools
drive): import once, fork the server.

Importing envd and its dependencies is most of envd's start-up cost under emulation (over a
second even with a warm page cache), so this process pays it once and then forks the actual
server; when the server dies for any reason, a new one is forked from the already-imported
parent and answers again within a few hundred milliseconds instead of seconds. The parent
forwards SIGTERM/SIGINT to the server and exits with it. Its parent (``envd-supervise``
under tini) restarts this process itself if it ever dies.

Arguments are envd's (``python -m aenv.envd --help``). With ``--guest`` the launcher first
puts itself into envd's cgroup, out of the OOM killer's reach, and passes the workload
cgroup on to the server (``aenv.envd.cgroups``). Markers on stdout, one line each:
``aenv-init: envd-imported <uptime>``, ``aenv-init: envd-fork <uptime> pid=<pid>``,
``aenv-init: envd-exit <uptime> rc=<code>`` (negative: killed by that signal).
Runs with ``python3 -S`` and nothing but the standard library until it imports envd.
"""

from __future__ import annotations

import gc
import importlib
import os
import signal
import sys
import time

# envd's site and sources: ``python/`` beside this file's ``bin/`` (``/opt/aenv/python`` in
# the base image, ``/.aenv/python`` on the tools drive).
PYTHON_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python")
# A server that dies sooner than this after its fork is restarted only after BACKOFF_S,
# so a crash at start-up does not spin the CPU.
MIN_LIFETIME_S = 1.0
BACKOFF_S = 0.2
# uvicorn imports these lazily when the server starts: importing them here is what makes
# a restart cheap. Missing ones are skipped. Not h11: with httptools installed (it is one of
# envd's requirements) uvicorn's "auto" never uses it, and it is ~0.1 s of a TCG boot.
_PRELOAD = (
    "aenv.envd.__main__",
    "aenv.envd.app",
    "uvicorn.loops.uvloop",
    "uvicorn.protocols.http.httptools_impl",
    "uvicorn.lifespan.on",
)


def _uptime() -> str:
    try:
        with open("/proc/uptime") as f:
            return f.read().split()[0]
    except OSError:
        return f"{time.monotonic():.2f}"


def mark(phase: str, extra: str = "") -> None:
    print(f"aenv-init: {phase} {_uptime()}{' ' + extra if extra else ''}", flush=True)


def preload() -> None:
    for name in _PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    # Keep the imported objects out of the collector's reach so the forked servers do not
    # touch (and so copy) their pages when they collect garbage.
    gc.collect()
    gc.freeze()


def serve(argv: list[str]) -> None:
    """In the forked child: become envd."""
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    from aenv.envd.__main__ import main

    try:
        main(argv)
    except SystemExit as e:
        os._exit(e.code if isinstance(e.code, int) else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
        os._exit(1)
    os._exit(0)


def supervise(argv: list[str]) -> int:
    child = 0
    stopping = False

    def forward(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True
        if child:
            try:
                os.kill(child, signum)
            except ProcessLookupError:
                pass

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    while True:
        started = time.monotonic()
        child = os.fork()
        if child == 0:
            serve(argv)
        mark("envd-fork", f"pid={child}")
        while True:
            try:
                _, status = os.waitpid(child, 0)
                break
            except InterruptedError:
                continue
        code = os.waitstatus_to_exitcode(status)
        mark("envd-exit", f"rc={code}")
        child = 0
        if stopping:
            return code if code >= 0 else 128 - code
        if time.monotonic() - started < MIN_LIFETIME_S:
            time.sleep(BACKOFF_S)


def placed(argv: list[str]) -> list[str]:
    """In a guest (``--guest``): envd's cgroup and OOM protection for this process and the
    servers it forks, and the workload cgroup for what they start."""
    if "--guest" not in argv:
        return argv
    from aenv.envd import cgroups

    try:
        workload = cgroups.place_envd()
    except OSError as e:
        print(f"aenv-init: envd stays in the root cgroup: {e}", flush=True)
        return argv
    return [*argv, "--workload-cgroup", str(workload)]


def main() -> None:
    if os.path.isdir(PYTHON_DIR) and PYTHON_DIR not in sys.path:
        sys.path.insert(0, PYTHON_DIR)
    argv = placed(sys.argv[1:])
    preload()
    mark("envd-imported")
    sys.exit(supervise(argv))


if __name__ == "__main__":
    main()
