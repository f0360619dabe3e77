"""The one way storage code runs external tools: captured output, named failures.

Tools run with a fixed C locale and without a terminal, so their output is parseable, and a
non-zero exit becomes ``CommandFailed`` carrying the stderr tail.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

from .errors import CommandFailed


def run(
    argv: Sequence[str | os.PathLike[str]],
    *,
    cwd: Path | None = None,
    env: Mapping[str, str] | None = None,
    input: bytes | None = None,
    stdout_to: Path | None = None,
) -> str:
    """Run ``argv`` to completion and return its stdout (text), or raise ``CommandFailed``.

    ``stdout_to`` sends stdout to a file instead (for large binary output).
    """
    args = [os.fspath(a) for a in argv]
    full_env = {**os.environ, "LC_ALL": "C", "LANG": "C", **(env or {})}
    full_env.setdefault("DEBIAN_FRONTEND", "noninteractive")
    with contextlib.ExitStack() as stack:
        out = stack.enter_context(open(stdout_to, "wb")) if stdout_to else subprocess.PIPE
        proc = subprocess.run(
            args,
            cwd=cwd,
            env=full_env,
            input=input,
            stdin=None if input is not None else subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.PIPE,
            check=False,
        )
    if proc.returncode != 0:
        raise CommandFailed(args, proc.returncode, proc.stderr.decode(errors="replace"))
    return proc.stdout.decode(errors="replace") if proc.stdout is not None else ""
