"""The QEMU command line for a ``VMSpec``: a pure function, so it can be read and tested alone.

Every path on the line is a fixed name relative to the VM working directory (the VMM's cwd),
so the line is identical for every sandbox with the same shape and a migration stream taken
from one VM loads into a VMM started with another VM's line.

Device model: ``-M microvm`` with no default devices; the serial console goes to
``console.log``; disks are virtio-blk over virtio-mmio, the network is virtio-net on the slot's
tap, entropy comes from virtio-rng, and QMP listens on ``qmp.sock``.

Block choices: ``cache=unsafe`` = writeback through the host page cache (so every sandbox
reading the shared base image shares its pages) with guest flushes ignored: a sandbox disk
does not outlive a host crash any more than its VM does, and QEMU still writes its qcow2
metadata out to the file on stop/quit, so other processes read a consistent file. Snapshot
code that must survive a host crash fsyncs what it keeps. ``aio=io_uring`` where the host
offers it (fewer syscalls and no thread pool per request), else ``aio=threads``; ``native``
is not an option because it needs O_DIRECT, which would bypass the shared page cache.
``discard=unmap`` + ``detect-zeroes=unmap`` let a guest's fstrim shrink its overlay.
``auto-read-only=off`` (``-drive`` defaults it on): a writable drive is opened read-write
at start-up, while QEMU is still root and outside its chroot; with it on, a restore opens
the drive read-only while the migration is incoming and re-opens it by name to activate
it, which a confined QEMU may not (``aenv.runtime.confine``).

A TCG boot starts paused (``-S``): before the guest's first instruction the driver stops
the PIT (``TCG_BOOT_HMP``) and then lets it run.

A restore (``restore=True``) differs only where ``aenv.runtime.qemu_snapshot`` needs it to:
guest RAM maps the snapshot's base image ``base-memory`` with ``share=off`` (copy-on-write),
the VMM waits for its device state (``-incoming defer``: the driver first writes the memory
diff, because loading virtio state reads the rings in guest RAM) and keeps the vCPUs stopped
afterwards (``-S``). ``send-configuration=off`` because the state is written by
``xen-save-devices-state``, which has no configuration section.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from pathlib import Path

from . import workdir as wd
from .base import Accel, VMSpec
from .tsc import host_tsc_khz

QEMU_BINARY = "qemu-system-x86_64"
NETNS_DIR = Path("/run/netns")

# Kernel arguments every guest gets under TCG (the host's accelerator decides, so the shared
# command line of ``aenv.guest.bootargs`` leaves them out). The TSC frequency is the host's
# (``aenv.runtime.tsc``: under TCG the guest reads the host's TSC) because, under TCG on a
# loaded host, the guest's PIT calibration of the TSC fails now and then and the guest then
# hangs for good; with the frequency given no boot failed. An emulated CPU does not
# speculate, so the guest kernel's Spectre/Meltdown mitigations only cost time (retpolines,
# RSB filling on every context switch): off, about 0.1 s of a boot. Every wake-up of an idle
# guest costs its VMM ~0.4 ms of host CPU under TCG, so two periodic ones go: the lockup
# detectors' timer (``nowatchdog``) and the vmstat folding every second (every 10 s:
# counters in /proc/meminfo may lag that much); idle sandboxes measured 12.3-12.4 ms/s of
# host CPU each with them, 13.0-13.3 without (benchmarks/density.py --n 8, alternating).
# Proactive compaction off: kcompactd woke an idle guest twice a second (1.85-2.0 of its
# ~10-19 wake-ups/s, counted in the guest over 20 s) to defragment memory for huge pages
# that a small guest rarely asks for; compaction on demand stays. Kernel arguments apply
# at boot only: snapshots taken before keep the value they booted with, and restore.
TCG_KERNEL_ARGS = ("tsc=reliable", "mitigations=off", "nowatchdog",
                   "sysctl.vm.stat_interval=10", "sysctl.vm.compaction_proactiveness=0")


# QEMU's reset leaves the PIT's channel 0 counting in mode 3 (a square wave at 18.2 Hz, as a PC
# BIOS would leave it). The guest kernels aenv boots never use it (their clock events are the
# local APIC's; Linux 6.1 leaves an unused PIT alone, later kernels stop it), but the VMM
# still flips its masked output line 36 times a second: every idle TCG VMM's main loop woke
# 86 times/s instead of 18 and spent 2.5 ms/s of host CPU instead of 0.5 (strace -c and
# /proc/PID/task/*/stat of an idle sandbox from base, 20 s each, before and after). Control
# word 0x30 puts channel 0 into mode 0 (one-shot), after which QEMU arms no timer for it. A
# guest that does use the PIT programs it itself, as it must on hardware, so this runs
# before the guest's first instruction (boots start paused under TCG). Snapshots keep the
# PIT as it was at the capture: templates booted before this keep theirs running. Under
# KVM the PIT is the kernel's, which these port writes do not reach.
TCG_BOOT_HMP = ("o /b 0x43 0x30",)


def tcg_kernel_args(tsc_khz: int | None = None) -> tuple[str, ...]:
    """``TCG_KERNEL_ARGS`` plus ``tsc_early_khz`` at ``tsc_khz`` (default: the host's)."""
    khz = tsc_khz if tsc_khz is not None else host_tsc_khz()
    return (f"tsc_early_khz={khz}", *TCG_KERNEL_ARGS) if khz else TCG_KERNEL_ARGS


def netns_path(netns: str) -> Path:
    """A netns given by name (``ip netns`` style) or by absolute path."""
    return Path(netns) if netns.startswith("/") else NETNS_DIR / netns


def kernel_cmdline(spec: VMSpec, accel: Accel) -> str:
    """``spec.boot_args`` plus, under TCG, what ``with_tcg_args`` adds."""
    return with_tcg_args(spec.boot_args) if accel == "tcg" else spec.boot_args


def with_tcg_args(boot_args: str, tsc_khz: int | None = None) -> str:
    """``boot_args`` plus each ``tcg_kernel_args`` key it does not set."""
    tokens = boot_args.split()
    keys = {t.split("=", 1)[0] for t in tokens}
    extra = [a for a in tcg_kernel_args(tsc_khz) if a.split("=", 1)[0] not in keys]
    return " ".join(tokens + extra)


def build_argv(
    spec: VMSpec,
    accel: Accel,
    *,
    binary: str = QEMU_BINARY,
    aio: str = "threads",
    nsenter: str = "nsenter",
    restore: bool = False,
    tcg_tb_mib: int | None = None,
    confine: Sequence[str] = (),
) -> list[str]:
    """The full argv, including the ``nsenter`` prefix when the spec names a netns.

    ``tcg_tb_mib`` sizes TCG's translation cache (QEMU's default is 1 GiB, filled as the
    guest runs new code and never given back: a guest could grow its VMM by that much);
    ``confine`` are the ``aenv.runtime.confine`` options (seccomp, chroot, uid), appended
    last. Neither changes what the guest sees.

    The netns is entered with ``nsenter --net=…`` rather than ``ip netns exec`` (which also
    unshares a mount namespace and remounts /sys for the VMM) or a ``preexec_fn`` (Python code
    between fork and exec is unsafe in a threaded server and unsupported by some event loops):
    nsenter calls setns and execs, so the VMM keeps nsenter's pid and the host's mounts.
    """
    machine = "microvm,x-option-roms=off"
    argv: list[str] = []
    if spec.netns is not None:
        argv += [nsenter, f"--net={netns_path(spec.netns)}", "--"]
    argv += [binary, "-nodefaults", "-no-user-config", "-nographic"]
    if spec.memory_file is not None:
        machine += ",memory-backend=mem"
    accel_opt = f"tcg,tb-size={tcg_tb_mib}" if accel == "tcg" and tcg_tb_mib else accel
    argv += ["-M", machine, "-accel", accel_opt, "-cpu", "host" if accel == "kvm" else "max"]
    argv += ["-smp", str(spec.vcpus), "-m", f"{spec.memory_mib}M"]
    if spec.memory_file is not None:
        mem_path, share = (wd.BASE_MEMORY, "off") if restore else (wd.MEMORY, "on")
        argv += [
            "-object",
            f"memory-backend-file,id=mem,size={spec.memory_mib}M,mem-path={mem_path},"
            f"share={share}",
        ]
    argv += ["-kernel", wd.KERNEL]
    if spec.initrd is not None:
        argv += ["-initrd", wd.INITRD]
    argv += ["-append", kernel_cmdline(spec, accel)]
    # append=on: the log can be cut from outside while the VMM writes (runtime.console).
    argv += ["-chardev", f"file,id=console,path={wd.CONSOLE},append=on",
             "-serial", "chardev:console", "-monitor", "none"]
    for drive in spec.drives:
        opts = [
            f"id={drive.id}",
            f"file={wd.drive_name(drive)}",
            f"format={drive.format}",
            "if=none",
            "cache=unsafe",
            "auto-read-only=off",
            f"aio={aio}",
        ]
        opts += ["readonly=on"] if drive.read_only else ["discard=unmap", "detect-zeroes=unmap"]
        argv += ["-drive", ",".join(opts), "-device", f"virtio-blk-device,drive={drive.id}"]
    if spec.tap is not None:
        argv += [
            "-netdev",
            f"tap,id=net0,ifname={spec.tap},script=no,downscript=no",
            "-device",
            f"virtio-net-device,netdev=net0,mac={spec.mac}",
        ]
    argv += ["-device", "virtio-rng-device"]
    argv += ["-qmp", f"unix:{wd.QMP_SOCKET},server=on,wait=off", "-pidfile", wd.PIDFILE]
    if restore:
        argv += ["-S", "-incoming", "defer", "-global", "migration.send-configuration=off"]
    elif accel == "tcg":
        argv += ["-S"]  # until TCG_BOOT_HMP has run
    argv += confine
    return argv


def render(argv: list[str]) -> str:
    """The argv as one shell-quoted line, for logs and the manifest."""
    return shlex.join(argv)
