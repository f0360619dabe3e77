"""Run tests/js/sdk_flow.mjs (the newest E2B JS SDK) with a given environment."""

from __future__ import annotations

import shutil

import pytest

from tests.conftest import ROOT, run_json_script

JS_DIR = ROOT / "tests/js"


def run_flow(env: dict[str, str], timeout: float = 180) -> dict:
    if shutil.which("node") is None or not (JS_DIR / "node_modules/e2b").is_dir():
        pytest.fail("node or the e2b npm package is missing: run ./scripts/setup.sh")
    return run_json_script(["node", "sdk_flow.mjs"], env, cwd=JS_DIR, timeout=timeout)


def check_flow(result: dict) -> None:
    assert result["running"] is True
    assert result["stdout"] == "hello from js\n" and result["stderr"] == "err\n"
    assert result["streamed"] == "1\n2\n3\n"
    assert result["exitError"] == 3
    assert result["listed"] is True and result["killed"] is True
    assert result["read"] == "from js"
    assert result["entries"] == ["dir", "a.txt"]
    assert result["exists"] is True and result["mode"] == 0o644
    assert result["watched"] is True and result["removed"] is True
    assert result["pty"] is True
    assert result["killedSandbox"] is True
