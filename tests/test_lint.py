"""``make lint`` as a test, so that ``make test`` (and CI, which runs only that) fails on a
lint or type error instead of leaving it to whoever remembers to run ``make lint``.

The same two commands as the Makefile's ``lint`` target: ruff over aenv, tests and
benchmarks, and mypy with pyproject's ``[tool.mypy]`` (strict on aenv/). Both run from the
interpreter's environment (the venv ``make test`` uses) in the repository root. mypy keeps
its incremental cache in ``.mypy_cache`` (git-ignored), so a warm run takes seconds; a cold
one (a fresh clone) some 20 s on 2 cores. Marked slow: ``make test-fast`` leaves it out.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from .conftest import ROOT

LINTERS = {
    "ruff": [sys.executable, "-m", "ruff", "check", "aenv", "tests", "benchmarks"],
    "mypy": [sys.executable, "-m", "mypy"],
}


@pytest.mark.slow
@pytest.mark.timeout(300)  # a cold mypy cache on a loaded CI machine
@pytest.mark.parametrize("name", sorted(LINTERS))
def test_reports_nothing(name: str) -> None:
    proc = subprocess.run(LINTERS[name], cwd=ROOT, capture_output=True, text=True,
                          timeout=280, check=False)
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(LINTERS[name][2:])} exited {proc.returncode}:\n"
                    f"{proc.stdout}{proc.stderr}", pytrace=False)
