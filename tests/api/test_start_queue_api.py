"""A burst of creates through the REST app (aenv/orchestrator/start_queue.py behind
``POST /v2/sandboxes``): beyond the start limit they queue and all get 201, the waiters'
``Server-Timing`` naming the ``queue`` phase; when the queue is full the answer is an
E2B-shaped 429 with ``Retry-After``."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx

from aenv.orchestrator.service import Limits
from aenv.orchestrator.timing import parse_server_timing
from tests.api.api_world import AUTH, make_world


async def burst(tmp_path: Path, n: int, limits: Limits) -> list[httpx.Response]:
    world = make_world(tmp_path, limits=limits)
    world.machines.delay = 0.1
    transport = httpx.ASGITransport(app=world.app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t", headers=AUTH,
                                 timeout=30) as c:
        return list(await asyncio.gather(*(c.post("/v2/sandboxes", json={"templateID": "base"})
                                           for _ in range(n))))


async def test_a_burst_beyond_the_start_limit_queues_and_all_start(tmp_path: Path) -> None:
    answers = await burst(tmp_path, 6, Limits(max_starting=2, start_queue=16))
    assert [r.status_code for r in answers] == [201] * 6, [r.text for r in answers]
    queued = [parse_server_timing(r.headers["server-timing"]).get("queue") for r in answers]
    assert sum(q is not None and q > 50 for q in queued) >= 3, queued


async def test_a_full_queue_answers_429_with_retry_after(tmp_path: Path) -> None:
    answers = await burst(tmp_path, 4, Limits(max_starting=1, start_queue=1))
    codes = sorted(r.status_code for r in answers)
    assert codes == [201, 201, 429, 429], [r.text for r in answers]
    for r in answers:
        if r.status_code == 429:
            body = r.json()
            assert body["code"] == 429 and "queued" in body["message"]
            assert int(r.headers["retry-after"]) >= 1
