"""What the proxy tests that run a real uvicorn share: a fake upstream's free loopback
address, and the ``Front`` served on a free port with every sandbox routed to that address."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import uvicorn

from aenv.proxy import ProxyRouter, Route, RouteTable
from aenv.proxy.front import Front
from tests.conftest import free_port


async def listen_on_free_loopback(listen: Callable[[str], Awaitable[None]],
                                  close: Callable[[], Awaitable[None]], what: str) -> str:
    """``listen(host)`` on a random loopback address nobody else in the test run uses (after
    an ``OSError``, ``close()`` and another address); the address it listens on."""
    for _ in range(20):
        host = "127." + ".".join(str(random.randint(100, 250)) for _ in range(3))
        try:
            await listen(host)
        except OSError:
            await close()
            continue
        return host
    raise RuntimeError(f"no free loopback address for {what}")


async def _api(scope, receive, send) -> None:
    await send({"type": "http.response.start", "status": 418, "headers": []})
    await send({"type": "http.response.body", "body": b"api"})


async def _no_sandbox(*_: object) -> str | None:
    return None


@contextlib.asynccontextmanager
async def serving_front(upstream_host: str, http: str, *,
                        https_ports: frozenset[int] = frozenset(),
                        **config: Any) -> AsyncIterator[tuple[int, ProxyRouter]]:
    """``Front`` (the API a 418 teapot, no sandbox hosts) under uvicorn with the ``http``
    implementation and ``config`` on a free port of 127.0.0.1, routing every sandbox to
    ``upstream_host`` (``https_ports`` its ``httpsPorts``): the port and the router."""

    async def lookup(sandbox_id: str) -> Route | None:
        return Route(sandbox_id, upstream_host, "gen-1", "tok", None,
                     https_ports=https_ports)

    router = ProxyRouter(RouteTable(lookup))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(
        Front(_api, router, _no_sandbox, _no_sandbox), host="127.0.0.1", port=port,
        http=http, lifespan="off", **config))
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    try:
        yield port, router
    finally:
        server.should_exit = True
        await task
        await router.close()
