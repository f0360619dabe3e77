"""Things envd does only when it owns the machine (inside a guest, ``--guest``).

On a host, envd must never set the clock, feed the kernel's entropy pool or change the
trusted CAs, so the default hooks do nothing; ``GuestHooks(enabled=True)`` does all three.
"""

from __future__ import annotations

import base64
import fcntl
import os
import struct
import time
from datetime import datetime

# Debian's bundle, which OpenSSL, curl and Python read, and the file that makes
# update-ca-certificates keep the CA when it rebuilds the bundle.
CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"
CA_SOURCE = "/usr/local/share/ca-certificates/aenv-egress.crt"
# <linux/random.h>: _IOW('R', 0x03, int[2])
_RNDADDENTROPY = 0x40085203
# Upstream envd leaves small drifts alone: behind by more than 50 ms or ahead by 5 s.
_MAX_BEHIND_S = 0.05
_MAX_AHEAD_S = 5.0


def ca_env(public_roots: bool, bundle: str = CA_BUNDLE,
           source: str = CA_SOURCE) -> dict[str, str]:
    """Variables that make Node.js, Python's ``requests`` (certifi) and ``httpx`` trust the
    node CA as well as the system's. Node's is additive, so it is always set; the other two
    replace a runtime's own list, so they name the system bundle only when it held public
    roots before the node CA was added (an image without ``ca-certificates`` would
    otherwise lose every public site). Processes get them below the sandbox's ``envVars``,
    which may override them."""
    env = {"NODE_EXTRA_CA_CERTS": source}
    if public_roots:
        env.update(REQUESTS_CA_BUNDLE=bundle, SSL_CERT_FILE=bundle)
    return env


FileId = tuple[int, int, int, int]  # device, inode, size, mtime (ns)


def _file_id(path: str) -> FileId | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


class GuestHooks:
    def __init__(self, enabled: bool = False) -> None:
        self.enabled = enabled
        # What the last trust_ca did: (pem, bundle, source, the bundle's and the source's
        # identity after it, the environment it returned).
        self._trusted: tuple[str, str, str, FileId | None, FileId | None,
                             dict[str, str]] | None = None

    def sync_clock(self, timestamp: str) -> None:
        """Step the guest clock to the host's RFC 3339 ``timestamp`` (after a resume the
        guest clock is as old as the snapshot)."""
        if not self.enabled:
            return
        try:
            host = datetime.fromisoformat(timestamp.replace("Z", "+00:00")).timestamp()
        except ValueError:
            return
        drift = host - time.time()
        if drift > _MAX_BEHIND_S or drift < -_MAX_AHEAD_S:
            time.clock_settime(time.CLOCK_REALTIME, host)

    def reseed(self, entropy_b64: str) -> None:
        """Mix host-provided bytes into the kernel pool and credit them, so forks of one
        snapshot do not share their random state."""
        if not self.enabled:
            return
        try:
            data = base64.b64decode(entropy_b64)
        except ValueError:
            return
        if not data:
            return
        req = struct.pack("ii", len(data) * 8, len(data)) + data
        with open("/dev/random", "wb") as f:
            fcntl.ioctl(f, _RNDADDENTROPY, req)

    def trust_ca(self, pem: str, bundle: str = CA_BUNDLE,
                 source: str = CA_SOURCE) -> dict[str, str]:
        """Add ``pem`` (the node's egress CA) to the system's trusted CAs, once: requests
        whose headers the egress proxy sets are served with its certificates. Returns the
        environment that points runtimes with CA lists of their own at it (``ca_env``).

        Every /init after a restore brings the same CA, which the snapshot's guest trusted
        already: while both files are as this call left them (device, inode, size, mtime),
        the answer is the last one and the bundle (~200 KB) is not read again. Reading and
        copying it was hundreds of KB of guest memory written, and code translated, in
        every sandbox restored under TCG."""
        if not self.enabled or "-----BEGIN CERTIFICATE-----" not in pem:
            return {}
        pem = pem.strip() + "\n"
        last = self._trusted
        if (last is not None and last[:3] == (pem, bundle, source)
                and last[3:5] == (_file_id(bundle), _file_id(source))):
            return dict(last[5])
        try:
            with open(bundle) as f:
                held = f.read()
        except FileNotFoundError:
            held = ""
        if pem not in held:  # once: /init comes after every resume, and does no more
            for path in (source, bundle):
                os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(source, "w") as f:
                f.write(pem)
            with open(bundle, "a") as f:
                f.write(pem)
        env = ca_env(held.replace(pem, "").count("-----BEGIN CERTIFICATE-----") > 0,
                     bundle, source)
        self._trusted = (pem, bundle, source, _file_id(bundle), _file_id(source), env)
        return dict(env)
