"""What can go wrong in a lifecycle operation, with what the API needs to answer it."""

from __future__ import annotations


class OrchestratorError(Exception):
    """Base class. ``status`` is the HTTP status the API answers with."""

    status = 500

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class SandboxNotFound(OrchestratorError):
    status = 404

    def __init__(self, sandbox_id: str) -> None:
        super().__init__(f"sandbox '{sandbox_id}' not found")
        self.sandbox_id = sandbox_id


class TemplateNotFound(OrchestratorError):
    status = 404

    def __init__(self, template: str) -> None:
        super().__init__(f"template '{template}' not found")
        self.template = template


class Conflict(OrchestratorError):
    """The sandbox is in a state that does not allow the operation."""

    status = 409


class LimitReached(OrchestratorError):
    """This node is full: too many sandboxes, a full start queue, or no room in its
    budgets. ``retry_after``: whole seconds the client should wait (the API's
    ``Retry-After``); the default is a guess for room that frees when sandboxes end."""

    status = 429

    def __init__(self, message: str, *, retry_after: int = 5) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class InsufficientStorage(OrchestratorError):
    """Not enough disk for what the operation must write (e.g. a pause's snapshot)."""

    status = 507


class InvalidRequest(OrchestratorError):
    status = 400


class StartFailed(OrchestratorError):
    """The VM could not be made or envd never answered; nothing is left running."""

    status = 500


class Unsupported(OrchestratorError):
    """This node cannot do that (yet): e.g. pause before snapshots exist."""

    status = 501


class NotRestorable(OrchestratorError):
    """This node cannot restore the snapshot (another driver, accelerator, CPU model,
    guest kernel or aenv version wrote it); the message says why. Another node may."""

    status = 409
