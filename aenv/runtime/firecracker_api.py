"""A small async client for Firecracker's API socket, and typed builders for its requests.

Written against the published API of Firecracker **v1.16.1** (``swagger/firecracker.yaml`` of
that release). Every request the driver sends is built here by one function whose arguments
are the fields aenv uses, so the wire format lives in one module and a test can check each
body against the spec. Firecracker rejects unknown fields (its Rust structs deny them), so a
builder never adds a field the spec does not name.

The client speaks HTTP/1.1 over the unix socket with httpx. The socket is reached through
``/proc/self/fd/<dirfd>/<name>`` (a directory descriptor held open by the client), so a
working directory deeper than the 107-byte ``sun_path`` limit still works.

Failures: a reply with status >= 300 raises ``FirecrackerAPIError`` carrying Firecracker's
``fault_message``; a socket that does not answer raises ``APIConnectionError``. Both are
``ControlError``s of the runtime's hierarchy; the driver turns a connection error into
``VMExitedError`` when the process is gone.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import httpx

from .base import ControlError

API_VERSION = "1.16.1"  # the release whose published API this module follows
MIN_VERSION = (1, 14, 0)  # oldest release with every endpoint used here (PUT /serial: 1.14)
DEFAULT_TIMEOUT = 10.0  # seconds for one request; snapshot calls pass their own

SnapshotType = Literal["Full", "Diff"]
VmState = Literal["Paused", "Resumed"]
LogLevel = Literal["Error", "Warning", "Info", "Debug", "Trace", "Off"]


class FirecrackerAPIError(ControlError):
    """Firecracker answered a request with an error status.

    ``fault_message`` is Firecracker's own explanation (the ``Error`` body of the spec).
    """

    def __init__(self, method: str, path: str, status: int, fault_message: str, *,
                 vm_id: str | None = None) -> None:
        super().__init__(f"Firecracker {method} {path} failed (HTTP {status}): {fault_message}",
                         vm_id=vm_id)
        self.method = method
        self.path = path
        self.status = status
        self.fault_message = fault_message


class APIConnectionError(ControlError):
    """The API socket did not answer (missing, refused, closed or timed out)."""


@dataclass(frozen=True)
class Request:
    """One API call: method, path and JSON body (None for bodiless requests)."""

    method: Literal["GET", "PUT", "PATCH"]
    path: str
    body: dict[str, Any] | None = None


# -- request builders (one per operation of the spec that aenv uses) ----------------------


def get_version() -> Request:
    """``GET /version`` -> ``{"firecracker_version": "1.16.1"}``."""
    return Request("GET", "/version")


def describe_instance() -> Request:
    """``GET /`` -> InstanceInfo; its ``state`` is ``Not started``, ``Running`` or ``Paused``."""
    return Request("GET", "/")


def put_logger(level: LogLevel) -> Request:
    """Set Firecracker's log level. No ``log_path``: the log stays on the VMM's stdout, which
    the driver sends to ``vmm.log`` (Firecracker would write a path of its own from offset
    0, over whatever stdout had put there)."""
    return Request("PUT", "/logger", {"level": level, "show_level": True,
                                      "show_log_origin": False})


def put_metrics(metrics_path: str) -> Request:
    """Flush JSON metrics lines to ``metrics_path`` (relative to the VMM's cwd)."""
    return Request("PUT", "/metrics", {"metrics_path": metrics_path})


def put_serial(serial_out_path: str) -> Request:
    """Send the guest serial console to a file (v1.14+); without it, it goes to stdout."""
    return Request("PUT", "/serial", {"serial_out_path": serial_out_path})


def put_machine_config(vcpu_count: int, mem_size_mib: int, *,
                       track_dirty_pages: bool, smt: bool = False) -> Request:
    return Request("PUT", "/machine-config", {
        "vcpu_count": vcpu_count,
        "mem_size_mib": mem_size_mib,
        "smt": smt,
        "track_dirty_pages": track_dirty_pages,
    })


def put_boot_source(kernel_image_path: str, boot_args: str,
                    initrd_path: str | None = None) -> Request:
    body: dict[str, Any] = {"kernel_image_path": kernel_image_path, "boot_args": boot_args}
    if initrd_path is not None:
        body["initrd_path"] = initrd_path
    return Request("PUT", "/boot-source", body)


def put_drive(drive_id: str, path_on_host: str, *, is_root_device: bool,
              is_read_only: bool) -> Request:
    """A virtio-blk drive backed by a raw file. Cache mode and IO engine are left at
    Firecracker's defaults (``Unsafe``: guest flushes are not forwarded; ``Sync``)."""
    return Request("PUT", f"/drives/{drive_id}", {
        "drive_id": drive_id,
        "path_on_host": path_on_host,
        "is_root_device": is_root_device,
        "is_read_only": is_read_only,
    })


def put_network_interface(iface_id: str, host_dev_name: str, guest_mac: str) -> Request:
    return Request("PUT", f"/network-interfaces/{iface_id}", {
        "iface_id": iface_id,
        "host_dev_name": host_dev_name,
        "guest_mac": guest_mac,
    })


def put_entropy() -> Request:
    """A virtio-rng device without a rate limiter."""
    return Request("PUT", "/entropy", {})


def instance_start() -> Request:
    return Request("PUT", "/actions", {"action_type": "InstanceStart"})


def patch_vm(state: VmState) -> Request:
    return Request("PATCH", "/vm", {"state": state})


def create_snapshot(snapshot_path: str, mem_file_path: str,
                    snapshot_type: SnapshotType) -> Request:
    """Write device state to ``snapshot_path`` and guest memory to ``mem_file_path``.

    A ``Diff`` writes only pages dirtied since boot, load or the last snapshot, at their own
    offsets; if ``mem_file_path`` already exists with the guest's size, Firecracker writes
    them into that file (a merge) instead of starting an empty one."""
    return Request("PUT", "/snapshot/create", {
        "snapshot_type": snapshot_type,
        "snapshot_path": snapshot_path,
        "mem_file_path": mem_file_path,
    })


def load_snapshot(snapshot_path: str, mem_file_path: str, *, track_dirty_pages: bool,
                  resume_vm: bool,
                  network_overrides: Sequence[tuple[str, str]] = ()) -> Request:
    """Load a snapshot into a fresh process, guest memory mapped ``MAP_PRIVATE`` from
    ``mem_file_path`` (the ``File`` backend). ``network_overrides`` pairs
    ``(iface_id, host_dev_name)`` rebind interfaces to other taps (v1.12+)."""
    body: dict[str, Any] = {
        "snapshot_path": snapshot_path,
        "mem_backend": {"backend_type": "File", "backend_path": mem_file_path},
        "track_dirty_pages": track_dirty_pages,
        "resume_vm": resume_vm,
    }
    if network_overrides:
        body["network_overrides"] = [{"iface_id": i, "host_dev_name": h}
                                     for i, h in network_overrides]
    return Request("PUT", "/snapshot/load", body)


def parse_version(text: str) -> tuple[int, int, int]:
    """``"1.16.1"`` / ``"v1.16.1-dev"`` -> ``(1, 16, 1)``."""
    core = text.strip().removeprefix("v").split("-")[0]
    parts = core.split(".")
    try:
        major, minor, patch = (int(p) for p in [*parts, "0", "0"][:3])
    except ValueError:
        raise ValueError(f"not a Firecracker version: {text!r}") from None
    return major, minor, patch


# -- client ---------------------------------------------------------------------------------


class FirecrackerAPI:
    """HTTP client for one Firecracker API socket; ``aclose`` when done."""

    def __init__(self, socket_path: Path, *, vm_id: str | None = None) -> None:
        self.socket_path = socket_path
        self.vm_id = vm_id
        self._dirfd = os.open(socket_path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        uds = f"/proc/self/fd/{self._dirfd}/{socket_path.name}"
        self._client = httpx.AsyncClient(
            transport=httpx.AsyncHTTPTransport(uds=uds),
            base_url="http://localhost",
            timeout=DEFAULT_TIMEOUT,
        )

    async def send(self, request: Request, *, timeout: float | None = None) -> Any:
        """Send ``request``; the decoded JSON reply, or None for 204 No Content."""
        try:
            reply = await self._client.request(
                request.method, request.path, json=request.body,
                headers={"Accept": "application/json"},
                timeout=timeout if timeout is not None else DEFAULT_TIMEOUT,
            )
        except httpx.TimeoutException as e:
            raise APIConnectionError(f"Firecracker {request.method} {request.path} timed out",
                                     vm_id=self.vm_id) from e
        except httpx.TransportError as e:
            raise APIConnectionError(
                f"Firecracker API socket {self.socket_path} does not answer "
                f"({type(e).__name__}: {e})", vm_id=self.vm_id) from e
        if reply.status_code >= 300:
            raise FirecrackerAPIError(request.method, request.path, reply.status_code,
                                      _fault_message(reply), vm_id=self.vm_id)
        if reply.status_code == 204 or not reply.content:
            return None
        return reply.json()

    async def aclose(self) -> None:
        await self._client.aclose()
        if self._dirfd >= 0:
            os.close(self._dirfd)
            self._dirfd = -1


def _fault_message(reply: httpx.Response) -> str:
    try:
        body = reply.json()
    except ValueError:
        return reply.text.strip() or reply.reason_phrase
    if isinstance(body, dict):
        message = body.get("fault_message")
        if isinstance(message, str):
            return message
    return reply.text.strip()
