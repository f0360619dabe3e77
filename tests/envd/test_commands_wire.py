"""``process.Process`` on the wire: frames, codes and messages the SDK cannot show directly.

Requests are hand-built Connect JSON (as the SDKs send them) over httpx, so these tests pin
the exact envelope sequence, JSON shapes and error codes.
"""

from __future__ import annotations

import base64
import json
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

BASH = "/bin/bash"


class Wire:
    """A raw Connect client for one envd."""

    def __init__(self, url: str, token: str) -> None:
        self.url, self.token = url, token

    def stream(self, method: str, body: dict, headers: dict | None = None,
               timeout: float = 30) -> list[tuple[int, dict]]:
        """All frames of a server stream as (flags, json)."""
        payload = json.dumps(body).encode()
        envelope = b"\x00" + len(payload).to_bytes(4, "big") + payload
        h = {"content-type": "application/connect+json", "connect-protocol-version": "1",
             "x-access-token": self.token, **(headers or {})}
        r = httpx.post(f"{self.url}/process.Process/{method}", content=envelope, headers=h,
                       timeout=timeout)
        assert r.status_code == 200, r.text
        assert r.headers["content-type"].startswith("application/connect+json")
        return parse_frames(r.content)

    def unary(self, method: str, body: dict, headers: dict | None = None) -> httpx.Response:
        h = {"connect-protocol-version": "1", "x-access-token": self.token, **(headers or {})}
        return httpx.post(f"{self.url}/process.Process/{method}", json=body, headers=h,
                          timeout=30)

    def start_in_background(self, body: dict, headers: dict | None = None
                            ) -> tuple[int, threading.Thread, list]:
        """Start a process on a stream read by a thread; returns once it is listed."""
        before = set(self.pids())
        frames: list = []
        thread = threading.Thread(
            target=lambda: frames.extend(self.stream("Start", body, headers, timeout=60)),
            daemon=True)
        thread.start()
        deadline = time.monotonic() + 10
        while not (new := set(self.pids()) - before):
            assert time.monotonic() < deadline, "process never appeared in List"
            time.sleep(0.02)
        return new.pop(), thread, frames

    def pids(self) -> list[int]:
        r = self.unary("List", {})
        r.raise_for_status()
        return [p["pid"] for p in r.json().get("processes", [])]

    def kill(self, pid: int) -> None:
        self.unary("SendSignal", {"process": {"pid": pid}, "signal": "SIGNAL_SIGKILL"})


def parse_frames(data: bytes) -> list[tuple[int, dict]]:
    frames, i = [], 0
    while i < len(data):
        flags, size = data[i], int.from_bytes(data[i + 1:i + 5], "big")
        frames.append((flags, json.loads(data[i + 5:i + 5 + size])))
        i += 5 + size
    return frames


def events(frames: list[tuple[int, dict]]) -> list[dict]:
    return [f["event"] for flags, f in frames if flags == 0]


def end_of_stream(frames: list[tuple[int, dict]]) -> dict:
    flags, body = frames[-1]
    assert flags == 2, frames[-1]
    return body


def command(cmd: str, **extra) -> dict:
    return {"process": {"cmd": BASH, "args": ["-l", "-c", cmd]}, "stdin": False, **extra}


@pytest.fixture
def wire(envd, access_token, control_plane) -> Iterator[Wire]:
    w = Wire(envd.url, access_token)
    yield w
    # envd keeps serving whatever a test threw at it
    assert httpx.get(envd.url + "/health").status_code == 204


def test_start_sends_start_data_end_then_end_of_stream(wire) -> None:
    frames = wire.stream("Start", command("echo hi"))
    evs = events(frames)
    assert list(evs[0]) == ["start"] and evs[0]["start"]["pid"] > 0
    assert evs[1:-1] == [{"data": {"stdout": base64.b64encode(b"hi\n").decode()}}]
    assert evs[-1] == {"end": {"exited": True, "status": "exit status 0"}}
    assert end_of_stream(frames) == {}


def test_nonzero_exit_end_event_carries_code_and_error(wire) -> None:
    end = events(wire.stream("Start", command("exit 4")))[-1]["end"]
    assert end == {"exitCode": 4, "exited": True, "status": "exit status 4",
                   "error": "exit status 4"}


@pytest.mark.slow
def test_keepalive_is_sent_after_the_ping_interval_of_silence(wire) -> None:
    evs = events(wire.stream("Start", command("sleep 2.5"),
                             headers={"keepalive-ping-interval": "1"}))
    kinds = [next(iter(e)) for e in evs]
    assert kinds[0] == "start" and kinds[-1] == "end"
    assert kinds[1:-1] == ["keepalive", "keepalive"]


def test_no_keepalive_before_the_default_interval(wire) -> None:
    kinds = [next(iter(e)) for e in events(wire.stream("Start", command("sleep 1.2")))]
    assert kinds == ["start", "end"]


def test_pipe_output_chunks_are_at_most_32_kib(wire) -> None:
    evs = events(wire.stream("Start", command("head -c 1000000 /dev/zero")))
    sizes = [len(base64.b64decode(e["data"]["stdout"])) for e in evs if "data" in e]
    assert sum(sizes) == 1_000_000
    assert max(sizes) <= 32 * 1024


def test_pty_output_chunks_are_at_most_16_kib(wire) -> None:
    body = {"process": {"cmd": BASH, "args": ["-c", "head -c 300000 /dev/zero | tr '\\0' x"]},
            "pty": {"size": {"cols": 80, "rows": 24}}}
    evs = events(wire.stream("Start", body))
    sizes = [len(base64.b64decode(e["data"]["pty"])) for e in evs if "data" in e]
    assert sum(sizes) >= 300_000
    assert max(sizes) <= 16 * 1024


def test_output_bytes_are_passed_through_raw(wire) -> None:
    evs = events(wire.stream("Start", command("printf '\\xff\\xfe\\x00ok'")))
    data = b"".join(base64.b64decode(e["data"]["stdout"]) for e in evs if "data" in e)
    assert data == b"\xff\xfe\x00ok"


def test_sigterm_ends_with_signal_terminated(wire) -> None:
    pid, thread, frames = wire.start_in_background(command("sleep 30"))
    r = wire.unary("SendSignal", {"process": {"pid": pid}, "signal": "SIGNAL_SIGTERM"})
    assert r.status_code == 200, r.text
    thread.join(10)
    assert events(frames)[-1]["end"] == {"exitCode": -1, "status": "signal: terminated",
                                         "error": "signal: terminated"}


def test_other_signals_are_unimplemented(wire) -> None:
    pid, thread, _ = wire.start_in_background(command("sleep 30"))
    try:
        r = wire.unary("SendSignal", {"process": {"pid": pid}, "signal": "SIGNAL_UNSPECIFIED"})
        assert (r.status_code, r.json()["code"]) == (501, "unimplemented")
    finally:
        wire.kill(pid)
        thread.join(10)


def test_unknown_pid_is_not_found_with_upstream_message(wire) -> None:
    r = wire.unary("SendSignal", {"process": {"pid": 999999}, "signal": "SIGNAL_SIGKILL"})
    assert r.status_code == 404
    assert r.json() == {"code": "not_found", "message": "process with pid 999999 not found"}


def test_missing_selector_is_invalid_argument(wire) -> None:
    r = wire.unary("SendSignal", {"signal": "SIGNAL_SIGKILL"})
    assert (r.status_code, r.json()["code"]) == (400, "invalid_argument")


def test_missing_process_config_fails_in_end_of_stream_frame(wire) -> None:
    frames = wire.stream("Start", {"stdin": False})
    assert events(frames) == []
    assert end_of_stream(frames)["error"]["code"] == "invalid_argument"


def test_empty_cmd_fails_in_end_of_stream_frame(wire) -> None:
    frames = wire.stream("Start", {"process": {"cmd": ""}})
    assert events(frames) == []
    assert end_of_stream(frames)["error"]["code"] == "invalid_argument"


def test_missing_cwd_fails_without_start_event(wire) -> None:
    frames = wire.stream("Start", {"process": {"cmd": BASH, "cwd": "/no/such/dir"}})
    assert events(frames) == []
    assert end_of_stream(frames)["error"] == {
        "code": "invalid_argument", "message": "cwd '/no/such/dir' does not exist"}


def test_unknown_user_is_unauthenticated(wire) -> None:
    auth = "Basic " + base64.b64encode(b"no-such-user:").decode()
    frames = wire.stream("Start", command("true"), headers={"authorization": auth})
    assert events(frames) == []
    assert end_of_stream(frames)["error"] == {
        "code": "unauthenticated", "message": "invalid username: 'no-such-user'"}


def test_start_deadline_kills_the_process_and_ends_with_deadline_exceeded(wire) -> None:
    started = time.monotonic()
    frames = wire.stream("Start", command("sleep 10"), headers={"connect-timeout-ms": "1000"})
    assert time.monotonic() - started < 5
    assert [next(iter(e)) for e in events(frames)] == ["start"]
    assert end_of_stream(frames)["error"]["code"] == "deadline_exceeded"
    pid = events(frames)[0]["start"]["pid"]
    deadline = time.monotonic() + 5
    while pid in wire.pids():
        assert time.monotonic() < deadline, "process outlived its deadline"
        time.sleep(0.05)


def test_connect_deadline_ends_the_stream_but_not_the_process(wire) -> None:
    pid, thread, _ = wire.start_in_background(command("sleep 30"))
    try:
        frames = wire.stream("Connect", {"process": {"pid": pid}},
                             headers={"connect-timeout-ms": "500"})
        assert events(frames) == [{"start": {"pid": pid}}]
        assert end_of_stream(frames)["error"]["code"] == "deadline_exceeded"
        assert pid in wire.pids()
    finally:
        wire.kill(pid)
        thread.join(10)


def test_tag_selects_the_process_everywhere(wire) -> None:
    pid, thread, frames = wire.start_in_background({**command("cat"), "stdin": True,
                                                    "tag": "my-tag"})
    listed = next(p for p in wire.unary("List", {}).json()["processes"] if p["pid"] == pid)
    assert listed["tag"] == "my-tag"
    by_tag = {"tag": "my-tag"}
    assert wire.unary("SendInput", {"process": by_tag,
                                    "input": {"stdin": base64.b64encode(b"tagged").decode()}}
                      ).status_code == 200
    assert wire.unary("CloseStdin", {"process": by_tag}).status_code == 200
    thread.join(10)
    out = b"".join(base64.b64decode(e["data"]["stdout"]) for e in events(frames) if "data" in e)
    assert out == b"tagged"


def test_tags_are_unique_among_live_processes(wire) -> None:
    pid, thread, _ = wire.start_in_background({**command("sleep 30"), "tag": "only-one"})
    try:
        frames = wire.stream("Start", {**command("true"), "tag": "only-one"})
        assert events(frames) == []
        assert end_of_stream(frames)["error"]["code"] == "already_exists"
    finally:
        wire.kill(pid)
        thread.join(10)


def test_system_tag_may_be_shared(wire) -> None:
    first, t1, _ = wire.start_in_background({**command("sleep 30"), "tag": "_system"})
    second, t2, _ = wire.start_in_background({**command("sleep 30"), "tag": "_system"})
    try:
        assert first != second
    finally:
        wire.kill(first)
        wire.kill(second)
        t1.join(10)
        t2.join(10)


def test_connect_by_tag_after_exit_replays_start_and_end(wire) -> None:
    pid = events(wire.stream("Start", {**command("exit 2"), "tag": "gone"}))[0]["start"]["pid"]
    evs = events(wire.stream("Connect", {"process": {"tag": "gone"}}))
    assert evs == [{"start": {"pid": pid}}, {"end": {"exitCode": 2, "exited": True,
                                                     "status": "exit status 2",
                                                     "error": "exit status 2"}}]


def test_pty_input_to_a_pipe_process_is_internal(wire) -> None:
    pid, thread, _ = wire.start_in_background({**command("cat"), "stdin": True})
    try:
        r = wire.unary("SendInput", {"process": {"pid": pid},
                                     "input": {"pty": base64.b64encode(b"x").decode()}})
        assert (r.status_code, r.json()["code"]) == (500, "internal")
    finally:
        wire.kill(pid)
        thread.join(10)


def test_resize_of_a_pipe_process_is_internal(wire) -> None:
    pid, thread, _ = wire.start_in_background(command("sleep 30"))
    try:
        r = wire.unary("Update", {"process": {"pid": pid},
                                  "pty": {"size": {"cols": 10, "rows": 10}}})
        assert (r.status_code, r.json()["code"]) == (500, "internal")
    finally:
        wire.kill(pid)
        thread.join(10)


def test_stream_input_must_open_with_start(wire) -> None:
    payload = json.dumps({"data": {"input": {"stdin": "eA=="}}}).encode()
    r = httpx.post(f"{wire.url}/process.Process/StreamInput",
                   content=b"\x00" + len(payload).to_bytes(4, "big") + payload,
                   headers={"content-type": "application/connect+json",
                            "connect-protocol-version": "1", "x-access-token": wire.token})
    assert end_of_stream(parse_frames(r.content))["error"]["code"] == "invalid_argument"


def test_unknown_request_fields_are_ignored(wire) -> None:
    evs = events(wire.stream("Start", {**command("echo ok"), "futureField": {"x": 1}}))
    assert evs[-1]["end"]["status"] == "exit status 0"


def test_process_runs_with_oom_score_adj_100(wire) -> None:
    evs = events(wire.stream("Start", command("cat /proc/self/oom_score_adj")))
    out = b"".join(base64.b64decode(e["data"]["stdout"]) for e in evs if "data" in e)
    assert out == b"100\n"


def test_child_inherits_only_its_three_stdio_descriptors(wire) -> None:
    # `ls` itself holds one more descriptor: the /proc/self/fd directory it lists.
    evs = events(wire.stream("Start", command("ls /proc/self/fd")))
    out = b"".join(base64.b64decode(e["data"]["stdout"]) for e in evs if "data" in e)
    assert out.split() == [b"0", b"1", b"2", b"3"]
