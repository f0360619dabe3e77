"""Volumes and secrets in a cluster, end to end: two real ``aenv server`` nodes (microVMs,
their own prefixes aenvcv1/aenvcv2 and nets 165/167), one ``aenv gateway``, a real
redis-server, and the unmodified E2B Python SDK pointed at the gateway only
(``E2B_API_URL``, ``E2B_SANDBOX_URL`` and ``E2B_VOLUME_API_URL``).

Shown: a volume made through the gateway is written and read through the gateway's content
API; a sandbox that mounts it is placed on the volume's node whichever node is emptier,
reads what the API wrote and writes what the API reads, and so are the sandboxes made from
its persistent snapshot; a volume made on the other node pins its sandbox there; volumes
of two nodes are refused together; a 64 MiB file streams through the gateway intact. A
secret made through the gateway fills the header transform of a sandbox on each node (an
"internet" namespace with an HTTP server that records headers,
``tests/network/egress_world``), and an update applies to the next request. At the end
every sandbox is killed, the nodes, the gateway and Redis stop, and the module fails if a
namespace, nft table or VMM process of either prefix is left
(``tests.server.conftest.serving``); the internet namespace is removed.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from e2b import Sandbox, Secret, Volume

from tests.cluster.redis_server import running_redis
from tests.cluster.test_cluster_e2e import (
    Gatewayed,
    gateway,
    sdk_at_gateway,
    serve_nodes,
)
from tests.conftest import ROOT, run_json_script
from tests.network.egress_world import Internet

pytestmark = [pytest.mark.vm, pytest.mark.net, pytest.mark.timeout(1200)]

INET_IP = "10.169.3.2"
TOKEN = "cluster-s3cret-7d1"
REQUEST = f"""\
import socket, sys
s = socket.create_connection(("{INET_IP}", 80), timeout=10)
s.sendall(("GET / HTTP/1.1\\r\\nHost: %s\\r\\n\\r\\n" % sys.argv[1]).encode())
out = b""
while chunk := s.recv(65536):
    out += chunk
print(out.decode(errors="replace"))
"""


@dataclass
class Cluster(Gatewayed):
    inet: Internet

    def node_of_volume(self, volume_id: str) -> str | None:
        return self.index("aenv:volumes", volume_id)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("cluster-volumes")
    with contextlib.ExitStack() as stack:
        inet = Internet(root, "aecv-inet", "aecv-j", "10.169.3.1", INET_IP)
        stack.callback(inet.close)
        redis_srv = stack.enter_context(running_redis(root / "redis"))
        nodes = serve_nodes(stack, root, redis_srv,
                            (("v1", "aenvcv1", 165), ("v2", "aenvcv2", 167)),
                            {"AENV_EGRESS_HOSTS": str(inet.hosts),
                             "AENV_EGRESS_UPSTREAM_CA": str(inet.ca_file)})
        url = stack.enter_context(gateway(redis_srv, root / "gateway"))
        with sdk_at_gateway(url):
            yield Cluster(redis_srv, nodes, url, inet)


def _copied(copy: Path) -> set[tuple[str, int]]:
    """(name, version) of each secret in a node's copy of the cluster's secrets."""
    try:
        records = json.loads(copy.read_text())["records"]
    except (OSError, ValueError):
        return set()
    return {(r["name"], r["version"]) for r in map(json.loads, records.values())}


def _run(sbx: Sandbox, cmd: str) -> str:
    return sbx.commands.run(cmd, timeout=120).stdout


def test_a_volume_made_through_the_gateway_is_mounted_on_its_node(cluster: Cluster) -> None:
    vol = Volume.create("cv-data")
    home = cluster.node_of_volume(vol.volume_id)
    assert home in ("v1", "v2")
    other = "v2" if home == "v1" else "v1"
    sandboxes: list[Sandbox] = []
    theirs = busy = snap = None
    try:
        vol.write_file("/hello.txt", "through the gateway\n")
        assert vol.read_file("/hello.txt") == "through the gateway\n"
        assert [e.name for e in vol.list("/")] == ["hello.txt"]
        assert any(v.volume_id == vol.volume_id for v in Volume.list())
        # the volume's node is made the fuller one (a sandbox made on it directly): the
        # create that mounts the volume goes there all the same
        with httpx.Client(base_url=cluster.nodes[home].url, timeout=120,
                          headers={"X-API-KEY": cluster.nodes[home].api_key}) as node:
            r = node.post("/v2/sandboxes", json={"templateID": "base", "timeout": 300})
            assert r.status_code == 201, r.text
            busy = r.json()["sandboxID"]
        assert cluster.node_of(busy) == home
        a = Sandbox.create("base", timeout=300, volume_mounts={"/data": vol})
        sandboxes.append(a)
        assert cluster.node_of(a.sandbox_id) == home
        assert _run(a, "cat /data/hello.txt") == "through the gateway\n"
        _run(a, "echo from-the-guest > /data/guest.txt")
        assert vol.read_file("/guest.txt") == "from-the-guest\n"
        assert [m["name"] for m in a.get_info().volume_mounts] == ["cv-data"]
        # a persistent snapshot's sandboxes mount the volume too: made on its node only
        snap = a.create_snapshot()
        c = Sandbox.create(snap.snapshot_id, timeout=300)
        sandboxes.append(c)
        assert cluster.node_of(c.sandbox_id) == home
        assert _run(c, "cat /data/guest.txt") == "from-the-guest\n"

        # a volume made on the other node (its own API) pins its sandboxes there
        with httpx.Client(base_url=cluster.nodes[other].url, timeout=120,
                          headers={"X-API-KEY": cluster.nodes[other].api_key}) as node:
            r = node.post("/volumes", json={"name": "cv-theirs"})
            assert r.status_code == 201, r.text
            theirs = r.json()["volumeID"]
        assert cluster.node_of_volume(theirs) == other
        b = Sandbox.create("base", timeout=300, volume_mounts={"/t": "cv-theirs"})
        sandboxes.append(b)
        assert cluster.node_of(b.sandbox_id) == other
        assert _run(b, "ls -A /t") == ""
        with cluster.api() as c:
            r = c.post("/v2/sandboxes", json={"templateID": "base", "volumeMounts": [
                {"name": "cv-data", "path": "/d"}, {"name": "cv-theirs", "path": "/t"}]})
            assert r.status_code == 400 and "different nodes" in r.json()["message"]
            assert c.post("/volumes", json={"name": "cv-theirs"}).status_code == 409
    finally:
        for s in sandboxes:
            s.kill()
        if busy is not None:
            Sandbox.kill(busy)
        if snap is not None:
            Sandbox.delete_snapshot(snap.snapshot_id)
    assert Volume.destroy(vol.volume_id)
    assert not Volume.destroy(vol.volume_id)
    assert cluster.node_of_volume(vol.volume_id) is None
    if theirs is not None:
        assert Volume.destroy(theirs)


def test_a_secret_made_through_the_gateway_fills_transforms_on_every_node(
        cluster: Cluster) -> None:
    Secret.create("CV-Token", TOKEN)
    network = {"allow_out": ["plain.aes.test"], "rules": {"plain.aes.test": [
        {"transform": {"headers": {"X-Key": Secret.fill("cv-token")}}}]}}
    sandboxes: list[Sandbox] = []
    try:
        for _ in range(4):   # creates go to the emptier node: one on each
            sandboxes.append(Sandbox.create("base", timeout=300, network=network))
            if {cluster.node_of(s.sandbox_id) for s in sandboxes} == {"v1", "v2"}:
                break
        placed = {cluster.node_of(s.sandbox_id): s for s in sandboxes}
        assert set(placed) == {"v1", "v2"}
        for node, sbx in sorted(placed.items()):
            sbx.files.write("/tmp/req.py", REQUEST)
            out = _run(sbx, "python3 /tmp/req.py plain.aes.test")
            assert "ok plain.aes.test" in out, (node, out)
            assert cluster.inet.http.seen[-1]["x-key"] == TOKEN, node
            assert TOKEN not in out
        Secret.update("cv-token", "rotated")
        for node, sbx in sorted(placed.items()):
            _run(sbx, "python3 /tmp/req.py plain.aes.test")
            assert cluster.inet.http.seen[-1]["x-key"] == "rotated", node
        # every node serves the cluster's secrets, and keeps a sealed copy of them
        for srv in cluster.nodes.values():
            with httpx.Client(base_url=srv.url, headers={"X-API-KEY": srv.api_key}) as c:
                assert c.get("/secrets/cv-token").json()["currentVersion"] == 2
            copy = srv.home / "secrets" / "cluster-secrets.json"
            deadline = time.monotonic() + 10
            while ("cv-token", 2) not in _copied(copy):
                assert time.monotonic() < deadline, "no copy of the secrets on the node"
                time.sleep(0.2)
            assert "rotated" not in copy.read_text() and TOKEN not in copy.read_text()
    finally:
        for s in sandboxes:
            s.kill()
        Secret.destroy("cv-token")


def test_a_large_file_streams_through_the_gateway(cluster: Cluster) -> None:
    """64 MiB through the gateway's content API, past its 1 MiB REST body limit, both ways
    intact; the time against the same calls straight to the node is printed (``-s``)."""
    data = os.urandom(64 * 1024 * 1024)
    vol = Volume.create("cv-big")
    try:
        home = cluster.nodes[cluster.node_of_volume(vol.volume_id) or ""]
        for how, url in (("gateway", cluster.gateway_url), ("node", home.url)):
            with pytest.MonkeyPatch.context() as mp:
                mp.setenv("E2B_VOLUME_API_URL", url)
                target = Volume(vol.volume_id, vol.name, vol.token)
                t0 = time.perf_counter()
                target.write_file(f"/{how}.bin", data)
                t1 = time.perf_counter()
                back = target.read_file(f"/{how}.bin", format="bytes")
                t2 = time.perf_counter()
            assert hashlib.sha256(back).digest() == hashlib.sha256(data).digest()
            print(f"{how}: write {64 / (t1 - t0):.0f} MiB/s, read {64 / (t2 - t1):.0f} MiB/s")
    finally:
        Volume.destroy(vol.volume_id)


@pytest.mark.js
def test_the_js_sdks_volume_methods_through_the_gateway(cluster: Cluster) -> None:
    """``tests/js/volumes.mjs`` (the newest E2B JS SDK) with every URL at the gateway: the
    same answers as against one node (``tests/server/test_volumes_js_e2e.py``)."""
    if shutil.which("node") is None or not (ROOT / "tests/js/node_modules/e2b").is_dir():
        pytest.fail("node or the e2b npm package is missing: run ./scripts/setup.sh")
    out = run_json_script(["node", "volumes.mjs"], {}, cwd=ROOT / "tests/js", timeout=500)
    assert out["read"] == "from the js sdk\n" and out["guestRead"] == "from the js sdk\n"
    assert out["apiRead"] == "from-the-guest\n"
    assert out["overwrite"][0] == "VolumeError" and "409" in out["overwrite"][1]
    assert out["missing"][0] == "VolumePathNotFoundError"
    assert out["mounts"] == [{"name": "js-volume", "path": "/mnt/js"}]
    assert out["destroyed"] == [True, False] and out["gone"][0] == "VolumeNotFoundError"
