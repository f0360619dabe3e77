"""A real ``aenv server`` subprocess with microVM sandboxes, for end-to-end tests.

The server gets its own home (database, VM dirs, secrets) and its own object prefix and
address ranges, but shares the host's kernel and image cache (``AENV_CACHE_HOME``) so the
base image is built once per machine. At the end of the session every sandbox is killed
through the API, the server is stopped, and the suite fails if any namespace, nft table
or VMM process of its prefix is left.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from aenv.config import Settings
from aenv.instance_lock import InstanceTaken, claim_instance
from tests.conftest import ROOT, free_port

# Overridable so that two pytest runs on one host (helper sessions, a developer's loop
# beside a CI run) each get a session server of their own.
PREFIX = os.environ.get("AENV_TEST_SERVER_PREFIX", "aenvsv")
NET = int(os.environ.get("AENV_TEST_SERVER_NET", "15"))
pytestmark = [pytest.mark.vm, pytest.mark.net]


class ServerProcess:
    """``aenv server`` in a subprocess. Servers that may run at the same time need distinct
    ``prefix`` and ``net`` (the second octet of their host and veth /24s)."""

    def __init__(self, home: Path, prefix: str = PREFIX, net: int = NET) -> None:
        self.home = home
        self.settings = Settings(
            home=home, cache_home=Settings.from_env().artifacts, name_prefix=prefix,
            host_cidr=f"10.{net}.0.0/24", veth_cidr=f"10.{net + 1}.0.0/24", warm_slots=1)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = home / "server.log"
        self.proc: subprocess.Popen | None = None
        s = self.settings
        self.env = {
            **os.environ, "AENV_HOME": str(home), "AENV_CACHE_HOME": str(s.artifacts),
            "AENV_NAME_PREFIX": s.name_prefix, "AENV_HOST_CIDR": s.host_cidr,
            "AENV_VETH_CIDR": s.veth_cidr, "AENV_WARM_SLOTS": str(s.warm_slots),
        }

    def start(self, timeout: float = 600) -> None:
        self.home.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:  # the child keeps its own copy of the fd
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "aenv.cli.main", "server", "--port", str(self.port)],
                cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.log_tail()}")
            if self.answers():
                return
            time.sleep(0.2)
        raise TimeoutError(f"server did not start: {self.log_tail()}")

    def answers(self) -> bool:
        """Whether the server is up (``/health`` is 204); asked every 0.2 s by ``start``."""
        try:
            return httpx.get(self.url + "/health", timeout=1).status_code == 204
        except httpx.HTTPError:
            return False

    @property
    def api_key(self) -> str:
        return (self.home / "secrets/api-key").read_text().strip()

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def kill9(self) -> None:
        """Crash the server (its VMMs run in their own process groups and survive)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def api(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"X-API-KEY": self.api_key}, timeout=120)

    def kill_all_sandboxes(self) -> None:
        with self.api() as c:
            for s in c.get("/v2/sandboxes").json():
                c.delete(f"/sandboxes/{s['sandboxID']}")


def leftovers(settings: Settings) -> dict[str, list[str]]:
    prefix = settings.name_prefix
    netns = sorted(n for n in os.listdir("/run/netns") if n.startswith(prefix + "-")) \
        if os.path.isdir("/run/netns") else []
    tables = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True,
                            check=False).stdout
    vms = str(settings.vms_dir)
    procs = []
    for e in os.scandir("/proc"):
        if e.name.isdigit():
            try:
                if os.readlink(f"/proc/{e.name}/cwd").startswith(vms):
                    procs.append(e.name)
            except OSError:
                pass
    return {"netns": netns, "nft": [t for t in tables.splitlines()
                                    if t.split()[-1:] == [prefix]],
            "vmm processes": procs}


@contextlib.contextmanager
def serving(srv: ServerProcess, *, cleanup: Callable[[Settings], None] | None = None
            ) -> Iterator[ServerProcess]:
    """Start ``srv``; at the end kill its sandboxes through the API, stop it, and fail if
    any namespace, nft table or VMM process of its prefix is left (after removing them:
    ``cleanup``, by default aenv's own leftover sweep). The sweep holds the prefix's
    instance lock: when another live server holds it (``srv`` could not start for that
    reason), its objects are that server's and are left alone."""
    if os.geteuid() != 0:
        pytest.skip("needs root")
    try:
        srv.start()
        yield srv
    finally:
        if srv.proc is not None and srv.proc.poll() is None:
            try:
                srv.kill_all_sandboxes()
            except Exception:
                pass
        srv.stop()
        try:  # what carries the prefix is ours only while no other live server holds it
            lock = claim_instance(srv.settings)
        except InstanceTaken as e:
            pytest.fail(f"not sweeping prefix {srv.settings.name_prefix}: {e}\n"
                        f"{srv.log_tail()}")
        try:
            left = leftovers(srv.settings)
            if any(left.values()):
                if cleanup is None:
                    from aenv.network import cleanup_leftovers

                    cleanup_leftovers(srv.settings)
                else:
                    cleanup(srv.settings)
                pytest.fail(f"the server left {left}\n{srv.log_tail()}")
        finally:
            lock.release()


@contextlib.contextmanager
def crash_tested(srv: ServerProcess,
                 more_leftovers: Callable[[ServerProcess], dict[str, list[str]]] | None = None
                 ) -> Iterator[ServerProcess]:
    """Start ``srv`` for a test that kills it with -9 and starts it again; at the end start
    it once more if the test failed between the two (so that it cleans up for real), kill
    its sandboxes, stop it and fail on any leftover (``more_leftovers`` adds kinds)."""
    srv.start()
    try:
        yield srv
    finally:
        if srv.proc is None or srv.proc.poll() is not None:
            srv.start()
        srv.kill_all_sandboxes()
        srv.stop()
        left = {**leftovers(srv.settings), **(more_leftovers(srv) if more_leftovers else {})}
        assert not any(left.values()), left


@contextlib.contextmanager
def sdk_pointed_at(srv: ServerProcess) -> Iterator[ServerProcess]:
    """The E2B SDK configured only through its environment variables, for a block."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("E2B_API_KEY", srv.api_key)
        mp.setenv("E2B_API_URL", srv.url)
        mp.setenv("E2B_SANDBOX_URL", srv.url)
        mp.delenv("E2B_DOMAIN", raising=False)
        yield srv


@pytest.fixture(scope="session")
def live_server(tmp_path_factory) -> Iterator[ServerProcess]:
    """The session's server: tests share it (and its base snapshot) unless they need a
    server of their own (other options, a kill -9, a second one on the same home)."""
    with serving(ServerProcess(tmp_path_factory.mktemp("aenv-server"))) as srv:
        yield srv


@pytest.fixture(scope="module")
def module_sdk(live_server: ServerProcess) -> Iterator[ServerProcess]:
    """``sdk`` for module-scoped fixtures (a template built once per module)."""
    with sdk_pointed_at(live_server) as srv:
        yield srv


@pytest.fixture
def sdk(live_server: ServerProcess) -> Iterator[ServerProcess]:
    """The E2B SDK configured only through its environment variables."""
    with sdk_pointed_at(live_server) as srv:
        yield srv
