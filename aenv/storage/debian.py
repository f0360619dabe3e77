"""Debian packages as build inputs: resolved and downloaded with apt, unpacked, never installed.

``download`` fetches ``.deb`` files with ``apt-get download`` into a cache directory (a file
already there is reused, so a second build needs no network); ``unpack`` extracts one with
``dpkg-deb -x``. ``debootstrap`` makes a minimal Debian tree from the Debian registry.
The host's apt sources decide which mirror and suites are used for downloads; apt's lists
are refreshed (``apt-get update``) only when they do not know a package at all.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ._run import run
from .errors import StorageError

DEBIAN_SUITE = "bookworm"
# debootstrap needs a mirror URL of its own (it does not read apt's sources).
DEBIAN_MIRROR = "http://deb.debian.org/debian"


@dataclass(frozen=True)
class Package:
    name: str
    version: str

    @property
    def filename(self) -> str:
        # apt-get download names files name_version_arch.deb with ':' escaped as %3a.
        return f"{self.name}_{self.version.replace(':', '%3a')}_"


def candidate(name: str) -> Package:
    """The version apt would install of ``name``, from apt's lists; when the lists do not
    know it (a fresh machine), they are refreshed once with ``apt-get update``."""
    found = _policy_candidate(name)
    if found is None and _refresh_lists():
        found = _policy_candidate(name)
    if found is None:
        raise StorageError(f"Debian package {name!r} is not known to apt")
    return Package(name, found)


def _policy_candidate(name: str) -> str | None:
    m = re.search(r"^\s*Candidate:\s*(\S+)", run(["apt-cache", "policy", name]), re.MULTILINE)
    return m.group(1) if m and m.group(1) != "(none)" else None


_lists_refreshed = False


def _refresh_lists() -> bool:
    """Run ``apt-get update`` once per process (root only); whether it ran."""
    global _lists_refreshed
    if _lists_refreshed or os.geteuid() != 0:
        return False
    _lists_refreshed = True
    run(["apt-get", "update", "-qq"])
    return True


def depends_of(pkg: Package) -> list[str]:
    """Package names in the ``Depends`` field of exactly this version of ``pkg``."""
    out = run(["apt-cache", "show", f"{pkg.name}={pkg.version}"])
    m = re.search(r"^Depends:\s*(.+)$", out, re.MULTILINE)
    if not m:
        return []
    return [alt.split("|")[0].split("(")[0].strip() for alt in m.group(1).split(",")]


def closure(names: Sequence[str], *, beside: Sequence[str] = ()) -> list[Package]:
    """What ``apt-get install --no-install-recommends names`` would install on a Debian
    that has ``beside`` (and their dependencies) and nothing else, in apt's order.

    apt resolves both sets from scratch (an empty dpkg status) and the second is taken
    away, so alternatives are chosen as apt chooses them and the answer does not depend
    on what this host has installed. The guest's own apt still decides at install time;
    a package this left out that the guest lacks makes that install fail by its name.
    apt's lists are refreshed first when they do not know ``names`` (``candidate``)."""
    for name in names:
        candidate(name)
    have = {p.name for p in _simulate(beside)} if beside else set()
    return [p for p in _simulate(names) if p.name not in have]


def _simulate(names: Sequence[str]) -> list[Package]:
    with tempfile.TemporaryDirectory(prefix="aenv-apt-") as d:
        status = Path(d) / "status"
        status.touch()
        out = run(["apt-get", "-s", "-q", "-o", f"Dir::State::status={status}",
                   "install", "--no-install-recommends", *names])
    return [Package(m.group(1), m.group(2))
            for m in re.finditer(r"^Inst (\S+) \((\S+) ", out, re.MULTILINE)]


def download(packages: Sequence[Package], dest: Path) -> list[Path]:
    """The ``.deb`` file of each package in ``dest``, downloading only the missing ones."""
    dest.mkdir(parents=True, exist_ok=True)
    missing = [p for p in packages if not _cached(p, dest)]
    if missing:
        run(["apt-get", "download", "-q", *(f"{p.name}={p.version}" for p in missing)], cwd=dest)
    found = []
    for p in packages:
        path = _cached(p, dest)
        if path is None:
            raise StorageError(f"apt-get download left no file for {p.name} {p.version}")
        found.append(path)
    return found


def _cached(pkg: Package, dest: Path) -> Path | None:
    for path in dest.glob(pkg.filename + "*.deb"):
        return path
    return None


def unpack(deb: Path, dest: Path) -> None:
    """Extract the files of ``deb`` below ``dest`` (maintainer scripts are not run)."""
    dest.mkdir(parents=True, exist_ok=True)
    run(["dpkg-deb", "-x", deb, dest])


def debootstrap(
    target: Path,
    *,
    include: Sequence[str],
    debs_cache: Path,
    suite: str = DEBIAN_SUITE,
    mirror: str = DEBIAN_MIRROR,
) -> None:
    """A ``--variant=minbase`` Debian tree in ``target`` plus ``include``.

    Runs as root so that ownership in the tree is real. ``debs_cache`` keeps the downloaded
    packages, so a rebuild of the same tree downloads nothing.
    """
    if shutil.which("debootstrap") is None:
        raise StorageError("debootstrap is not installed (scripts/setup.sh installs it)")
    debs_cache.mkdir(parents=True, exist_ok=True)
    run([
        "debootstrap",
        "--variant=minbase",
        f"--include={','.join(include)}",
        f"--cache-dir={debs_cache}",
        "--components=main",
        suite,
        target,
        mirror,
    ])
