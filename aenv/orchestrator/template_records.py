"""The template records the orchestrator makes: one constructor per purpose.

Stored templates:

- ``builtin_base``: the built-in template ``base`` (the node's base image), ready out of
  the box;
- ``reserved_for_build``: a template a build request reserves, waiting for its first build;
- ``persistent_snapshot``: a snapshot of a running sandbox, kept as a template of kind
  ``snapshot`` under its own id.

And what a start boots or restores from, records handed to ``Machines.start`` that are
never stored (they keep the id of the sandbox's own template, its family name, so the
children and the resumed sandbox still belong to it):

- ``fork_source``: a fork's children restore the capture of their source;
- ``resume_source``: a paused sandbox restores (or, paused without memory, boots) its pause
  snapshot;
- ``base_image_boot``: a template booted from the node's base image instead of restored
  from its snapshot (to take that snapshot again);
- ``from_image``: what a ``fromImage`` build starts from, the image it pulled (in place of
  a parent template).

The user, working directory and start command a start applies come from the template the
sandbox was made from (its ``family``, None once deleted); sizes, env vars and the envd
token inside a snapshot come from the sandbox.
"""

from __future__ import annotations

import dataclasses

from ..store import BuildStatus, SandboxRecord, TemplateKind, TemplateRecord

BASE_TEMPLATE = "base"  # the built-in template's id and name


def builtin_base(*, cpu_count: int, memory_mb: int, disk_size_mb: int,
                 now: float) -> TemplateRecord:
    """``base``: the node's base image, whose sandboxes run as ``user``."""
    return TemplateRecord(
        id=BASE_TEMPLATE, kind=TemplateKind.TEMPLATE, build_id="builtin",
        status=BuildStatus.READY, cpu_count=cpu_count, memory_mb=memory_mb,
        disk_size_mb=disk_size_mb, created_at=now, updated_at=now, names=[BASE_TEMPLATE],
        user="user")


def reserved_for_build(template_id: str, name: str, *, cpu_count: int, memory_mb: int,
                       disk_size_mb: int, now: float) -> TemplateRecord:
    """A new template called ``name``, waiting for its first build (no image yet)."""
    return TemplateRecord(
        id=template_id, kind=TemplateKind.TEMPLATE, build_id="", status=BuildStatus.WAITING,
        cpu_count=cpu_count, memory_mb=memory_mb, disk_size_mb=disk_size_mb,
        created_at=now, updated_at=now, names=[name])


def persistent_snapshot(snapshot_id: str, source: SandboxRecord,
                        family: TemplateRecord | None, image: str, *, name: str | None,
                        now: float) -> TemplateRecord:
    """The snapshot ``image`` of the running sandbox ``source``, ready under
    ``snapshot_id`` (its build id too), ``name`` if given and ``<snapshot_id>:default``; its
    parent is the source's template."""
    return TemplateRecord(
        id=snapshot_id, kind=TemplateKind.SNAPSHOT, build_id=snapshot_id,
        status=BuildStatus.READY, cpu_count=source.cpu_count, memory_mb=source.memory_mb,
        disk_size_mb=source.disk_size_mb, created_at=now, updated_at=now, image=image,
        parent_id=source.template_id, source_sandbox=source.id,
        env_vars=dict(source.env_vars),
        workdir=family.workdir if family else None, user=family.user if family else None,
        envd_token=source.envd_token,
        names=[*([name] if name else []), f"{snapshot_id}:default"])


def fork_source(source: SandboxRecord, family: TemplateRecord | None,
                capture: str) -> TemplateRecord:
    """What a fork's children start from: the ``capture`` of ``source``, at its size, under
    the family's id, names and spawn count (a start counts one more spawn)."""
    return TemplateRecord(
        id=source.template_id, kind=TemplateKind.SNAPSHOT, build_id="fork",
        status=BuildStatus.READY, cpu_count=source.cpu_count, memory_mb=source.memory_mb,
        disk_size_mb=source.disk_size_mb, created_at=source.started_at,
        updated_at=source.started_at, image=capture,
        workdir=family.workdir if family else None, user=family.user if family else None,
        envd_token=source.envd_token, spawn_count=family.spawn_count if family else 0,
        names=family.names if family else [])


def resume_source(paused: SandboxRecord, family: TemplateRecord | None) -> TemplateRecord:
    """What resuming ``paused`` starts from: its pause snapshot (``snapshot_id``), at its
    size and with its env vars."""
    return TemplateRecord(
        id=paused.template_id, kind=TemplateKind.SNAPSHOT, build_id="resume",
        status=BuildStatus.READY, cpu_count=paused.cpu_count, memory_mb=paused.memory_mb,
        disk_size_mb=paused.disk_size_mb, created_at=paused.started_at,
        updated_at=paused.started_at, image=paused.snapshot_id, envd_token=paused.envd_token,
        user=family.user if family else None, workdir=family.workdir if family else None,
        env_vars=paused.env_vars)


def base_image_boot(template: TemplateRecord) -> TemplateRecord:
    """``template`` booted from the node's base image, whatever snapshot it names now."""
    return dataclasses.replace(template, image=None)


def from_image(template: TemplateRecord, image: str, *, env: dict[str, str], workdir: str,
               user: str) -> TemplateRecord:
    """What a build of ``template`` from a pulled image boots: ``image`` (``image:<digest>``)
    with the image config's environment, working directory and user, under the image's
    reference as its id (a build VM's record names it; nothing is stored under it)."""
    return TemplateRecord(
        id=image, kind=TemplateKind.TEMPLATE, build_id="image", status=BuildStatus.READY,
        cpu_count=template.cpu_count, memory_mb=template.memory_mb,
        disk_size_mb=template.disk_size_mb, created_at=template.created_at,
        updated_at=template.updated_at, image=image, env_vars=dict(env), workdir=workdir,
        user=user)
