"""Errors of the storage layer: one base class, one subclass per thing that can fail.

Each carries what a caller needs to show or act on (the command and its stderr tail for a
failed tool, the input that could not be read), so the CLI and the orchestrator never have
to parse messages.
"""

from __future__ import annotations

from collections.abc import Sequence


class StorageError(Exception):
    """Base of every storage error."""


class CommandFailed(StorageError):
    """An external tool (apt-get, dpkg-deb, debootstrap, mkfs.ext4, make, ...) failed."""

    def __init__(self, argv: Sequence[str], returncode: int, stderr: str) -> None:
        self.argv = list(argv)
        self.returncode = returncode
        self.stderr_tail = "\n".join(stderr.strip().splitlines()[-20:])
        super().__init__(
            f"{' '.join(self.argv[:6])}{' ...' if len(self.argv) > 6 else ''} "
            f"exited with {returncode}:\n{self.stderr_tail}"
        )


class KernelError(StorageError):
    """A guest kernel could not be prepared (bad vmlinuz, missing module, no PVH note)."""


class ImageError(StorageError):
    """A root-filesystem image could not be built from its source."""


class LayerError(ImageError):
    """A layer tarball or OCI layout is malformed or tries to escape the root."""
