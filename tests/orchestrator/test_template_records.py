"""The template records the orchestrator makes, one constructor per purpose: what each
takes from the sandbox and what from its template (the family)."""

from __future__ import annotations

import dataclasses

from aenv.orchestrator import template_records as tr
from aenv.store import BuildStatus, SandboxRecord, SandboxState, TemplateKind, TemplateRecord

NOW = 1_700_000_000.0


def _sandbox(**changes) -> SandboxRecord:
    rec = SandboxRecord(
        id="sbx1", template_id="tpl1", state=SandboxState.RUNNING, client_id="c",
        started_at=NOW - 60, end_at=NOW + 240, cpu_count=2, memory_mb=1024,
        disk_size_mb=4096, env_vars={"A": "sandbox"}, envd_token="sandbox-token",
        snapshot_id="snapshot:paused")
    return dataclasses.replace(rec, **changes)


def _family() -> TemplateRecord:
    return TemplateRecord(
        id="tpl1", kind=TemplateKind.TEMPLATE, build_id="b1", status=BuildStatus.READY,
        cpu_count=1, memory_mb=512, disk_size_mb=2048, created_at=NOW - 3600,
        updated_at=NOW - 3600, image="snapshot:tpl", env_vars={"A": "template"},
        workdir="/work", user="alice", start_cmd="serve", envd_token="template-token",
        spawn_count=7, names=["fam", "fam:default"])


def test_the_builtin_base_is_ready_on_the_base_image_as_user() -> None:
    base = tr.builtin_base(cpu_count=1, memory_mb=512, disk_size_mb=2048, now=NOW)
    assert base == TemplateRecord(
        id="base", kind=TemplateKind.TEMPLATE, build_id="builtin", status=BuildStatus.READY,
        cpu_count=1, memory_mb=512, disk_size_mb=2048, created_at=NOW, updated_at=NOW,
        names=["base"], user="user")
    assert base.image is None and tr.BASE_TEMPLATE == "base"


def test_a_reserved_template_waits_for_its_first_build_under_its_name() -> None:
    tpl = tr.reserved_for_build("t1", "mine", cpu_count=2, memory_mb=512, disk_size_mb=4096,
                                now=NOW)
    assert tpl == TemplateRecord(
        id="t1", kind=TemplateKind.TEMPLATE, build_id="", status=BuildStatus.WAITING,
        cpu_count=2, memory_mb=512, disk_size_mb=4096, created_at=NOW, updated_at=NOW,
        names=["mine"])


def test_a_persistent_snapshot_takes_the_sandbox_and_its_familys_user() -> None:
    snap = tr.persistent_snapshot("s1", _sandbox(), _family(), "snapshot:cap", name="keep",
                                  now=NOW)
    assert snap == TemplateRecord(
        id="s1", kind=TemplateKind.SNAPSHOT, build_id="s1", status=BuildStatus.READY,
        cpu_count=2, memory_mb=1024, disk_size_mb=4096, created_at=NOW, updated_at=NOW,
        image="snapshot:cap", parent_id="tpl1", source_sandbox="sbx1",
        env_vars={"A": "sandbox"}, workdir="/work", user="alice",
        envd_token="sandbox-token", names=["keep", "s1:default"])


def test_an_unnamed_snapshot_of_a_sandbox_whose_template_is_gone() -> None:
    source = _sandbox()
    snap = tr.persistent_snapshot("s1", source, None, "snapshot:cap", name=None, now=NOW)
    assert (snap.names, snap.user, snap.workdir) == (["s1:default"], None, None)
    assert snap.env_vars == source.env_vars and snap.env_vars is not source.env_vars


def test_a_forks_children_restore_the_capture_under_the_familys_name() -> None:
    family = _family()
    src = tr.fork_source(_sandbox(), family, "snapshot:cap")
    assert src == TemplateRecord(
        id="tpl1", kind=TemplateKind.SNAPSHOT, build_id="fork", status=BuildStatus.READY,
        cpu_count=2, memory_mb=1024, disk_size_mb=4096, created_at=NOW - 60,
        updated_at=NOW - 60, image="snapshot:cap", workdir="/work", user="alice",
        envd_token="sandbox-token", spawn_count=7, names=["fam", "fam:default"])
    assert src.start_cmd is None and src.env_vars == {}  # children take the source's env


def test_a_fork_of_a_sandbox_whose_template_is_gone() -> None:
    src = tr.fork_source(_sandbox(), None, "snapshot:cap")
    assert (src.names, src.spawn_count, src.user, src.workdir) == ([], 0, None, None)


def test_a_resume_restores_the_pause_snapshot_with_the_sandboxs_env() -> None:
    paused = _sandbox(state=SandboxState.PAUSED)
    src = tr.resume_source(paused, _family())
    assert src == TemplateRecord(
        id="tpl1", kind=TemplateKind.SNAPSHOT, build_id="resume", status=BuildStatus.READY,
        cpu_count=2, memory_mb=1024, disk_size_mb=4096, created_at=NOW - 60,
        updated_at=NOW - 60, image="snapshot:paused", envd_token="sandbox-token",
        user="alice", workdir="/work", env_vars={"A": "sandbox"})
    assert tr.resume_source(paused, None).user is None


def test_a_base_image_boot_is_the_template_without_its_snapshot() -> None:
    family = _family()
    assert tr.base_image_boot(family) == dataclasses.replace(family, image=None)
    assert family.image == "snapshot:tpl"
