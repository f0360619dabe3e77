"""Identifiers and secrets handed out to clients.

Sandbox ids are 20 characters of ``[a-z0-9]``: the SDKs build host names
``<port>-<id>.<domain>``, so ids must not contain ``-`` or ``.``.
"""

from __future__ import annotations

import secrets
import string

from ..storage.image_ref import ImageRef

_ALPHABET = string.ascii_lowercase + string.digits


def new_id(length: int = 20) -> str:
    return "".join(secrets.choice(_ALPHABET) for _ in range(length))


def new_token() -> str:
    return secrets.token_hex(20)


def is_valid_id(value: str) -> bool:
    return 0 < len(value) <= 64 and all(c in _ALPHABET for c in value)


def new_layer_ref() -> str:
    """``layer:<id>``: the name of a committed disk layer in the node's layer store."""
    return str(ImageRef.layer(new_id()))


def new_snapshot_ref() -> str:
    """``snapshot:<id>``: the name of a snapshot in the node's snapshot store."""
    return str(ImageRef.snapshot(new_id()))
