"""Why a process operation was refused, each reason carrying the Connect code it maps to.

The process modules raise these and stay free of RPC types; ``service.py`` turns them into
``ConnectError``s. Messages match upstream envd's where the SDKs or their tests read them.
"""

from __future__ import annotations

from connectrpc.code import Code


class ProcessError(Exception):
    """Base class: ``code`` is the Connect code the RPC layer answers with."""

    code = Code.INTERNAL


class InvalidRequest(ProcessError):
    """The request is malformed or names something unusable (missing cmd, bad cwd)."""

    code = Code.INVALID_ARGUMENT


class ProcessNotFound(ProcessError):
    """No live process matches the selector."""

    code = Code.NOT_FOUND


class TagInUse(ProcessError):
    """Another live process already carries the requested tag."""

    code = Code.ALREADY_EXISTS


class UnsupportedSignal(ProcessError):
    """Only SIGKILL and SIGTERM may be sent."""

    code = Code.UNIMPLEMENTED


class InputRejected(ProcessError):
    """Input (or a resize) went to a channel the process does not have: stdin of a PTY
    process, the PTY of a pipe process, a closed or disabled stdin, or a dead writer."""

    code = Code.INTERNAL


class StdinCloseFailed(ProcessError):
    """CloseStdin on a PTY process (upstream answers ``unknown`` here, not ``internal``)."""

    code = Code.UNKNOWN
