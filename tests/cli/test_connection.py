"""How the CLI finds the server and the key (no server needed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from aenv.cli.connection import DEFAULT_URL, ConnectionSetupError, is_local, resolve


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    for name in ("AENV_URL", "E2B_API_URL", "AENV_API_KEY", "E2B_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AENV_HOME", str(tmp_path))
    return tmp_path


def write_key(home: Path, key: str) -> None:
    (home / "secrets").mkdir()
    (home / "secrets/api-key").write_text(key + "\n")


def test_aenv_key_wins_over_e2b_key(monkeypatch) -> None:
    monkeypatch.setenv("E2B_API_KEY", "e2b_second")
    monkeypatch.setenv("AENV_API_KEY", "e2b_first")
    assert resolve(None) == resolve(DEFAULT_URL)
    assert resolve(None).api_key == "e2b_first"


def test_local_server_key_comes_from_the_servers_file(clean_env: Path) -> None:
    write_key(clean_env, "e2b_fromfile")
    assert resolve("http://localhost:3000/").api_key == "e2b_fromfile"
    assert resolve("http://localhost:3000/").url == "http://localhost:3000"


def test_remote_server_needs_a_key_in_the_environment(clean_env: Path) -> None:
    write_key(clean_env, "e2b_fromfile")
    with pytest.raises(ConnectionSetupError, match="set AENV_API_KEY"):
        resolve("http://10.0.0.5:3000")


def test_missing_key_file_says_what_to_do() -> None:
    with pytest.raises(ConnectionSetupError, match="no API key"):
        resolve(None)


def test_bad_url_is_refused(monkeypatch) -> None:
    monkeypatch.setenv("AENV_API_KEY", "k")
    with pytest.raises(ConnectionSetupError, match="invalid server URL"):
        resolve("127.0.0.1:3000")


@pytest.mark.parametrize(("url", "local"), [
    ("http://127.0.0.1:3000", True), ("http://127.8.0.1", True), ("http://[::1]:3000", True),
    ("http://localhost", True), ("http://10.1.2.3", False), ("https://api.example.com", False),
])
def test_is_local(url: str, local: bool) -> None:
    assert is_local(url) is local


def test_the_url_comes_from_aenv_url_else_e2b_api_url_and_url_wins(monkeypatch) -> None:
    monkeypatch.setenv("AENV_API_KEY", "k")
    monkeypatch.setenv("E2B_API_URL", "http://10.0.0.2:3000/")
    assert resolve(None).url == "http://10.0.0.2:3000"
    monkeypatch.setenv("AENV_URL", "http://10.0.0.1:3000")
    assert resolve(None).url == "http://10.0.0.1:3000"
    assert resolve("http://10.0.0.3:3000").url == "http://10.0.0.3:3000"


def test_a_bad_server_setting_is_a_setup_error_not_a_traceback(monkeypatch) -> None:
    monkeypatch.setenv("AENV_NAME_PREFIX", "Not-A-Prefix")
    with pytest.raises(ConnectionSetupError, match="AENV_NAME_PREFIX="):
        resolve(None)


def test_the_cli_reads_the_url_from_the_environment(monkeypatch) -> None:
    """``aenv sandbox ls`` with AENV_URL and no --url talks to AENV_URL's server."""
    from typer.testing import CliRunner

    from aenv.cli.main import app

    monkeypatch.setenv("AENV_API_KEY", "k")
    r = CliRunner().invoke(app, ["sandbox", "ls"], env={"AENV_URL": "http://127.0.0.1:9"})
    assert r.exit_code == 1 and "127.0.0.1:9" in r.output, r.output
