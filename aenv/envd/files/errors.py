"""The one exception ``/files`` code raises to answer with an HTTP error.

``status`` and ``message`` become the ``{"code": status, "message": message}`` body that
the SDK maps to its exceptions (400 InvalidArgument, 401 Authentication, 404 FileNotFound,
507 NotEnoughSpace, others SandboxException).
"""

from __future__ import annotations


class FilesHTTPError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
