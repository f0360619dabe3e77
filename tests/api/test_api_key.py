"""The server's API key: generated atomically, never shorter than 32 characters wherever it
comes from, and never matched by an empty ``X-API-KEY``."""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

import httpx
import pytest
from starlette.responses import PlainTextResponse

from aenv.api.auth import MIN_KEY_LENGTH, ApiKeyError, ApiKeyMiddleware, load_api_key
from aenv.config import Settings

GOOD = "k" * MIN_KEY_LENGTH


@pytest.fixture(autouse=True)
def _no_env_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AENV_API_KEY", raising=False)


def test_a_new_key_is_written_whole_with_mode_0600(tmp_path: Path) -> None:
    key, path = load_api_key(tmp_path / "secrets")
    assert path == tmp_path / "secrets/api-key"
    assert key.startswith("e2b_") and len(key) == 44
    assert path.read_text() == key + "\n"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert sorted(os.listdir(path.parent)) == ["api-key"], "no temporary file is left"
    assert load_api_key(tmp_path / "secrets") == (key, path)


def test_a_crash_while_writing_the_key_leaves_no_key_file(tmp_path: Path, monkeypatch) -> None:
    def crash(fd: int) -> None:
        raise OSError("disk gone")

    monkeypatch.setattr(os, "fsync", crash)
    with pytest.raises(OSError):
        load_api_key(tmp_path / "secrets")
    assert not (tmp_path / "secrets/api-key").exists()
    monkeypatch.undo()
    key, _ = load_api_key(tmp_path / "secrets")
    assert len(key) == 44


def test_a_zero_length_key_file_from_an_old_crash_gets_a_fresh_key(tmp_path: Path) -> None:
    (tmp_path / "api-key").touch(mode=0o600)
    key, path = load_api_key(tmp_path)
    assert len(key) == 44 and path.read_text() == key + "\n"


@pytest.mark.parametrize("content", ["\n", "short\n", "x" * (MIN_KEY_LENGTH - 1),
                                     "has a space in it and is long enough"])
def test_a_key_file_that_holds_no_usable_key_is_refused(tmp_path: Path, content: str) -> None:
    (tmp_path / "api-key").write_text(content)
    with pytest.raises(ApiKeyError, match=re.escape(str(tmp_path / "api-key"))):
        load_api_key(tmp_path)
    assert (tmp_path / "api-key").read_text() == content, "the file is left as it was"


def _configured(value: str) -> str | None:
    """``Settings.api_key`` as the server reads it from ``AENV_API_KEY=value``."""
    return Settings.from_env({"AENV_API_KEY": value}).api_key


def test_a_short_AENV_API_KEY_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ApiKeyError, match=r"AENV_API_KEY .* at least 32"):
        load_api_key(tmp_path, _configured("secret"))
    assert not (tmp_path / "api-key").exists()


def test_AENV_API_KEY_is_used_stripped_and_an_empty_one_means_unset(tmp_path: Path) -> None:
    assert load_api_key(tmp_path, _configured(f" {GOOD}\n")) == (GOOD, None)
    # what docker-compose passes when it is unset
    key, path = load_api_key(tmp_path, _configured(""))
    assert path == tmp_path / "api-key" and len(key) == 44


def test_the_server_takes_the_key_from_its_settings_not_the_environment(
        tmp_path: Path, monkeypatch) -> None:
    from aenv.server import Server
    from tests.control.process_machines import ProcessMachines

    monkeypatch.setenv("AENV_API_KEY", "e2b_" + "e" * 40)
    srv = Server(Settings(home=tmp_path, api_key=GOOD), ProcessMachines())
    try:
        assert (srv.api_key, srv.api_key_file) == (GOOD, None)
    finally:
        srv.db.close()


def test_the_middleware_refuses_an_empty_or_short_key() -> None:
    for key in ("", "x" * (MIN_KEY_LENGTH - 1)):
        with pytest.raises(ValueError):
            ApiKeyMiddleware(PlainTextResponse("ok"), key)


async def test_an_empty_x_api_key_is_401_and_the_right_one_passes() -> None:
    app = ApiKeyMiddleware(PlainTextResponse("ok"), GOOD)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://t") as c:
        assert (await c.get("/sandboxes", headers={"X-API-KEY": ""})).status_code == 401
        assert (await c.get("/sandboxes")).status_code == 401
        assert (await c.get("/sandboxes", headers={"X-API-KEY": GOOD[:-1]})).status_code == 401
        assert (await c.get("/sandboxes", headers={"X-API-KEY": GOOD})).status_code == 200
        assert (await c.get("/health")).status_code == 200


async def test_a_server_whose_key_file_was_left_empty_answers_401_to_an_empty_key(
        tmp_path: Path) -> None:
    from aenv.server import Server
    from tests.control.process_machines import ProcessMachines

    settings = Settings(home=tmp_path)
    settings.secrets_dir.mkdir(mode=0o700)
    (settings.secrets_dir / "api-key").touch(mode=0o600)
    srv = Server(settings, ProcessMachines())
    try:
        assert len(srv.api_key) >= MIN_KEY_LENGTH
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=srv.app),
                                     base_url="http://t") as c:
            for headers in ({"X-API-KEY": ""}, {}):
                r = await c.get("/v2/sandboxes", headers=headers)
                assert r.status_code == 401, r.text
            r = await c.get("/v2/sandboxes", headers={"X-API-KEY": srv.api_key})
            assert r.status_code == 200, r.text
    finally:
        srv.db.close()  # never started: nothing else to stop
