"""The cluster's secrets survive a Redis that restarts empty (real redis-server, no VMs):
each node keeps a copy (sealed values only, 0600) and the first node that finds Redis on a
new epoch writes the lost secrets back, once; a node that comes back later with an old copy
of that epoch does not write it again (a deletion stays deleted)."""

from __future__ import annotations

import stat
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

from aenv.cluster.shared_secrets import SharedSecrets
from aenv.store.secrets import SecretsUnavailable
from tests.cluster.redis_server import RedisServer

SECRET = "cluster-secret-" + "m" * 30
T = TypeVar("T")


async def again(call: Callable[[], Awaitable[T]]) -> T:
    """``call``, once more if the client's connection died with the old Redis."""
    try:
        return await call()
    except SecretsUnavailable:
        return await call()


async def test_a_redis_that_restarted_empty_gets_the_secrets_back_from_a_node(
        redis_server: RedisServer, tmp_path: Path) -> None:
    url = redis_server.url(5)
    gateway = SharedSecrets.from_url(url, SECRET)
    node = SharedSecrets.from_url(url, SECRET, mirror=tmp_path / "a" / "copy.json")
    late = SharedSecrets.from_url(url, SECRET, mirror=tmp_path / "b" / "copy.json")
    try:
        await gateway.client.flushdb()
        await gateway.create("kept", "v1-s3cret", {"k": "v"})
        await gateway.create("gone", "x", {})
        await gateway.update("kept", "v2-s3cret", None)
        await node.sync()
        await late.sync()
        copy = tmp_path / "a" / "copy.json"
        assert stat.S_IMODE(copy.stat().st_mode) == 0o600
        assert "s3cret" not in copy.read_text()          # sealed, as in Redis
        await gateway.delete("gone")
        await node.sync()                                # late's copy still has "gone"

        redis_server.restart_empty()
        assert await again(lambda: gateway.value("kept")) is None
        await again(lambda: gateway.create("new", "n", {}))   # a write before any node saw
        await again(node.sync)
        assert await gateway.value("kept") == "v2-s3cret"
        kept = await gateway.get("kept")
        assert kept is not None and (kept.version, kept.metadata) == (2, {"k": "v"})
        assert await gateway.value("new") == "n"
        assert await gateway.value("gone") is None
        await again(late.sync)                           # that epoch was written back already
        assert await gateway.value("gone") is None
        assert [r.name for r in await gateway.page(None, 10)] == ["kept", "new"]
        # the copies follow Redis from then on
        await gateway.update("new", "n2", None)
        await late.sync()
        assert '"rev": "' in (tmp_path / "b" / "copy.json").read_text()
        restored = tmp_path / "b" / "copy.json"
        assert "gone" not in restored.read_text()
    finally:
        for s in (gateway, node, late):
            await s.close()
