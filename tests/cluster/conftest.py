"""Fixtures of the cluster tests: a real redis-server per module, a clean DB per test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.cluster.redis_server import RedisServer, running_redis


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with running_redis(tmp_path_factory.mktemp("redis")) as srv:
        yield srv
