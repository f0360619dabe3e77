"""deploy/systemd/install.sh and deploy/host-packages.sh: the package list is setup.sh's,
a dry run changes nothing on the host, and a real install into a staging root (--root)
produces a working venv, the unit and the settings file."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests.deploy.files import ENV_TEMPLATE, HOST_PACKAGES, INSTALL, UNIT, setup_sh_packages

# Everything install.sh would change on a real host.
HOST_TARGETS = [Path("/opt/aenv"), Path("/etc/systemd/system/aenv.service"),
                Path("/etc/default/aenv"), Path("/usr/local/bin/aenv"),
                Path("/usr/local/bin/aenv-drain")]
# Commands that change the host; in a dry run none may be executed.
MUTATING = ["apt-get", "systemctl", "ln", "mkdir", "chmod", "mv", "tar", "install", "cp",
            "pip", "python3"]


def run_install(*args: str, env: dict[str, str] | None = None,
                timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(INSTALL), *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=timeout)


def snapshot(paths: list[Path]) -> dict[Path, tuple | None]:
    out = {}
    for p in paths:
        try:
            st = p.lstat()
            out[p] = (st.st_mode, st.st_mtime_ns, st.st_size)
        except FileNotFoundError:
            out[p] = None
    return out


@pytest.fixture
def spy_path(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """A PATH whose first entries record and swallow every mutating command, plus a
    dpkg-query that reports nothing installed (so the package step has work to plan)."""
    bin_dir, log = tmp_path / "spy-bin", tmp_path / "calls.log"
    bin_dir.mkdir()
    for name in MUTATING:
        p = bin_dir / name
        # `systemctl is-active` only reads; answer "inactive" without recording it.
        guard = '[ "$1" = is-active ] && exit 3\n' if name == "systemctl" else ""
        p.write_text(f'#!/bin/sh\n{guard}echo "{name} $*" >> {log}\n')
        p.chmod(0o755)
    q = bin_dir / "dpkg-query"
    q.write_text("#!/bin/sh\nexit 1\n")
    q.chmod(0o755)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHON": str(bin_dir / "python3")}
    return env, log


def test_host_packages_are_setup_sh_list_plus_python_and_venv():
    out = subprocess.run([str(HOST_PACKAGES)], capture_output=True, text=True, check=True)
    assert out.stdout.split() == [*setup_sh_packages(), "python3", "python3-venv"]


def test_host_packages_fails_loudly_without_the_list(tmp_path: Path):
    (tmp_path / "deploy").mkdir()
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "setup.sh").write_text("PACKAGES=(a b)\n")
    copy = tmp_path / "deploy" / "host-packages.sh"
    copy.write_text(HOST_PACKAGES.read_text())
    r = subprocess.run(["bash", str(copy)], capture_output=True, text=True)
    assert r.returncode != 0 and "no APT_PACKAGES" in r.stderr


def test_dry_run_executes_no_command_that_changes_the_host(spy_path):
    env, log = spy_path
    before = snapshot(HOST_TARGETS)
    r = run_install("--dry-run", env=env)
    assert r.returncode == 0, r.stderr
    assert not log.exists(), log.read_text()
    assert snapshot(HOST_TARGETS) == before


def test_dry_run_prints_every_step_it_would_take(spy_path):
    env, _ = spy_path
    out = run_install("--dry-run", env=env).stdout
    packages = " ".join([*setup_sh_packages(), "python3", "python3-venv"])
    assert f"--no-install-recommends {packages}" in out
    assert "+ apt-get update" in out
    if not Path("/opt/aenv/bin/python").exists():
        assert " -m venv /opt/aenv" in out
    assert "/opt/aenv/bin/pip install" in out
    assert "would write /etc/systemd/system/aenv.service" in out
    if not Path("/etc/default/aenv").exists():
        assert "would write /etc/default/aenv (mode 0600)" in out
    assert "+ ln -sfn /opt/aenv/bin/aenv /usr/local/bin/aenv" in out
    # Either systemd runs this machine, or the script says it does not and what to run.
    assert "+ systemctl enable aenv.service" in out or (
        "systemd is not PID 1" in out and "/opt/aenv/bin/aenv server" in out)
    assert not [line for line in out.splitlines()
                if line.startswith(("+ systemctl start", "+ systemctl restart"))]


def test_dry_run_keeps_an_existing_settings_file(tmp_path: Path):
    (tmp_path / "etc" / "default").mkdir(parents=True)
    (tmp_path / "etc" / "default" / "aenv").write_text("AENV_LISTEN_PORT=4000\n")
    out = run_install("--dry-run", "--root", str(tmp_path)).stdout
    assert f"keeping {tmp_path}/etc/default/aenv" in out
    assert "would write /etc/default/aenv" not in out


def test_unknown_argument_is_refused():
    r = run_install("--frobnicate")
    assert r.returncode == 2 and "unknown argument" in r.stderr


@pytest.mark.timeout(600)
@pytest.mark.slow
def test_staged_install_gives_a_working_venv_unit_and_settings(tmp_path: Path):
    """A real run below a staging root with a non-default prefix: the only test that
    creates the venv and pip-installs aenv (PyPI must be reachable, or pip's cache warm)."""
    root = tmp_path / "root"
    r = run_install("--root", str(root), "--prefix", "/srv/aenv",
                    env={"PYTHON": sys.executable}, timeout=540)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "systemctl not called" in r.stdout

    aenv = root / "srv/aenv/bin/aenv"
    help_text = subprocess.run([str(aenv), "--help"], capture_output=True, text=True,
                               check=True).stdout
    assert "server" in help_text
    # The first start builds the guest image from envd's requirement list; an installed
    # (non-editable) aenv must find it too.
    reqs = subprocess.run(
        [str(root / "srv/aenv/bin/python"), "-I", "-c",
         "from aenv.guest.base import envd_requirements; print(envd_requirements())"],
        capture_output=True, text=True, cwd=tmp_path)
    assert reqs.returncode == 0 and "connectrpc" in reqs.stdout, reqs.stderr
    assert os.access(root / "srv/aenv/bin/aenv-drain", os.X_OK)
    assert os.readlink(root / "usr/local/bin/aenv") == "/srv/aenv/bin/aenv"

    unit = (root / "etc/systemd/system/aenv.service").read_text()
    assert unit == UNIT.read_text().replace("/opt/aenv", "/srv/aenv")
    settings = root / "etc/default/aenv"
    assert settings.read_text() == ENV_TEMPLATE.read_text()
    assert stat.S_IMODE(settings.stat().st_mode) == 0o600
