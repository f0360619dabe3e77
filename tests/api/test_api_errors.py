"""The REST API's error boundary (issue 16): whatever a route lets escape is answered as E2B's
``{"code", "message"}`` JSON with a 5xx, never Starlette's plain-text 500, never a 400 for a
host fault, and never with the exception's text (paths, argv, stderr) in the body; the
traceback goes to the log once."""

from __future__ import annotations

import asyncio
import logging

import httpx
import pytest
import uvicorn
from fastapi import FastAPI

from aenv.api import errors
from aenv.network.errors import (
    NetnsError,
    NftError,
    PolicyError,
    PoolClosedError,
    PoolExhaustedError,
    SlotBusyError,
)
from aenv.orchestrator.errors import Conflict, StartFailed
from aenv.runtime.base import BootError, NotSupportedError, SnapshotError, VMExitedError
from aenv.storage.errors import CommandFailed, ImageError
from aenv.storage.snapshot_store import SnapshotMissing
from aenv.storage.snapshots import SnapshotFilesError
from tests.api.api_world import new_sandbox
from tests.conftest import free_port

SECRET = "/var/lib/aenv/secret-home"  # in every exception's text; must never reach a client

RAISED: dict[str, tuple[BaseException, int, str]] = {
    # name: (what the route raises, status, start of the message)
    "key-error": (KeyError(SECRET), 500, "internal error: KeyError"),
    "runtime-error": (RuntimeError(SECRET), 500, "internal error: RuntimeError"),
    "os-error": (OSError(28, "No space left on device", SECRET), 500, "internal error: OSError"),
    "command-failed": (CommandFailed(["mkfs.ext4", SECRET], 1, "disk full"), 500,
                       "host storage failure (CommandFailed)"),
    "image-error": (ImageError(SECRET), 500, "host storage failure (ImageError)"),
    "snapshot-missing": (SnapshotMissing(SECRET), 500, "host storage failure (SnapshotMissing)"),
    "disk-snapshot": (SnapshotFilesError(SECRET), 500, "host storage failure (SnapshotFilesError)"),
    "vm-snapshot": (SnapshotError(SECRET, vmm_log_tail=SECRET), 500,
                    "VM runtime failure (SnapshotError)"),
    "boot-error": (BootError(SECRET, console_tail=SECRET), 500, "VM runtime failure (BootError)"),
    "vm-exited": (VMExitedError(SECRET), 500, "VM runtime failure (VMExitedError)"),
    "vm-unsupported": (NotSupportedError(SECRET), 501,
                       "this node's VM runtime cannot do that (NotSupportedError)"),
    "nft": (NftError(SECRET, stderr=SECRET), 500, "host network failure (NftError)"),
    "netns": (NetnsError(SECRET), 500, "host network failure (NetnsError)"),
    # A ValueError too, but one raised on the host side is the host's fault, not a 400.
    "policy": (PolicyError(SECRET, "bad"), 500, "host network failure (PolicyError)"),
    "slot-busy": (SlotBusyError(7), 500, "host network failure (SlotBusyError)"),
    "pool-exhausted": (PoolExhaustedError(SECRET), 503,
                       "no network slot is free on this node (PoolExhaustedError)"),
    "pool-closed": (PoolClosedError(SECRET), 503,
                    "the server is shutting down (PoolClosedError)"),
}


def _raising_app() -> FastAPI:
    app = FastAPI()
    errors.install(app)

    @app.get("/raise/{name}")
    async def _raise(name: str) -> None:
        raise RAISED[name][0]

    return app


def _assert_e2b(r: httpx.Response, status: int, message: str) -> None:
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json", r.text
    body = r.json()
    assert set(body) == {"code", "message"} and body["code"] == status, body
    assert body["message"].startswith(message), body
    assert SECRET not in r.text and "Traceback" not in r.text


@pytest.mark.parametrize("name", list(RAISED))
async def test_an_escaped_error_is_an_e2b_shaped_5xx(name: str) -> None:
    _, status, message = RAISED[name]
    transport = httpx.ASGITransport(_raising_app(), raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        _assert_e2b(await c.get(f"/raise/{name}"), status, message)


async def test_the_trace_is_logged_once_and_not_raised_to_the_server(caplog) -> None:
    # The default transport re-raises what the app raises, as ServerErrorMiddleware does
    # after its handler answered: the boundary must take it before that.
    transport = httpx.ASGITransport(_raising_app())
    with caplog.at_level(logging.ERROR, logger="aenv.api.errors"):
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            r = await c.get("/raise/command-failed")
    assert r.status_code == 500
    logged = [rec for rec in caplog.records if rec.name == "aenv.api.errors"]
    assert len(logged) == 1 and logged[0].exc_info and logged[0].exc_info[0] is CommandFailed
    assert "GET /raise/command-failed" in logged[0].getMessage()


async def test_the_body_on_the_wire_is_json() -> None:
    """Through uvicorn, where ServerErrorMiddleware's own answer would be plain text."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(_raising_app(), host="127.0.0.1", port=port,
                                           log_level="critical", lifespan="off"))
    task = asyncio.create_task(server.serve())
    try:
        while not server.started:
            await asyncio.sleep(0.01)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as c:
            _assert_e2b(await c.get("/raise/key-error"), 500, "internal error: KeyError")
            _assert_e2b(await c.get("/raise/pool-exhausted"), 503, "no network slot is free")
    finally:
        server.should_exit = True
        await task


# -- through the real routes: the orchestrator lets a machine's error escape -----------------

async def test_a_failed_snapshot_is_a_500_not_plain_text(api) -> None:
    world, c = api
    sid = await new_sandbox(c)

    async def snapshot(rec, ref) -> None:
        raise SnapshotError(SECRET, vmm_log_tail=SECRET)

    world.machines.snapshot = snapshot
    _assert_e2b(await c.post(f"/sandboxes/{sid}/snapshots", json={}), 500,
                "VM runtime failure (SnapshotError)")
    assert (await c.get(f"/sandboxes/{sid}")).json()["state"] == "running"


async def test_a_refused_ruleset_is_a_500_not_a_400(api) -> None:
    world, c = api
    sid = await new_sandbox(c)

    async def update_network(rec) -> None:
        raise NftError(SECRET, stderr=SECRET)

    world.machines.update_network = update_network
    _assert_e2b(await c.put(f"/sandboxes/{sid}/network", json={"allowOut": ["10.0.0.0/8"]}),
                500, "host network failure (NftError)")


async def test_a_bug_while_killing_is_an_internal_error(api) -> None:
    world, c = api
    sid = await new_sandbox(c)

    async def stop(rec) -> None:
        raise KeyError(SECRET)

    world.machines.stop = stop
    _assert_e2b(await c.delete(f"/sandboxes/{sid}"), 500, "internal error: KeyError")


async def test_a_snapshot_name_already_taken_is_a_409(api) -> None:
    """Found by the fuzz: the store's NameTaken escaped as a 500."""
    _, c = api
    sid = await new_sandbox(c)
    r = await c.post(f"/sandboxes/{sid}/snapshots", json={"name": "base"})
    assert r.status_code == 409, r.text
    assert r.json() == {"code": 409, "message": "name 'base' is already used by template base"}
    r = await c.post(f"/sandboxes/{sid}/snapshots", json={"name": "mine"})
    assert r.status_code == 201, r.text
    r = await c.post(f"/sandboxes/{sid}/snapshots", json={"name": "mine"})
    assert r.status_code == 409 and r.json()["code"] == 409, r.text


async def test_a_failed_start_does_not_show_the_console_or_vmm_log(api) -> None:
    """Found by the fuzz: StartFailed's message embedded the BootError's text (console
    and VMM log tails, host paths)."""
    world, c = api

    async def start(rec, template):
        raise BootError(SECRET, console_tail=SECRET, vmm_log_tail=SECRET)

    world.machines.start = start
    _assert_e2b(await c.post("/v2/sandboxes", json={"templateID": "base"}), 500,
                "sandbox could not be started: VM runtime failure (BootError)")


def test_public_error_is_what_an_answer_would_carry() -> None:
    """What a fork's failed child should report (``snapshots.fork`` uses ``str(exc)``)."""
    try:
        try:
            raise BootError(SECRET, console_tail=SECRET)
        except BootError as e:
            raise StartFailed(f"sandbox could not be started: {e}") from e
    except StartFailed as e:
        started = e
    assert errors.public_error(started) == (
        500, "sandbox could not be started: VM runtime failure (BootError)")
    assert errors.public_error(KeyError(SECRET)) == (500, "internal error: KeyError")
    assert errors.public_error(Conflict("sandbox 'x' is paused")) == (
        409, "sandbox 'x' is paused")


async def test_a_fork_whose_children_fail_does_not_show_the_vmm_log(api) -> None:
    """Found by the fuzz."""
    world, c = api
    sid = await new_sandbox(c)

    async def start(rec, template):
        raise BootError(SECRET, vmm_log_tail=SECRET)

    world.machines.start = start
    r = await c.post(f"/sandboxes/{sid}/fork", json={"count": 2})
    assert r.status_code == 201, r.text
    assert SECRET not in r.text
    message = "sandbox could not be started: VM runtime failure (BootError)"
    assert r.json() == [{"error": {"code": 500, "message": message}}] * 2
