"""Errors of a registry pull: one base class, one subclass per thing a user can act on.

Every message names the image (as the user wrote it, expanded) and says what went wrong
in the user's words. None ever holds a credential: callers build messages from the
reference, the registry host and status codes only, never from request headers, token
answers or ``RegistryCredentials``. They are ``ImageError``s, so whoever builds an image
treats a failed pull like any other unusable image source.
"""

from __future__ import annotations

from .errors import ImageError


class RegistryError(ImageError):
    """Base of every registry pull error."""


class BadReference(RegistryError, ValueError):
    """The text is not an image reference (or names an unsupported digest algorithm)."""


class ImageNotFound(RegistryError):
    """The registry has no such repository, tag or digest."""


class AuthFailed(RegistryError):
    """The registry (or its token service) refused the credentials, or wants some."""


class NoPlatform(RegistryError):
    """The image index has no ``linux/amd64`` manifest; ``platforms`` lists what it has."""

    def __init__(self, message: str, platforms: list[str]) -> None:
        super().__init__(message)
        self.platforms = platforms


class RegistryUnreachable(RegistryError):
    """No connection, TLS failure, a refused transport (plain HTTP to a host not allowed
    it), a timeout, or a server error from the registry."""


class DigestMismatch(RegistryError):
    """A manifest or blob does not hash to the digest that names it."""


class UnsupportedManifest(RegistryError):
    """A manifest of a kind aenv does not read (Docker schema 1, an unknown media type)."""
