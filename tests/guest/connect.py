"""Run a command in a guest through envd's Connect JSON API (``process.Process/Start``).

The smallest client that serves these tests: one server-streaming call with Connect
envelopes (1 flag byte, 4-byte big-endian length, JSON), HTTP Basic ``<user>:`` as envd
expects. Returns stdout, stderr and the exit code, or raises if the stream ends early.
"""

from __future__ import annotations

import base64
import json
import struct
from dataclasses import dataclass

import httpx

_END_STREAM = 0x02


@dataclass
class Result:
    exit_code: int | None
    stdout: bytes
    stderr: bytes


def _envelope(message: dict) -> bytes:
    body = json.dumps(message).encode()
    return struct.pack(">BI", 0, len(body)) + body


def run(url: str, cmd: str, *args: str, user: str = "root", timeout: float = 30.0) -> Result:
    headers = {
        "Content-Type": "application/connect+json",
        "Connect-Protocol-Version": "1",
        "Authorization": "Basic " + base64.b64encode(f"{user}:".encode()).decode(),
    }
    request = {"process": {"cmd": cmd, "args": list(args)}}
    out, err, code = b"", b"", None
    with httpx.stream("POST", f"{url}/process.Process/Start", headers=headers,
                      content=_envelope(request), timeout=timeout) as resp:
        resp.raise_for_status()
        buf = b""
        for chunk in resp.iter_bytes():
            buf += chunk
            while len(buf) >= 5:
                flags, length = struct.unpack(">BI", buf[:5])
                if len(buf) < 5 + length:
                    break
                frame, buf = json.loads(buf[5 : 5 + length] or b"{}"), buf[5 + length :]
                if flags & _END_STREAM:
                    if frame.get("error"):
                        raise RuntimeError(f"envd error: {frame['error']}")
                    return Result(code, out, err)
                event = frame.get("event", {})
                data = event.get("data", {})
                out += base64.b64decode(data.get("stdout", ""))
                err += base64.b64decode(data.get("stderr", ""))
                if "end" in event:
                    code = event["end"].get("exitCode", 0)
    return Result(code, out, err)
