"""Durable state of one aenv node: sandboxes, templates and their builds, snapshots.

SQLite in WAL mode under ``AENV_HOME`` is the embedded default. The store is the source of
truth: after a crash the orchestrator rebuilds everything it knows from here. It holds no
business logic — state transitions are decided by the orchestrator and written here with
compare-and-set so that two requests cannot both win.
"""

from .db import Database
from .records import BuildRecord, SandboxRecord, TemplateRecord
from .sandboxes import SandboxStore
from .templates import TemplateStore

__all__ = [
    "BuildRecord",
    "Database",
    "SandboxRecord",
    "SandboxStore",
    "TemplateRecord",
    "TemplateStore",
]
