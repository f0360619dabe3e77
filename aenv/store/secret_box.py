"""The node key that encrypts secret values at rest (AES-256-GCM).

The key is 32 random bytes in ``<secrets>/secret-key`` (directory 0700, file 0600), made
once at the first start and read at every later one. Losing it loses every stored secret
value (the records stay, their values no longer open); copying it with the database
moves them. Each value is sealed with a fresh 96-bit nonce and the secret's id and version
as associated data, so a ciphertext copied onto another row or version does not open.

Why AES-GCM from ``cryptography`` (already a dependency for TLS): an authenticated
cipher from a maintained library, nothing of our own; the node key never leaves the host
and the database alone holds no readable value.
"""

from __future__ import annotations

import os
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

KEY_FILE = "secret-key"
_NONCE = 12


class SecretKeyError(Exception):
    """The node key is unreadable or a stored value does not open with it."""


def _create_key(path: Path) -> bytes:
    """Write a new key, 0600 from the first byte, never over an existing file."""
    key = AESGCM.generate_key(bit_length=256)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, key)
        os.fsync(fd)
    finally:
        os.close(fd)
    return key


def load_key(secrets_dir: Path) -> bytes:
    """The node key from ``secrets_dir``, made there if it does not exist yet."""
    secrets_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = secrets_dir / KEY_FILE
    try:
        key = _create_key(path)
    except FileExistsError:
        key = path.read_bytes()
    if len(key) != 32:
        raise SecretKeyError(f"{path}: expected 32 bytes, found {len(key)}")
    return key


class SecretBox:
    """Seals and opens secret values with one node key."""

    def __init__(self, key: bytes) -> None:
        self._aead = AESGCM(key)

    def seal(self, plaintext: str, context: str) -> bytes:
        nonce = os.urandom(_NONCE)
        return nonce + self._aead.encrypt(nonce, plaintext.encode(), context.encode())

    def open(self, sealed: bytes, context: str) -> str:
        try:
            return self._aead.decrypt(sealed[:_NONCE], sealed[_NONCE:],
                                      context.encode()).decode()
        except (InvalidTag, ValueError):
            raise SecretKeyError(f"secret {context} does not open with this node's key") \
                from None
