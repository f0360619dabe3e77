"""End to end under the qemu driver: the ``base`` image on the cloud kernel in real network
slots, driven with the real E2B SDK through each slot's host address.

Two VMs are booted for the whole module (``guest_a``, ``guest_b``) and shared by every test;
the envd-restart test runs last because it resets envd's /init state.
"""

from __future__ import annotations

import asyncio
import os
import time

import httpx
import pytest

from aenv.guest import markers
from aenv.network import GUEST_IP
from aenv.runtime import AttachError, console
from aenv.runtime.kvm import host_accel
from aenv.runtime.qemu import QemuRuntime
from tests.runtime.conftest import Guest

pytestmark = [pytest.mark.vm, pytest.mark.net, pytest.mark.timeout(300)]


async def test_boot_returns_a_running_vm_with_its_accelerator(guest_a: Guest) -> None:
    vm = guest_a.vm
    assert vm.is_alive() and vm.pid > 0
    assert await vm.status() == "running"
    # The handle names the host's decision, and the VMM runs on it: a KVM VMM holds a
    # kvm-vm descriptor, a TCG one none.
    choice = host_accel()
    assert (vm.accel, vm.accel_reason) == (choice.accel, choice.reason)
    fds = {os.readlink(f"/proc/{vm.pid}/fd/{fd}") for fd in os.listdir(f"/proc/{vm.pid}/fd")}
    assert ("anon_inode:kvm-vm" in fds) == (vm.accel == "kvm"), sorted(fds)
    # The boot went through its phases in order: QMP, then the kernel reached init, which
    # exec'd envd, which then answered /health.
    p = guest_a.phases
    assert p is not None
    assert p.vmm_to_qmp > 0 and p.kernel_to_init > 0
    assert p.init_to_envd_exec >= 0 and p.envd_exec_to_health >= 0
    seen = {m.key for m in markers.parse((vm.workdir / "console.log").read_text())}
    assert {"aenv-init:start", "aenv-init:envd-exec"} <= seen


def test_commands_run_as_the_default_user_and_as_root(guest_a: Guest) -> None:
    sbx = guest_a.sandbox()
    assert sbx.commands.run("whoami").stdout.strip() == "user"
    assert sbx.commands.run("whoami", user="root").stdout.strip() == "root"


def test_a_file_written_through_the_sdk_reads_back(guest_a: Guest) -> None:
    sbx = guest_a.sandbox()
    sbx.files.write("/home/user/hello.txt", "hello from the host\n")
    assert sbx.files.read("/home/user/hello.txt") == "hello from the host\n"
    assert sbx.commands.run("cat /home/user/hello.txt").stdout == "hello from the host\n"


def test_both_guests_have_the_fixed_guest_address(guest_a: Guest, guest_b: Guest) -> None:
    for g in (guest_a, guest_b):
        out = g.sandbox().commands.run("ip -4 addr show dev eth0").stdout
        assert "169.254.0.21/30" in out, out


def test_guest_disks_are_independent(guest_a: Guest, guest_b: Guest) -> None:
    a, b = guest_a.sandbox(), guest_b.sandbox()
    a.commands.run("echo a > /var/tmp/only-in-a", user="root")
    b.commands.run("echo b > /var/tmp/only-in-b", user="root")
    assert a.commands.run("cat /var/tmp/only-in-a").stdout == "a\n"
    assert not b.files.exists("/var/tmp/only-in-a")
    assert not a.files.exists("/var/tmp/only-in-b")
    assert guest_a.disk.path != guest_b.disk.path


def test_envd_outranks_the_workload_for_cpu_and_memory(guest_a: Guest) -> None:
    """envd (the command's parent) sits in the envd cgroup with 10x the workload's CPU
    weight and out of the OOM killer's reach; commands run in the user cgroup."""
    out = guest_a.sandbox().commands.run(
        "cat /proc/self/cgroup /proc/self/oom_score_adj /proc/$PPID/cgroup "
        "/proc/$PPID/oom_score_adj /sys/fs/cgroup/envd/cpu.weight "
        "/sys/fs/cgroup/user/cpu.weight", user="root").stdout.split()
    assert out == ["0::/user", "100", "0::/envd", "-1000", "1000", "100"]


def test_a_flooded_console_log_is_cut_and_qemu_writes_on_at_its_end(guest_a: Guest) -> None:
    """Root in the guest can flood the serial port; the host keeps the log bounded, and
    QEMU (append=on) writes its next lines right after the kept tail."""
    sbx = guest_a.sandbox()
    log = guest_a.vm.console_log
    sbx.commands.run("head -c 300000 /dev/zero | tr '\\0' x > /dev/console", user="root",
                     timeout=120)
    assert log.stat().st_size > 300000
    assert console.bound(log, max_bytes=128 * 1024, keep_bytes=32 * 1024) > 0
    sbx.commands.run("echo console-after-cut > /dev/console", user="root")
    data = log.read_bytes()
    assert len(data) < 64 * 1024
    assert b"\0" not in data and data.rstrip().endswith(b"console-after-cut")


def test_the_guest_clock_keeps_the_hosts_pace(guest_a: Guest) -> None:
    """Under TCG the guest counts the host's TSC at the rate it was told at boot; a wrong
    rate (a frequency fixed for another CPU) made guests gain seconds per minute."""
    sbx = guest_a.sandbox()

    def offset() -> float:
        # The guest read its clock before the host's second reading: the largest of a few
        # (guest - host after) is the closest to the true offset.
        best = -1e9
        for _ in range(3):
            guest = float(sbx.commands.run("date +%s.%N").stdout)
            best = max(best, guest - time.time())
        return best

    first = offset()
    time.sleep(6)
    drift = offset() - first
    assert abs(drift) < 0.15, f"guest clock drifted {drift:+.3f}s in ~8s"


def health(url: str, timeout: float = 0.5) -> int | None:
    try:
        return httpx.get(url + "/health", timeout=timeout).status_code
    except httpx.HTTPError:
        return None


async def test_a_paused_vm_stops_answering_until_resumed(guest_b: Guest) -> None:
    vm = guest_b.vm
    await vm.pause()
    try:
        assert await vm.status() == "paused"
        assert await asyncio.to_thread(health, guest_b.url) is None
    finally:
        await vm.resume()
    assert await vm.status() == "running"
    assert await asyncio.to_thread(health, guest_b.url, 5.0) == 204


async def test_attach_takes_over_the_running_vmm_from_its_workdir(guest_b: Guest) -> None:
    old = guest_b.vm
    await old.detach()  # what a server exit does to its QMP connection
    vm = await QemuRuntime().attach(old.workdir)
    guest_b.old_handles.append(old)
    guest_b.vm = vm
    assert vm.pid == old.pid and vm.vm_id == "rt-b" and vm.accel == old.accel
    assert await vm.status() == "running"
    assert await asyncio.to_thread(health, guest_b.url, 5.0) == 204


async def test_attach_refuses_a_workdir_without_a_live_vmm(tmp_path) -> None:
    (tmp_path / "vm.json").write_text('{"vm_id": "ghost", "accel": "tcg", "accel_reason": ""}')
    (tmp_path / "vmm.pid").write_text("999999999\n")
    with pytest.raises(AttachError, match="gone"):
        await QemuRuntime().attach(tmp_path)


CONNECT = (
    "python3 -c \"import socket,sys; socket.create_connection((sys.argv[1], 49983), 3)\" {ip}"
)


def test_a_guest_cannot_reach_another_sandbox(guest_a: Guest, guest_b: Guest) -> None:
    from e2b import CommandExitException

    for src, dst in ((guest_a, guest_b), (guest_b, guest_a)):
        # the host reaches dst at its host address ...
        assert httpx.get(dst.url + "/health").status_code == 204
        # ... the probe connects where an envd listens and nothing stops it (src's own) ...
        src.sandbox().commands.run(CONNECT.format(ip=GUEST_IP), timeout=20)
        # ... but src's slot rejects dst's address: the reject (ICMP admin-prohibited)
        # reaches the probe as EHOSTUNREACH, not a refusal, a timeout or a missing tool
        with pytest.raises(CommandExitException) as refused:
            src.sandbox().commands.run(CONNECT.format(ip=dst.slot.host_ip), timeout=20)
        assert "[Errno 113] No route to host" in refused.value.stderr, refused.value.stderr




def envd_exits(guest: Guest) -> int:
    console = (guest.vm.workdir / "console.log").read_text(errors="replace")
    return sum(1 for m in markers.parse(console) if m.phase == "envd-exit")


def test_envd_killed_inside_the_guest_is_back_within_2s(guest_a: Guest) -> None:
    sbx = guest_a.sandbox()
    exits = envd_exits(guest_a)
    # $PPID of the command's shell is the envd server itself
    sbx.commands.run("sleep 0.3; kill -9 $PPID", user="root", background=True)
    deadline = time.monotonic() + 10
    while health(guest_a.url) == 204:
        assert time.monotonic() < deadline, "envd never went down"
        time.sleep(0.02)
    down = time.monotonic()
    while health(guest_a.url) != 204:
        assert time.monotonic() - down < 10, "envd did not come back"
        time.sleep(0.02)
    back = time.monotonic() - down
    assert envd_exits(guest_a) == exits + 1  # it was envd that died, once
    assert back < 2.0, f"envd took {back:.2f}s to come back"
