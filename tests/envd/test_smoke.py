"""The SDK reaches envd through the test control plane at all."""

from __future__ import annotations


def test_sandbox_is_running(sandbox) -> None:
    assert sandbox.is_running()


async def test_async_sandbox_is_running(async_sandbox) -> None:
    assert await async_sandbox.is_running()
