"""A real OCI registry for tests: Debian's ``docker-registry`` on a free loopback port
(optionally with htpasswd basic auth), and images made on this machine with ``umoci``
and pushed with ``skopeo``. Nothing here is a test.

``busybox_layout`` is a one-layer image of the static busybox from Debian's
``busybox-static`` (no libc, no bash, no Python), with an image config that sets ``Env``
and ``WorkingDir``; it is cached under the cache dir, so a second session only pushes it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from aenv.storage import debian
from tests.conftest import free_port

BUSYBOX_ENV = {"PATH": "/bin", "FOO": "from-image"}
BUSYBOX_WORKDIR = "/srv"
BUSYBOX_MARKER = "hello from the image\n"  # /srv/marker
DEBIAN_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
              "LANG": "C.UTF-8"}


@dataclass(frozen=True)
class Registry:
    host: str  # 127.0.0.1:<port>
    credentials: tuple[str, str] | None

    def push(self, layout: Path, repo_tag: str) -> str:
        """Push ``layout`` (an OCI layout, tag ``latest``) as ``<host>/<repo_tag>``."""
        ref = f"{self.host}/{repo_tag}"
        cmd = ["skopeo", "copy", "-q", "--all", "--dest-tls-verify=false"]
        if self.credentials:
            cmd.append(f"--dest-creds={self.credentials[0]}:{self.credentials[1]}")
        subprocess.run([*cmd, f"oci:{layout}:latest", f"docker://{ref}"], check=True,
                       capture_output=True)
        return ref


@contextmanager
def local_registry(root: Path, *, credentials: tuple[str, str] | None = None
                   ) -> Iterator[Registry]:
    """A ``docker-registry`` serving from ``root`` until the block ends."""
    if shutil.which("docker-registry") is None:
        raise RuntimeError("docker-registry is missing: run ./scripts/setup.sh")
    root.mkdir(parents=True, exist_ok=True)
    port = free_port()
    auth = ""
    if credentials:
        htpasswd = subprocess.run(["htpasswd", "-Bbn", *credentials], check=True,
                                  capture_output=True, text=True).stdout
        (root / "htpasswd").write_text(htpasswd)
        auth = f"auth: {{htpasswd: {{realm: aenv-test, path: {root / 'htpasswd'}}}}}\n"
    (root / "config.yml").write_text(
        "version: 0.1\nlog: {level: error}\n"
        f"storage: {{filesystem: {{rootdirectory: {root / 'data'}}}}}\n"
        f"http: {{addr: 127.0.0.1:{port}}}\n" + auth)
    with open(root / "registry.log", "wb") as log:
        proc = subprocess.Popen(["docker-registry", "serve", str(root / "config.yml")],
                                stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                httpx.get(f"http://127.0.0.1:{port}/v2/", timeout=1)
                break
            except httpx.TransportError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("docker-registry did not start: "
                                       + (root / "registry.log").read_text()[-2000:]) from None
                time.sleep(0.05)
        yield Registry(f"127.0.0.1:{port}", credentials)
    finally:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _umoci_layout(final: Path, fill: Callable[[Path, Path], None], config: list[str]) -> Path:
    """The OCI layout ``final``, made once (it is there when its ``index.json`` is): an empty
    umoci image whose root file system ``fill(work, rootfs)`` fills (``work``: a scratch
    directory), repacked as one layer and configured with ``config`` (``umoci config``
    arguments)."""
    if (final / "index.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=final.parent) as tmp:
        work = Path(tmp)
        layout, bundle = work / "layout", work / "bundle"
        umoci = ["umoci", "--log", "error"]
        subprocess.run([*umoci, "init", "--layout", str(layout)], check=True)
        subprocess.run([*umoci, "new", "--image", f"{layout}:latest"], check=True)
        subprocess.run([*umoci, "unpack", "--image", f"{layout}:latest", str(bundle)],
                       check=True, capture_output=True)
        fill(work, bundle / "rootfs")
        subprocess.run([*umoci, "repack", "--image", f"{layout}:latest", str(bundle)],
                       check=True)
        subprocess.run([*umoci, "config", "--image", f"{layout}:latest", *config], check=True)
        os.replace(layout, final)
    return final


def busybox_layout(cache_dir: Path) -> Path:
    """The busybox test image as an OCI layout (made once per cache dir)."""

    def fill(work: Path, rootfs: Path) -> None:
        (deb,) = debian.download([debian.candidate("busybox-static")], cache_dir / "debs")
        debian.unpack(deb, work / "deb")
        for d in ("bin", "etc", "srv", "tmp", "root"):
            (rootfs / d).mkdir(exist_ok=True)
        shutil.copy2(work / "deb/bin/busybox", rootfs / "bin/busybox")
        applets = subprocess.run([rootfs / "bin/busybox", "--list"], check=True,
                                 capture_output=True, text=True).stdout.split()
        for applet in applets:
            if applet != "busybox":
                os.symlink("busybox", rootfs / "bin" / applet)
        (rootfs / "etc/passwd").write_text("root:x:0:0:root:/root:/bin/sh\n")
        (rootfs / "etc/group").write_text("root:x:0:\n")
        (rootfs / "srv/marker").write_text(BUSYBOX_MARKER)

    return _umoci_layout(cache_dir / "test-images" / "busybox-oci", fill,
                         [*(f"--config.env={k}={v}" for k, v in BUSYBOX_ENV.items()),
                          f"--config.workingdir={BUSYBOX_WORKDIR}"])


def debian_layout(cache_dir: Path) -> Path:
    """A Debian minbase image without Python (bash, coreutils, apt, no python3) as an OCI
    layout, made once per cache dir: ``debootstrap --variant=minbase`` reusing the
    ``.deb`` files the base image build keeps under ``<cache>/debs`` (the mirror is asked
    for its indexes only, once), trimmed as Debian's ``-slim`` images are (docs, man
    pages, apt lists)."""

    def fill(work: Path, rootfs: Path) -> None:
        tree = work / "tree"
        subprocess.run(["debootstrap", "--variant=minbase", "--components=main",
                        f"--cache-dir={cache_dir / 'debs'}", debian.DEBIAN_SUITE, str(tree),
                        debian.DEBIAN_MIRROR], check=True, capture_output=True)
        if any(tree.glob("usr/bin/python*")):
            raise RuntimeError("debootstrap's minbase has Python: not the image this wants")
        for junk in ("usr/share/doc", "usr/share/man", "usr/share/info", "var/lib/apt/lists",
                     "var/cache/apt", "var/log"):
            shutil.rmtree(tree / junk, ignore_errors=True)
            (tree / junk).mkdir(parents=True)
        subprocess.run(["cp", "-a", f"{tree}/.", str(rootfs)], check=True)

    return _umoci_layout(cache_dir / "test-images" / "debian-minbase-oci", fill,
                         [*(f"--config.env={k}={v}" for k, v in DEBIAN_ENV.items()),
                          "--config.cmd=bash"])
