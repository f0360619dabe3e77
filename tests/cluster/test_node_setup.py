"""What a node and a gateway need to join a cluster, checked before anything starts (no
Redis, no root)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from aenv.cli import server as cli_server
from aenv.cli.main import app
from aenv.cluster.node_setup import NodeSetupError, advertise_url, check, node_id
from aenv.config import Settings, SettingsError

NO_FLAGS = {f.name: None for f, var in Settings.variables() if var.flag}
SECRET = "s" * 32


def settings(env: dict[str, str], **flags: object) -> Settings:
    return cli_server.server_settings({**NO_FLAGS, **flags}, env)


def test_cluster_flags_win_over_their_variables() -> None:
    env = {"AENV_CLUSTER": "redis://10.0.0.5:6379/0", "AENV_NODE_ID": "n1",
           "AENV_ADVERTISE_URL": "http://10.0.0.11:3000", "AENV_CLUSTER_SECRET": SECRET}
    s = settings(env, node_id="n2", cluster="redis://127.0.0.1:6380/3")
    assert (s.cluster, s.node_id, s.advertise_url) == (
        "redis://127.0.0.1:6380/3", "n2", "http://10.0.0.11:3000")
    assert "<hidden>" in repr(s) and SECRET not in repr(s)
    check(s)


@pytest.mark.parametrize(("env", "error"), [
    ({"AENV_CLUSTER": "10.0.0.5:6379"}, "AENV_CLUSTER='10.0.0.5:6379' is not a redis://"),
    ({"AENV_NODE_ID": "a b"}, "AENV_NODE_ID='a b' must be 1-63 letters"),
    ({"AENV_ADVERTISE_URL": "10.0.0.1:3000"}, "is not an http(s)://HOST:PORT URL"),
    ({"AENV_CLUSTER_SECRET": "short"}, "AENV_CLUSTER_SECRET=<hidden> must be at least 32"),
])
def test_bad_values_are_refused_naming_the_variable(env: dict[str, str], error: str) -> None:
    with pytest.raises(SettingsError, match=re.escape(error)):
        settings(env)


def test_a_node_needs_the_secret_and_a_reachable_url() -> None:
    with pytest.raises(NodeSetupError, match="AENV_CLUSTER_SECRET"):
        check(settings({"AENV_CLUSTER": "redis://127.0.0.1:6379/0"}))
    wild = settings({"AENV_CLUSTER": "redis://127.0.0.1:6379/0", "AENV_CLUSTER_SECRET": SECRET},
                    listen_host="0.0.0.0")
    with pytest.raises(NodeSetupError, match="--advertise"):
        check(wild)
    s = settings({"AENV_CLUSTER_SECRET": SECRET}, listen_port=3100)
    assert advertise_url(s) == "http://127.0.0.1:3100"
    assert node_id(s)                                   # the host name
    check(settings({}))                                 # not in a cluster: nothing needed


def test_the_gateway_refuses_to_start_without_redis_or_secret() -> None:
    runner = CliRunner()
    out = runner.invoke(app, ["gateway", "--port", "0"], env={"AENV_CLUSTER": ""})
    assert out.exit_code == 1 and "--cluster / AENV_CLUSTER" in out.output
    out = runner.invoke(app, ["gateway", "--cluster", "redis://127.0.0.1:1/0"],
                        env={"AENV_CLUSTER_SECRET": ""})
    assert out.exit_code == 1 and "AENV_CLUSTER_SECRET is required" in out.output


async def test_a_paused_sandbox_another_node_took_is_not_published(tmp_path: Path) -> None:
    """The node's index leaves out a paused sandbox whose offer another node claimed."""
    import dataclasses

    from aenv.cluster.handover import Handover
    from aenv.cluster.node_setup import node_agent
    from aenv.storage.shared_store import SharedStore
    from aenv.store import Database, SandboxRecord, SandboxState, SandboxStore

    s = Settings.from_env({"AENV_HOME": str(tmp_path / "home"), "AENV_CLUSTER":
                           "redis://127.0.0.1:1/0", "AENV_CLUSTER_SECRET": "x" * 32,
                           "AENV_NODE_ID": "a", "AENV_ADVERTISE_URL": "http://127.0.0.1:9",
                           "AENV_SHARED_STORE": str(tmp_path / "shared")})
    store = SharedStore(tmp_path / "shared")
    db = Database(tmp_path / "db.sqlite")
    sandboxes = SandboxStore(db)
    for sid, snap in (("kept", "s1"), ("taken", "s2")):
        (store.root / "refs").mkdir(parents=True, exist_ok=True)
        (store.root / "refs" / snap).write_text("0" * 64)
        rec = SandboxRecord(id=sid, template_id="base", state=SandboxState.PAUSED,
                            client_id="c", started_at=1.0, end_at=2.0, cpu_count=1,
                            memory_mb=512, disk_size_mb=2048, snapshot_id=f"snapshot:{snap}")
        sandboxes.insert(dataclasses.replace(rec))
        Handover(store, "a").offer(rec, {"driver": "qemu"})
    assert Handover(store, "b").claim("taken") is not None
    agent = node_agent(s, sandboxes)
    try:
        assert [e.sandbox_id for e in agent.index()] == ["kept"]
    finally:
        await agent.registry.close()
        db.close()


def test_a_node_publishes_its_budgets_and_what_its_sandboxes_use(tmp_path: Path) -> None:
    """The budgets are the settings' (host cores and RAM x overcommit); the usage counts
    the sandboxes holding a VM, as admission does, those starting, and the creates queued
    behind the starts (counted against vCPUs and memory as admission counts them)."""
    import os

    from aenv.cluster.node_setup import capacity_of, usage_of
    from aenv.store import Database, SandboxRecord, SandboxState, SandboxStore

    s = Settings.from_env({"AENV_HOME": str(tmp_path / "home"), "AENV_MAX_SANDBOXES": "7",
                           "AENV_MAX_STARTING": "3", "AENV_CPU_OVERCOMMIT": "4",
                           "AENV_START_QUEUE": "5"})
    cap = capacity_of(s)
    assert (cap.max_sandboxes, cap.max_starting, cap.vcpus) == (7, 3, 4 * (os.cpu_count() or 1))
    assert cap.start_queue == 5
    assert cap.memory_mb > 0
    db = Database(tmp_path / "db.sqlite")
    try:
        sandboxes = SandboxStore(db)
        for sid, state, cpus, mem in (("run", SandboxState.RUNNING, 2, 1024),
                                      ("new", SandboxState.CREATING, 1, 512),
                                      ("back", SandboxState.RESUMING, 1, 256),
                                      ("zzz", SandboxState.PAUSED, 4, 4096),
                                      ("end", SandboxState.KILLED, 8, 8192)):
            sandboxes.insert(SandboxRecord(
                id=sid, template_id="base", state=state, client_id="c", started_at=1.0,
                end_at=2.0, cpu_count=cpus, memory_mb=mem, disk_size_mb=2048))
        used = usage_of(sandboxes)()
        assert (used.starting, used.vcpus_used, used.memory_used_mb) == (2, 4, 1792)
        assert used.queued == 0
        used = usage_of(sandboxes, lambda: [(2, 2048), (1, 512)])()
        assert (used.starting, used.queued) == (2, 2)
        assert (used.vcpus_used, used.memory_used_mb) == (4 + 3, 1792 + 2560)
    finally:
        db.close()


async def test_the_taken_check_is_read_at_most_every_few_seconds_but_afresh_to_publish(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On NFS every read costs: a heartbeat's index asks the shared store whether another
    node took a paused sandbox at most every MOVED_CHECK_S; what is published is read
    afresh, so a stale answer never routes a taken sandbox back."""
    import dataclasses

    from aenv.cluster import node_setup
    from aenv.cluster.handover import Handover
    from aenv.storage.shared_store import SharedStore
    from aenv.store import Database, SandboxRecord, SandboxState, SandboxStore

    s = Settings.from_env({"AENV_HOME": str(tmp_path / "home"), "AENV_CLUSTER":
                           "redis://127.0.0.1:1/0", "AENV_CLUSTER_SECRET": "x" * 32,
                           "AENV_NODE_ID": "a", "AENV_ADVERTISE_URL": "http://127.0.0.1:9",
                           "AENV_SHARED_STORE": str(tmp_path / "shared")})
    store = SharedStore(tmp_path / "shared")
    db = Database(tmp_path / "db.sqlite")
    sandboxes = SandboxStore(db)
    for sid, snap in (("kept", "s1"), ("later", "s2")):
        (store.root / "refs").mkdir(parents=True, exist_ok=True)
        (store.root / "refs" / snap).write_text("0" * 64)
        rec = SandboxRecord(id=sid, template_id="base", state=SandboxState.PAUSED,
                            client_id="c", started_at=1.0, end_at=2.0, cpu_count=1,
                            memory_mb=512, disk_size_mb=2048, snapshot_id=f"snapshot:{snap}")
        sandboxes.insert(dataclasses.replace(rec))
        Handover(store, "a").offer(rec, {"driver": "qemu"})
    reads: list[str] = []
    real = Handover.moved

    def counted(self: Handover, rec: SandboxRecord) -> bool:
        reads.append(rec.id)
        return real(self, rec)

    monkeypatch.setattr(Handover, "moved", counted)
    agent = node_setup.node_agent(s, sandboxes)
    try:
        assert [e.sandbox_id for e in agent.index()] == ["kept", "later"]
        assert [e.sandbox_id for e in agent.index()] == ["kept", "later"]
        assert sorted(reads) == ["kept", "later"]              # read once, then kept
        assert Handover(store, "b").claim("later") is not None
        assert [e.sandbox_id for e in agent.index()] == ["kept", "later"]  # not yet seen
        assert agent.fresh_index is not None
        assert [e.sandbox_id for e in agent.fresh_index()] == ["kept"]     # to publish
        assert [e.sandbox_id for e in agent.index()] == ["kept"]
        monkeypatch.setattr(node_setup, "MOVED_CHECK_S", 0.0)
        agent.fresh_index()                                    # kept for 0 s from now on
        reads.clear()
        agent.index()
        agent.index()
        assert reads == ["kept", "later"] * 2                  # past the interval: again
    finally:
        await agent.registry.close()
        db.close()


async def test_a_paused_sandbox_with_volumes_is_not_offered_to_other_nodes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its volumes live on this node only: no requirements are published for it, so no
    gateway resumes it elsewhere (nor by traffic, whatever its autoResume)."""
    from types import SimpleNamespace

    from aenv.cluster.node_setup import node_agent
    from aenv.storage.shared_store import SharedStore
    from aenv.store import Database, SandboxRecord, SandboxState, SandboxStore

    s = Settings.from_env({"AENV_HOME": str(tmp_path / "home"), "AENV_CLUSTER":
                           "redis://127.0.0.1:1/0", "AENV_CLUSTER_SECRET": "x" * 32,
                           "AENV_NODE_ID": "a", "AENV_ADVERTISE_URL": "http://127.0.0.1:9",
                           "AENV_SHARED_STORE": str(tmp_path / "shared")})
    monkeypatch.setattr(SharedStore, "bundle",
                        lambda self, ref: SimpleNamespace(requires={"driver": "qemu"}))
    db = Database(tmp_path / "db.sqlite")
    sandboxes = SandboxStore(db)
    mounts = [{"name": "data", "path": "/data", "volumeID": "vol_1"}]
    for sid, volume_mounts in (("plain", None), ("with-volume", mounts)):
        sandboxes.insert(SandboxRecord(
            id=sid, template_id="base", state=SandboxState.PAUSED, client_id="c",
            started_at=1.0, end_at=2.0, cpu_count=1, memory_mb=512, disk_size_mb=2048,
            snapshot_id=f"snapshot:{sid}", auto_resume=True, volume_mounts=volume_mounts))
    agent = node_agent(s, sandboxes, volumes=lambda: {"vol_1": "data"})
    try:
        entries = {e.sandbox_id: e for e in agent.fresh_index()}  # type: ignore[misc]
        assert entries["plain"].requires and entries["plain"].auto_resume
        assert entries["with-volume"].requires == "" and not entries["with-volume"].auto_resume
        assert agent.volumes is not None and agent.volumes() == {"vol_1": "data"}
    finally:
        await agent.registry.close()
        db.close()


async def test_a_paused_sandbox_whose_volumes_are_in_the_shared_store_is_offered(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Shared volumes are served by any node: a paused sandbox that mounts only those is
    offered like one without volumes; one that also mounts a volume the shared store
    lacks (made before the node had the store) is not."""
    from types import SimpleNamespace

    from aenv.cluster.node_setup import node_agent
    from aenv.storage.shared_store import SharedStore
    from aenv.storage.shared_volumes import SharedVolumes
    from aenv.store import Database, SandboxRecord, SandboxState, SandboxStore

    shared = tmp_path / "shared"
    s = Settings.from_env({"AENV_HOME": str(tmp_path / "home"), "AENV_CLUSTER":
                           "redis://127.0.0.1:1/0", "AENV_CLUSTER_SECRET": "x" * 32,
                           "AENV_NODE_ID": "a", "AENV_ADVERTISE_URL": "http://127.0.0.1:9",
                           "AENV_SHARED_STORE": str(shared)})
    monkeypatch.setattr(SharedStore, "bundle",
                        lambda self, ref: SimpleNamespace(requires={"driver": "qemu"}))
    volumes = SharedVolumes(shared, "a")
    vol = volumes.insert("data", 16)
    volumes.make_root(vol.id, 16, owner=os.getuid())
    db = Database(tmp_path / "db.sqlite")
    sandboxes = SandboxStore(db)
    for sid, ids in (("shared", [vol.id]), ("mixed", [vol.id, "vol_local"])):
        sandboxes.insert(SandboxRecord(
            id=sid, template_id="base", state=SandboxState.PAUSED, client_id="c",
            started_at=1.0, end_at=2.0, cpu_count=1, memory_mb=512, disk_size_mb=2048,
            snapshot_id=f"snapshot:{sid}", auto_resume=True, volume_mounts=[
                {"name": i, "path": f"/{i}", "volumeID": i} for i in ids]))
    agent = node_agent(s, sandboxes)
    try:
        entries = {e.sandbox_id: e for e in agent.fresh_index()}  # type: ignore[misc]
        assert entries["shared"].requires and entries["shared"].auto_resume
        assert entries["mixed"].requires == "" and not entries["mixed"].auto_resume
        assert agent.record.shared_volumes
    finally:
        await agent.registry.close()
