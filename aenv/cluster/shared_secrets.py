"""A cluster's secrets (E2B ``Secret``), shared by every node and gateway through Redis.

A secret made through any gateway (or node) of a cluster fills the egress transforms of a
sandbox on any node: a node's egress proxy reads the value here at each request, so an
update applies to the next request everywhere. Gateways serve ``/secrets`` from here
themselves (``gateway``); a node in a cluster serves the same secrets (its own database's
are not used while it is clustered).

At rest each value is sealed with AES-256-GCM (``SecretBox``, the secret's id and version
as associated data) under the *cluster key*: HKDF-SHA256 of ``AENV_CLUSTER_SECRET``, which
every node and gateway already holds. Redis alone reveals no value. Why that key rather
than one more setting: whoever holds the cluster secret can already call every node as a
gateway does, and so make a sandbox whose transform sends the secret to a host of their
choice; a separate key would add a setting to distribute and no protection. Rotating the
cluster secret therefore makes the stored values unreadable (they must be set again).

Keys (under the registry's prefix): ``secret:<id>`` (string): the record as JSON, with the
current version's sealed value; ``secret-names`` (hash): name -> id; ``secret-order``
(sorted set): ids scored by creation time, for pages (equal scores order by id, as a
node's store orders them). Only the current version's value is kept (no call reads an
older one); the version number counts on. Writes are optimistic transactions (WATCH):
two gateways creating one name, or updating one secret, never both win.

Redis errors become ``SecretsUnavailable``: the API answers 503, an egress transform 502.
"""

from __future__ import annotations

import base64
import json
import secrets as _random
import string
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import redis.asyncio as aioredis
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from fastapi import FastAPI
from redis.exceptions import RedisError, WatchError
from starlette.types import ASGIApp

from ..api import errors
from ..api import secrets as routes
from ..api.app import BodyLimit
from ..store.secret_box import SecretBox
from ..store.secrets import ID_PREFIX, SecretNameTaken, SecretRecord, SecretsUnavailable
from .registry import DEFAULT_PREFIX, Registry

_ID_CHARS = string.ascii_lowercase + string.digits
_INFO = b"aenv cluster secrets v1"
_RETRIES = 16


def cluster_key(cluster_secret: str) -> bytes:
    """The 32-byte key that seals a cluster's secret values, from its cluster secret."""
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None,
                info=_INFO).derive(cluster_secret.encode())


def _context(secret_id: str, version: int) -> str:
    return f"{secret_id}:{version}"


class SharedSecrets:
    """``aenv.store.secrets.Secrets`` over a cluster's Redis."""

    def __init__(self, client: aioredis.Redis, cluster_secret: str, *,
                 prefix: str = DEFAULT_PREFIX) -> None:
        self.client, self.prefix = client, prefix
        self._box = SecretBox(cluster_key(cluster_secret))

    @classmethod
    def from_url(cls, url: str, cluster_secret: str) -> SharedSecrets:
        """Over a client of its own on the cluster's Redis (``Registry.from_url``'s), which
        ``close`` closes."""
        registry = Registry.from_url(url)
        return cls(registry.client, cluster_secret, prefix=registry.prefix)

    async def close(self) -> None:
        await self.client.aclose()

    def _k(self, *parts: str) -> str:
        return self.prefix + ":".join(parts)

    @asynccontextmanager
    async def _redis(self) -> AsyncIterator[None]:
        try:
            yield
        except (RedisError, OSError) as e:
            if isinstance(e, WatchError):
                raise
            raise SecretsUnavailable(f"{type(e).__name__}: {e}") from None

    def _dump(self, rec: SecretRecord, sealed: bytes) -> str:
        return json.dumps({"id": rec.id, "name": rec.name, "version": rec.version,
                           "created_at": rec.created_at, "updated_at": rec.updated_at,
                           "metadata": rec.metadata,
                           "sealed": base64.b64encode(sealed).decode()})

    @staticmethod
    def _load(raw: Any) -> tuple[SecretRecord, bytes]:
        d = json.loads(raw)
        return (SecretRecord(id=d["id"], name=d["name"], version=d["version"],
                             created_at=d["created_at"], updated_at=d["updated_at"],
                             metadata=d["metadata"]), base64.b64decode(d["sealed"]))

    async def _id_of(self, id_or_name: str) -> str | None:
        """By id, else by name (names are stored lower-case)."""
        if await self.client.exists(self._k("secret", id_or_name)):
            return id_or_name
        found = await self.client.hget(self._k("secret-names"), id_or_name.lower())
        return None if found is None else str(found)

    async def create(self, name: str, value: str, metadata: dict[str, str]) -> SecretRecord:
        now = time.time()
        rec = SecretRecord(id=ID_PREFIX + "".join(_random.choice(_ID_CHARS) for _ in range(20)),
                           name=name, version=1, created_at=now, updated_at=now,
                           metadata=dict(metadata))
        sealed = self._box.seal(value, _context(rec.id, 1))
        names = self._k("secret-names")
        async with self._redis():
            for _ in range(_RETRIES):
                async with self.client.pipeline(transaction=True) as p:
                    try:
                        await p.watch(names)
                        if await p.hexists(names, name):
                            raise SecretNameTaken(name)
                        p.multi()  # type: ignore[no-untyped-call]
                        p.hset(names, name, rec.id)
                        p.set(self._k("secret", rec.id), self._dump(rec, sealed))
                        p.zadd(self._k("secret-order"), {rec.id: rec.created_at})
                        await p.execute()
                        return rec
                    except WatchError:
                        continue
        raise SecretsUnavailable("too many concurrent secret creates; try again")

    async def get(self, id_or_name: str) -> SecretRecord | None:
        async with self._redis():
            sid = await self._id_of(id_or_name)
            raw = await self.client.get(self._k("secret", sid)) if sid else None
        return None if raw is None else self._load(raw)[0]

    async def update(self, id_or_name: str, value: str,
                     metadata: dict[str, str] | None) -> SecretRecord | None:
        async with self._redis():
            for _ in range(_RETRIES):
                sid = await self._id_of(id_or_name)
                if sid is None:
                    return None
                key = self._k("secret", sid)
                async with self.client.pipeline(transaction=True) as p:
                    try:
                        await p.watch(key)
                        raw = await p.get(key)
                        if raw is None:
                            return None
                        rec, _ = self._load(raw)
                        rec.version += 1
                        rec.updated_at = time.time()
                        if metadata is not None:
                            rec.metadata = dict(metadata)
                        sealed = self._box.seal(value, _context(rec.id, rec.version))
                        p.multi()  # type: ignore[no-untyped-call]
                        p.set(key, self._dump(rec, sealed))
                        await p.execute()
                        return rec
                    except WatchError:
                        continue
        raise SecretsUnavailable("too many concurrent updates of one secret; try again")

    async def delete(self, id_or_name: str) -> bool:
        async with self._redis():
            sid = await self._id_of(id_or_name)
            if sid is None:
                return False
            raw = await self.client.get(self._k("secret", sid))
            if raw is None:
                return False
            rec, _ = self._load(raw)
            async with self.client.pipeline(transaction=True) as p:
                p.delete(self._k("secret", sid))
                p.hdel(self._k("secret-names"), rec.name)
                p.zrem(self._k("secret-order"), sid)
                results = await p.execute()
        return bool(results[0])

    async def page(self, after: tuple[float, str] | None, limit: int) -> list[SecretRecord]:
        """Up to ``limit`` secrets in (created_at, id) order after the cursor ``after``."""
        async with self._redis():
            ids: list[str] = []
            rows: list[tuple[str, float]] = await self.client.zrangebyscore(
                self._k("secret-order"), after[0] if after else "-inf", "+inf",
                withscores=True)  # type: ignore[assignment]  # (member, score) pairs
            for member, score in rows:
                sid = str(member)
                if after is not None and (score, sid) <= after:
                    continue
                ids.append(sid)
                if len(ids) == limit:
                    break
            raws = await self.client.mget([self._k("secret", i) for i in ids]) if ids else []
        return [self._load(r)[0] for r in raws if r is not None]

    async def value(self, name: str) -> str | None:
        """The current value of the secret named ``name`` (for egress transforms only)."""
        async with self._redis():
            sid = await self.client.hget(self._k("secret-names"), name.lower())
            raw = await self.client.get(self._k("secret", str(sid))) if sid else None
        if raw is None:
            return None
        rec, sealed = self._load(raw)
        return self._box.open(sealed, _context(rec.id, rec.version))


def secrets_app(store: SharedSecrets) -> ASGIApp:
    """The ``/secrets`` routes of ``aenv.api.secrets`` over ``store``, with a node's
    E2B-shaped errors and body limit: what a gateway serves (behind its key check)."""
    app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)
    app.state.secrets = store
    errors.install(app)
    app.include_router(routes.router)
    return BodyLimit(app)
