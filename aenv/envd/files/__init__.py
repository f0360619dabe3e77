"""envd's ``/files`` endpoint: file download and upload over plain HTTP.

``routes(state)`` gives the Starlette routes; the rest of the package streams bodies
(download, upload, multipart, gzip) and negotiates codings.
"""

from .routes import routes

__all__ = ["routes"]
