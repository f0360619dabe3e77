"""Request bodies of the REST API, validated strictly (wrong types are a 400) while unknown
fields are ignored, since SDKs send fields this server does not use (``mcp``, ``iam``...)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)


Timeout = Field(default=None, ge=0, le=24 * 3600)


class AutoResume(_Body):
    enabled: bool = False


class NetworkConfig(_Body):
    allowOut: list[str] | None = None
    denyOut: list[str] | None = None
    allowPublicTraffic: bool | None = None
    maskRequestHost: str | None = None
    dnsServers: list[str] | None = None
    rules: dict[str, Any] | None = None
    egressProxy: dict[str, Any] | None = None
    httpsPorts: list[int] | None = None


class VolumeMount(_Body):
    name: str = Field(min_length=1, max_length=128)
    path: str = Field(min_length=1, max_length=4096)


class NewSandbox(_Body):
    """Both generations: v2 ``POST /v2/sandboxes`` and v1 ``POST /sandboxes`` (+ ``secure``)."""

    templateID: str = Field(min_length=1, max_length=256)
    timeout: int | None = Timeout
    autoPause: bool | None = None
    autoPauseMemory: bool | None = None
    autoResume: AutoResume | None = None
    allow_internet_access: bool | None = None
    network: NetworkConfig | None = None
    metadata: dict[str, str] | None = None
    envVars: dict[str, str] | None = None
    secure: bool | None = None
    volumeMounts: list[VolumeMount] | None = None
    # aenv extensions (AgentENV's cold-start knobs): override the template's size.
    cpuCount: int | None = Field(default=None, ge=1, le=64)
    memoryMB: int | None = Field(default=None, ge=64, le=262144)


class ConnectRequest(_Body):
    timeout: int | None = Timeout
    memory: bool | None = None


class ResumeRequest(_Body):
    timeout: int | None = Timeout
    autoPause: bool | None = None
    memory: bool | None = None


class TimeoutRequest(_Body):
    timeout: int = Field(ge=0, le=24 * 3600)


class RefreshRequest(_Body):
    duration: int | None = Field(default=None, ge=0, le=3600)


class PauseRequest(_Body):
    memory: bool | None = None
    requireHealthyGuest: bool | None = None


class SnapshotRequest(_Body):
    name: str | None = Field(default=None, max_length=128)
    memory: bool | None = None


class ForkRequest(_Body):
    count: int | None = Field(default=None, ge=1)
    timeout: int | None = Timeout


class NetworkUpdate(_Body):
    allowOut: list[str] | None = None
    denyOut: list[str] | None = None
    allow_internet_access: bool | None = None
    rules: dict[str, Any] | None = None
    egressProxy: dict[str, Any] | None = None
    dnsServers: list[str] | None = None
    # Create-only options: read so that an update carrying one is refused by name
    # (``api.network.update_options``), not ignored.
    allowPublicTraffic: Any = None
    maskRequestHost: Any = None
    httpsPorts: Any = None


class AssignTemplateTags(_Body):
    """``POST /templates/tags``: point ``tags`` at the build ``target`` (``name:tag``) names."""

    target: str
    tags: list[str]


class DeleteTemplateTags(_Body):
    """``DELETE /templates/tags`` (a JSON body on a DELETE): remove ``tags`` from ``name``."""

    name: str
    tags: list[str]
