"""The QEMU command line: fixed relative names, devices from the spec, netns entry."""

from __future__ import annotations

from pathlib import Path

from aenv.network.guest_link import GUEST_MAC
from aenv.runtime import qemu_args
from aenv.runtime.base import Drive, VMSpec
from aenv.runtime.qemu_args import build_argv, kernel_cmdline


def spec(vm_id: str = "sbx1", root: Path = Path("/data/vms/sbx1"), **kw) -> VMSpec:
    base = {
        "vm_id": vm_id,
        "workdir": root,
        "kernel": Path("/data/kernels/cloud/vmlinux"),
        "initrd": Path("/data/kernels/cloud/initrd"),
        "boot_args": "console=ttyS0 root=/dev/vda",
        "drives": (Drive("rootfs", root / "rootfs.qcow2", format="qcow2"),
                   Drive("data", Path("/data/images/x.raw"), read_only=True)),
        "tap": "tap0",
        "netns": f"aenv-ns-{vm_id}",
        "memory_file": Path(f"/dev/shm/aenv-vm-{vm_id}.mem"),
    }
    base.update(kw)
    return VMSpec(**base)


def opt(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == flag]


def test_no_host_path_of_the_spec_appears_on_the_qemu_line() -> None:
    argv = build_argv(spec(), "tcg")
    qemu = argv[argv.index("--") + 1:]
    assert not [a for a in qemu[1:] if "/data/" in a or "/dev/shm" in a or "sbx1" in a]


def test_two_sandboxes_get_the_same_qemu_line() -> None:
    a = build_argv(spec("one", Path("/data/vms/one")), "tcg")
    b = build_argv(spec("two", Path("/elsewhere/two")), "tcg")
    assert a[a.index("--"):] == b[b.index("--"):]


def test_netns_is_entered_with_nsenter_before_qemu() -> None:
    argv = build_argv(spec(netns="aenv-ns-7"), "tcg")
    assert argv[:3] == ["nsenter", "--net=/run/netns/aenv-ns-7", "--"]
    assert build_argv(spec(netns=None), "tcg")[0] == "qemu-system-x86_64"


def test_rootfs_is_the_first_block_device_and_read_only_drives_stay_read_only() -> None:
    argv = build_argv(spec(), "tcg")
    drives = opt(argv, "-drive")
    assert drives[0].startswith("id=rootfs,file=rootfs.qcow2,format=qcow2")
    assert "readonly=on" in drives[1] and "file=data.raw" in drives[1]
    assert "discard=unmap" in drives[0] and "readonly" not in drives[0]
    assert opt(argv, "-device")[0] == "virtio-blk-device,drive=rootfs"


def test_network_device_uses_the_slot_tap_and_the_fixed_guest_mac() -> None:
    argv = build_argv(spec(), "tcg")
    assert opt(argv, "-netdev") == ["tap,id=net0,ifname=tap0,script=no,downscript=no"]
    assert f"virtio-net-device,netdev=net0,mac={GUEST_MAC}" in opt(argv, "-device")
    assert "-netdev" not in build_argv(spec(tap=None), "tcg")


def test_guest_ram_is_a_shared_file_named_memory() -> None:
    argv = build_argv(spec(memory_mib=512), "tcg")
    assert opt(argv, "-object") == [
        "memory-backend-file,id=mem,size=512M,mem-path=memory,share=on"]
    assert "memory-backend=mem" in opt(argv, "-M")[0]
    plain = build_argv(spec(memory_file=None), "tcg")
    assert "-object" not in plain and "memory-backend" not in opt(plain, "-M")[0]


def test_tcg_adds_its_arguments_once_and_kvm_does_not(monkeypatch) -> None:
    monkeypatch.setattr(qemu_args, "host_tsc_khz", lambda: 2793436)
    assert kernel_cmdline(spec(), "tcg") == (
        "console=ttyS0 root=/dev/vda tsc_early_khz=2793436 tsc=reliable mitigations=off "
        "nowatchdog sysctl.vm.stat_interval=10 sysctl.vm.compaction_proactiveness=0")
    given = spec(boot_args="console=ttyS0 tsc_early_khz=1000000 tsc=reliable mitigations=auto")
    # What the caller set wins; what it left out is added.
    assert kernel_cmdline(given, "tcg") == \
        given.boot_args + " nowatchdog sysctl.vm.stat_interval=10 " \
        "sysctl.vm.compaction_proactiveness=0"
    assert kernel_cmdline(spec(), "kvm") == "console=ttyS0 root=/dev/vda"


def test_an_unknown_tsc_frequency_leaves_calibration_to_the_guest(monkeypatch) -> None:
    monkeypatch.setattr(qemu_args, "host_tsc_khz", lambda: None)
    assert kernel_cmdline(spec(), "tcg") == (
        "console=ttyS0 root=/dev/vda tsc=reliable mitigations=off nowatchdog "
        "sysctl.vm.stat_interval=10 sysctl.vm.compaction_proactiveness=0")


def test_accelerator_selects_cpu_model() -> None:
    tcg, kvm = build_argv(spec(), "tcg"), build_argv(spec(), "kvm")
    assert opt(tcg, "-accel") == ["tcg"] and opt(tcg, "-cpu") == ["max"]
    assert opt(kvm, "-accel") == ["kvm"] and opt(kvm, "-cpu") == ["host"]


def test_console_qmp_and_pidfile_are_relative() -> None:
    argv = build_argv(spec(), "tcg")
    assert opt(argv, "-serial") == ["chardev:console"]
    assert opt(argv, "-chardev") == ["file,id=console,path=console.log,append=on"]
    assert opt(argv, "-qmp") == ["unix:qmp.sock,server=on,wait=off"]
    assert opt(argv, "-pidfile") == ["vmm.pid"]
    assert opt(argv, "-kernel") == ["kernel"] and opt(argv, "-initrd") == ["initrd"]


def test_a_tcg_boot_starts_paused_and_a_kvm_boot_does_not() -> None:
    # Paused so that the driver stops the PIT (TCG_BOOT_HMP) before the guest runs.
    assert "-S" in build_argv(spec(), "tcg")
    assert "-S" not in build_argv(spec(), "kvm")
    restore = build_argv(spec(), "tcg", restore=True)
    assert restore.count("-S") == 1 and "-incoming" in restore


def test_the_pit_is_stopped_by_a_mode_0_control_word() -> None:
    # Port 0x43 is the PIT's control register; 0x30: channel 0, low then high byte, mode 0.
    assert qemu_args.TCG_BOOT_HMP == ("o /b 0x43 0x30",)


def test_the_translation_cache_size_is_tcg_only() -> None:
    from aenv.runtime.qemu import TCG_TB_MIB, QemuRuntime

    assert QemuRuntime().tcg_tb_mib == TCG_TB_MIB == 128
    assert opt(build_argv(spec(), "tcg", tcg_tb_mib=TCG_TB_MIB), "-accel") == ["tcg,tb-size=128"]
    assert opt(build_argv(spec(), "kvm", tcg_tb_mib=TCG_TB_MIB), "-accel") == ["kvm"]
