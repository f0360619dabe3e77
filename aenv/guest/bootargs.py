"""The kernel command line of every guest: console, clock, root disk, init, network identity.

The guest's network is fixed (see ``aenv.network.guest_link``) and passed in the kernel's
own ``ip=`` syntax, which aenv's init reads (and which a kernel built with ``CONFIG_IP_PNP``
would apply by itself). The root filesystem is always the first virtio-blk drive,
``/dev/vda``, mounted read-write: the runtime gives each VM a copy-on-write disk. A guest
booting with the tools drive (``tools=True``) has it as the second, ``/dev/vdb``, named by
``aenv.tools=`` for the cloud initramfs, which mounts it at ``/.aenv``; ``init=`` is then
the drive's own init, or (``tools="fallback"``, for a disk whose image is not known) the
image's, which the initramfs replaces with the drive's when the root has none.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from ..network.guest_link import GUEST_IP, LINK_PREFIXLEN, TAP_IP
from ..storage.kernel import Kernel
from . import tools as tools_recipe

GUEST_INIT = "/sbin/aenv-init"
DEFAULT_DNS = "8.8.8.8"

ToolsBoot = bool | Literal["fallback"]


def _netmask(prefixlen: int) -> str:
    bits = (0xFFFFFFFF << (32 - prefixlen)) & 0xFFFFFFFF
    return ".".join(str((bits >> s) & 0xFF) for s in (24, 16, 8, 0))


def guest_boot_args(
    kernel: Kernel,
    *,
    hostname: str = "sandbox",
    extra: Sequence[str] = (),
    dns: str = DEFAULT_DNS,
    quiet: bool = True,
    tools: ToolsBoot = False,
) -> str:
    """The command line for ``kernel`` booting an aenv image (``extra`` is appended);
    ``tools``: with the tools drive as the second drive (see the module docstring)."""
    if not hostname or any(c in hostname for c in ": \t\n"):
        raise ValueError(f"bad hostname {hostname!r}")
    if tools and kernel.initrd is None:
        raise ValueError(f"kernel {kernel.version} has no initramfs to mount the tools drive "
                         "(images on the tools drive boot with the cloud kernel)")
    ip = ":".join(
        [GUEST_IP, "", TAP_IP, _netmask(LINK_PREFIXLEN), hostname, "eth0", "off", dns]
    )
    args = [
        "console=ttyS0",
        "root=/dev/vda",
        "rootfstype=ext4",
        "rw",
        f"init={tools_recipe.INIT if tools is True else GUEST_INIT}",
        f"ip={ip}",
        # A dead PID 1 reboots instead of hanging; the VMM turns that into an exit.
        "panic=1",
        # No PCI, keyboard controller or legacy probing on microvm / Firecracker.
        "pci=off",
        "i8042.noaux",
        "i8042.nomux",
        "i8042.dumbkbd",
        "8250.nr_uarts=1",
        "random.trust_cpu=on",
        # The crypto self-tests are ~0.2 s of a TCG boot (crypto_algapi_init under
        # initcall_debug); they test the kernel's own algorithms, not anything of the guest's.
        "cryptomgr.notests",
    ]
    if tools:
        args.append(f"{tools_recipe.BOOT_PARAM}={tools_recipe.TOOLS_DEVICE}")
    if quiet:
        args.append("quiet")
    if kernel.initrd is None:
        # Without an initramfs the kernel mounts the root itself and must wait for it.
        args.append("rootwait")
    return " ".join([*args, *extra])
