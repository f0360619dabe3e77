"""Fixtures of the guest tests: the real kernel and base image (cached in the machine's aenv
home, built on first use: about a minute cold), and one booted guest per module."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator

import pytest

from aenv.config import Settings
from aenv.storage.images import Image, ensure_base_image
from aenv.storage.kernel import Kernel, ensure_kernel
from tests.guest.harness import BootedGuest, boot


def _need_vm_host() -> None:
    if os.geteuid() != 0:
        pytest.skip("building images needs root")
    if shutil.which("qemu-system-x86_64") is None:
        pytest.skip("qemu-system-x86_64 is not installed")


@pytest.fixture(scope="session")
def cloud_kernel() -> Kernel:
    _need_vm_host()
    return ensure_kernel(Settings.from_env(), "cloud")


@pytest.fixture(scope="session")
def base_image(cloud_kernel: Kernel) -> Image:
    return ensure_base_image(Settings.from_env(), kernel_flavor="cloud")


@pytest.fixture(scope="module")
def guest(cloud_kernel: Kernel, base_image: Image, tmp_path_factory) -> Iterator[BootedGuest]:
    g = boot(cloud_kernel, base_image, tmp_path_factory.mktemp("guest"), cpus=2)
    try:
        g.ready_after = g.wait_health(timeout=90)
        yield g
    finally:
        g.stop()
