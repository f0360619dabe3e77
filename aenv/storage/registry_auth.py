"""Authorization to one registry repository: anonymous, bearer-token challenge, basic.

A registry says how it wants to be asked in the ``WWW-Authenticate`` header of a 401.
``Bearer realm=...,service=...,scope=...`` (Docker Hub, GHCR, Quay, distribution's
``auth: token``) means: get a token from ``realm`` (with basic credentials when the
caller has some, anonymously otherwise) and send it as ``Authorization: Bearer``;
``Basic`` means send the username and password with every request. ``Authorizer``
answers one challenge and keeps the header for every later request of the pull, so a
pull asks the token service once, not once per blob.

Credentials come from the caller (E2B's ``fromImageRegistry``) and live only in memory:
``RegistryCredentials`` hides the password from ``repr``, no message built here quotes
a header, a token or a password, nothing here logs and nothing is written to disk.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx

from .registry_errors import AuthFailed, RegistryError, RegistryUnreachable

# One auth-param: name=token or name="quoted string" (RFC 9110 section 11.2).
_PARAM = re.compile(r'([A-Za-z0-9_.-]+)\s*=\s*(?:"((?:[^"\\]|\\.)*)"|([^\s,"]*))')
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9_.!#$%&'*+^`|~-]*")


@dataclass(frozen=True)
class RegistryCredentials:
    """A username and password (or token) for one pull; the password never shows."""

    username: str
    password: str = field(repr=False)

    def __repr__(self) -> str:
        return f"RegistryCredentials(username={self.username!r}, password=<hidden>)"

    @classmethod
    def from_e2b(cls, value: Mapping[str, Any]) -> RegistryCredentials:
        """E2B's ``fromImageRegistry``: ``{"type": "registry", "username", "password"}``
        (the cloud-specific types, ``aws`` and ``gcp``, are refused by name)."""
        kind = value.get("type")
        if kind != "registry":
            raise RegistryError(f"registry credentials of type {kind!r} are not supported "
                                "(only 'registry': a username and password)")
        username, password = value.get("username"), value.get("password")
        if not isinstance(username, str) or not isinstance(password, str) or not username:
            raise RegistryError("registry credentials need a username and a password")
        return cls(username, password)

    def basic(self) -> str:
        raw = f"{self.username}:{self.password}".encode()
        return "Basic " + base64.b64encode(raw).decode()


@dataclass(frozen=True)
class Challenge:
    """One challenge of a ``WWW-Authenticate`` header: scheme (lower case) and params."""

    scheme: str
    params: dict[str, str]


def parse_challenges(header: str) -> list[Challenge]:
    """Every challenge in ``header`` (``Bearer realm="x",scope="y", Basic realm="z"``):
    a token not followed by ``=`` starts a challenge, ``name=value`` pairs belong to the
    last one started."""
    found: list[Challenge] = []
    pos, end = 0, len(header)
    while pos < end:
        while pos < end and header[pos] in " \t,":
            pos += 1
        if pos >= end:
            break
        param = _PARAM.match(header, pos)
        if param and found:
            value = param.group(2) if param.group(2) is not None else param.group(3)
            found[-1].params[param.group(1).lower()] = re.sub(r"\\(.)", r"\1", value)
            pos = param.end()
            continue
        scheme = _SCHEME.match(header, pos)
        if not scheme:
            break
        found.append(Challenge(scheme.group(0).lower(), {}))
        pos = scheme.end()
    return found


TokenGet = Callable[[str, dict[str, str], str | None], httpx.Response]
"""``get(url, params, authorization)``: one GET to a token service, under the pull's
transport policy (the caller checks the URL's scheme and host)."""


class Authorizer:
    """The ``Authorization`` header for one repository of one registry.

    ``header`` starts as None (anonymous). ``answer(response)`` reads a 401's
    challenges and sets it, asking the token service through ``token_get`` for a bearer
    challenge; it raises ``AuthFailed`` when the challenge cannot be met (basic without
    credentials, a token service that refuses them)."""

    def __init__(self, image: str, registry: str, repository: str,
                 credentials: RegistryCredentials | None, token_get: TokenGet) -> None:
        self.image = image
        self.registry = registry
        self.repository = repository
        self.credentials = credentials
        self.token_get = token_get
        self.header: str | None = None
        self.scheme: str | None = None

    def answer(self, response: httpx.Response) -> None:
        challenges = parse_challenges(response.headers.get("www-authenticate", ""))
        by_scheme = {c.scheme: c for c in challenges}
        if "bearer" in by_scheme:
            self.header = "Bearer " + self._token(by_scheme["bearer"])
            self.scheme = "bearer"
        elif "basic" in by_scheme:
            if self.credentials is None:
                raise AuthFailed(f"registry {self.registry} requires a username and password "
                                 f"for {self.image!r}")
            self.header = self.credentials.basic()
            self.scheme = "basic"
        else:
            raise AuthFailed(f"registry {self.registry} refused access to {self.image!r} "
                             "without saying how to authenticate")

    def refused(self) -> AuthFailed:
        """The error for a 401 that came back although the challenge was answered."""
        if self.credentials is not None:
            return AuthFailed(f"registry {self.registry} refused the credentials for "
                              f"{self.image!r}")
        return AuthFailed(f"registry {self.registry} refused anonymous access to "
                          f"{self.image!r}: the image may not exist, or it needs credentials")

    def _token(self, challenge: Challenge) -> str:
        realm = challenge.params.get("realm")
        if not realm:
            raise AuthFailed(f"registry {self.registry} sent a bearer challenge without a "
                             "token service (realm)")
        params = {"scope": challenge.params.get("scope")
                  or f"repository:{self.repository}:pull"}
        if "service" in challenge.params:
            params["service"] = challenge.params["service"]
        basic = self.credentials.basic() if self.credentials is not None else None
        response = self.token_get(realm, params, basic)
        if response.status_code in (401, 403):
            raise self.refused()
        if response.status_code != 200:
            raise RegistryUnreachable(f"the token service of registry {self.registry} "
                                      f"answered {response.status_code} for {self.image!r}")
        try:
            body = response.json()
        except ValueError:
            body = None
        token = body.get("token") or body.get("access_token") if isinstance(body, dict) \
            else None
        if not isinstance(token, str) or not token:
            raise RegistryUnreachable(f"the token service of registry {self.registry} "
                                      f"gave no token for {self.image!r}")
        return token
