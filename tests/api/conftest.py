"""The ``api`` fixture of the route tests: a world of fake machines and a client of its
app, with the API key (``api_world.world_client``)."""

from __future__ import annotations

import pytest

from tests.api.api_world import world_client


@pytest.fixture
async def api(tmp_path):
    async with world_client(tmp_path / "build-files") as (world, c):
        yield world, c
