"""Fixtures of the storage tests: a private aenv home per test module, ext4 readers."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from aenv.config import Settings


@pytest.fixture
def settings(tmp_path) -> Settings:
    return Settings(home=tmp_path / "aenv-home")


def ext4_cat(image: Path, path: str) -> bytes:
    """Contents of ``path`` inside an ext4 image, read with debugfs (no mount)."""
    out = subprocess.run(["debugfs", "-R", f"cat {path}", str(image)], capture_output=True,
                         check=True)
    return out.stdout


def ext4_owner_mode(image: Path, path: str) -> tuple[int, int, int]:
    """(uid, gid, permission bits) of ``path`` inside an ext4 image."""
    out = subprocess.run(["debugfs", "-R", f"stat {path}", str(image)], capture_output=True,
                         text=True, check=True).stdout
    m = re.search(r"Mode:\s+(\d+).*?User:\s+(\d+)\s+Group:\s+(\d+)", out, re.DOTALL)
    if not m:
        raise FileNotFoundError(f"{path} not in {image}: {out[-200:]}")
    return int(m.group(2)), int(m.group(3)), int(m.group(1), 8) & 0o7777


def ext4_exists(image: Path, path: str) -> bool:
    out = subprocess.run(["debugfs", "-R", f"stat {path}", str(image)], capture_output=True,
                         text=True, check=False)
    return "Inode:" in out.stdout
