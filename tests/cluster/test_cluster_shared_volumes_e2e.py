"""Shared volumes end to end: two real ``aenv server`` nodes (microVMs, prefixes
aenvcw1/aenvcw2, nets 171/173) over one redis-server and one shared store
(``AENV_SHARED_STORE``), one ``aenv gateway``, and the unmodified E2B Python SDK pointed at
the gateway only (``E2B_API_URL``, ``E2B_SANDBOX_URL``, ``E2B_VOLUME_API_URL``).

Shown: a volume made through the gateway lives in the shared store (no node holds it in
Redis); sandboxes on both nodes mount it and read each other's writes and the content
API's; the delete is refused while any of them mounts it, naming both; a persistent
snapshot of one is not pinned to its node: the other node makes a sandbox of it that mounts
the volume; with one node stopped, the
content API and a new sandbox on the other node still serve it; once no sandbox mounts it
the delete goes through and its files and record are gone. A volume's size is a soft limit
here (the test's shared store has no XFS project quotas): an upload over it is 507. At the
end every sandbox is killed, the nodes, the gateway and Redis stop, and the module fails if
a namespace, nft table or VMM process of either prefix is left
(``tests.server.conftest.serving``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import httpx
import pytest
from e2b import Sandbox, Volume

from tests.cluster.redis_server import running_redis
from tests.cluster.test_cluster_e2e import Cluster as SharedCluster
from tests.cluster.test_cluster_e2e import (
    gateway,
    sdk_at_gateway,
    serve_nodes,
)

pytestmark = [pytest.mark.vm, pytest.mark.net, pytest.mark.timeout(1200)]


class Cluster(SharedCluster):
    def on(self, node_id: str) -> httpx.Client:
        """A client of one node's own API."""
        node = self.nodes[node_id]
        return httpx.Client(base_url=node.url, timeout=300,
                            headers={"X-API-KEY": node.api_key})


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("cluster-shared-volumes")
    shared = root / "shared"
    with contextlib.ExitStack() as stack:
        redis_srv = stack.enter_context(running_redis(root / "redis"))
        nodes = serve_nodes(stack, root, redis_srv,
                            (("w1", "aenvcw1", 171), ("w2", "aenvcw2", 173)),
                            {"AENV_SHARED_STORE": str(shared)})
        url = stack.enter_context(gateway(redis_srv, root / "gateway"))
        with sdk_at_gateway(url):
            yield Cluster(redis_srv, nodes, url, shared)


def _run(sbx: Sandbox, cmd: str) -> str:
    return sbx.commands.run(cmd, timeout=120).stdout


def _eventually_reads(sbx: Sandbox, path: str, want: str) -> None:
    """NFS caches attributes for up to 1 s in the guest (``actimeo=1``)."""
    deadline = time.monotonic() + 20
    while (got := sbx.commands.run(f"cat {path} 2>/dev/null || true", timeout=60).stdout
           ) != want:
        assert time.monotonic() < deadline, (path, got)
        time.sleep(0.5)


def test_a_shared_volume_is_mounted_on_both_nodes_and_outlives_one(
        cluster: Cluster) -> None:
    vol = Volume.create("sv-data")
    sandboxes: list[Sandbox] = []
    snap = None
    try:
        assert cluster.index("aenv:volumes", vol.volume_id) is None   # no node holds it
        assert (cluster.shared / "volumes/records" / f"{vol.volume_id}.json").is_file()
        vol.write_file("/hello.txt", "from the api\n")
        for _ in range(4):   # creates go to the emptier node: one on each
            sandboxes.append(Sandbox.create("base", timeout=600,
                                            volume_mounts={"/data": vol}))
            if {cluster.node_of(s.sandbox_id) for s in sandboxes} == {"w1", "w2"}:
                break
        placed = {cluster.node_of(s.sandbox_id): s for s in sandboxes}
        assert set(placed) == {"w1", "w2"}
        a, b = placed["w1"], placed["w2"]
        for sbx in (a, b):
            assert _run(sbx, "cat /data/hello.txt") == "from the api\n"
        _run(a, "echo from-w1 > /data/a.txt")
        _eventually_reads(b, "/data/a.txt", "from-w1\n")
        _run(b, "echo from-w2 > /data/b.txt")
        _eventually_reads(a, "/data/b.txt", "from-w2\n")
        assert vol.read_file("/a.txt") == "from-w1\n" and vol.read_file("/b.txt") == "from-w2\n"
        assert sorted(e.name for e in vol.list("/")) == ["a.txt", "b.txt", "hello.txt"]

        with cluster.api() as c:   # mounted on both nodes: refused, whichever node answers
            for _ in range(3):
                r = c.delete(f"/volumes/{vol.volume_id}")
                assert r.status_code == 409, r.text
                said = r.json()["message"]
                assert a.sandbox_id in said and b.sandbox_id in said, said

        # a persistent snapshot of w1's sandbox is not pinned to w1: w2, which never saw
        # its source, makes a sandbox of it that mounts the volume
        snap = a.create_snapshot()
        assert cluster.index("aenv:volume-templates", snap.snapshot_id) is None
        with cluster.on("w2") as node:
            r = node.post("/sandboxes", json={"templateID": snap.snapshot_id,
                                              "timeout": 600})
            assert r.status_code == 201, r.text
        d = Sandbox.connect(r.json()["sandboxID"])
        sandboxes.append(d)
        assert cluster.node_of(d.sandbox_id) == "w2"
        assert [m["name"] for m in d.get_info().volume_mounts] == ["sv-data"]
        _eventually_reads(d, "/data/b.txt", "from-w2\n")
        _run(d, "echo from-the-snapshot > /data/d.txt")
        assert vol.read_file("/d.txt") == "from-the-snapshot\n"

        # w2 goes away (its sandboxes first): w1 serves the volume on its own
        for s in [s for s in sandboxes if cluster.node_of(s.sandbox_id) == "w2"]:
            s.kill()
            sandboxes.remove(s)
        cluster.nodes["w2"].stop()
        assert vol.read_file("/b.txt") == "from-w2\n"
        vol.write_file("/after.txt", "w2 is gone\n")
        c2 = Sandbox.create("base", timeout=600, volume_mounts={"/v": "sv-data"})
        sandboxes.append(c2)
        assert cluster.node_of(c2.sandbox_id) == "w1"
        assert _run(c2, "cat /v/after.txt /v/b.txt") == "w2 is gone\nfrom-w2\n"
        with cluster.api() as c:
            r = c.delete(f"/volumes/{vol.volume_id}")
            assert r.status_code == 409 and c2.sandbox_id in r.json()["message"], r.text
    finally:
        for s in sandboxes:
            s.kill()
        if snap is not None:
            Sandbox.delete_snapshot(snap.snapshot_id)
        w2 = cluster.nodes["w2"]
        if w2.proc is None or w2.proc.poll() is not None:
            w2.start()   # for the next tests
    assert Volume.destroy(vol.volume_id)
    assert not Volume.destroy(vol.volume_id)
    assert not (cluster.shared / "volumes/data" / vol.volume_id).exists()
    assert not (cluster.shared / "volumes/records" / f"{vol.volume_id}.json").exists()
    again = Volume.create("sv-data")   # the name is free again
    assert Volume.destroy(again.volume_id)


def test_an_upload_over_a_shared_volumes_size_is_refused(cluster: Cluster) -> None:
    with cluster.api() as c:
        r = c.post("/volumes", json={"name": "sv-small", "sizeMB": 16})
        assert r.status_code == 201, r.text
        made = r.json()
    vol = Volume(made["volumeID"], made["name"], made["token"])
    try:
        vol.write_file("/fits.bin", b"x" * (8 << 20))
        with pytest.raises(Exception) as e:
            vol.write_file("/over.bin", b"y" * (12 << 20))
        assert "507" in str(e.value) or "full" in str(e.value), e.value
        assert [x.name for x in vol.list("/")] == ["fits.bin"]
    finally:
        Volume.destroy(vol.volume_id)


def test_a_paused_sandbox_with_a_shared_volume_resumes_on_another_node(
        cluster: Cluster) -> None:
    """Paused on w2, which is then SIGKILLed: connecting through the gateway resumes it on
    w1 from the shared store, and its volume is mounted there (its guest's NFS client
    reconnects to w1's server for its new slot)."""
    vol = Volume.create("sv-move")
    victim = cluster.nodes["w2"]
    sid = None
    try:
        with cluster.on("w2") as node:
            r = node.post("/sandboxes", json={"templateID": "base", "timeout": 600,
                                              "volumeMounts": [{"name": "sv-move",
                                                                "path": "/m"}]})
            assert r.status_code == 201, r.text
            sid = r.json()["sandboxID"]
        sbx = Sandbox.connect(sid)
        _run(sbx, "echo before > /m/before.txt")
        with cluster.api() as c:
            assert c.post(f"/sandboxes/{sid}/pause").status_code == 204
        assert (cluster.shared / "handover" / f"{sid}.json").is_file()   # offered

        victim.kill9()
        killed_at = time.monotonic()
        while cluster.statuses()["w2"] != "unhealthy":
            assert time.monotonic() - killed_at < 10, "still ready"
            time.sleep(0.1)
        sbx = Sandbox.connect(sid)
        assert cluster.node_of(sid) == "w1"
        _eventually_reads(sbx, "/m/before.txt", "before\n")
        _run(sbx, "echo after > /m/after.txt")
        assert vol.read_file("/after.txt") == "after\n"
    finally:
        if victim.proc is None or victim.proc.poll() is not None:
            victim.start()
        if sid is not None:
            with contextlib.suppress(Exception):
                Sandbox.kill(sid)
    # w2, back, forgets the sandbox w1 took; its users file says so within seconds
    deadline = time.monotonic() + 30
    while True:
        with cluster.api() as c:
            r = c.delete(f"/volumes/{vol.volume_id}")
        if r.status_code == 204:
            break
        assert r.status_code == 409 and time.monotonic() < deadline, r.text
        time.sleep(1)
