"""Which sandbox a request without routing headers is for, across a cluster's nodes.

Two kinds of sandbox traffic name no sandbox (``aenv.proxy.front``): the SDK's signed
``download_url``/``upload_url`` (a ``/files`` URL whose ``signature`` only the sandbox's
envd token reproduces) and token-only envd calls (E2B 2.7's sync ``connect``). A node
finds the owner among its own running sandboxes; a gateway has no tokens, so it asks its
nodes: ``POST /node/owner`` (behind the node's key check: the cluster secret) with the
signature's parts or the token, answered ``{"sandboxID": ...}`` or 404. The gateway asks
every live node at once, takes the first that knows it, keeps the answer for
``OWNER_CACHE_S`` and then routes the request as any other, through the index.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
from fastapi import APIRouter
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from ..envd.signing import Operation
from .registry import Registry
from .trust import SECRET_HEADER

OWNER_PATH = "/node/owner"
OWNER_CACHE_S = 60.0
OWNER_CACHE_SIZE = 10_000
ASK_TIMEOUT_S = 5.0

SignedLookup = Callable[[str, Operation, str | None, str, str | None], Awaitable[str | None]]
TokenLookup = Callable[[str], Awaitable[str | None]]


class OwnerQuery(BaseModel):
    """A signed URL's parts (``path``, ``operation``, ``username``, ``signature``,
    ``expiration``), or an envd access ``token``."""

    path: str | None = None
    operation: Operation | None = None
    username: str | None = None
    signature: str | None = None
    expiration: str | None = None
    token: str | None = None


def owner_router(signed: SignedLookup, token: TokenLookup) -> APIRouter:
    """A node's ``POST /node/owner``: its running sandbox the query belongs to."""
    router = APIRouter()

    @router.post(OWNER_PATH, response_model=None)
    async def owner(q: OwnerQuery) -> dict[str, str] | JSONResponse:
        if q.token:
            found = await token(q.token)
        elif q.path is not None and q.operation and q.signature:
            found = await signed(q.path, q.operation, q.username, q.signature, q.expiration)
        else:
            return JSONResponse({"code": 400, "message": "give a token, or a signed URL's "
                                 "path, operation and signature"}, status_code=400)
        if found is None:
            return JSONResponse({"code": 404, "message": "no running sandbox of this node"},
                                status_code=404)
        return {"sandboxID": found}

    return router


class Owners:
    """A gateway's side: asks the live nodes, caches what they answered."""

    def __init__(self, registry: Registry, http: httpx.AsyncClient, secret: bytes) -> None:
        self.registry, self.http, self.secret = registry, http, secret
        self._known: dict[tuple[str, ...], tuple[float, str]] = {}

    async def signed(self, path: str, op: Operation, user: str | None, signature: str,
                     expiration: str | None) -> str | None:
        return await self._ask(("s", path, op, user or "", signature, expiration or ""), {
            "path": path, "operation": op, "username": user, "signature": signature,
            "expiration": expiration})

    async def token(self, token: str) -> str | None:
        return await self._ask(("t", token), {"token": token})

    async def _ask(self, key: tuple[str, ...], query: dict[str, Any]) -> str | None:
        now = time.monotonic()
        hit = self._known.get(key)
        if hit is not None and hit[0] > now:
            return hit[1]
        nodes = [n for n in await self.registry.nodes() if n.alive]

        async def one(url: str) -> str | None:
            try:
                r = await self.http.post(url + OWNER_PATH, json=query,
                                         headers={SECRET_HEADER.decode(): self.secret.decode()},
                                         timeout=ASK_TIMEOUT_S)
            except httpx.HTTPError:
                return None
            found = r.json().get("sandboxID") if r.status_code == 200 else None
            return found if isinstance(found, str) else None

        answers = await asyncio.gather(*(one(n.record.url) for n in nodes))
        found = next((a for a in answers if a), None)
        if found is not None:  # misses are not kept: a sandbox may start meanwhile
            if len(self._known) >= OWNER_CACHE_SIZE:
                self._known = {k: v for k, v in self._known.items() if v[0] > now}
                if len(self._known) >= OWNER_CACHE_SIZE:
                    self._known.clear()
            self._known[key] = (now + OWNER_CACHE_S, found)
        return found
