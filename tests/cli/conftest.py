"""The ``aenv`` CLI against the session's aenv server (``server`` in tests/conftest.py),
driven in-process through typer's CliRunner, or as a real process where a terminal is
part of the claim (tests/cli/test_shell.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import httpx
import pytest
from click.testing import Result
from typer.testing import CliRunner

from aenv.cli.main import app

Aenv = Callable[..., Result]


@pytest.fixture
def cli_env(server, monkeypatch: pytest.MonkeyPatch, tmp_path) -> dict[str, str]:
    """Only the CLI's own variables, pointed at the test server (no E2B_* leaking in from
    the SDK tests, no key file from a real installation)."""
    for name in ("AENV_URL", "E2B_API_URL", "AENV_API_KEY", "E2B_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    env = {"AENV_URL": server.url, "AENV_API_KEY": server.server.api_key,
           "AENV_HOME": str(tmp_path / "aenv-home")}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return env


@pytest.fixture
def aenv(cli_env) -> Aenv:
    runner = CliRunner()

    def invoke(*args: str) -> Result:
        return runner.invoke(app, list(args), catch_exceptions=False)

    return invoke


@pytest.fixture
def sandbox_id(aenv: Aenv, server) -> Iterator[str]:
    """A sandbox made with ``aenv sandbox create``; killed afterwards if still there."""
    result = aenv("sandbox", "create", "--metadata", "suite=cli")
    assert result.exit_code == 0, result.output
    sid = result.stdout.strip()
    yield sid
    httpx.delete(f"{server.url}/sandboxes/{sid}",
                 headers={"X-API-KEY": server.server.api_key}, timeout=30)
