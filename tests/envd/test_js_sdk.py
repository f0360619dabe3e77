"""The newest E2B JavaScript SDK against envd on the host (through the test control plane)."""

from __future__ import annotations

import pytest

from tests.jsflow import check_flow, run_flow

pytestmark = pytest.mark.js


def test_js_sdk_drives_envd(sdk_env) -> None:
    check_flow(run_flow({**sdk_env, "AENV_JS_ENVD_ONLY": "1"}))
