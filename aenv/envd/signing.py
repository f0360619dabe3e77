"""Access check of ``/files``: the access-token header, or a signed URL instead.

``download_url()``/``upload_url()`` carry no header, so ``/files`` accepts a signature
``v1_`` + unpadded base64(sha256("<path>:<op>:<user>:<token>[:<expiration>]")), where
``path`` and ``user`` are the query parameters exactly as sent (``user`` empty when the
parameter is absent) and ``op`` is ``read`` or ``write``. Checks, in upstream's order:
no token set -> allowed; a header token must match; else the signature must be present
and match; then it must not have expired. Each failure has upstream's exact message.

A signature without an expiration never expires (it is as good as the token, for the
sandbox's life). E2B's envd accepts those, and the SDK makes them by default:
``download_url(path)`` without ``use_signature_expiration`` signs no expiration. So they
are accepted unless ``require_expiration`` is set (envd's
``AENV_ENVD_REQUIRE_SIGNATURE_EXPIRATION=1``), which refuses them with a 401 as well.
The expiration is part of the signed string, so it cannot be dropped or moved without
invalidating the signature.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import time
from typing import Literal

from .state import EnvdState

Operation = Literal["read", "write"]
REQUIRE_EXPIRATION_ENV = "AENV_ENVD_REQUIRE_SIGNATURE_EXPIRATION"


class SigningError(Exception):
    """The request may not use ``/files``; the message is the 401 body's."""


def expiration_required_by_env() -> bool:
    return os.environ.get(REQUIRE_EXPIRATION_ENV, "").strip().lower() in ("1", "true", "yes")


def signature(
    path: str, operation: Operation, user: str, token: str, expiration: int | None
) -> str:
    fields = [path, operation, user, token]
    if expiration is not None:
        fields.append(str(expiration))
    digest = hashlib.sha256(":".join(fields).encode()).digest()
    return "v1_" + base64.b64encode(digest).decode().rstrip("=")


def check(
    state: EnvdState,
    *,
    header_token: str | None,
    signature_param: str | None,
    expiration: int | None,
    username: str | None,
    path: str,
    operation: Operation,
    require_expiration: bool = False,
) -> None:
    """Raise SigningError unless the request is authorised for ``operation`` on ``path``."""
    token = state.access_token
    if token is None:
        return
    if header_token:
        if not state.token_matches(header_token):
            raise SigningError("access token present in header but does not match")
        return
    if signature_param is None:
        raise SigningError("missing signature query parameter")
    expected = signature(path, operation, username or "", token, expiration)
    if not hmac.compare_digest(expected.encode(), signature_param.encode()):
        raise SigningError("invalid signature")
    if expiration is None and require_expiration:
        raise SigningError("signature without expiration is not accepted")
    if expiration is not None and expiration < int(time.time()):
        raise SigningError("signature is already expired")
