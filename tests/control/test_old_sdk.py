"""The oldest supported E2B Python SDK (2.7.0: v1 create and connect) against aenv."""

from __future__ import annotations

import pytest

from tests.conftest import ROOT, run_json_script

OLD_PYTHON = ROOT / ".venv-e2b-2.7/bin/python"


def test_e2b_2_7_runs_the_v1_flow_unchanged(api_env) -> None:
    if not OLD_PYTHON.exists():
        pytest.fail(f"{OLD_PYTHON} is missing: run ./scripts/setup.sh")
    out = run_json_script([str(OLD_PYTHON), str(ROOT / "tests/old_sdk/flow.py")], api_env,
                          timeout=120)
    assert out["running"] is True
    assert (out["stdout"], out["stderr"]) == ("hi\n", "err\n")
    assert out["streamed"] == "1\n2\n3\n"
    assert out["exit"] == 3
    assert out["bg_killed"] is True
    assert out["whoami"] == "root\n"
    assert out["env"] == "y\n"
    assert out["read"] == "old sdk" and out["listed"] == ["a.txt"]
    assert out["exists"] == [False, True] and out["removed"] is True
    assert out["found"] is True
    assert out["connected"] == "again\n"
    assert out["killed"] is True and out["gone"] is True
