"""Plain records as stored: one dataclass per table, JSON columns decoded, and the
lifecycle columns (``state``, ``kind``, ``status``) read back as their enums (``states``).

The orchestrator owns what the values mean; the API turns records into E2B shapes.
"""

from __future__ import annotations

import functools
import json
import sqlite3
import typing
from dataclasses import dataclass, field, fields
from enum import StrEnum
from typing import Any, TypeVar

from .states import BuildStatus, SandboxState, TemplateKind

T = TypeVar("T")

_JSON_FIELDS = {"metadata", "env_vars", "network", "spec", "volume_mounts"}
_BOOL_FIELDS = {"secure", "auto_pause", "auto_pause_memory", "auto_resume", "allow_internet",
                "public"}


@dataclass
class SandboxRecord:
    id: str
    template_id: str
    state: SandboxState
    client_id: str
    started_at: float
    end_at: float
    cpu_count: int
    memory_mb: int
    disk_size_mb: int
    seq: int = 0
    alias: str | None = None
    ended_at: float | None = None
    metadata: dict[str, str] = field(default_factory=dict)
    env_vars: dict[str, str] = field(default_factory=dict)
    envd_token: str | None = None
    traffic_token: str | None = None
    secure: bool = True
    auto_pause: bool = False
    auto_pause_memory: bool = True
    auto_resume: bool = False
    allow_internet: bool | None = None
    network: dict[str, Any] | None = None
    pause_mode: str | None = None
    runtime: str | None = None
    vm_dir: str | None = None
    vm_pid: int | None = None
    slot: int | None = None
    host_ip: str | None = None
    snapshot_id: str | None = None
    idempotency_key: str | None = None
    reason: str | None = None
    restored_from: str | None = None
    # [{name, path, volumeID}] (orchestrator.volumes): fork children inherit it.
    volume_mounts: list[dict[str, str]] | None = None


@dataclass
class TemplateRecord:
    id: str
    kind: TemplateKind
    build_id: str
    status: BuildStatus
    cpu_count: int
    memory_mb: int
    disk_size_mb: int
    created_at: float
    updated_at: float
    public: bool = False
    image: str | None = None
    parent_id: str | None = None
    source_sandbox: str | None = None
    start_cmd: str | None = None
    ready_cmd: str | None = None
    env_vars: dict[str, str] = field(default_factory=dict)
    workdir: str | None = None
    user: str | None = None
    last_spawned_at: float | None = None
    spawn_count: int = 0
    build_count: int = 0
    envd_token: str | None = None
    names: list[str] = field(default_factory=list)


@dataclass
class BuildRecord:
    id: str
    template_id: str
    status: BuildStatus
    created_at: float
    spec: dict[str, Any] | None = None
    reason: str | None = None
    reason_step: str | None = None
    finished_at: float | None = None


@functools.cache
def _plan(cls: type, columns: tuple[str, ...]) -> tuple[tuple[int, str, Any], ...]:
    """(column index, field name, decode: None, ``json.loads``, ``bool`` or the field's
    enum) for each field the row has: worked out once per record type and column list,
    not per row."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in fields(cls)}

    def decoder(name: str) -> Any:
        if name in _JSON_FIELDS:
            return json.loads
        if name in _BOOL_FIELDS:
            return bool
        hint = hints.get(name)
        return hint if isinstance(hint, type) and issubclass(hint, StrEnum) else None

    return tuple((i, c, decoder(c)) for i, c in enumerate(columns) if c in names)


def from_row(cls: type[T], row: sqlite3.Row, **extra: Any) -> T:
    values: dict[str, Any] = {}
    key: type = cls  # the plan's cache key (a TypeVar's type is not known to be Hashable)
    for i, name, decode in _plan(key, tuple(row.keys())):
        v = row[i]
        if v is not None and decode is not None:
            v = decode(v)
        values[name] = v
    values.update(extra)
    return cls(**values)


def encode(name: str, value: Any) -> Any:
    """A field value as its column holds it."""
    if name in _JSON_FIELDS and value is not None:
        return json.dumps(value, separators=(",", ":"))
    if isinstance(value, bool):
        return int(value)
    return value


def to_columns(record: Any, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    return {f.name: encode(f.name, getattr(record, f.name)) for f in fields(record)
            if f.name not in skip}


def encode_changes(changes: dict[str, Any]) -> dict[str, Any]:
    return {k: encode(k, v) for k, v in changes.items()}
