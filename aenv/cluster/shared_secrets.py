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

Keys (under the registry's prefix): ``secrets`` (hash): id -> the record as JSON, with the
current version's sealed value; ``secret-names`` (hash): name -> id; ``secret-order``
(sorted set): ids scored by creation time, for pages (equal scores order by id, as a
node's store orders them); ``secrets-rev`` (counter): every write adds one;
``secrets-epoch``: a random id made by the first write into an empty Redis. Only the
current version's value is kept (no call reads an older one); the version number counts
on. Every write is an optimistic transaction on ``secrets-rev`` (WATCH): two gateways
creating one name, or updating one secret, never both win.

**Redis may lose them; the nodes keep a copy.** The cluster's Redis runs without
persistence (``deploy/``): everything else in it the nodes publish again, and secrets must
survive that too. Every node keeps ``mirror``: a file (0600) with the epoch, the revision
and every sealed record, rewritten whenever the revision moves (``sync``, every
``SYNC_S``). When a node finds Redis on another epoch (it restarted empty, and maybe took
writes since), it writes back each mirrored secret whose id is absent and whose name is
free, once per lost epoch (``secrets-restored`` names the epochs already written back, so
a node that comes back later with an old copy does not write it again). What changed in
the last ``SYNC_S`` before Redis was lost can be lost, or a deletion undone.

Redis errors become ``SecretsUnavailable``: the API answers 503, an egress transform 502.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
import secrets as _random
import string
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
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

log = logging.getLogger("aenv.cluster")

_ID_CHARS = string.ascii_lowercase + string.digits
# How often a node compares its copy of the secrets with Redis (one MGET when unchanged).
SYNC_S = 2.0
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
                 prefix: str = DEFAULT_PREFIX, mirror: Path | None = None) -> None:
        self.client, self.prefix, self.mirror = client, prefix, mirror
        self._mirrored: tuple[Any, Any] | None = None  # (epoch, revision) ``mirror`` holds
        self._box = SecretBox(cluster_key(cluster_secret))

    @classmethod
    def from_url(cls, url: str, cluster_secret: str, *,
                 mirror: Path | None = None) -> SharedSecrets:
        """Over a client of its own on the cluster's Redis (``Registry.from_url``'s), which
        ``close`` closes; ``mirror``: a node's copy (see the module docstring)."""
        registry = Registry.from_url(url)
        return cls(registry.client, cluster_secret, prefix=registry.prefix, mirror=mirror)

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
        if await self.client.hexists(self._k("secrets"), id_or_name):
            return id_or_name
        found = await self.client.hget(self._k("secret-names"), id_or_name.lower())
        return None if found is None else str(found)

    async def _write(self, change: Callable[[Any], Awaitable[Callable[[Any], None] | None]]
                     ) -> bool:
        """One write as an optimistic transaction on ``secrets-rev``: ``change`` reads
        through the watching pipeline and returns what to queue (None: nothing to write).
        False when there was nothing to write."""
        rev = self._k("secrets-rev")
        async with self._redis():
            for _ in range(_RETRIES):
                async with self.client.pipeline(transaction=True) as p:
                    try:
                        await p.watch(rev, self._k("secrets-epoch"))
                        queue = await change(p)
                        if queue is None:
                            return False
                        p.multi()  # type: ignore[no-untyped-call]
                        queue(p)
                        p.set(self._k("secrets-epoch"), _random.token_hex(8), nx=True)
                        p.incr(rev)
                        await p.execute()
                        return True
                    except WatchError:
                        continue
        raise SecretsUnavailable("too many concurrent secret writes; try again")

    async def create(self, name: str, value: str, metadata: dict[str, str]) -> SecretRecord:
        now = time.time()
        rec = SecretRecord(id=ID_PREFIX + "".join(_random.choice(_ID_CHARS) for _ in range(20)),
                           name=name, version=1, created_at=now, updated_at=now,
                           metadata=dict(metadata))
        raw = self._dump(rec, self._box.seal(value, _context(rec.id, 1)))

        async def change(p: Any) -> Callable[[Any], None]:
            if await p.hexists(self._k("secret-names"), name):
                raise SecretNameTaken(name)
            return lambda q: self._put(q, rec, raw)

        await self._write(change)
        return rec

    def _put(self, p: Any, rec: SecretRecord, raw: str) -> None:
        p.hset(self._k("secrets"), rec.id, raw)
        p.hset(self._k("secret-names"), rec.name, rec.id)
        p.zadd(self._k("secret-order"), {rec.id: rec.created_at})

    async def get(self, id_or_name: str) -> SecretRecord | None:
        async with self._redis():
            sid = await self._id_of(id_or_name)
            raw = await self.client.hget(self._k("secrets"), sid) if sid else None
        return None if raw is None else self._load(raw)[0]

    async def update(self, id_or_name: str, value: str,
                     metadata: dict[str, str] | None) -> SecretRecord | None:
        done: list[SecretRecord] = []

        async def change(p: Any) -> Callable[[Any], None] | None:
            done.clear()
            sid = await self._id_of(id_or_name)
            raw = await p.hget(self._k("secrets"), sid) if sid else None
            if raw is None:
                return None
            rec, _ = self._load(raw)
            rec.version += 1
            rec.updated_at = time.time()
            if metadata is not None:
                rec.metadata = dict(metadata)
            new = self._dump(rec, self._box.seal(value, _context(rec.id, rec.version)))
            done.append(rec)
            return lambda q: q.hset(self._k("secrets"), rec.id, new)

        return done[0] if await self._write(change) else None

    async def delete(self, id_or_name: str) -> bool:
        async def change(p: Any) -> Callable[[Any], None] | None:
            sid = await self._id_of(id_or_name)
            raw = await p.hget(self._k("secrets"), sid) if sid else None
            if raw is None:
                return None
            rec, _ = self._load(raw)

            def queue(q: Any) -> None:
                q.hdel(self._k("secrets"), rec.id)
                q.hdel(self._k("secret-names"), rec.name)
                q.zrem(self._k("secret-order"), rec.id)
            return queue

        return await self._write(change)

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
            raws = await self.client.hmget(self._k("secrets"), ids) if ids else []
        return [self._load(r)[0] for r in raws if r is not None]

    async def value(self, name: str) -> str | None:
        """The current value of the secret named ``name`` (for egress transforms only)."""
        async with self._redis():
            sid = await self.client.hget(self._k("secret-names"), name.lower())
            raw = await self.client.hget(self._k("secrets"), str(sid)) if sid else None
        if raw is None:
            return None
        rec, sealed = self._load(raw)
        return self._box.open(sealed, _context(rec.id, rec.version))

    # -- a node's copy (see the module docstring)

    async def sync(self) -> None:
        """Keep ``mirror`` as Redis holds the secrets, or write it back into a Redis that
        lost them. Redis errors are left to the next call."""
        if self.mirror is None:
            return
        async with self._redis():
            epoch, rev = await self.client.mget(self._k("secrets-epoch"),
                                                self._k("secrets-rev"))
        if self._mirrored == (epoch, rev):  # as the copy holds: no file read
            return
        mine = _read_mirror(self.mirror)
        async with self._redis():
            if mine and mine["epoch"] and epoch != mine["epoch"] and not \
                    await self.client.sismember(self._k("secrets-restored"), mine["epoch"]):
                await self._restore(mine)
            elif mine and epoch == mine["epoch"] and str(rev) == str(mine["rev"]):
                self._mirrored = (epoch, rev)
                return
            async with self.client.pipeline(transaction=True) as p:
                p.get(self._k("secrets-epoch"))
                p.get(self._k("secrets-rev"))
                p.hgetall(self._k("secrets"))
                epoch, rev, records = await p.execute()
        _write_mirror(self.mirror, {"epoch": epoch, "rev": rev, "records": records})
        self._mirrored = (epoch, rev)

    async def _restore(self, mine: dict[str, Any]) -> None:
        """Write back the mirrored secrets a Redis that restarted empty lost (their ids
        absent, their names free), once for the mirror's epoch."""
        restored: list[str] = []

        async def change(p: Any) -> Callable[[Any], None] | None:
            restored.clear()
            if await p.sismember(self._k("secrets-restored"), mine["epoch"]):
                return None
            names = await p.hgetall(self._k("secret-names"))
            ids = set(await p.hkeys(self._k("secrets")))
            back = [(rec, raw) for rec, raw in
                    ((self._load(raw)[0], raw) for raw in mine["records"].values())
                    if rec.id not in ids and rec.name not in names]

            def queue(q: Any) -> None:
                for rec, raw in back:
                    self._put(q, rec, raw)
                q.sadd(self._k("secrets-restored"), mine["epoch"])
            restored.extend(rec.name for rec, _ in back)
            return queue

        if await self._write(change):
            log.warning("cluster secrets: Redis had lost them; %d written back from this "
                        "node's copy (%s)", len(restored), ", ".join(sorted(restored)))

    async def keep_mirror(self) -> None:
        """``sync`` every ``SYNC_S`` until cancelled (a node's task)."""
        while True:
            try:
                await self.sync()
            except SecretsUnavailable:
                pass
            except Exception:
                log.exception("cluster secrets: keeping this node's copy failed")
            await asyncio.sleep(SYNC_S)


def _read_mirror(path: Path) -> dict[str, Any] | None:
    try:
        data: dict[str, Any] = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        log.warning("cluster secrets: unreadable copy %s: %s", path, e)
        return None
    return data


def _write_mirror(path: Path, data: dict[str, Any]) -> None:
    """Whole or not at all, 0600 from the first byte."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, json.dumps(data).encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def secrets_app(store: SharedSecrets) -> ASGIApp:
    """The ``/secrets`` routes of ``aenv.api.secrets`` over ``store``, with a node's
    E2B-shaped errors and body limit: what a gateway serves (behind its key check)."""
    app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)
    app.state.secrets = store
    errors.install(app)
    app.include_router(routes.router)
    return BodyLimit(app)
