"""Placeholder until the filesystem service lands."""

from __future__ import annotations

from connectrpc.code import Code
from connectrpc.errors import ConnectError

from ..state import EnvdState


class FilesystemService:
    def __init__(self, state: EnvdState) -> None:
        self.state = state

    def __getattr__(self, name: str):
        async def unimplemented(*_):
            raise ConnectError(Code.UNIMPLEMENTED, f"{name} is not implemented")

        return unimplemented
