"""Run tests/js/sdk_flow.mjs (the newest E2B JS SDK) with a given environment."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

from tests.conftest import ROOT

JS_DIR = ROOT / "tests/js"


def run_flow(env: dict[str, str], timeout: float = 180) -> dict:
    if shutil.which("node") is None or not (JS_DIR / "node_modules/e2b").is_dir():
        pytest.fail("node or the e2b npm package is missing: run ./scripts/setup.sh")
    proc = subprocess.run(["node", "sdk_flow.mjs"], cwd=JS_DIR, env={**os.environ, **env},
                          capture_output=True, text=True, timeout=timeout, check=False)
    assert proc.returncode == 0, f"node failed:\n{proc.stdout}\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


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
