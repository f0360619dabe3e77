"""A small async client for envd: health, ``/init``, metrics, and running commands.

It speaks Connect's JSON protocol directly (envelopes of 1 flag byte + 4-byte length +
JSON), which is all the host needs; the E2B SDK is a test dependency only.
"""

from __future__ import annotations

import asyncio
import base64
import json
import struct
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

ENVD_PORT = 49983


class EnvdError(Exception):
    """envd answered with an error, or not at all."""


@dataclass
class CommandResult:
    exit_code: int
    stdout: str
    stderr: str
    error: str | None = None


def envelope(message: dict[str, Any], flags: int = 0) -> bytes:
    data = json.dumps(message, separators=(",", ":")).encode()
    return struct.pack(">BI", flags, len(data)) + data


async def read_envelopes(stream: AsyncIterator[bytes]) -> AsyncIterator[tuple[int, dict]]:
    buf = b""
    async for chunk in stream:
        buf += chunk
        while len(buf) >= 5:
            flags, size = struct.unpack(">BI", buf[:5])
            if len(buf) < 5 + size:
                break
            payload, buf = buf[5:5 + size], buf[5 + size:]
            yield flags, json.loads(payload) if payload else {}


class EnvdClient:
    def __init__(self, base_url: str, token: str | None = None, *,
                 client: httpx.AsyncClient | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.token = token
        self._own = client is None
        self.http = client or httpx.AsyncClient(timeout=httpx.Timeout(30.0, connect=2.0))

    async def aclose(self) -> None:
        if self._own:
            await self.http.aclose()

    def _headers(self, user: str | None = None, extra: dict[str, str] | None = None) -> dict:
        h = dict(extra or {})
        if self.token:
            h["X-Access-Token"] = self.token
        if user:
            h["Authorization"] = "Basic " + base64.b64encode(f"{user}:".encode()).decode()
        return h

    async def wait_healthy(self, timeout: float, interval: float = 0.02,
                           alive: Callable[[], bool] | None = None) -> float:
        """Poll ``/health`` until 204; returns seconds waited. ``alive`` lets the caller
        stop early when the VM died."""
        start = time.monotonic()
        deadline = start + timeout
        while True:
            try:
                r = await self.http.get(self.base_url + "/health", timeout=0.5)
                if r.status_code == 204:
                    return time.monotonic() - start
            except httpx.HTTPError:
                pass
            if alive is not None and not alive():
                raise EnvdError("the VM exited before envd answered")
            if time.monotonic() >= deadline:
                raise EnvdError(f"envd did not answer /health within {timeout:.0f}s")
            await asyncio.sleep(interval)

    async def init(self, *, access_token: str | None, env_vars: dict[str, str],
                   default_user: str | None = "user", default_workdir: str | None = None,
                   current_token: str | None = None, entropy: bytes | None = None) -> None:
        body: dict[str, Any] = {"envVars": env_vars, "timestamp": _now_rfc3339()}
        if access_token is not None:
            body["accessToken"] = access_token
        if default_user:
            body["defaultUser"] = default_user
        if default_workdir:
            body["defaultWorkdir"] = default_workdir
        if entropy:
            body["entropy"] = base64.b64encode(entropy).decode()
        headers = {"X-Access-Token": current_token} if current_token else {}
        r = await self.http.post(self.base_url + "/init", json=body, headers=headers)
        if r.status_code != 204:
            raise EnvdError(f"/init answered {r.status_code}: {r.text[:200]}")
        self.token = access_token

    async def metrics(self) -> dict[str, Any]:
        r = await self.http.get(self.base_url + "/metrics", headers=self._headers(), timeout=5)
        r.raise_for_status()
        return r.json()

    async def run(self, cmd: str, *, user: str | None = None, cwd: str | None = None,
                  envs: dict[str, str] | None = None, timeout: float = 600,
                  on_output: Callable[[str, str], None] | None = None) -> CommandResult:
        """Run ``cmd`` with ``bash -l -c`` and wait for it; ``on_output(stream, text)``
        sees output as it arrives."""
        process: dict[str, Any] = {"cmd": "/bin/bash", "args": ["-l", "-c", cmd]}
        if envs:
            process["envs"] = envs
        if cwd:
            process["cwd"] = cwd
        headers = self._headers(user, {
            "Content-Type": "application/connect+json",
            "Connect-Protocol-Version": "1",
            "Connect-Timeout-Ms": str(int(timeout * 1000)),
        })
        out: dict[str, list[str]] = {"stdout": [], "stderr": []}
        end: dict[str, Any] | None = None
        async with self.http.stream(
            "POST", self.base_url + "/process.Process/Start",
            content=envelope({"process": process, "stdin": False}), headers=headers,
            timeout=httpx.Timeout(timeout + 5, connect=5),
        ) as r:
            if r.status_code != 200:
                raise EnvdError(f"Start answered {r.status_code}: {(await r.aread())[:200]!r}")
            async for flags, msg in read_envelopes(r.aiter_bytes()):
                if flags & 0x02:
                    if msg.get("error"):
                        raise EnvdError(f"{msg['error'].get('code')}: {msg['error'].get('message')}")
                    break
                event = msg.get("event", {})
                if "data" in event:
                    for stream, b64 in event["data"].items():
                        text = base64.b64decode(b64).decode(errors="replace")
                        if stream in out:
                            out[stream].append(text)
                        if on_output:
                            on_output(stream, text)
                elif "end" in event:
                    end = event["end"]
        if end is None:
            raise EnvdError("command ended without an end event")
        return CommandResult(end.get("exitCode", 0), "".join(out["stdout"]),
                             "".join(out["stderr"]), end.get("error"))


    async def start_background(self, cmd: str, *, user: str | None = None,
                               cwd: str | None = None,
                               envs: dict[str, str] | None = None) -> int:
        """Start ``cmd`` with no lifetime limit and return its pid once envd reports the
        start; closing the stream does not stop the process."""
        process: dict[str, Any] = {"cmd": "/bin/bash", "args": ["-l", "-c", cmd]}
        if envs:
            process["envs"] = envs
        if cwd:
            process["cwd"] = cwd
        headers = self._headers(user, {"Content-Type": "application/connect+json",
                                       "Connect-Protocol-Version": "1"})
        async with self.http.stream(
            "POST", self.base_url + "/process.Process/Start",
            content=envelope({"process": process, "stdin": False}), headers=headers,
        ) as r:
            if r.status_code != 200:
                raise EnvdError(f"Start answered {r.status_code}")
            async for flags, msg in read_envelopes(r.aiter_bytes()):
                if flags & 0x02:
                    err = msg.get("error") or {}
                    raise EnvdError(f"{err.get('code')}: {err.get('message')}")
                start = msg.get("event", {}).get("start")
                if start is not None:
                    return int(start.get("pid", 0))
        raise EnvdError("the process stream ended before the start event")

    async def upload(self, remote_path: str, local: Path, *, user: str | None = None) -> None:
        """Stream a local file to ``remote_path`` in the guest (octet-stream ``/files``)."""

        async def chunks() -> AsyncIterator[bytes]:
            with open(local, "rb") as f:
                while block := f.read(1 << 20):
                    yield block

        params = {"path": remote_path}
        if user:
            params["username"] = user
        r = await self.http.post(self.base_url + "/files", params=params, content=chunks(),
                                 headers=self._headers(None, {
                                     "Content-Type": "application/octet-stream"}),
                                 timeout=httpx.Timeout(None, connect=5))
        if r.status_code != 200:
            raise EnvdError(f"upload of {remote_path} answered {r.status_code}: {r.text[:200]}")


def _now_rfc3339() -> str:
    from datetime import UTC, datetime

    return datetime.now(UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")
