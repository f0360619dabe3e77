"""Durable state of one aenv node: sandboxes, templates and their builds, snapshots.

SQLite in WAL mode under ``AENV_HOME`` is the embedded default. The store is the source of
truth: after a crash the orchestrator rebuilds everything it knows from here. It holds no
business logic — state transitions are decided by the orchestrator and written here with
compare-and-set so that two requests cannot both win. The lifecycle's vocabulary lives
here (``states``: the enums, and the table of transitions the store refuses to break)
because both the store and the orchestrator need it and the store imports nothing above it.
"""

from .db import Database
from .records import BuildRecord, SandboxRecord, TemplateRecord
from .sandboxes import SandboxStore
from .states import (
    BUILD_ENDED,
    ENDED_STATES,
    LIVE_STATES,
    TRANSITIONS,
    VM_STATES,
    BuildStatus,
    IllegalTransition,
    SandboxState,
    TemplateKind,
)
from .templates import TemplateStore

__all__ = [
    "BUILD_ENDED",
    "ENDED_STATES",
    "LIVE_STATES",
    "TRANSITIONS",
    "VM_STATES",
    "BuildRecord",
    "BuildStatus",
    "Database",
    "IllegalTransition",
    "SandboxRecord",
    "SandboxState",
    "SandboxStore",
    "TemplateKind",
    "TemplateRecord",
    "TemplateStore",
]
