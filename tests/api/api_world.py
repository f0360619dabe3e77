"""The REST app as the server builds it, without a host: ``create_api`` over an
``Orchestrator`` with an in-memory ``Database``, ``FakeMachines`` (no VM, no netns, no disk)
and a ``Builder``, behind the API key. Shared by the API's unit tests; nothing here is a test.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import httpx
from starlette.types import ASGIApp

from aenv.api.app import create_api
from aenv.orchestrator.builds import Builder
from aenv.orchestrator.metrics import MetricsCollector
from aenv.orchestrator.service import Limits, Orchestrator
from aenv.store import Database, SandboxStore, TemplateRecord, TemplateStore
from aenv.store.secret_box import SecretBox
from aenv.store.secrets import SecretStore
from tests.orchestrator.test_orchestrator import FakeMachines

KEY = "e2b_" + "1" * 40
AUTH = {"X-API-KEY": KEY}


@dataclass
class World:
    app: ASGIApp
    orchestrator: Orchestrator
    machines: FakeMachines
    builder: Builder


def make_world(files_dir: Path, *, limits: Limits | None = None) -> World:
    db = Database(":memory:")
    sandboxes, templates = SandboxStore(db), TemplateStore(db)
    now = time.time()
    templates.insert(TemplateRecord(id="base", kind="template", build_id="builtin",
                                    status="ready", cpu_count=1, memory_mb=256,
                                    disk_size_mb=1024, created_at=now, updated_at=now,
                                    names=["base"], user="user"))
    machines = FakeMachines()
    orch = Orchestrator(sandboxes, templates, machines, limits=limits or Limits())
    builder = Builder(templates, machines, files_dir, pins=orch.pins)
    app = create_api(orch, api_key=KEY, domain="localhost", metrics=MetricsCollector(sandboxes),
                     logs=lambda *a, **k: [], builder=builder, upload_secret=KEY.encode(),
                     secret_store=SecretStore(db, SecretBox(os.urandom(32))))
    return World(app, orch, machines, builder)


@contextlib.asynccontextmanager
async def world_client(files_dir: Path) -> AsyncIterator[tuple[World, httpx.AsyncClient]]:
    """A world and a client of its app in this process, with the key; an exception that
    escapes the app is its 500 answer, not raised into the test."""
    world = make_world(files_dir)
    transport = httpx.ASGITransport(world.app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://t", headers=AUTH) as c:
        yield world, c


async def new_sandbox(c: httpx.AsyncClient) -> str:
    """A sandbox from ``base`` made through the client's app; its id."""
    r = await c.post("/v2/sandboxes", json={"templateID": "base"})
    assert r.status_code == 201, r.text
    return str(r.json()["sandboxID"])
