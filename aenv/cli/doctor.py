"""``aenv doctor``: what this host can and cannot do (filled in as checks land)."""

from __future__ import annotations

import platform

import typer
from rich.console import Console
from rich.table import Table


def register(app: typer.Typer) -> None:
    app.command()(doctor)


def doctor() -> None:
    """Check the host: kernel, virtualization, storage, networking."""
    table = Table("check", "result")
    table.add_row("kernel", platform.release())
    from aenv import runtime
    from aenv.storage import disks

    for check, result in [*runtime.doctor_checks(), *disks.doctor_checks()]:
        table.add_row(check, result)
    Console().print(table)
