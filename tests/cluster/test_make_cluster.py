"""`make cluster`'s scripts, without booting a third cluster here: they parse, the Makefile
runs them, what they start does not collide with the tests' or `make run`'s server, and
the stop path (scripts/cluster-stop.sh) ends every process whose pid file it finds and
removes the pid files, even when nothing answers."""

from __future__ import annotations

import ipaddress
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT

SCRIPTS = ROOT / "scripts"


def cluster_env(**overrides: str) -> dict[str, str]:
    """The variables scripts/cluster-env.sh sets, as bash computes them."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("AENV_CLUSTER_DIR", "CLUSTER_PORT", "CLUSTER_REDIS_PORT")}
    out = subprocess.run(
        ["bash", "-c", ". scripts/cluster-env.sh; for v in DIR CACHE SHARED GATEWAY_PORT "
         "N1_PORT N2_PORT REDIS_PORT REDIS_URL GATEWAY_URL NODES; do echo \"$v=${!v}\"; done"],
        cwd=ROOT, env={**env, **overrides}, capture_output=True, text=True, check=True).stdout
    return dict(line.split("=", 1) for line in out.splitlines())


@pytest.mark.parametrize("script", ["cluster.sh", "cluster-stop.sh", "cluster-env.sh"])
def test_the_scripts_parse(script: str) -> None:
    r = subprocess.run(["bash", "-n", str(SCRIPTS / script)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_make_runs_them() -> None:
    make = (ROOT / "Makefile").read_text()
    assert re.search(r"^cluster: setup\n\t@\./scripts/cluster\.sh$", make, re.MULTILINE)
    assert re.search(r"^cluster-stop:\n\t@\./scripts/cluster-stop\.sh$", make, re.MULTILINE)
    assert "make cluster" in (ROOT / "README.md").read_text()
    for script in ("cluster.sh", "cluster-stop.sh"):
        assert os.access(SCRIPTS / script, os.X_OK), script


def test_the_demo_script_loads_its_modules() -> None:
    r = subprocess.run([sys.executable, str(SCRIPTS / "cluster_demo.py"), "--help"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "spread" in r.stdout, r.stderr


def test_what_it_starts_does_not_collide_with_the_tests_or_make_run() -> None:
    env = cluster_env()
    assert env["DIR"] == "/var/lib/aenv-cluster" and env["CACHE"] == "/var/lib/aenv"
    ports = {int(env[k]) for k in ("GATEWAY_PORT", "N1_PORT", "N2_PORT", "REDIS_PORT")}
    assert len(ports) == 4 and 3000 not in ports
    assert env["REDIS_URL"] == f"redis://127.0.0.1:{env['REDIS_PORT']}/0"
    text = (SCRIPTS / "cluster.sh").read_text()
    nets = [int(n) for n in re.findall(r"^start_node n\d \"\$N\d_PORT\" (\d+)$", text,
                                       re.MULTILINE)]
    assert sorted(set(nets)) == [91, 93]
    mine = [ipaddress.ip_network(f"10.{n + d}.0.0/24") for n in (91, 93) for d in (0, 1)]
    # the default ranges (make run), tests/server's and tests/cluster's servers
    theirs = [ipaddress.ip_network(c) for c in ("10.11.0.0/16", "10.12.0.0/16")] + [
        ipaddress.ip_network(f"10.{n}.0.0/24") for n in (15, 16, 71, 72, 73, 74)]
    assert not any(a.overlaps(b) for a in mine for b in theirs)
    assert len(set(mine)) == 4
    assert 'AENV_NAME_PREFIX="aenv$id"' in text
    # a umask set for the secret only: the nodes' VM directories must stay searchable by
    # their VMMs' uids (a 0700 one made every snapshot fail)
    assert re.search(r"\( umask 077; [^)]*cluster-secret\" \)", text)
    assert not re.search(r"^\s*umask|\{ umask", text, re.MULTILINE)
    assert env["NODES"].split() == ["n1", "n2"]


def test_a_port_can_be_moved(tmp_path: Path) -> None:
    env = cluster_env(AENV_CLUSTER_DIR=str(tmp_path), CLUSTER_PORT="4200",
                      CLUSTER_REDIS_PORT="6500")
    assert (env["DIR"], env["GATEWAY_URL"], env["N2_PORT"], env["REDIS_PORT"]) == (
        str(tmp_path), "http://127.0.0.1:4200", "4202", "6500")
    assert env["SHARED"] == f"{tmp_path}/shared"


@pytest.mark.slow  # several seconds of waiting: left out of make test-fast
def test_cluster_stop_ends_every_process_it_started_and_forgets_their_pids(
        tmp_path: Path) -> None:
    """What cluster.sh leaves (pid files of setsid'ed processes, here sleeps; node homes
    without keys: no API answers) is stopped, in order, and the pid files are gone."""
    if os.geteuid() != 0:
        pytest.skip("the stop path's leftover sweep needs root")
    pids: dict[str, int] = {}
    for name in ("gateway", "n1", "n2", "redis"):
        # as cluster.sh starts them: setsid'ed, not this process's children (init reaps)
        pids[name] = int(subprocess.run(
            ["bash", "-c", "setsid nohup sleep 300 >/dev/null 2>&1 < /dev/null & echo $!"],
            capture_output=True, text=True, check=True).stdout)
        (tmp_path / f"{name}.pid").write_text(f"{pids[name]}\n")
    (tmp_path / "n1").mkdir()
    (tmp_path / "stale.pid").write_text("999999\n")  # not one of its names: left alone
    t0 = time.monotonic()
    try:
        r = subprocess.run([str(SCRIPTS / "cluster-stop.sh")], cwd=ROOT, capture_output=True,
                           text=True, timeout=120,
                           env={**os.environ, "AENV_CLUSTER_DIR": str(tmp_path)})
    finally:
        left = [p for p in pids.values() if _alive(p)]
        for p in left:
            os.kill(p, 9)
    assert r.returncode == 0, r.stdout + r.stderr
    assert time.monotonic() - t0 < 60, r.stdout
    assert left == []
    assert "SIGKILL" not in r.stdout
    order = [line.split()[2] for line in r.stdout.splitlines() if "stopping" in line]
    assert order == ["gateway", "n1", "n2", "redis"]
    assert sorted(p.name for p in tmp_path.glob("*.pid")) == ["stale.pid"]
    # a second stop finds nothing to do
    again = subprocess.run([str(SCRIPTS / "cluster-stop.sh")], cwd=ROOT, capture_output=True,
                           text=True, timeout=60, env={**os.environ,
                                                       "AENV_CLUSTER_DIR": str(tmp_path)})
    assert again.returncode == 0 and "stopping" not in again.stdout


def _alive(pid: int) -> bool:
    for _ in range(50):  # a process just killed is reaped by init within moments
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        time.sleep(0.1)
    return True
