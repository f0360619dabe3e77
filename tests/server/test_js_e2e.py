"""The newest E2B JavaScript SDK against ``aenv server`` with a real microVM sandbox."""

from __future__ import annotations

import pytest

from tests.jsflow import check_flow, run_flow

pytestmark = [pytest.mark.vm, pytest.mark.net, pytest.mark.js]


def test_js_sdk_against_the_server(sdk) -> None:
    result = run_flow({"E2B_API_KEY": sdk.api_key, "E2B_API_URL": sdk.url,
                       "E2B_SANDBOX_URL": sdk.url})
    check_flow(result)
    assert result["listedSandbox"] is True
