"""The cloud kernel + base image boot to a working envd, and the guest init does its job."""

from __future__ import annotations

import time

import httpx
import pytest

from aenv.guest.markers import PHASES
from tests.guest import connect

pytestmark = [pytest.mark.vm, pytest.mark.timeout(600)]


def sh(guest, script: str, user: str = "root") -> str:
    result = connect.run(guest.url, "/bin/sh", "-c", script, user=user)
    assert result.exit_code == 0, result.stderr.decode()
    return result.stdout.decode()


def test_envd_answers_health_after_boot(guest):
    assert httpx.get(guest.url + "/health", timeout=5).status_code in (200, 204)
    print(f"boot to envd /health: {guest.ready_after:.2f} s wall; phases {guest.phases()}")


def test_boot_phase_markers_appear_in_order(guest):
    times = guest.phases()
    assert list(times) == list(PHASES)
    assert list(times.values()) == sorted(times.values())


def test_network_hostname_and_dns_come_from_the_kernel_command_line(guest):
    out = sh(guest, "ip -4 -o addr show dev eth0; ip route show default; hostname; "
                    "cat /etc/resolv.conf")
    assert "169.254.0.21/30" in out
    assert "default via 169.254.0.22 dev eth0" in out
    assert "\nsandbox\n" in out
    assert "nameserver 8.8.8.8" in out


def test_api_filesystems_are_mounted(guest):
    mounts = {line.split()[1]: line.split()[2]
              for line in sh(guest, "cat /proc/mounts").splitlines()}
    assert mounts["/"] == "ext4"
    for point, fstype in [("/proc", "proc"), ("/sys", "sysfs"), ("/dev", "devtmpfs"),
                          ("/dev/pts", "devpts"), ("/dev/shm", "tmpfs"), ("/run", "tmpfs"),
                          ("/sys/fs/cgroup", "cgroup2")]:
        assert mounts.get(point) == fstype, point
    assert sh(guest, "readlink /dev/fd").strip() == "/proc/self/fd"


def test_user_has_uid_1000_a_home_and_passwordless_sudo(guest):
    out = sh(guest, "id -u; echo $HOME; sudo -n id -u", user="user")
    assert out.split() == ["1000", "/home/user", "0"]


def test_login_shells_get_the_right_path_without_running_id(guest):
    """Every E2B command is a login shell: /etc/profile asks bash for the uid, not id."""
    assert '"$(id -u)"' not in sh(guest, "cat /etc/profile")
    path_for = {u: sh(guest, "exec bash -l -c 'echo $PATH'", user=u).strip().split(":")
                for u in ("root", "user")}
    assert "/usr/sbin" in path_for["root"] and "/usr/sbin" not in path_for["user"]
    assert sh(guest, "exec sh -l -c 'echo $PATH'", user="root").find("/usr/sbin") >= 0


def test_base_tools_are_installed(guest):
    tools = ["bash", "python3", "sudo", "ip", "tput", "ps", "tini", "modprobe"]
    out = sh(guest, f"for t in {' '.join(tools)}; do command -v $t || echo missing $t; done; "
                    "python3 -V")
    assert "missing" not in out
    assert "Python 3.11" in out


def test_envd_python_code_is_byte_compiled(guest):
    script = (
        "import importlib.util, pathlib, sys\n"
        "missing = [str(p) for p in pathlib.Path('/opt/aenv/python').rglob('*.py')\n"
        "           if not pathlib.Path(importlib.util.cache_from_source(str(p))).exists()]\n"
        "print(len(missing), missing[:5])\n"
    )
    out = sh(guest, f"python3 -c \"{script}\"")
    assert out.startswith("0 "), out


def test_orphans_are_reaped(guest):
    sh(guest, "(sleep 0.3 &) ; exit 0")
    time.sleep(1.5)
    zombies = sh(guest, "ps -eo stat=,pid=,args= | awk '$1 ~ /^Z/'")
    assert zombies.strip() == ""


def test_killed_envd_is_back_within_two_seconds(guest):
    t0 = time.monotonic()
    try:
        connect.run(guest.url, "/bin/sh", "-c", "kill -9 $PPID", timeout=5)
    except httpx.HTTPError:
        pass  # the server died mid-stream: expected
    down_seen = False
    while time.monotonic() - t0 < 10:
        try:
            up = httpx.get(guest.url + "/health", timeout=0.5).status_code < 300
        except httpx.HTTPError:
            up = False
        down_seen = down_seen or not up
        if up and down_seen:
            break
        time.sleep(0.02)
    back = time.monotonic() - t0
    assert down_seen
    assert back < 2.0, f"envd took {back:.2f} s to come back"
    assert "envd-exit" in guest.console() and "rc=-9" in guest.console()
