"""``aenv doctor``: what this host can and cannot do, one row per check.

Each area reports its own rows (``doctor_checks()`` in aenv.runtime, aenv.storage.disks,
aenv.network); this command only adds the host basics and prints them.
"""

from __future__ import annotations

import platform
import shutil
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table


def register(app: typer.Typer) -> None:
    app.command()(doctor)


def _free_disk(path: Path) -> str:
    probe = path
    while not probe.exists():
        probe = probe.parent
    usage = shutil.disk_usage(probe)
    return f"{usage.free / 2**30:.1f} GiB free of {usage.total / 2**30:.1f} GiB at {probe}"


def doctor() -> None:
    """Check the host: kernel, virtualization, storage, networking."""
    from aenv import network, runtime
    from aenv.config import Settings, SettingsError
    from aenv.storage import disks

    try:
        settings = Settings.from_env()
    except SettingsError as e:
        typer.echo(f"aenv doctor: {e}", err=True)
        raise typer.Exit(1) from None
    table = Table("check", "result")
    rows = [
        ("host kernel", f"{platform.release()} ({platform.machine()})"),
        ("data dir", _free_disk(settings.home)),
        *runtime.doctor_checks(),
        *disks.doctor_checks(settings.home),
        *network.doctor_checks(),
    ]
    for check, result in rows:
        table.add_row(check, result)
    Console().print(table)
