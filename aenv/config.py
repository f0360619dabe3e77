"""Settings of the host side of aenv, read once from the environment.

Everything aenv keeps lives under ``AENV_HOME`` (default ``/var/lib/aenv`` as root,
``~/.local/share/aenv`` otherwise). Rebuildable artifacts — guest kernels, base images,
downloads — may live elsewhere (``AENV_CACHE_HOME``, default: the home), so several homes
(tests, a second server) can share them. The layout below is the one place that names
those paths; modules ask ``Settings`` instead of joining strings themselves.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path


def _default_home() -> Path:
    if os.geteuid() == 0:
        return Path("/var/lib/aenv")
    return Path.home() / ".local/share/aenv"


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    return int(raw) if raw else default


@dataclass(frozen=True)
class Settings:
    home: Path = field(default_factory=_default_home)
    # Kernels, base images and downloads; None means ``home``.
    cache_home: Path | None = None
    # Host-reachable sandbox addresses are taken from here (one /32 per network slot).
    host_cidr: str = "10.11.0.0/16"
    # veth pairs between the host and each sandbox namespace (one /31 per slot).
    veth_cidr: str = "10.12.0.0/16"
    # Prefix of every host object aenv creates (netns, veth, nft table), so leftovers of a
    # crash can be found and nothing else is touched.
    name_prefix: str = "aenv"
    # Network slots kept created ahead of demand, so a sandbox start finds one ready. As many
    # as a fork's default cap (16 children): made on demand during a fork, the slots cost
    # each child 0.4-0.6 s under contention; kept warm they cost ~100 KiB of kernel memory
    # each and a fork finds them all made.
    warm_slots: int = 16
    # Which VMM drives guests: "qemu" or "firecracker".
    runtime: str = "qemu"

    @classmethod
    def from_env(cls) -> Settings:
        home = os.environ.get("AENV_HOME")
        cache_home = os.environ.get("AENV_CACHE_HOME")
        return cls(
            home=Path(home) if home else _default_home(),
            cache_home=Path(cache_home) if cache_home else None,
            host_cidr=os.environ.get("AENV_HOST_CIDR", cls.host_cidr),
            veth_cidr=os.environ.get("AENV_VETH_CIDR", cls.veth_cidr),
            name_prefix=os.environ.get("AENV_NAME_PREFIX", cls.name_prefix),
            warm_slots=_env_int("AENV_WARM_SLOTS", cls.warm_slots),
            runtime=os.environ.get("AENV_RUNTIME", cls.runtime),
        )

    # -- layout ---------------------------------------------------------------------------

    @cached_property
    def artifacts(self) -> Path:
        return self.cache_home or self.home

    @cached_property
    def kernels_dir(self) -> Path:
        """Guest kernels and initramfs images, one directory per kernel build."""
        return self.artifacts / "kernels"

    @cached_property
    def images_dir(self) -> Path:
        """Content-addressed read-only root-filesystem images."""
        return self.artifacts / "images"

    @cached_property
    def snapshots_dir(self) -> Path:
        """VM snapshots (pauses, persistent snapshots, fork captures, templates): state."""
        return self.home / "snapshots"

    @cached_property
    def layers_dir(self) -> Path:
        """Read-only layers committed by template builds (state: they back templates)."""
        return self.home / "layers"

    @cached_property
    def vms_dir(self) -> Path:
        """One working directory per running VM (fixed relative paths inside)."""
        return self.home / "vms"

    @cached_property
    def cache_dir(self) -> Path:
        """Downloads and build scratch space (Debian packages, wheels, debootstrap trees)."""
        return self.artifacts / "cache"

    @cached_property
    def secrets_dir(self) -> Path:
        return self.home / "secrets"


