"""Two real ``aenv server`` nodes and one ``aenv gateway`` over a real redis-server, driven
by the unmodified E2B Python SDK pointed at the gateway (E2B_API_URL = E2B_SANDBOX_URL).

One pair of nodes for the whole module (each its own home, prefix and address ranges,
sharing the kernel and image cache and a shared store, ``AENV_SHARED_STORE``, in the
module's tmp dir), started side by side. At the end every sandbox is
killed through each node's API, the nodes and the gateway are stopped, Redis is killed,
and the module fails if a namespace, nft table or VMM process of either prefix is left
(``tests.server.conftest.serving``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import redis
from e2b import Sandbox, SandboxQuery

from aenv.cluster.registry import DEFAULT_TTL_S
from tests.cluster.redis_server import RedisServer, running_redis
from tests.conftest import ROOT, free_port
from tests.server.conftest import ServerProcess, serving

pytestmark = [pytest.mark.vm, pytest.mark.net]

SECRET = "cluster-secret-" + "c" * 32
GATEWAY_KEY = "e2b_" + "9" * 40


@dataclass
class Gatewayed:
    """Nodes behind a gateway over one Redis (DB 2), as a test drives them."""

    redis: RedisServer
    nodes: dict[str, ServerProcess]
    gateway_url: str

    def api(self) -> httpx.Client:
        return httpx.Client(base_url=self.gateway_url, headers={"X-API-KEY": GATEWAY_KEY},
                            timeout=120)

    def index(self, key: str, field: str) -> str | None:
        """The node a cluster index (``aenv:sandboxes``, ``aenv:volumes``) names."""
        with redis.Redis.from_url(self.redis.url(2), decode_responses=True) as r:
            node: str | None = r.hget(key, field)  # type: ignore[assignment]
            return node

    def node_of(self, sandbox_id: str) -> str | None:
        return self.index("aenv:sandboxes", sandbox_id)


@dataclass
class Cluster(Gatewayed):
    shared: Path

    def statuses(self) -> dict[str, str]:
        with self.api() as c:
            return {n["nodeID"]: n["status"] for n in c.get("/nodes").json()}


@contextlib.contextmanager
def gateway(redis: RedisServer, home: Path) -> Iterator[str]:
    """``aenv gateway`` on a free port over ``redis``'s DB 2; yields its URL."""
    with gateway_process(redis, home) as (url, _):
        yield url


@contextlib.contextmanager
def gateway_process(redis: RedisServer, home: Path
                    ) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """``gateway``, also yielding the process (to kill it)."""
    port = free_port()
    home.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "AENV_HOME": str(home), "AENV_API_KEY": GATEWAY_KEY,
           "AENV_CLUSTER_SECRET": SECRET}
    with open(home / "gateway.log", "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "aenv.cli.main", "gateway", "--port", str(port),
             "--cluster", redis.url(2)], cwd=ROOT, env=env, stdout=log,
            stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, (home / "gateway.log").read_text()[-2000:]
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=1).status_code == 204:
                    break
            assert time.monotonic() < deadline, "gateway did not start"
            time.sleep(0.1)
        yield url, proc
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def serve_nodes(stack: contextlib.ExitStack, root: Path, redis: RedisServer,
                nodes: tuple[tuple[str, str, int], ...], env: dict[str, str]
                ) -> dict[str, ServerProcess]:
    """Cluster nodes (id, name prefix, net) over ``redis``'s DB 2, with ``env`` added,
    started side by side (each start snapshots base: 15-30 s under TCG) and checked for
    leftovers when ``stack`` closes."""
    servers: dict[str, ServerProcess] = {}
    for node_id, prefix, net in nodes:
        srv = ServerProcess(root / node_id, prefix=prefix, net=net)
        srv.env.update({"AENV_CLUSTER": redis.url(2), "AENV_NODE_ID": node_id,
                        "AENV_ADVERTISE_URL": srv.url, "AENV_CLUSTER_SECRET": SECRET, **env})
        servers[node_id] = srv
        stack.callback(srv.stop)  # even when another one's start fails first
    pool = stack.enter_context(ThreadPoolExecutor(len(servers)))
    started = {i: pool.submit(srv.start) for i, srv in servers.items()}
    for i, srv in servers.items():
        srv.start = started[i].result  # type: ignore[method-assign]  # serving() waits
        stack.enter_context(serving(srv))
        del srv.start  # a restart starts the process again
    return servers


@contextlib.contextmanager
def sdk_at_gateway(url: str) -> Iterator[None]:
    """The E2B SDKs' environment pointed at a gateway: API, sandboxes and volume content."""
    with pytest.MonkeyPatch.context() as mp:
        for var in ("E2B_API_URL", "E2B_SANDBOX_URL", "E2B_VOLUME_API_URL"):
            mp.setenv(var, url)
        mp.setenv("E2B_API_KEY", GATEWAY_KEY)
        mp.delenv("E2B_DOMAIN", raising=False)
        yield


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("cluster")
    with contextlib.ExitStack() as stack:
        redis = stack.enter_context(running_redis(root / "redis"))
        shared = root / "shared"
        nodes = serve_nodes(stack, root, redis, (("c1", "aenvc1", 71), ("c2", "aenvc2", 73)),
                            {"AENV_SHARED_STORE": str(shared)})
        url = stack.enter_context(gateway(redis, root / "gateway"))
        with sdk_at_gateway(url):
            yield Cluster(redis, nodes, url, shared)


def test_the_gateway_reports_both_nodes(cluster: Cluster) -> None:
    with cluster.api() as c:
        nodes = c.get("/nodes").json()
        assert [(n["nodeID"], n["status"], n["url"]) for n in nodes] == [
            ("c1", "ready", cluster.nodes["c1"].url), ("c2", "ready", cluster.nodes["c2"].url)]
        c2 = c.get("/nodes/c2").json()
        assert c2["sandboxes"] == {"running": 0, "paused": 0, "starting": 0,
                                  "queued": 0}
        # its budgets, as its admission applies them (host x overcommit), and their use
        cores = os.cpu_count() or 1   # x AENV_CPU_OVERCOMMIT, whatever its default
        assert c2["capacity"]["cpuCount"] >= cores and c2["capacity"]["cpuCount"] % cores == 0
        assert c2["capacity"]["memoryMB"] > 0 and c2["capacity"]["maxStarting"] > 0
        assert c2["usage"] == {"cpuCount": 0, "memoryMB": 0}
        assert c.get("/nodes").status_code == 200
    assert httpx.get(cluster.gateway_url + "/nodes").status_code == 401
    # a node takes the secret in place of its key; a client without either gets nothing
    node = cluster.nodes["c1"].url
    assert httpx.get(node + "/v2/sandboxes", headers={"X-Aenv-Cluster-Secret": SECRET}
                     ).status_code == 200
    assert httpx.get(node + "/v2/sandboxes", headers={"X-Aenv-Cluster-Secret": "x" * 40}
                     ).status_code == 401


def test_sandboxes_spread_over_both_nodes_and_work_through_the_gateway(
        cluster: Cluster) -> None:
    made = [Sandbox.create("base", metadata={"suite": "cluster"}) for _ in range(2)]
    try:
        assert {cluster.node_of(s.sandbox_id) for s in made} == {"c1", "c2"}
        with cluster.api() as c:   # each node publishes what its sandbox uses
            for s in made:
                used = c.get(f"/nodes/{cluster.node_of(s.sandbox_id)}").json()["usage"]
                assert used["cpuCount"] >= 1 and used["memoryMB"] >= 256, used
        for s in made:
            assert s.commands.run("echo hi from $(hostname)").stdout.startswith("hi from")
        a, b = made
        a.files.write("/home/user/note.txt", "through the gateway")
        assert a.files.read("/home/user/note.txt") == "through the gateway"
        assert not b.files.exists("/home/user/note.txt")   # b is another VM, elsewhere
        lines: list[str] = []
        b.commands.run("for i in 1 2 3; do echo $i; sleep 0.2; done",
                       on_stdout=lines.append)             # streamed as it runs
        assert [x.strip() for x in lines] == ["1", "2", "3"]
        listed = {s.sandbox_id for s in Sandbox.list().next_items()}
        assert {s.sandbox_id for s in made} <= listed
        pages = Sandbox.list(query=SandboxQuery(metadata={"suite": "cluster"}), limit=1)
        paged = [pages.next_items() for _ in range(2)]   # one from each node
        assert sorted(p[0].sandbox_id for p in paged) == sorted(s.sandbox_id for s in made)
        assert not pages.has_next or pages.next_items() == []
        assert Sandbox.connect(a.sandbox_id).get_info().metadata == {"suite": "cluster"}

        # a fork's child lives on its source's node and is routed at once
        with cluster.api() as c:
            r = c.post(f"/sandboxes/{b.sandbox_id}/fork", json={"count": 1})
            assert r.status_code == 201, r.text
            child = r.json()[0]["sandbox"]["sandboxID"]
        assert cluster.node_of(child) == cluster.node_of(b.sandbox_id)
        kid = Sandbox.connect(child)
        assert kid.commands.run("echo child").stdout.strip() == "child"
        kid.kill()

        # paused, it stays indexed on its node (and counted there); connect resumes it
        home = cluster.node_of(b.sandbox_id)
        with cluster.api() as c:
            assert c.post(f"/sandboxes/{b.sandbox_id}/pause").status_code == 204
            assert c.get(f"/nodes/{home}").json()["sandboxes"] == {
                "running": 0, "paused": 1, "starting": 0, "queued": 0}
        assert cluster.node_of(b.sandbox_id) == home
        b = Sandbox.connect(b.sandbox_id)
        assert b.commands.run("echo resumed").stdout.strip() == "resumed"

        a.kill()
        assert cluster.node_of(a.sandbox_id) is None
        listed = {s.sandbox_id for s in Sandbox.list().next_items()}
        assert a.sandbox_id not in listed and b.sandbox_id in listed
    finally:
        for s in made:
            with contextlib.suppress(Exception):
                s.kill()


def test_a_gateway_killed_leaves_every_sandbox_to_the_other(
        cluster: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two gateways over the same Redis and nodes: sandboxes made through the second one
    (one on each node) run commands through both; after a SIGKILL of the second, the SDK
    pointed at the survivor (the module's gateway) serves every one of them."""
    made: list[str] = []
    with gateway_process(cluster.redis, tmp_path / "gateway2") as (second, proc):
        with monkeypatch.context() as mp:
            mp.setenv("E2B_API_URL", second)
            mp.setenv("E2B_SANDBOX_URL", second)
            through_second = [Sandbox.create("base") for _ in range(2)]
            made = [s.sandbox_id for s in through_second]
            for s in through_second:
                s.files.write("/home/user/via.txt", f"made through {second}")
                assert s.commands.run("echo two").stdout.strip() == "two"
        assert {cluster.node_of(i) for i in made} == {"c1", "c2"}
        for i in made:   # the first gateway serves them too, while both live
            assert Sandbox.connect(i).commands.run("echo one").stdout.strip() == "one"
        proc.kill()
        proc.wait(10)
        with pytest.raises(httpx.ConnectError):
            httpx.get(second + "/health", timeout=2)
        with pytest.raises(Exception):  # noqa: B017  (the SDK's class varies)
            through_second[0].commands.run("true", request_timeout=10)
    try:
        for i in made:
            survivor = Sandbox.connect(i)
            assert survivor.commands.run("echo survived").stdout.strip() == "survived"
            assert survivor.files.read("/home/user/via.txt").startswith("made through")
        assert set(made) <= {s.sandbox_id for s in Sandbox.list().next_items()}
        with cluster.api() as c:
            assert all(c.delete(f"/sandboxes/{i}").status_code == 204 for i in made)
        made = []
    finally:
        for i in made:
            with contextlib.suppress(Exception):
                Sandbox.kill(i)


def test_redis_restarted_empty_is_filled_again_by_the_nodes(cluster: Cluster) -> None:
    sbx = Sandbox.create("base")
    try:
        home = cluster.node_of(sbx.sandbox_id)
        cluster.redis.restart_empty()
        restarted = time.monotonic()
        # each node republishes at its own next heartbeat: wait for both, not just one
        while (cluster.node_of(sbx.sandbox_id) != home
               or cluster.statuses() != {"c1": "ready", "c2": "ready"}):
            assert time.monotonic() - restarted < 10, "routing not whole again in 10 s"
            time.sleep(0.1)
        assert sbx.commands.run("echo still here").stdout.strip() == "still here"
    finally:
        sbx.kill()


def test_a_node_killed_with_sigkill_leaves_scheduling_within_its_ttl(cluster: Cluster) -> None:
    victim, other = cluster.nodes["c2"], cluster.nodes["c1"]
    before = [Sandbox.create("base") for _ in range(2)]    # one on each node
    on_victim = next(s for s in before if cluster.node_of(s.sandbox_id) == "c2")
    moved: list[Sandbox] = []
    try:
        victim.kill9()
        killed_at = time.monotonic()
        while cluster.statuses()["c2"] != "unhealthy":
            assert time.monotonic() - killed_at < DEFAULT_TTL_S + 1.5, "still ready"
            time.sleep(0.1)
        moved = [Sandbox.create("base") for _ in range(2)]
        assert {cluster.node_of(s.sandbox_id) for s in moved} == {"c1"}
        assert cluster.statuses() == {"c1": "ready", "c2": "unhealthy"}
        # its sandboxes answer an error at once, not a hang
        asked = time.monotonic()
        with pytest.raises(Exception):  # noqa: B017  (the SDK's class varies)
            on_victim.commands.run("true", request_timeout=30)
        assert time.monotonic() - asked < 10
    finally:
        # Back, it re-attaches its VMs and publishes again (and serving() cleans up).
        victim.start()
    try:
        assert cluster.statuses()["c2"] == "ready"
        assert cluster.node_of(on_victim.sandbox_id) == "c2"
        assert on_victim.commands.run("echo back").stdout.strip() == "back"
    finally:
        for s in [*before, *moved]:
            with contextlib.suppress(Exception):
                s.kill()
    assert other.proc is not None and other.proc.poll() is None


def _on_node(node: ServerProcess, method: str, path: str, **kw: object) -> httpx.Response:
    """A call to one node's own API, as a gateway makes it (the cluster secret)."""
    return httpx.request(method, node.url + path, headers={"X-Aenv-Cluster-Secret": SECRET},
                         timeout=300, **kw)  # type: ignore[arg-type]


def _as_if_taken_under_kvm(cluster: Cluster, sandbox_id: str) -> None:
    """Fake what a node that paused under KVM would have published for ``sandbox_id``:
    its bundle's, its offer's and the index's requirements name KVM and another CPU."""
    offer_path = cluster.shared / "handover" / f"{sandbox_id}.json"
    offer = json.loads(offer_path.read_text())
    snap = offer["record"]["snapshot_id"].split(":", 1)[1]
    ref = cluster.shared / "refs" / snap
    bundle = json.loads((cluster.shared / "bundles/sha256" / ref.read_text()).read_text())
    fake = {**bundle["requires"], "accel": "kvm", "cpu_model": "Imaginary CPU 9000"}
    raw = json.dumps({**bundle, "requires": fake}, indent=1, sort_keys=True).encode()
    digest = hashlib.sha256(raw).hexdigest()
    (cluster.shared / "bundles/sha256" / digest).write_bytes(raw)
    ref.write_text(digest)
    offer_path.write_text(json.dumps({**offer, "requires": fake}))
    with redis.Redis.from_url(cluster.redis.url(2), decode_responses=True) as r:
        r.hset("aenv:requires", sandbox_id, json.dumps(fake, sort_keys=True))


def _count(sbx: Sandbox) -> int:
    """The counter's file, read again if caught between its truncation and its write."""
    for _ in range(20):
        text = sbx.files.read("/tmp/count").strip()
        if text:
            return int(text)
        time.sleep(0.05)
    raise AssertionError("/tmp/count stays empty")


def test_a_sandbox_paused_on_a_node_killed_resumes_on_the_other(cluster: Cluster) -> None:
    """Pause three sandboxes on c1 and SIGKILL it: connecting through the gateway resumes
    the first on c2 from the shared store, files and a running process intact; the
    second, faked as taken under KVM on another CPU, is refused with the reason and not
    sent to c2, which refuses it too when asked directly, and traffic does not move it;
    the third, created with autoResume, is resumed on c2 by its traffic alone. c1, back,
    lets the first and third go."""
    victim, other = cluster.nodes["c1"], cluster.nodes["c2"]
    ids: list[str] = []
    try:
        for auto in (False, False, True):
            r = _on_node(victim, "POST", "/sandboxes", json={
                "templateID": "base", "timeout": 600, "autoResume": {"enabled": auto}})
            assert r.status_code == 201, r.text
            ids.append(r.json()["sandboxID"])
        moving, stuck, by_traffic = ids
        Sandbox.connect(by_traffic).files.write("/home/user/auto.txt", "auto on c1")
        sbx = Sandbox.connect(moving)
        sbx.files.write("/home/user/kept.txt", "written on c1")
        counter = sbx.commands.run(
            "i=0; while :; do i=$((i+1)); echo $i > /tmp/count; sleep 0.2; done",
            background=True)
        time.sleep(1)
        before = _count(sbx)
        with cluster.api() as c:
            for sid in ids:
                assert c.post(f"/sandboxes/{sid}/pause").status_code == 204
        assert {cluster.node_of(sid) for sid in ids} == {"c1"}
        assert (cluster.shared / "handover" / f"{moving}.json").is_file()

        victim.kill9()
        killed_at = time.monotonic()
        while cluster.statuses()["c1"] != "unhealthy":
            assert time.monotonic() - killed_at < DEFAULT_TTL_S + 1.5, "still ready"
            time.sleep(0.1)
        _as_if_taken_under_kvm(cluster, stuck)

        # The first comes back on c2, as it was.
        sbx = Sandbox.connect(moving)
        assert cluster.node_of(moving) == "c2"
        assert sbx.files.read("/home/user/kept.txt") == "written on c1"
        pid = counter.pid
        alive = sbx.commands.run(f"kill -0 {pid} && cat /proc/{pid}/cmdline | tr '\\0' ' '")
        assert "while" in alive.stdout
        time.sleep(1)
        after = _count(sbx)
        assert after > before  # counted on from its memory, not started again

        # The second: no node can restore it, and it says why.
        with cluster.api() as c:
            r = c.post(f"/sandboxes/{stuck}/connect", json={"timeout": 60})
        assert r.status_code == 409, r.text
        assert r.json()["code"] == 409
        assert "node c2: it needs the kvm accelerator" in r.json()["message"], r.text
        assert _on_node(other, "GET", f"/sandboxes/{stuck}").status_code == 404  # not sent
        r = _on_node(other, "POST", f"/sandboxes/{stuck}/connect", json={"timeout": 60})
        assert r.status_code == 409, r.text
        assert "cannot be resumed on this node" in r.json()["message"]
        assert "Imaginary CPU 9000" in r.json()["message"]
        assert (cluster.shared / "handover" / f"{stuck}.json").is_file()  # still offered

        # Traffic alone: the autoResume one comes back on c2; the other one stays paused.
        envd = {"E2b-Sandbox-Port": "49983"}
        r = httpx.get(cluster.gateway_url + "/health", timeout=120,
                      headers={**envd, "E2b-Sandbox-Id": by_traffic})
        assert r.status_code == 204, r.text
        assert cluster.node_of(by_traffic) == "c2"
        assert Sandbox.connect(by_traffic).files.read("/home/user/auto.txt") == "auto on c1"
        r = httpx.get(cluster.gateway_url + "/health", timeout=30,
                      headers={**envd, "E2b-Sandbox-Id": stuck})
        assert r.status_code == 502 and cluster.node_of(stuck) == "c1"
    finally:
        if victim.proc is None or victim.proc.poll() is not None:  # killed: back again
            victim.start()
    try:
        # Back, c1 forgets the one c2 took (the index keeps it on c2) and keeps the other.
        assert cluster.statuses()["c1"] == "ready"
        assert cluster.node_of(moving) == cluster.node_of(by_traffic) == "c2"
        assert _on_node(victim, "GET", f"/sandboxes/{moving}").status_code == 404
        assert _on_node(victim, "GET", f"/sandboxes/{by_traffic}").status_code == 404
        assert cluster.node_of(stuck) == "c1"
        assert Sandbox.connect(stuck).commands.run("echo home").stdout.strip() == "home"
    finally:
        for sid in ids:
            with contextlib.suppress(Exception):
                Sandbox.kill(sid)


def test_a_persistent_snapshot_taken_on_one_node_starts_on_the_other(
        cluster: Cluster) -> None:
    """A snapshot taken (through the gateway) of a sandbox on c1 creates a sandbox on c2,
    which never saw it: its record and files come from the shared store."""
    r = _on_node(cluster.nodes["c1"], "POST", "/sandboxes",
                 json={"templateID": "base", "timeout": 300})
    assert r.status_code == 201, r.text
    ids = [r.json()["sandboxID"]]
    try:
        Sandbox.connect(ids[0]).files.write("/home/user/snap.txt", "taken on c1")
        with cluster.api() as c:
            r = c.post(f"/sandboxes/{ids[0]}/snapshots", json={})
            assert r.status_code == 201, r.text
        snap = r.json()["snapshotID"]
        assert _on_node(cluster.nodes["c2"], "GET", f"/snapshots/{snap}").status_code == 404
        r = _on_node(cluster.nodes["c2"], "POST", "/sandboxes",
                     json={"templateID": snap, "timeout": 300})
        assert r.status_code == 201, r.text
        ids.append(r.json()["sandboxID"])
        assert cluster.node_of(ids[1]) == "c2"
        assert Sandbox.connect(ids[1]).files.read("/home/user/snap.txt") == "taken on c1"
        assert _on_node(cluster.nodes["c2"], "GET", f"/snapshots/{snap}").status_code == 200
    finally:
        for sid in ids:
            with contextlib.suppress(Exception):
                Sandbox.kill(sid)


def test_a_template_built_through_the_gateway_starts_on_both_nodes(
        cluster: Cluster, tmp_path: Path) -> None:
    """E2B's ``Template.build`` through the gateway (its COPY archive uploaded through the
    gateway's link) builds on one node; a sandbox from it starts on each node, the one
    that did not build it taking it from the shared store; then it is deleted on both."""
    from e2b import Template

    (tmp_path / "hello.txt").write_text("copied through the gateway")
    name = f"cl-{os.urandom(4).hex()}"
    Template.build(Template(file_context_path=str(tmp_path)).from_template("base")
                   .copy("hello.txt", "/home/user/hello.txt")
                   .run_cmd("echo built > /home/user/built.txt"), name)
    with redis.Redis.from_url(cluster.redis.url(2), decode_responses=True) as r:
        home = r.hget("aenv:templates", name)
    assert home in ("c1", "c2")
    ids: list[str] = []
    try:
        for node_id in sorted(cluster.nodes, key=lambda n: n != home):  # the builder first
            r2 = _on_node(cluster.nodes[node_id], "POST", "/sandboxes",
                          json={"templateID": name, "timeout": 300})
            assert r2.status_code == 201, (node_id, r2.text)
            ids.append(r2.json()["sandboxID"])
        for sid in ids:
            sbx = Sandbox.connect(sid)
            assert sbx.files.read("/home/user/hello.txt") == "copied through the gateway"
            assert sbx.files.read("/home/user/built.txt").strip() == "built"
        listed = [t for t in cluster.api().get("/templates").json() if name in t["aliases"]]
        assert len(listed) == 1                       # both nodes know it, listed once
    finally:
        for sid in ids:
            with contextlib.suppress(Exception):
                Sandbox.kill(sid)
        with cluster.api() as c:
            tid = c.get(f"/templates/{name}").json().get("templateID", name)
            assert c.delete(f"/templates/{tid}").status_code == 204
            assert c.get(f"/templates/{name}").status_code == 404   # on no node, not again


def test_a_node_sent_sigterm_drains_while_its_sandboxes_run(cluster: Cluster) -> None:
    """Draining with real nodes and VMs: after SIGTERM, c2 is ``draining`` at once, creates
    go to c1, c2's sandbox keeps running commands through the gateway; c2 stops once it
    is killed, and starts again (ready) for what follows."""
    victim = cluster.nodes["c2"]
    made = [Sandbox.create("base") for _ in range(2)]    # one on each node
    on_victim = next(s for s in made if cluster.node_of(s.sandbox_id) == "c2")
    others: list[Sandbox] = []
    try:
        assert victim.proc is not None
        victim.proc.send_signal(signal.SIGTERM)
        asked = time.monotonic()
        while cluster.statuses()["c2"] != "draining":
            assert time.monotonic() - asked < 3, "not draining within 3 s"
            time.sleep(0.05)
        others = [Sandbox.create("base") for _ in range(2)]
        assert {cluster.node_of(s.sandbox_id) for s in others} == {"c1"}
        assert on_victim.commands.run("echo still serving").stdout.strip() == "still serving"
        assert victim.proc.poll() is None, "stopped with a sandbox running"
        on_victim.kill()
        victim.proc.wait(60)     # nothing runs on it any more (AENV_DRAIN_TIMEOUT: 30 s)
        assert cluster.statuses()["c2"] == "unhealthy"
    finally:
        victim.stop()
        victim.start()
        for s in [*made, *others]:
            with contextlib.suppress(Exception):
                s.kill()
    assert cluster.statuses() == {"c1": "ready", "c2": "ready"}


def test_signed_file_urls_and_token_only_calls_work_through_the_gateway(
        cluster: Cluster) -> None:
    """The SDK's download_url/upload_url carry no routing headers, only a signature that
    the sandbox's envd token reproduces; token-only envd calls carry only the token. The
    gateway has neither: it asks its nodes whose they are (``aenv.cluster.owners``)."""
    made = [Sandbox.create("base", secure=True) for _ in range(2)]
    try:
        assert {cluster.node_of(s.sandbox_id) for s in made} == {"c1", "c2"}
        for s in made:
            home = cluster.node_of(s.sandbox_id)
            s.files.write("/home/user/signed.txt", f"kept on {home}")
            url = s.download_url("/home/user/signed.txt", use_signature_expiration=120)
            assert url.startswith(cluster.gateway_url) and "signature=" in url
            r = httpx.get(url, timeout=60)
            assert r.status_code == 200 and r.text == f"kept on {home}", r.text
            up = s.upload_url("/home/user/uploaded.txt")
            r = httpx.post(up, files={"file": ("uploaded.txt", f"to {home}".encode())},
                           timeout=60)
            assert r.status_code == 200, r.text
            assert s.files.read("/home/user/uploaded.txt") == f"to {home}"
            token = s._envd_access_token
            assert token
            r = httpx.get(cluster.gateway_url + "/files", params={"path": "/home/user/signed.txt",
                                                                   "username": "user"},
                          headers={"X-Access-Token": token}, timeout=60)
            assert r.status_code == 200 and r.text == f"kept on {home}", r.text
        # a signature no sandbox made reaches nothing
        bad = made[0].download_url("/home/user/signed.txt").replace("signature=v1_",
                                                                    "signature=v1_x")
        assert httpx.get(bad, timeout=60).status_code == 502
    finally:
        for s in made:
            with contextlib.suppress(Exception):
                s.kill()
