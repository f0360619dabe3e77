"""Decide once per process whether guests run on KVM or under TCG, and say why.

KVM is chosen only when ``/dev/kvm`` opens, answers ``KVM_GET_API_VERSION`` with 12, and the
module behind it is a hardware vendor module (``kvm_intel``/``kvm_amd``). A ``/dev/kvm`` served
by ``kvm_pvm`` (PVM, the paravirtual backend some cloud VMs offer) only runs guest kernels
built as PVM guests, so stock distribution kernels must use TCG there. The decision is a pure
function of a few host files, computed once and logged; ``AccelChoice.reason`` is what
``aenv doctor`` and the VM handle show.
"""

from __future__ import annotations

import fcntl
import functools
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from .base import Accel

log = logging.getLogger("aenv.runtime")

KVM_GET_API_VERSION = 0xAE00
KVM_API_VERSION = 12


@dataclass(frozen=True)
class AccelChoice:
    accel: Accel
    reason: str


def decide(dev: Path = Path("/dev/kvm"), sys_module: Path = Path("/sys/module")) -> AccelChoice:
    """Pick the accelerator from the device node and the loaded KVM modules."""
    if not dev.exists():
        return AccelChoice("tcg", f"{dev} does not exist")
    try:
        fd = os.open(dev, os.O_RDWR | os.O_CLOEXEC)
    except OSError as e:
        return AccelChoice("tcg", f"cannot open {dev}: {e.strerror}")
    try:
        version = fcntl.ioctl(fd, KVM_GET_API_VERSION)
    except OSError as e:
        return AccelChoice("tcg", f"{dev} rejects KVM_GET_API_VERSION: {e.strerror}")
    finally:
        os.close(fd)
    if version != KVM_API_VERSION:
        return AccelChoice("tcg", f"{dev} speaks KVM API {version}, not {KVM_API_VERSION}")
    if (sys_module / "kvm_pvm").exists():
        return AccelChoice(
            "tcg", "/dev/kvm is kvm_pvm (PVM): it runs only PVM guest kernels, not stock ones"
        )
    for vendor in ("kvm_intel", "kvm_amd"):
        if (sys_module / vendor).exists():
            return AccelChoice("kvm", f"/dev/kvm is {vendor} (hardware virtualization)")
    return AccelChoice("tcg", "/dev/kvm is served by no known hardware module")


@functools.cache
def host_accel() -> AccelChoice:
    """The decision for this host, made once and logged."""
    choice = decide()
    log.info("accelerator: %s (%s)", choice.accel, choice.reason)
    return choice
