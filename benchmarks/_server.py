"""An ``aenv server`` with microVM sandboxes in a child process, for the benchmarks.

It gets its own home, name prefix and address ranges (so it can run beside any other
server), shares the host's kernel and image cache, and ``leftovers`` tells whether it left
any host object behind.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx

from aenv.config import Settings
from benchmarks._common import free_port, spawn_child, stop

PROFILED_SERVER = """
import cProfile, runpy, signal, sys
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
out = sys.argv.pop(1)
sys.argv[0] = "aenv"
cProfile.run("runpy.run_module('aenv.cli.main', run_name='__main__')", out)
"""


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class VMServer:
    """``aenv server`` with microVM sandboxes, isolated from any other server on the host."""

    def __init__(self, home: Path, net: int, cache_home: Path,
                 cprofile: Path | None = None, server_args: tuple[str, ...] = (),
                 letters: str = "cp", tree: Path | None = None,
                 env: dict[str, str] | None = None) -> None:
        """``letters``: the name prefix's first letters (two servers of one benchmark need
        different ones); ``tree``: run the aenv of another source tree (e.g. an older
        commit's ``git archive``, to compare side by side) instead of this one; ``env``:
        more environment for the server (settings to compare side by side)."""
        self.settings = Settings(
            home=home, cache_home=cache_home,
            name_prefix=f"{letters}{os.getpid() % 10000:04d}",
            host_cidr=f"10.{net}.0.0/24", veth_cidr=f"10.{net}.1.0/24")
        self.tree = tree
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = home / "server.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.cprofile = cprofile
        self.server_args = server_args
        self.env = env or {}

    def start(self) -> None:
        s = self.settings
        env = {**os.environ, "AENV_HOME": str(s.home), "AENV_CACHE_HOME": str(s.artifacts),
               "AENV_NAME_PREFIX": s.name_prefix, "AENV_HOST_CIDR": s.host_cidr,
               "AENV_VETH_CIDR": s.veth_cidr, "AENV_WARM_SLOTS": str(s.warm_slots),
               **self.env}
        argv = [sys.executable, "-m", "aenv.cli.main", "server", "--port", str(self.port),
                *self.server_args]
        if self.tree is not None:
            argv[1:3] = ["-c", f"import runpy, sys; sys.path.insert(0, {str(self.tree)!r}); "
                               "runpy.run_module('aenv.cli.main', run_name='__main__')"]
        if self.cprofile:
            # uvicorn re-raises SIGTERM after its graceful shutdown; make that an exit that
            # cProfile survives, so it writes its stats.
            argv[1:3] = ["-c", PROFILED_SERVER, str(self.cprofile)]
        self.proc = spawn_child(argv, self.url + "/health", log_path=self.log_path, env=env,
                                timeout=600)

    def api(self) -> httpx.Client:
        key = (self.settings.secrets_dir / "api-key").read_text().strip()
        return httpx.Client(base_url=self.url, headers={"X-API-KEY": key}, timeout=180)

    def kill_all(self) -> int:
        with self.api() as c:
            ids = [s["sandboxID"] for s in c.get("/v2/sandboxes", params={"limit": 1000}).json()]
            for sid in ids:
                c.delete(f"/sandboxes/{sid}")
        return len(ids)

    def stop(self) -> None:
        if self.proc is not None:
            stop(self.proc, grace=30)

    def shut_down(self) -> dict[str, list[str]]:
        """The end of every benchmark's server: its sandboxes killed through the API (if it
        still runs), the server stopped, whatever of its prefix is left swept (and said),
        its home deleted. Returns what was left before the sweep."""
        try:
            if self.proc is not None and self.proc.poll() is None:
                self.kill_all()
        finally:
            self.stop()
            left = leftovers(self.settings)
            if any(left.values()):
                from aenv.network import cleanup_leftovers

                log(f"leftovers found, removing: {left}")
                cleanup_leftovers(self.settings)
            shutil.rmtree(self.settings.home, ignore_errors=True)
        return left


def leftovers(settings: Settings) -> dict[str, list[str]]:
    """Host objects of ``settings.name_prefix`` still present (all lists empty when clean)."""
    prefix = settings.name_prefix
    netns = sorted(n for n in os.listdir("/run/netns") if n.startswith(prefix + "-")) \
        if os.path.isdir("/run/netns") else []
    tables = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True,
                            check=False).stdout.splitlines()
    vms = str(settings.vms_dir)
    procs = []
    for e in os.scandir("/proc"):
        if e.name.isdigit():
            try:
                if os.readlink(f"/proc/{e.name}/cwd").startswith(vms):
                    procs.append(e.name)
            except OSError:
                pass
    shm = sorted(p.name for p in Path("/dev/shm").glob(f"{prefix}-*"))
    names = [t.split()[-1] for t in tables if t.strip()]
    return {"netns": netns,
            "nft_tables": [n for n in names if n == prefix or n.startswith(prefix + "-")],
            "vmm_processes": procs, "shm_files": shm}
