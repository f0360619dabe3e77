"""Real guests for the runtime tests: the ``base`` image on the cloud kernel under QEMU, each in
its own network slot, reached through the slot's host address.

Booting costs seconds under TCG, so VMs are module-scoped and shared by the tests of a module.
Everything is named with its own prefix (``aenvrt``) and address ranges, so these tests can
run while other suites use the defaults, and ``leak_guard`` can tell our leftovers apart: at
the end of the session it asserts that no namespace, veth, tap, nft table, mount, VMM process
or guest-RAM file of ours is left.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import secrets
import shutil
import subprocess
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from aenv.config import Settings
from aenv.envd import ENVD_PORT
from aenv.network import NetworkSlot, SlotPool
from aenv.runtime import VMLimits
from aenv.runtime import workdir as wd
from aenv.runtime.base import Drive, VMSpec
from aenv.runtime.cgroups import Hierarchies
from aenv.runtime.qemu import QemuRuntime, QemuVM
from aenv.runtime.ready import BootPhases, boot_until_ready
from aenv.storage.disks import Disk, create_disk
from tests.fake_control_plane import FakeControlPlane

# Host objects' name prefix and the 10.<net>/10.<net+1> /24s; overridable so that two
# sessions on one host can run this suite side by side (with their own AENV_HOME).
PREFIX = os.environ.get("AENV_TEST_RT_PREFIX", "aenvrt")
_NET = int(os.environ.get("AENV_TEST_RT_NET", "13"))
VM_PREFIX = "rt-"  # working directories of this suite's VMs: <vms_dir>/rt-<name>
GUEST_MIB = 512  # the guest RAM boot_guest gives every guest


def vm_host_ready() -> str | None:
    """Why VM tests cannot run here, or None."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, taps)"
    if shutil.which("qemu-system-x86_64") is None:
        return "qemu-system-x86_64 is not installed"
    return None


@pytest.fixture(scope="session")
def rt_settings() -> Settings:
    """The host's data dir (kernels and images are cached there across runs) with our own
    object prefix and address ranges."""
    return dataclasses.replace(
        Settings.from_env(), name_prefix=PREFIX, host_cidr=f"10.{_NET}.0.0/24",
        veth_cidr=f"10.{_NET + 1}.0.0/24", warm_slots=0,
    )


def _ours(settings: Settings, tmp_root: str) -> dict[str, list[str]]:
    """Every host object of this suite that could leak, by kind. ``tmp_root`` is the part of
    a path that marks this run's temporary files (test_disks.py's XFS images)."""
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True,
                           check=False).stdout
    tables = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True,
                           check=False).stdout
    mounts = Path("/proc/self/mounts").read_text()
    vms = str(settings.vms_dir / VM_PREFIX)
    procs = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if os.readlink(f"/proc/{entry.name}/cwd").startswith(vms):
                    procs.append(entry.name)
            except OSError:
                pass
    loops = subprocess.run(["losetup", "-a"], capture_output=True, text=True,
                           check=False).stdout
    netns_dir = Path("/run/netns")
    return {
        "netns": sorted(n for n in os.listdir(netns_dir) if n.startswith(PREFIX))
        if netns_dir.is_dir() else [],
        "links": [ln.split(":")[1].strip() for ln in links.splitlines() if PREFIX in ln],
        "nft tables": [t for t in tables.splitlines() if PREFIX in t],
        "mounts": [m for m in mounts.splitlines()
                   if PREFIX in m or vms in m or (tmp_root in m and " xfs " in m)],
        "loop devices": [ln for ln in loops.splitlines()
                         if tmp_root in ln and "xfs.img" in ln],
        "vmm processes": procs,
        "guest ram files": sorted(p.name for p in wd.SHM.glob(f"{PREFIX}-*")),
        "vm dirs": sorted(p.name for p in settings.vms_dir.glob(VM_PREFIX + "*"))
        if settings.vms_dir.is_dir() else [],
    }


@pytest.fixture(scope="session", autouse=True)
def leak_guard(rt_settings: Settings, tmp_path_factory: pytest.TempPathFactory,
               worker_id: str) -> Iterator[None]:
    # Under pytest-xdist (make test-fast) every worker runs this guard while the others'
    # test_disks.py may hold an XFS image mounted; a worker looks only under its own
    # temporary directory. The VM objects are left to make test, which runs one session.
    tmp_root = "pytest-of" if worker_id == "master" else str(tmp_path_factory.getbasetemp())
    before = _ours(rt_settings, tmp_root)
    assert not any(before.values()), f"leftovers of an earlier run: {before}"
    yield
    after = _ours(rt_settings, tmp_root)
    assert not any(after.values()), f"the runtime tests leaked: {after}"


@pytest.fixture(scope="session")
def vm_host() -> None:
    reason = vm_host_ready()
    if reason:
        pytest.skip(reason)


@pytest.fixture(scope="session")
def kernel(rt_settings: Settings, vm_host: None):
    from aenv.storage.kernel import ensure_kernel

    return ensure_kernel(rt_settings, "cloud")


@pytest.fixture(scope="session")
def base_image(rt_settings: Settings, kernel):
    from aenv.storage.images import ensure_base_image

    return ensure_base_image(rt_settings, kernel_flavor=kernel.flavor)


@pytest.fixture(scope="session")
def slot_pool(rt_settings: Settings, vm_host: None, leak_guard: None) -> Iterator[SlotPool]:
    pool = SlotPool(rt_settings, warm_size=0)
    pool.start()
    yield pool
    pool.close()


@dataclass
class Guest:
    """One booted sandbox VM: its VMM handle, slot, disk, envd URL and SDK plumbing."""

    vm: QemuVM
    slot: NetworkSlot
    disk: Disk
    phases: BootPhases | None  # None for a guest restored from a snapshot
    token: str
    control_plane: FakeControlPlane | None = None
    # handles replaced by a re-attach; their VMM is guest.vm's, reaped at teardown
    old_handles: list[QemuVM] = dataclasses.field(default_factory=list)

    @property
    def url(self) -> str:
        return self.envd_url(self.slot.host_ip)

    @staticmethod
    def envd_url(host_ip: str) -> str:
        return f"http://{host_ip}:{ENVD_PORT}"

    def sandbox(self):
        """A real E2B SDK ``Sandbox`` talking to this guest's envd."""
        from e2b import Sandbox

        assert self.control_plane is not None
        return Sandbox.create("base", api_key="e2b_" + "0" * 40, api_url=self.control_plane.url,
                              sandbox_url=self.url, domain="localhost")


def remove_cgroups(hierarchies: Hierarchies) -> None:
    """Kill and remove every VM cgroup under ``hierarchies``' parent, then the parent
    directories that are left empty (a test's cgroup teardown)."""
    for cg in hierarchies.existing():
        cg.kill()
        cg.remove()
    for parent in hierarchies.parent_dirs():
        try:
            parent.rmdir()
        except OSError:
            pass


async def boot_guest(name: str, settings: Settings, kernel, image, pool: SlotPool,
                     limits: VMLimits | None = None) -> Guest:
    """Boot ``image`` in a fresh slot and wait for envd; the caller must ``destroy_guest``.
    ``limits``: the VM's ``VMSpec.limits`` (None: derived from its size)."""
    from aenv.guest.bootargs import guest_boot_args

    slot = await asyncio.to_thread(pool.acquire)
    workdir = settings.vms_dir / name
    vm: QemuVM | None = None
    try:
        disk = create_disk(image.path, workdir)
        spec = VMSpec(
            vm_id=name, workdir=workdir, kernel=kernel.vmlinux, initrd=kernel.initrd,
            boot_args=guest_boot_args(kernel), memory_mib=GUEST_MIB,
            drives=(Drive("rootfs", disk.path, format=disk.format),),
            tap=slot.tap_name, netns=slot.netns, mac=slot.guest_mac,
            memory_file=wd.default_memory_file(name, workdir, PREFIX), limits=limits,
        )
        vm, phases = await boot_until_ready(QemuRuntime(), spec, Guest.envd_url(slot.host_ip))
        guest = Guest(vm=vm, slot=slot, disk=disk, phases=phases, token=secrets.token_hex(16))
        guest.control_plane = FakeControlPlane(guest, guest.token)
        return guest
    except BaseException:
        if vm is not None:
            await vm.stop()
        wd.remove(workdir)
        await asyncio.to_thread(pool.release, slot)
        raise


async def restore_guest(name: str, snapshot_dir: Path, settings: Settings, pool: SlotPool,
                        token: str, runtime: QemuRuntime | None = None) -> Guest:
    """Restore a snapshot into a fresh slot, wait for envd, re-``/init`` it with the token it
    already holds (as the orchestrator does); the caller must ``destroy_guest``."""
    from aenv.runtime.base import RestoreOverrides
    from aenv.runtime.ready import wait_for_envd

    slot = await asyncio.to_thread(pool.acquire)
    workdir = settings.vms_dir / name
    vm: QemuVM | None = None
    try:
        vm = await (runtime or QemuRuntime(track_writes=settings.native_dir)).restore(
            snapshot_dir, RestoreOverrides(vm_id=name, workdir=workdir, netns=slot.netns))
        await wait_for_envd(Guest.envd_url(slot.host_ip), 30, vm=vm)
        drive = vm.workdir / "rootfs.qcow2"
        disk = Disk(drive, "qcow2", "qcow2", Path(os.readlink(drive)) if drive.is_symlink()
                    else snapshot_dir / "rootfs.qcow2")
        guest = Guest(vm=vm, slot=slot, disk=disk, phases=None, token=token)
        guest.control_plane = FakeControlPlane(guest, token)
        return guest
    except BaseException:
        if vm is not None:
            await vm.stop()
        wd.remove(workdir)
        await asyncio.to_thread(pool.release, slot)
        raise


@contextlib.asynccontextmanager
async def running_guest(name: str, settings: Settings, kernel, image, pool: SlotPool,
                        limits: VMLimits | None = None) -> AsyncIterator[Guest]:
    """``boot_guest`` for the length of a block (a module's fixture), then ``destroy_guest``."""
    guest = await boot_guest(name, settings, kernel, image, pool, limits)
    try:
        yield guest
    finally:
        await destroy_guest(guest, pool)


async def destroy_guest(guest: Guest, pool: SlotPool) -> None:
    if guest.control_plane is not None:
        guest.control_plane.stop()
    await guest.vm.stop()
    for old in guest.old_handles:
        await old.wait()
    wd.remove(guest.vm.workdir)
    await asyncio.to_thread(pool.release, guest.slot)


@pytest.fixture(scope="module")
async def guest_a(rt_settings, kernel, base_image, slot_pool) -> AsyncIterator[Guest]:
    async with running_guest(VM_PREFIX + "a", rt_settings, kernel, base_image, slot_pool) as g:
        yield g


@pytest.fixture(scope="module")
async def guest_b(rt_settings, kernel, base_image, slot_pool) -> AsyncIterator[Guest]:
    async with running_guest(VM_PREFIX + "b", rt_settings, kernel, base_image, slot_pool) as g:
        yield g
