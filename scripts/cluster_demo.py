"""`make cluster`'s demo: the unmodified E2B Python SDK against `aenv gateway`, over two
nodes (scripts/cluster.sh starts them and sets E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY).

Three steps, with scripts/cluster.sh stopping node n1 between the second and third:

- ``spread``: two sandboxes (one lands on each node), a command in each, a fork of the
  one on n2 (its child lives on n2 too), a file written in the one on n1, which is then
  paused there;
- ``resume``: n1 is gone, so connecting to the paused sandbox resumes it on n2 from the
  shared store; its file is still there;
- ``finish``: both nodes ready again (``GET /nodes``); the demo's sandboxes are killed.

Which node holds a sandbox is read from the cluster's Redis index (``--redis``), only to
show it: the SDK never needs to know.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import httpx
import redis
from e2b import Sandbox

STATE = Path(os.environ.get("AENV_CLUSTER_DIR", "/var/lib/aenv-cluster")) / "demo.json"


def node_of(r: redis.Redis, sandbox_id: str) -> str:
    return str(r.hget("aenv:sandboxes", sandbox_id))


def api() -> httpx.Client:
    return httpx.Client(base_url=os.environ["E2B_API_URL"], timeout=300,
                        headers={"X-API-KEY": os.environ["E2B_API_KEY"]})


def wait_ready(timeout: float = 60) -> dict[str, str]:
    """Both nodes ``ready`` in ``GET /nodes`` (a node busy starting may miss a heartbeat)."""
    deadline = time.monotonic() + timeout
    with api() as c:
        while True:
            nodes = {n["nodeID"]: n["status"] for n in c.get("/nodes").json()}
            if nodes == {"n1": "ready", "n2": "ready"} or time.monotonic() > deadline:
                return nodes
            time.sleep(0.5)


def spread(r: redis.Redis) -> None:
    print(f"demo: nodes {wait_ready()}")
    t0 = time.monotonic()
    made: list[Sandbox] = []
    where: dict[str, str] = {}
    # the gateway sends each create to the node with the fewest running: one each, unless
    # a node was briefly not ready (then a few more, the extra ones killed)
    while set(where.values()) != {"n1", "n2"} and len(made) < 6:
        made.append(Sandbox.create("base", metadata={"demo": "make-cluster"}))
        where[made[-1].sandbox_id] = node_of(r, made[-1].sandbox_id)
    print(f"demo: {len(made)} sandboxes in {time.monotonic() - t0:.1f} s through the gateway")
    if set(where.values()) != {"n1", "n2"}:
        sys.exit(f"demo: expected sandboxes on both nodes, got {where}")
    on_n1 = next(s for s in made if where[s.sandbox_id] == "n1")
    on_n2 = next(s for s in made if where[s.sandbox_id] == "n2")
    for s in made:
        if s not in (on_n1, on_n2):
            s.kill()
    for s in (on_n1, on_n2):
        out = s.commands.run("echo hello from $(hostname)").stdout.strip()
        print(f"demo:   {s.sandbox_id} on node {where[s.sandbox_id]}: {out}")
    with api() as c:
        forked = c.post(f"/sandboxes/{on_n2.sandbox_id}/fork", json={"count": 1})
        forked.raise_for_status()
        child = forked.json()[0]["sandbox"]["sandboxID"]
    kid = Sandbox.connect(child)
    print(f"demo: fork of {on_n2.sandbox_id}: {child} on node {node_of(r, child)}: "
          f"{kid.commands.run('echo child').stdout.strip()}")
    on_n1.files.write("/home/user/note.txt", "written on n1 before the pause\n")
    t0 = time.monotonic()
    with api() as c:
        c.post(f"/sandboxes/{on_n1.sandbox_id}/pause").raise_for_status()
    print(f"demo: {on_n1.sandbox_id} paused on node {node_of(r, on_n1.sandbox_id)} "
          f"in {time.monotonic() - t0:.1f} s")
    STATE.write_text(json.dumps({"paused": on_n1.sandbox_id,
                                 "others": [on_n2.sandbox_id, child]}))


def resume(r: redis.Redis) -> None:
    state = json.loads(STATE.read_text())
    with api() as c:
        nodes = {n["nodeID"]: n["status"] for n in c.get("/nodes").json()}
    print(f"demo: nodes now {nodes}")
    t0 = time.monotonic()
    sbx = Sandbox.connect(state["paused"])
    print(f"demo: {state['paused']} resumed on node {node_of(r, state['paused'])} "
          f"in {time.monotonic() - t0:.1f} s; its file: "
          f"{sbx.files.read('/home/user/note.txt').strip()!r}")


def finish(r: redis.Redis) -> None:
    state = json.loads(STATE.read_text())
    with api() as c:
        deadline = time.monotonic() + 30
        while (nodes := {n["nodeID"]: n["status"] for n in c.get("/nodes").json()}) != {
                "n1": "ready", "n2": "ready"} and time.monotonic() < deadline:
            time.sleep(0.5)
        print(f"demo: nodes {nodes}")
        listed = [s["sandboxID"] for s in c.get("/v2/sandboxes").json()]
        print(f"demo: listed through the gateway: {listed}")
        for sid in [state["paused"], *state["others"]]:
            c.delete(f"/sandboxes/{sid}")
    print("demo: the demo's sandboxes killed")
    STATE.unlink(missing_ok=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("step", choices=["spread", "resume", "finish"])
    ap.add_argument("--redis", required=True)
    args = ap.parse_args()
    with redis.Redis.from_url(args.redis, decode_responses=True) as r:
        {"spread": spread, "resume": resume, "finish": finish}[args.step](r)


if __name__ == "__main__":
    main()
