"""A burst of creates through the real E2B SDK (issue 21): 16 concurrent
``AsyncSandbox.create`` on one node, twice its start limit, all succeed (the start queue
holds the rest instead of answering 429) and every sandbox runs a command. The SDK's own
429 retries are off, so a refusal cannot be hidden by a retry."""

from __future__ import annotations

import asyncio

import pytest
from e2b import AsyncSandbox

pytestmark = [pytest.mark.vm, pytest.mark.net]

BURST = 16


async def test_a_burst_of_16_creates_all_start_and_answer(sdk) -> None:
    results = await asyncio.gather(
        *(AsyncSandbox.create("base", timeout=300, retries=0) for _ in range(BURST)),
        return_exceptions=True)
    made = [r for r in results if isinstance(r, AsyncSandbox)]
    try:
        assert len(made) == BURST, [repr(r) for r in results if not isinstance(r, AsyncSandbox)]
        assert len({s.sandbox_id for s in made}) == BURST
        runs = await asyncio.gather(*(s.commands.run("echo $((6 * 7))") for s in made))
        assert [r.stdout.strip() for r in runs] == ["42"] * BURST
    finally:
        await asyncio.gather(*(s.kill() for s in made), return_exceptions=True)
