"""A plain QEMU microvm boot of an aenv kernel + image, for tests of what storage/guest build.

Independent of aenv/runtime on purpose (it checks the artefacts, not the driver): user-mode
networking with ``restrict=on`` and one host forward from 127.0.0.1 to the guest's envd,
the console in a file, the image opened with ``snapshot=on`` so it is never written.
``BootedGuest.stop`` kills QEMU's process group; use it in a ``finally``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from aenv.envd import ENVD_PORT
from aenv.guest.bootargs import guest_boot_args
from aenv.guest.markers import first_times
from aenv.network.guest_link import GUEST_IP
from aenv.runtime.qemu_args import with_tcg_args
from aenv.storage.images import Image
from aenv.storage.kernel import Kernel
from tests.conftest import free_port

GUEST_ENVD = f"{GUEST_IP}:{ENVD_PORT}"


@dataclass
class BootedGuest:
    proc: subprocess.Popen
    port: int
    console_path: Path
    started: float  # time.monotonic() at spawn
    ready_after: float | None = None  # wall seconds from spawn to the first /health answer
    extra: dict = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def console(self) -> str:
        try:
            return self.console_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def phases(self) -> dict[str, float]:
        return first_times(self.console())

    def wait_health(self, timeout: float = 60.0) -> float:
        """Seconds from spawn until ``GET /health`` answered."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"qemu exited {self.proc.returncode}:\n{self.console()}")
            try:
                if httpx.get(self.url + "/health", timeout=0.5).status_code < 300:
                    return time.monotonic() - self.started
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise TimeoutError(f"envd did not answer within {timeout}s:\n{self.console()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()


def boot(
    kernel: Kernel,
    image: Image,
    workdir: Path,
    *,
    memory_mb: int = 512,
    cpus: int = 1,
    extra_args: Sequence[str] = (),
    init_args: Sequence[str] = (),
) -> BootedGuest:
    port = free_port()
    console = workdir / f"console-{port}.log"
    # The harness always runs TCG, so it adds what the qemu driver adds under TCG.
    cmdline = with_tcg_args(guest_boot_args(kernel, extra=extra_args))
    if init_args:
        cmdline += " -- " + " ".join(init_args)
    argv = [
        "qemu-system-x86_64", "-M", "microvm", "-accel", "tcg",
        "-m", f"{memory_mb}M", "-smp", str(cpus),
        "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
        "-serial", f"file:{console}",
        "-kernel", str(kernel.vmlinux),
        *(["-initrd", str(kernel.initrd)] if kernel.initrd else []),
        "-append", cmdline,
        "-drive", f"id=root,file={image.path},format=raw,if=none,snapshot=on",
        "-device", "virtio-blk-device,drive=root",
        "-netdev", ("user,id=n0,net=169.254.0.20/30,host=169.254.0.22,dhcpstart=169.254.0.21,"
                    f"restrict=on,hostfwd=tcp:127.0.0.1:{port}-{GUEST_ENVD}"),
        "-device", "virtio-net-device,netdev=n0",
        "-device", "virtio-rng-device",
    ]
    with open(workdir / f"qemu-{port}.log", "wb") as log:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    return BootedGuest(proc, port, console, time.monotonic())
