"""Draining (issue 18): a node told to stop (SIGTERM, or ``POST /node/drain`` from the
Kubernetes preStop ``aenv-drain``) shows ``draining`` in ``GET /nodes`` at once, gets no
new creates from the gateway, and keeps serving its sandboxes until it stops.

Real processes, no VMs: a real redis-server, a real ``aenv gateway``, and nodes that are
the real ``aenv.server.Server`` under the ``DrainingServer`` that ``aenv server`` runs,
over machines that start nothing (``tests/cluster/idle_node.py``).
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.cluster.idle_node import IdleNode
from tests.cluster.redis_server import RedisServer
from tests.cluster.test_cluster_e2e import GATEWAY_KEY, SECRET, gateway
from tests.deploy.files import DRAIN


@pytest.fixture
def fresh_db(redis_server: RedisServer) -> RedisServer:
    import redis

    with redis.Redis.from_url(redis_server.url(2)) as r:
        r.flushdb()
    return redis_server


@contextlib.contextmanager
def nodes(redis: RedisServer, root: Path, *ids: str, drain_timeout: float = 30.0
          ) -> Iterator[dict[str, IdleNode]]:
    made: dict[str, IdleNode] = {}
    try:
        for i in ids:
            made[i] = IdleNode(root / i, redis.url(2), i, SECRET, drain_timeout)
        yield made
    finally:
        for n in made.values():
            n.stop()


def api(url: str) -> httpx.Client:
    return httpx.Client(base_url=url, headers={"X-API-KEY": GATEWAY_KEY}, timeout=30)


def statuses(c: httpx.Client) -> dict[str, str]:
    return {n["nodeID"]: n["status"] for n in c.get("/nodes").json()}


def create(c: httpx.Client) -> str:
    r = c.post("/sandboxes", json={"templateID": "base", "timeout": 600})
    assert r.status_code == 201, r.text
    return str(r.json()["sandboxID"])


def wait_for(what: str, check: object, timeout: float) -> float:
    t0 = time.monotonic()
    while not check():  # type: ignore[operator]
        assert time.monotonic() - t0 < timeout, f"{what}: not within {timeout} s"
        time.sleep(0.05)
    return time.monotonic() - t0


@pytest.mark.slow  # several seconds of waiting: left out of make test-fast
def test_sigterm_drains_then_stops_when_its_last_sandbox_ends(
        fresh_db: RedisServer, tmp_path: Path) -> None:
    with nodes(fresh_db, tmp_path, "d1", "d2") as n, \
            gateway(fresh_db, tmp_path / "gw") as url, api(url) as c:
        assert statuses(c) == {"d1": "ready", "d2": "ready"}
        on_d1 = create(c)   # the first create goes to d1 (both empty: ties by id)
        assert _holds(n["d1"], on_d1)

        n["d1"].signal(signal.SIGTERM)
        took = wait_for("draining in GET /nodes", lambda: statuses(c)["d1"] == "draining", 2)
        assert statuses(c) == {"d1": "draining", "d2": "ready"}, f"after {took:.2f} s"
        # no new creates go to it, however many come
        made = [create(c) for _ in range(4)]
        assert all(_holds(n["d2"], s) for s in made) and not any(_holds(n["d1"], s) for s in made)
        # its sandbox keeps working through the gateway while it drains
        time.sleep(1.0)
        assert n["d1"].proc.poll() is None, "stopped with a sandbox running"
        r = c.get(f"/sandboxes/{on_d1}")
        assert r.status_code == 200 and r.json()["state"] == "running"
        assert c.post(f"/sandboxes/{on_d1}/timeout", json={"timeout": 300}).status_code == 204
        # its last sandbox killed, it stops (exit status: the SIGTERM's) and leaves
        assert c.delete(f"/sandboxes/{on_d1}").status_code == 204
        n["d1"].proc.wait(10)
        assert n["d1"].proc.returncode == -signal.SIGTERM
        assert statuses(c) == {"d1": "unhealthy", "d2": "ready"}
        for s in made:
            assert c.delete(f"/sandboxes/{s}").status_code == 204


@pytest.mark.slow  # several seconds of waiting: left out of make test-fast
def test_sigterm_stops_after_the_drain_timeout_or_at_a_second_sigterm(
        fresh_db: RedisServer, tmp_path: Path) -> None:
    with nodes(fresh_db, tmp_path, "t1", "t2", drain_timeout=2.0) as n, \
            gateway(fresh_db, tmp_path / "gw") as url, api(url) as c:
        held = {i: [s for s in (create(c), create(c)) if _holds(node, s)]
                for i, node in n.items()}
        assert all(held.values()), held
        t0 = time.monotonic()
        n["t1"].signal(signal.SIGTERM)
        n["t1"].proc.wait(15)
        assert 2.0 <= time.monotonic() - t0 < 10, "not stopped at the drain timeout"
        n["t2"].signal(signal.SIGTERM)
        wait_for("draining", lambda: statuses(c)["t2"] == "draining", 2)
        t0 = time.monotonic()
        n["t2"].signal(signal.SIGTERM)
        n["t2"].proc.wait(10)
        assert time.monotonic() - t0 < 1.9, "a second SIGTERM did not stop it at once"
        assert statuses(c) == {"t1": "unhealthy", "t2": "unhealthy"}


@pytest.mark.slow  # several seconds of waiting: left out of make test-fast
def test_aenv_drain_marks_the_node_draining_and_waits_for_its_sandboxes(
        fresh_db: RedisServer, tmp_path: Path) -> None:
    """The Kubernetes preStop: ``aenv-drain`` (node API key) drains the node over HTTP
    and returns once its sandboxes are gone; the node is still up for the SIGTERM."""
    with nodes(fresh_db, tmp_path, "p1", "p2") as n, \
            gateway(fresh_db, tmp_path / "gw") as url, api(url) as c:
        sandboxes = [create(c), create(c)]
        on_p1 = next(s for s in sandboxes if _holds(n["p1"], s))
        assert httpx.post(n["p1"].url + "/node/drain").status_code == 401  # needs the key
        proc = subprocess.Popen(
            [sys.executable, str(DRAIN), "--url", n["p1"].url, "--interval", "0.2",
             "--timeout", "60"], env={"AENV_API_KEY": n["p1"].api_key, "PATH": "/usr/bin"},
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            wait_for("draining", lambda: statuses(c)["p1"] == "draining", 5)
            assert [_holds(n["p2"], create(c)) for _ in range(2)] == [True, True]
            assert proc.poll() is None, "aenv-drain returned with a sandbox running"
            assert c.get(f"/sandboxes/{on_p1}").json()["state"] == "running"
            assert c.delete(f"/sandboxes/{on_p1}").status_code == 204
            out, _ = proc.communicate(timeout=15)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert proc.returncode == 0, out
        assert "node draining" in out and "no running sandboxes" in out
        assert n["p1"].proc.poll() is None and statuses(c)["p1"] == "draining"
        # the node's own /node/drain through the cluster secret works too, and repeats
        r = httpx.post(n["p2"].url + "/node/drain", headers={"X-Aenv-Cluster-Secret": SECRET})
        assert r.status_code == 200 and r.json()["status"] == "draining"
        assert statuses(c) == {"p1": "draining", "p2": "draining"}
        assert c.post("/sandboxes", json={"templateID": "base"}).status_code == 503


@pytest.mark.slow  # several seconds of waiting: left out of make test-fast
def test_a_drained_node_is_taken_back_through_the_gateway_unless_it_is_stopping(
        fresh_db: RedisServer, tmp_path: Path) -> None:
    """E2B's admin call ``POST /nodes/{id}`` ``{"status": ...}`` drains a node and makes
    it ready again (the node's ``/node/drain`` and ``/node/ready``); a node draining for a
    SIGTERM refuses to be made ready."""
    with nodes(fresh_db, tmp_path, "u1", "u2") as n, \
            gateway(fresh_db, tmp_path / "gw") as url, api(url) as c:
        r = c.post("/nodes/u1", json={"status": "draining"})
        assert r.status_code == 200 and r.json()["status"] == "draining", r.text
        assert statuses(c) == {"u1": "draining", "u2": "ready"}
        made = [create(c) for _ in range(2)]
        assert all(_holds(n["u2"], s) for s in made)
        r = c.post("/nodes/u1", json={"status": "ready"})
        assert r.status_code == 200 and r.json()["status"] == "ready", r.text
        assert statuses(c) == {"u1": "ready", "u2": "ready"}
        back = create(c)                  # u1 is the emptier one again
        assert _holds(n["u1"], back)
        # the node's own call, with its key; bad requests through the gateway
        r = httpx.post(n["u2"].url + "/node/ready", headers={"X-API-KEY": n["u2"].api_key})
        assert r.status_code == 200 and r.json() == {"nodeID": "u2", "status": "ready",
                                                     "published": True}
        assert httpx.post(n["u2"].url + "/node/ready").status_code == 401
        assert c.post("/nodes/u1", json={"status": "gone"}).status_code == 400
        assert c.post("/nodes/zz", json={"status": "ready"}).status_code == 404
        assert httpx.post(url + "/nodes/u1", json={"status": "ready"}).status_code == 401
        # SIGTERM: draining until it stops, whatever an operator says
        n["u1"].signal(signal.SIGTERM)
        wait_for("draining", lambda: statuses(c)["u1"] == "draining", 2)
        r = c.post("/nodes/u1", json={"status": "ready"})
        assert r.status_code == 409 and "stopping" in r.json()["message"], r.text
        assert statuses(c)["u1"] == "draining"
        for s in [*made, back]:
            assert c.delete(f"/sandboxes/{s}").status_code == 204


def _holds(node: IdleNode, sandbox_id: str) -> bool:
    """Whether ``node`` itself lists ``sandbox_id`` (asked directly, with its own key)."""
    r = httpx.get(node.url + "/v2/sandboxes", headers={"X-API-KEY": node.api_key},
                  params={"state": "running"}, timeout=10)
    return sandbox_id in {s["sandboxID"] for s in r.json()}
