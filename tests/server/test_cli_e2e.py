"""The ``aenv`` CLI against a real server: fork and snapshot (public API only)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from e2b import Sandbox

from tests.conftest import ROOT

pytestmark = [pytest.mark.vm, pytest.mark.net]


def _aenv(srv, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "AENV_URL": srv.url, "AENV_API_KEY": srv.api_key}
    return subprocess.run([sys.executable, "-m", "aenv.cli.main", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120, check=False)


def test_cli_fork_and_snapshot(sdk) -> None:
    src = Sandbox.create("base")
    made: list[str] = []
    try:
        src.files.write("/home/user/from-cli.txt", "src")
        out = _aenv(sdk, "sandbox", "fork", src.sandbox_id, "--count", "2")
        assert out.returncode == 0, out.stderr
        made = out.stdout.split()
        assert len(made) == 2
        for sid in made:
            assert Sandbox.connect(sid).files.read("/home/user/from-cli.txt") == "src"
        snap = _aenv(sdk, "sandbox", "snapshot", src.sandbox_id)
        assert snap.returncode == 0, snap.stderr
        child = Sandbox.create(snap.stdout.strip())
        made.append(child.sandbox_id)
        assert child.files.read("/home/user/from-cli.txt") == "src"
        assert Sandbox.delete_snapshot(snap.stdout.strip())
    finally:
        for sid in made:
            Sandbox.kill(sid)
        src.kill()
