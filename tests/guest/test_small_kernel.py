"""The optional small kernel (``aenv kernel build small``) boots the base image to envd.

Building it takes ~8 minutes, so the suite never does: these tests run only on a machine
where ``aenv kernel build small`` has been run (in the machine's aenv home).
"""

from __future__ import annotations

import httpx
import pytest

from aenv.config import Settings
from aenv.storage.images import ensure_base_image
from aenv.storage.kernel import list_kernels
from tests.guest import connect
from tests.guest.harness import boot

pytestmark = [pytest.mark.vm, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def small_guest(cloud_kernel, tmp_path_factory):
    settings = Settings.from_env()
    kernels = [k for k in list_kernels(settings) if k.flavor == "small"]
    if not kernels:
        pytest.skip("no small kernel built (aenv kernel build small)")
    image = ensure_base_image(settings, kernel_flavor="small")
    g = boot(kernels[0], image, tmp_path_factory.mktemp("small"), cpus=2)
    try:
        g.ready_after = g.wait_health(timeout=90)
        yield g
    finally:
        g.stop()


def test_small_kernel_boots_without_initramfs_to_envd(small_guest):
    assert httpx.get(small_guest.url + "/health", timeout=5).status_code in (200, 204)
    assert "aenv-initrd" not in small_guest.console()
    print(f"small kernel: envd /health after {small_guest.ready_after:.2f} s wall")


def test_small_kernel_has_what_sandboxes_use(small_guest):
    script = ("uname -r; grep -wc -e overlay -e fuse -e ext4 /proc/filesystems; "
              "ls /dev/hwrng /dev/fuse >/dev/null && echo devices-ok; "
              "ip -4 -o addr show dev eth0")
    result = connect.run(small_guest.url, "/bin/sh", "-c", script)
    out = result.stdout.decode()
    assert result.exit_code == 0, result.stderr.decode()
    assert "aenv-small" in out.splitlines()[0]
    assert out.splitlines()[1] == "3"
    assert "devices-ok" in out and "169.254.0.21/30" in out
