"""Placeholder until the process service lands."""

from __future__ import annotations

from connectrpc.code import Code
from connectrpc.errors import ConnectError

from ..state import EnvdState


class ProcessService:
    def __init__(self, state: EnvdState) -> None:
        self.state = state

    async def shutdown(self) -> None:
        pass

    def __getattr__(self, name: str):
        async def unimplemented(*_):
            raise ConnectError(Code.UNIMPLEMENTED, f"{name} is not implemented")

        return unimplemented
