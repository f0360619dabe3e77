"""Placeholder until ``/files`` lands."""

from __future__ import annotations

from starlette.routing import Route

from .state import EnvdState


def routes(state: EnvdState) -> list[Route]:
    return []
