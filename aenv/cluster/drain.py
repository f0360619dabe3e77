"""Draining a node (issue 18): it stays up and keeps serving its sandboxes, while gateways
send it no new creates.

Two ways in:

- ``SIGTERM`` to ``aenv server`` in a cluster (systemd stop, ``docker stop``, the kubelet):
  ``DrainingServer`` marks the node ``draining`` in Redis at once, keeps its listener and
  sandboxes serving until none holds a VM or ``AENV_DRAIN_TIMEOUT`` seconds pass, then
  stops as before. A second SIGTERM, or SIGINT, stops it at once. A node outside a
  cluster stops at once, as always.
- ``POST /node/drain`` (the node's API key or the cluster secret): marks it draining and
  answers at once; ``aenv-drain`` (the Kubernetes preStop) calls it, then waits for the
  running sandboxes to end before the kubelet sends SIGTERM.

The way back, for an operator who drained a node to look at it (as AgentENV lifts its
no-schedule label): ``POST /node/ready`` on the node, or through a gateway E2B's admin
call ``POST /nodes/{id}`` with ``{"status": "ready"}`` (``"draining"`` drains). A node
draining because of a SIGTERM stops anyway: ``ready`` answers 409 then. A new process
starts ``ready``.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable
from types import FrameType

import uvicorn
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from .node_agent import NodeAgent

log = logging.getLogger("aenv.cluster")

DRAIN_PATH = "/node/drain"
READY_PATH = "/node/ready"


class DrainingServer(uvicorn.Server):
    """uvicorn's server, where the first SIGTERM runs ``drain`` (then stops) instead of
    stopping at once; with ``drain`` None it is uvicorn's own."""

    def __init__(self, config: uvicorn.Config,
                 drain: Callable[[], Awaitable[None]] | None = None) -> None:
        super().__init__(config)
        self.drain = drain
        self._asked = False
        self._task: asyncio.Task[None] | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if (sig == signal.SIGTERM and self.drain is not None and self.started
                and not self._asked):
            self._asked = True
            self._captured_signals.append(sig)  # re-raised after shutdown: the exit status
            return
        super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        if self._asked and self._task is None and self.drain is not None:
            self._task = asyncio.create_task(self._drain_then_exit(self.drain),
                                             name="cluster-drain")
        return await super().on_tick(counter)

    async def _drain_then_exit(self, drain: Callable[[], Awaitable[None]]) -> None:
        try:
            await drain()
        except Exception:
            log.exception("cluster: draining failed; stopping")
        self.should_exit = True


def drain_router(agent: NodeAgent) -> APIRouter:
    """``POST /node/drain`` and ``POST /node/ready`` (behind the API's key check)."""
    router = APIRouter()

    @router.post(DRAIN_PATH)
    async def drain(_: Request) -> dict[str, object]:
        published = await agent.drain()
        return {"nodeID": agent.record.node_id, "status": "draining", "published": published}

    @router.post(READY_PATH, response_model=None)
    async def ready(_: Request) -> dict[str, object] | JSONResponse:
        try:
            published = await agent.ready()
        except RuntimeError as e:
            return JSONResponse({"code": 409, "message": str(e)}, status_code=409)
        return {"nodeID": agent.record.node_id, "status": "ready", "published": published}

    return router
