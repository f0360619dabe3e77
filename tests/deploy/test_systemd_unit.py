"""deploy/systemd/aenv.service and its settings file: the keys that make VMMs outlive a
restart and the server survive load, checked by our parser and, where systemd is
installed, by ``systemd-analyze verify`` (which needs no systemd running as PID 1)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.deploy.files import ENV_TEMPLATE, UNIT, env_file_names, parse_unit, variables_aenv_reads


@pytest.fixture(scope="module")
def service() -> dict[str, list[str]]:
    return parse_unit(UNIT.read_text())["Service"]


def test_unit_runs_aenv_server_from_the_venv(service):
    assert service["ExecStart"] == ["/opt/aenv/bin/aenv server"]


def test_stop_and_restart_signal_only_the_server_so_vmms_survive(service):
    assert service["KillMode"] == ["process"]


def test_unit_restarts_the_server_when_it_fails(service):
    assert service["Restart"] == ["on-failure"]


def test_unit_raises_file_and_locked_memory_limits(service):
    assert int(service["LimitNOFILE"][0]) >= 65536
    assert service["LimitMEMLOCK"] == ["infinity"]


def test_unit_reads_settings_from_etc_default_aenv_after_its_own_defaults(service):
    assert service["EnvironmentFile"] == ["-/etc/default/aenv"]
    assert "AENV_HOME=%S/aenv" in service["Environment"]


def test_unit_keeps_state_in_var_lib_aenv(service):
    assert service["StateDirectory"] == ["aenv"]


def test_unit_creates_no_private_mount_namespace(service):
    """Network namespaces are bind mounts under /run/netns that the next server process
    must see; any of these options would hide them in a per-start mount namespace."""
    namespacing = {"ProtectSystem", "ProtectHome", "PrivateTmp", "PrivateDevices",
                   "PrivateMounts", "ReadOnlyPaths", "InaccessiblePaths", "TemporaryFileSystem",
                   "BindPaths", "RootDirectory", "MountFlags"}
    assert namespacing.isdisjoint(service)


def test_unit_is_enabled_for_the_multi_user_target():
    assert parse_unit(UNIT.read_text())["Install"]["WantedBy"] == ["multi-user.target"]


def test_unit_starts_after_the_boot_time_nftables_load():
    unit = parse_unit(UNIT.read_text())["Unit"]
    assert "nftables.service" in " ".join(unit["After"]).split()


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd not installed")
def test_systemd_analyze_verify_accepts_the_unit(tmp_path: Path):
    """verify also checks that ExecStart is executable: point it at this checkout's
    aenv (same arguments) since /opt/aenv exists only on an installed host."""
    aenv = Path(sys.executable).with_name("aenv")
    unit = tmp_path / "aenv.service"
    unit.write_text(UNIT.read_text().replace("/opt/aenv/bin/aenv", str(aenv)))
    r = subprocess.run(["systemd-analyze", "verify", "--man=no", str(unit)],
                       capture_output=True, text=True, cwd=tmp_path, timeout=60)
    complaints = [line for line in (r.stdout + r.stderr).splitlines() if "aenv.service" in line]
    assert r.returncode == 0 and not complaints, r.stdout + r.stderr


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd not installed")
def test_systemd_analyze_verify_reports_a_misspelt_key(tmp_path: Path):
    """The check above can fail: an unknown key is reported (with exit status 0)."""
    aenv = Path(sys.executable).with_name("aenv")
    unit = tmp_path / "aenv.service"
    unit.write_text(UNIT.read_text().replace("/opt/aenv/bin/aenv", str(aenv))
                    .replace("KillMode=process", "KilMode=process"))
    r = subprocess.run(["systemd-analyze", "verify", "--man=no", str(unit)],
                       capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert "KilMode" in r.stdout + r.stderr


def test_settings_file_names_only_variables_aenv_reads():
    names = env_file_names(ENV_TEMPLATE)
    assert {"AENV_LISTEN_HOST", "AENV_LISTEN_PORT", "AENV_API_KEY"} <= names
    assert names <= variables_aenv_reads(), names - variables_aenv_reads()


def test_settings_file_binds_loopback_by_default():
    assert "\nAENV_LISTEN_HOST=127.0.0.1\n" in ENV_TEMPLATE.read_text()
