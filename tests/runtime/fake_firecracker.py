"""A stand-in for the ``firecracker`` binary: serves the API socket, records every request.

It runs no guest. It exists so the driver's tests can check, against a real process on a
real unix socket, which requests the driver sends and how it handles the replies. It keeps
the few rules of the real API that the driver depends on: it refuses to start when the
socket path exists, pre-boot resources are refused after InstanceStart, ``/snapshot/load``
only on a fresh process (logger, metrics and serial allowed before it) and the process ends
after a failed load, ``/snapshot/create`` needs a paused VM and resolves paths against the
cwd. A ``Diff`` merges into an existing memory file of the right size, as Firecracker does.

Guest memory is modelled as a few pages with known contents: InstanceStart writes pages
0-3, every ``Resumed`` writes page 1 and page 10+n, and the dirty set follows those writes
when ``track_dirty_pages`` is on (as KVM's dirty log would).

Environment: ``FAKE_FC_RECORD`` (file to append JSON lines to; default ``fc-requests.jsonl``
in the cwd), ``FAKE_FC_VERSION`` (default 1.16.1), ``FAKE_FC_FAULT`` (``"METHOD /path"`` to
answer with 400 and ``FAKE_FC_FAULT_MESSAGE``), ``FAKE_FC_IGNORE_TERM=1`` (survive SIGTERM),
``FAKE_FC_JAILED=1`` (set by ``fake_jailer.py``: every path in a request must stay inside the
cwd, as in a real jail, whose root is the cwd).

The kernel and every drive are opened on InstanceStart and load, with the access a real
Firecracker needs (drives read-write unless read-only), as whatever user the fake runs as.
"""

from __future__ import annotations

import json
import os
import signal
import socketserver
import sys
import threading
from http.server import BaseHTTPRequestHandler
from pathlib import Path

PAGE = 4096
VERSION = os.environ.get("FAKE_FC_VERSION", "1.16.1")
FAULT = os.environ.get("FAKE_FC_FAULT", "")
FAULT_MESSAGE = os.environ.get("FAKE_FC_FAULT_MESSAGE", "fake fault")
RECORD = Path(os.environ.get("FAKE_FC_RECORD", "fc-requests.jsonl")).resolve()
JAILED = os.environ.get("FAKE_FC_JAILED") == "1"
PATH_KEYS = ("kernel_image_path", "initrd_path", "path_on_host", "serial_out_path",
             "snapshot_path", "mem_file_path", "backend_path", "metrics_path", "log_path")
PREBOOT_ONLY = ("/machine-config", "/boot-source", "/drives/", "/network-interfaces/",
                "/entropy", "/logger", "/metrics", "/serial")
ALLOWED_BEFORE_LOAD = ("/logger", "/metrics", "/serial")

lock = threading.Lock()


def record(entry: dict) -> None:
    with lock, open(RECORD, "a") as f:
        f.write(json.dumps(entry) + "\n")


class Machine:
    def __init__(self) -> None:
        self.state = "Not started"
        self.config: dict[str, object] = {"drives": {}, "net": {}}
        self.configured: set[str] = set()
        self.memory: dict[int, bytes] = {}
        self.dirty: set[int] = set()
        self.track = False
        self.resumes = 0

    def write(self, page: int, text: str) -> None:
        self.memory[page] = text.encode().ljust(PAGE, b".")
        if self.track:
            self.dirty.add(page)

    @property
    def mem_size(self) -> int:
        return int(self.config.get("machine", {}).get("mem_size_mib", 128)) << 20

    def handle(self, method: str, path: str, body: dict | None) -> tuple[int, object]:
        key = f"{method} {path}"
        if FAULT and key == FAULT:
            return 400, {"fault_message": FAULT_MESSAGE}
        if JAILED:
            for p in paths_in(body):
                if p.startswith("/") or ".." in Path(p).parts:
                    return 400, {"fault_message": f"{p}: no such file in the jail"}
        if key == "GET /version":
            return 200, {"firecracker_version": VERSION}
        if key == "GET /":
            return 200, {"app_name": "Firecracker", "id": "anonymous-instance",
                         "state": self.state, "vmm_version": VERSION}
        if method == "PUT" and path.startswith(PREBOOT_ONLY):
            if self.state != "Not started":
                return 400, {"fault_message": "The requested operation is not supported "
                                              "after starting the microVM."}
            self.configured.add(path)
            if path == "/machine-config":
                self.config["machine"] = body
                self.track = bool(body.get("track_dirty_pages"))
            elif path == "/boot-source":
                self.config["boot"] = body
            elif path.startswith("/drives/"):
                self.config["drives"][body["drive_id"]] = body
            elif path.startswith("/network-interfaces/"):
                self.config["net"][body["iface_id"]] = body
            elif path == "/serial":
                self.config["serial"] = body["serial_out_path"]
            return 204, None
        if key == "PUT /actions" and body.get("action_type") == "InstanceStart":
            return self.start()
        if key == "PATCH /vm":
            if self.state == "Not started":
                return 400, {"fault_message": "The microVM is not started."}
            if body["state"] == "Paused":
                self.state = "Paused"
            else:
                if self.state == "Paused":
                    self.resumes += 1
                    self.write(1, f"gen:{self.resumes}")
                    self.write(10 + self.resumes, f"resume:{self.resumes}")
                self.state = "Running"
            return 204, None
        if key == "PUT /snapshot/create":
            return self.create(body)
        if key == "PUT /snapshot/load":
            return self.load(body)
        return 400, {"fault_message": f"Invalid request method and/or path: {method} {path}."}

    def start(self) -> tuple[int, object]:
        boot = self.config.get("boot")
        if not boot or not Path(boot["kernel_image_path"]).is_file():
            return 400, {"fault_message": "Cannot start microvm without kernel configuration."}
        for name in (boot["kernel_image_path"], boot.get("initrd_path")):
            if name and not can_open(name, os.O_RDONLY):
                return 400, {"fault_message": f"Unable to open {name}"}
        for d in self.config["drives"].values():
            mode = os.O_RDONLY if d.get("is_read_only") else os.O_RDWR
            if not can_open(d["path_on_host"], mode):
                return 400, {"fault_message": f"Unable to open {d['path_on_host']}"}
        self.state = "Running"
        for page in range(4):
            self.write(page, f"boot:{page}")
        if "serial" in self.config:
            with open(self.config["serial"], "a") as f:
                f.write("fake firecracker: guest started\n")
        return 204, None

    def create(self, body: dict) -> tuple[int, object]:
        if self.state != "Paused":
            return 400, {"fault_message": "Cannot create snapshot: the microVM is not paused."}
        mem_path = Path(body["mem_file_path"])
        full = body.get("snapshot_type", "Full") == "Full"
        fd = os.open(mem_path, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            if os.fstat(fd).st_size != self.mem_size:
                os.ftruncate(fd, 0)
            os.ftruncate(fd, self.mem_size)
            pages = self.memory if full or not self.track else self.dirty
            for page in sorted(pages):
                os.pwrite(fd, self.memory[page], page * PAGE)
        finally:
            os.close(fd)
        self.dirty.clear()
        Path(body["snapshot_path"]).write_text(json.dumps({"fake-vmstate": self.config}))
        return 204, None

    def load(self, body: dict) -> tuple[int, object]:
        if self.state != "Not started" or self.configured - set(ALLOWED_BEFORE_LOAD):
            return 400, {"fault_message": "Loading a microVM snapshot not allowed after "
                                          "configuring boot-specific resources."}
        state = json.loads(Path(body["snapshot_path"]).read_text())["fake-vmstate"]
        self.config.update({k: v for k, v in state.items() if k != "serial"})
        for d in self.config["drives"].values():
            mode = os.O_RDONLY if d.get("is_read_only") else os.O_RDWR
            if not can_open(d["path_on_host"], mode):
                return 400, {"fault_message": f"Unable to open {d['path_on_host']}"}
        data = Path(body["mem_backend"]["backend_path"]).read_bytes()
        self.memory = {p: data[p * PAGE:(p + 1) * PAGE] for p in range(len(data) // PAGE)
                       if data[p * PAGE:(p + 1) * PAGE].strip(b"\0")}
        self.track = bool(body.get("track_dirty_pages"))
        self.dirty.clear()
        self.state = "Running" if body.get("resume_vm") else "Paused"
        return 204, None


def paths_in(body: object) -> list[str]:
    """Every host path a request body names."""
    found: list[str] = []
    if isinstance(body, dict):
        for k, v in body.items():
            if k in PATH_KEYS and isinstance(v, str):
                found.append(v)
            else:
                found += paths_in(v)
    elif isinstance(body, list):
        for v in body:
            found += paths_in(v)
    return found


def can_open(path: str, mode: int) -> bool:
    try:
        os.close(os.open(path, mode))
        return True
    except OSError:
        return False


machine = Machine()


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def _serve(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        body = json.loads(raw) if raw else None
        with lock:
            status, reply = machine.handle(self.command, self.path, body)
        record({"pid": os.getpid(), "method": self.command, "path": self.path, "body": body,
                "status": status})
        data = json.dumps(reply).encode() if reply is not None else b""
        self.send_response(status)
        if data:
            self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
        self.wfile.flush()
        if self.path == "/snapshot/load" and status != 204:
            os._exit(1)  # Firecracker ends the process after a failed load

    do_GET = do_PUT = do_PATCH = _serve

    def log_message(self, format: str, *args: object) -> None:
        pass


class Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True


def main() -> None:
    args = sys.argv[1:]
    if args == ["--version"]:
        print(f"Firecracker v{VERSION}\n\nSupported snapshot data format versions: v8.0.0")
        return
    sock = args[args.index("--api-sock") + 1]
    record({"event": "start", "argv": sys.argv, "cwd": os.getcwd(), "pid": os.getpid(),
            "pgid": os.getpgid(0), "sid": os.getsid(0)})
    if os.path.exists(sock):
        print(f"Failed to open the API socket at: {sock}. Address in use", file=sys.stderr)
        sys.exit(1)

    def on_term(signum: int, frame: object) -> None:
        record({"pid": os.getpid(), "event": "signal", "signal": "SIGTERM"})
        if os.environ.get("FAKE_FC_IGNORE_TERM") != "1":
            os._exit(0)

    signal.signal(signal.SIGTERM, on_term)
    print(f"fake firecracker {VERSION} listening on {sock}", flush=True)
    Server(sock, Handler).serve_forever()


if __name__ == "__main__":
    main()
