"""What the orchestrator told envd through ``POST /init``, shared by every handler.

One ``EnvdState`` lives for the life of the daemon. ``/init`` is called after every boot
and every resume, so each field can change while processes run; handlers read it on each
request instead of caching it.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass, field

# The envd API level we implement (upstream envd 0.6.13). The SDKs gate features on this
# value; anything >= 0.6.4 unlocks all of them.
ENVD_VERSION = "0.6.13"


@dataclass
class EnvdState:
    access_token: str | None = None
    env_vars: dict[str, str] = field(default_factory=dict)
    default_user: str = "root"
    default_workdir: str | None = None
    # Set by envd itself, below ``env_vars`` in every process: the node CA's variables
    # (``guest.ca_env``). Not part of ``/envs``, which is the sandbox's own.
    tls_env: dict[str, str] = field(default_factory=dict)

    def process_env(self) -> dict[str, str]:
        """What every process starts with, before its own ``envs``: the sandbox's
        ``envVars`` over envd's ``tls_env``."""
        return {**self.tls_env, **self.env_vars}

    def token_matches(self, candidate: str | None) -> bool:
        """Constant-time check of ``candidate`` against the access token (if one is set)."""
        if self.access_token is None:
            return True
        if candidate is None:
            return False
        return hmac.compare_digest(candidate.encode(), self.access_token.encode())
