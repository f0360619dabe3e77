"""Build the ``small`` guest kernel from Debian's ``linux-source-6.1`` (minutes, not seconds).

``make tinyconfig`` plus aenv's fragment (``kconfig/small.txt``: virtio-mmio, ext4,
overlayfs, PVH, ACPI, cgroups, namespaces... all built in), then ``make vmlinux``; the
stripped ELF is booted through PVH with no initramfs. Every option of the fragment is
checked in the final ``.config``, so a fragment line that Kconfig silently dropped fails
the build instead of producing a kernel that cannot boot. The kernel's directory name
carries the fragment's hash: changing the fragment gives a new kernel. Source and objects
are scratch in the cache and removed after a successful build; the ``.deb`` is kept.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
from collections import deque
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

from ..config import Settings
from . import debian
from ._fsutil import build_lock, staging
from ._run import run
from .errors import CommandFailed, KernelError

if TYPE_CHECKING:  # kernel imports this module when it builds; only the type here
    from .kernel import Kernel

SOURCE_PACKAGE = "linux-source-6.1"
_TOOLS = ("gcc", "make", "flex", "bison", "bc", "perl", "strip", "tar", "xz")
_BUILD_LINE = re.compile(r"^\s+([A-Z][A-Z0-9_]*)\s+(\S+)")


def fragment() -> str:
    return resources.files("aenv.storage.kconfig").joinpath("small.txt").read_text()


def wanted_options(text: str) -> dict[str, str]:
    """``CONFIG_X`` -> ``y``/``n``/value from a fragment (``=n`` means "is not set")."""
    out = {}
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("CONFIG_") and "=" in line:
            key, _, value = line.partition("=")
            out[key] = value
    return out


def missing_options(config_text: str, wanted: dict[str, str]) -> list[str]:
    """Options of ``wanted`` that the final ``.config`` does not have as asked."""
    have: dict[str, str] = {}
    for line in config_text.splitlines():
        if line.startswith("CONFIG_"):
            key, _, value = line.partition("=")
            have[key] = value
        elif line.startswith("# CONFIG_") and line.endswith(" is not set"):
            have[line[2:-len(" is not set")]] = "n"
    bad = []
    for key, value in wanted.items():
        got = have.get(key, "n")
        if got != value and not (value == "n" and got == "n"):
            bad.append(f"{key}={value} (got {got})")
    return bad


def build_small_kernel(settings: Settings, *, progress: Callable[[str], None],
                       jobs: int | None = None) -> Kernel:
    from .kernel import MANIFEST, read_manifest, write_manifest

    missing = [t for t in _TOOLS if shutil.which(t) is None]
    if not Path("/usr/include/libelf.h").exists():
        missing.append("libelf-dev")
    if missing:
        raise KernelError(f"building the small kernel needs: {', '.join(missing)} "
                          "(scripts/setup.sh installs them)")
    text = fragment()
    frag_hash = hashlib.sha256(text.encode()).hexdigest()[:10]
    progress(f"resolving {SOURCE_PACKAGE}")
    pkg = debian.candidate(SOURCE_PACKAGE)
    with build_lock(settings.kernels_dir):
        for d in settings.kernels_dir.glob(f"small-*-{frag_hash}"):
            if (d / MANIFEST).is_file() and read_manifest(d)[1].source.endswith(pkg.version):
                return read_manifest(d)[1]
        progress(f"downloading {SOURCE_PACKAGE} {pkg.version} (~140 MB)")
        (deb,) = debian.download([pkg], settings.cache_dir / "debs")
        work = settings.cache_dir / "kernel-build" / f"{pkg.version}-{frag_hash}"
        shutil.rmtree(work, ignore_errors=True)
        try:
            src, build = _unpack_source(deb, work, progress)
            _configure(src, build, text, progress)
            _make(src, build, jobs or os.cpu_count() or 2, progress)
            # Only after the build does kernelrelease include CONFIG_LOCALVERSION.
            release = (build / "include/config/kernel.release").read_text().strip()
            final = settings.kernels_dir / f"small-{release}-{frag_hash}"
            with staging(final) as out:
                progress("stripping vmlinux")
                run(["strip", "-o", out / "vmlinux", build / "vmlinux"])
                shutil.copy2(build / ".config", out / "config")
                write_manifest(out, {
                    "flavor": "small",
                    "version": release,
                    "vmlinux": "vmlinux",
                    "initrd": None,
                    "modules": None,
                    "fragment_sha256": frag_hash,
                    "source": f"{SOURCE_PACKAGE} {pkg.version}",
                })
        finally:
            shutil.rmtree(work, ignore_errors=True)
    progress(f"kernel small {release} ready")
    return read_manifest(final)[1]


def _unpack_source(deb: Path, work: Path, progress: Callable[[str], None]) -> tuple[Path, Path]:
    progress(f"unpacking {deb.name}")
    debian.unpack(deb, work / "deb")
    tarballs = list((work / "deb" / "usr" / "src").glob("linux-source-*.tar.*"))
    if not tarballs:
        raise KernelError(f"{deb.name} holds no linux-source tarball")
    progress(f"extracting {tarballs[0].name} (about a minute)")
    run(["tar", "-xf", tarballs[0], "-C", work])
    tarballs[0].unlink()
    src = next(p for p in work.iterdir() if p.name.startswith("linux-source-") and p.is_dir())
    build = work / "build"
    build.mkdir()
    return src, build


def _configure(src: Path, build: Path, text: str, progress: Callable[[str], None]) -> None:
    progress("make tinyconfig + aenv fragment")
    make: list[str | os.PathLike[str]] = ["make", "-C", src, f"O={build}", "ARCH=x86_64"]
    run([*make, "tinyconfig"])
    frag = build / "aenv-small.config"
    frag.write_text(text + '\nCONFIG_LOCALVERSION="-aenv-small"\n')
    run([src / "scripts/kconfig/merge_config.sh", "-m", "-O", build, build / ".config", frag],
        cwd=src)
    run([*make, "olddefconfig"])
    bad = missing_options((build / ".config").read_text(), wanted_options(text))
    if bad:
        raise KernelError("Kconfig did not take these options of kconfig/small.txt: "
                          + ", ".join(bad))


def _make(src: Path, build: Path, jobs: int, progress: Callable[[str], None]) -> None:
    argv = ["make", "-C", str(src), f"O={build}", "ARCH=x86_64", f"-j{jobs}", "vmlinux"]
    progress(f"make -j{jobs} vmlinux (about 8 minutes on 2 cores)")
    tail: deque[str] = deque(maxlen=40)
    env = {**os.environ, "LC_ALL": "C", "KBUILD_BUILD_USER": "aenv", "KBUILD_BUILD_HOST": "aenv"}
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env=env, stdin=subprocess.DEVNULL) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            tail.append(line.rstrip())
            m = _BUILD_LINE.match(line)
            if m:
                progress(f"{m.group(1)} {m.group(2)}")
        code = proc.wait()
    if code != 0:
        raise CommandFailed(argv, code, "\n".join(tail))
    if not (build / "vmlinux").is_file():
        raise KernelError("make finished without producing vmlinux")
