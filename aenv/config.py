"""Every setting of aenv, declared once: environment variable, type, default, description.

``Settings`` holds what the server and the host-side commands read (``aenv server``,
``aenv image``, ``aenv doctor``); ``ClientSettings`` what the CLI's client side reads to
find a server (``AENV_URL``, ``AENV_API_KEY``, their ``E2B_*`` fallbacks). Each field is
declared with ``setting(...)``: its variable(s), default and one-line description side by
side, its type from the annotation. docs/install.md's tables are this module's output
(``python -m aenv.config`` prints them; tests/deploy/test_settings_files.py compares the
doc, deploy/systemd/aenv.env, the compose file and the k8s manifests with them).

``from_env()`` reads the environment once; callers pass the object down instead of
reading variables themselves. An empty value counts as unset (docker-compose passes
``${X:-}`` that way), values are stripped, and one that does not parse or is out of range
is a ``SettingsError`` naming the variable. ``repr`` shows secrets (the API key) as
``<hidden>``. ``aenv server``'s flags override the environment (``override``), which
overrides the declared defaults.

Everything aenv keeps lives under ``AENV_HOME`` (default ``/var/lib/aenv`` as root,
``~/.local/share/aenv`` otherwise). Rebuildable artifacts — guest kernels, base images,
downloads — may live elsewhere (``AENV_CACHE_HOME``, default: the home), so several homes
(tests, a second server) can share them. The layout below is the one place that names
those paths; modules ask ``Settings`` instead of joining strings themselves.

Guest-side variables are not here: envd runs alone in the guest and reads its own
(``AENV_ENVD_REQUIRE_SIGNATURE_EXPIRATION``, in ``aenv/envd``).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import math
import os
import re
import typing
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Self

ROOT_HOME = Path("/var/lib/aenv")
# Drivers of aenv.runtime.get_runtime (its RUNTIMES; not imported: it pulls in the drivers).
RUNTIMES = ("qemu", "firecracker")
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


class SettingsError(ValueError):
    """A variable's value cannot be used; the message names the variable."""


@dataclass(frozen=True)
class Var:
    """How one field is set: ``names`` are its environment variables, the first one set
    wins; ``shown`` is the default as the docs write it, when it is computed; ``flag``
    the command-line option that overrides them."""

    names: tuple[str, ...]
    doc: str
    check: Callable[[Any], str | None] | None = None
    parse: Callable[[str], Any] | None = None
    shown: str | None = None
    secret: bool = False
    flag: str | None = None  # aenv server's option for it, which wins over the variable

    @property
    def name(self) -> str:
        return self.names[0]


def setting(env: str | tuple[str, ...], default: Any = dataclasses.MISSING, *, doc: str,
            check: Callable[[Any], str | None] | None = None,
            parse: Callable[[str], Any] | None = None,
            default_factory: Callable[[], Any] | Any = dataclasses.MISSING,
            shown: str | None = None, secret: bool = False, flag: str | None = None) -> Any:
    """A settings field read from ``env``. ``check`` returns what is wrong with a parsed
    value (or None); ``parse`` replaces the one the annotation implies."""
    names = (env,) if isinstance(env, str) else tuple(env)
    return field(default=default, default_factory=default_factory,
                 metadata={"var": Var(names, doc, check, parse, shown, secret, flag)})


# -- parsing and checks -----------------------------------------------------------------

_TRUE = frozenset({"1", "true", "t", "yes", "y", "on"})
_FALSE = frozenset({"0", "false", "f", "no", "n", "off"})


def _bool(raw: str) -> bool:
    """What click's BOOL took from ``envvar=`` before this module: 1/0, true/false,
    yes/no, on/off, t/f, y/n in any case."""
    low = raw.lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise ValueError("is not a boolean (use 1 or 0)")


def _int(raw: str) -> int:
    try:
        return int(raw)
    except ValueError:
        raise ValueError("is not a whole number") from None


def _float(raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise ValueError("is not a number") from None
    if not math.isfinite(value):
        raise ValueError("is not a finite number")
    return value


def _str(raw: str) -> str:
    return raw


def _at_least(low: float) -> Callable[[float], str | None]:
    return lambda v: None if v >= low else f"must be at least {low:g}"


def _above(low: float) -> Callable[[float], str | None]:
    return lambda v: None if v > low else f"must be more than {low:g}"


def _port(v: int) -> str | None:
    return None if 0 <= v <= 65535 else "is not a TCP port (0-65535)"


def _one_of(*choices: str) -> Callable[[str], str | None]:
    return lambda v: None if v in choices else f"is not one of {', '.join(choices)}"


def _ipv4_network(v: str) -> str | None:
    try:
        ipaddress.IPv4Network(v)  # what network.Addressing makes of it
    except ValueError as e:
        return f"is not an IPv4 network ({e})"
    return None


def _ipv4_networks(v: str | None) -> str | None:
    for entry in (v or "").split(","):
        if entry.strip() and (problem := _ipv4_network(entry.strip())) is not None:
            return f"has {entry.strip()!r}, which {problem}"
    return None


def _prefix(v: str) -> str | None:
    if re.fullmatch(r"[a-z][a-z0-9]*", v):
        return None
    return "must be lower-case letters and digits, starting with a letter"


def _file(v: Path | None) -> str | None:
    return "is a directory, not a file" if v is not None and v.is_dir() else None


_REGISTRY_HOST = r"(?:[A-Za-z0-9.-]+|\[[0-9A-Fa-f:]+\])(?::[0-9]{1,5})?"


def _registry_hosts(v: str | None) -> str | None:
    for entry in (v or "").split(","):
        entry = entry.strip()
        if entry and not re.fullmatch(_REGISTRY_HOST, entry):
            return f"has {entry!r}, which is not a host or host:port"
    return None


def _redis_url(v: str | None) -> str | None:
    if v is None or re.fullmatch(r"(?:rediss?|unix)://\S+", v):
        return None
    return "is not a redis://HOST:PORT/DB URL"


def _node_id(v: str | None) -> str | None:
    if v is None or re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}", v):
        return None
    return "must be 1-63 letters, digits, '.', '_' or '-', starting with a letter or digit"


def _http_url(v: str | None) -> str | None:
    if v is None or re.fullmatch(r"https?://[^/\s]+/?", v):
        return None
    return "is not an http(s)://HOST:PORT URL (no path)"


def _cluster_secret(v: str | None) -> str | None:
    if v is None or (len(v) >= 32 and re.fullmatch(r"[\x21-\x7e]+", v)):
        return None
    return "must be at least 32 printable ASCII characters without spaces"


def _lower(raw: str) -> str:
    return raw.lower()


def _tls_verify(raw: str) -> bool:
    """Off only for 0/false/no, as client/http.py has always read it."""
    return raw.lower() not in ("0", "false", "no")


_PARSERS: dict[Any, Callable[[str], Any]] = {
    bool: _bool, int: _int, float: _float, str: _str, Path: Path,
    bool | None: _bool, int | None: _int, str | None: _str, Path | None: Path,
}


def _default_home() -> Path:
    if os.geteuid() == 0:
        return ROOT_HOME
    return Path.home() / ".local/share/aenv"


# -- the declared tables ----------------------------------------------------------------

class _Declared:
    """What ``Settings`` and ``ClientSettings`` share: reading, overriding, printing."""

    @classmethod
    def variables(cls) -> Iterator[tuple[dataclasses.Field[Any], Var]]:
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            if "var" in f.metadata:
                yield f, f.metadata["var"]

    @classmethod
    def declared(cls, name: str) -> tuple[dataclasses.Field[Any], Var]:
        """Field ``name`` and its declaration."""
        return next((f, var) for f, var in cls.variables() if f.name == name)

    @classmethod
    def _parser(cls, f: dataclasses.Field[Any], var: Var) -> Callable[[str], Any]:
        """``var.parse``, else the one for the field's annotated type."""
        return var.parse or _PARSERS[typing.get_type_hints(cls)[f.name]]

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Self:
        """The settings the environment (``os.environ`` by default) gives; unset
        variables keep their declared defaults."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for f, var in cls.variables():
            for name in var.names:
                raw = env.get(name, "").strip()
                if raw:
                    values[f.name] = cls._value(f, var, raw, name)
                    break
        return cls(**values)

    @classmethod
    def _value(cls, f: dataclasses.Field[Any], var: Var, raw: str, name: str) -> Any:
        shown = "<hidden>" if var.secret else repr(raw)
        try:
            value = cls._parser(f, var)(raw)
        except ValueError as e:
            raise SettingsError(f"{name}={shown} {e}") from None
        if var.check is not None and (problem := var.check(value)):
            raise SettingsError(f"{name}={shown} {problem}")
        return value

    def override(self, given: Mapping[str, Any], flags: Mapping[str, str] | None = None
                 ) -> Self:
        """A copy with the values of ``given`` that are not None (command-line flags),
        checked like the environment's; ``flags`` names each field's flag for errors."""
        declared = {f.name: var for f, var in self.variables()}
        changes: dict[str, Any] = {}
        for name, value in given.items():
            if value is None:
                continue
            check = declared[name].check
            if check is not None and (problem := check(value)):
                raise SettingsError(f"{(flags or {}).get(name, name)} {value!r} {problem}")
            changes[name] = value
        return dataclasses.replace(self, **changes)  # type: ignore[type-var]

    def __repr__(self) -> str:
        shown = []
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            var = f.metadata.get("var")
            text = "<hidden>" if var is not None and var.secret and value else repr(value)
            shown.append(f"{f.name}={text}")
        return f"{type(self).__name__}({', '.join(shown)})"

    __str__ = __repr__

    @classmethod
    def default_text(cls, f: dataclasses.Field[Any]) -> str | None:
        """The default as a variable's value spells it (``""``: unset); None when it is
        computed (``Var.shown`` says how)."""
        return None if f.default is dataclasses.MISSING else env_text(f.default)

    @classmethod
    def markdown_table(cls) -> str:
        """The docs' table: one row per variable, in declaration order."""
        rows = ["| variable | default | what | flag |", "|---|---|---|---|"]
        for f, var in cls.variables():
            names = ", else ".join(f"`{n}`" for n in var.names)
            if var.shown is not None:
                default = var.shown
            elif f.default is None:
                default = "unset"
            else:
                default = f"`{cls.default_text(f)}`"
            flag = f"`{var.flag}`" if var.flag else ""
            rows.append(f"| {names} | {default} | {var.doc} | {flag} |")
        return "\n".join(rows)


def env_text(value: Any) -> str:
    """A value as an environment variable spells it: ``1``/``0``, ``16`` for 16.0."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


@dataclass(frozen=True, repr=False)
class Settings(_Declared):
    """The server's and the host-side commands' settings."""

    # -- the listener
    listen_host: str = setting(
        "AENV_LISTEN_HOST", "127.0.0.1", flag="--host",
        doc="address of the one listener (REST API and sandbox traffic)")
    listen_port: int = setting(
        "AENV_LISTEN_PORT", 3000, flag="--port", check=_port,
        doc="port of that listener")
    domain: str = setting(
        "AENV_DOMAIN", "localhost", flag="--domain",
        doc="domain returned to SDKs; sandbox hosts are `<port>-<id>.<domain>`")
    tls_cert: Path | None = setting(
        "AENV_TLS_CERT", None, flag="--tls-cert", check=_file,
        doc="serve HTTPS with this PEM certificate (chain first to last), covering "
            "`<domain>` and `*.<domain>`")
    tls_key: Path | None = setting(
        "AENV_TLS_KEY", None, flag="--tls-key", check=_file,
        doc="the unencrypted PEM private key of `AENV_TLS_CERT`")
    tls_self_signed: bool = setting(
        "AENV_TLS_SELF_SIGNED", False, flag="--tls-self-signed",
        doc="serve HTTPS with a certificate from a local CA made once under "
            "`$AENV_HOME/secrets/tls/<domain>/`")
    api_key: str | None = setting(
        "AENV_API_KEY", None, secret=True,
        doc="fixed API key (32+ printable characters) instead of the one generated into "
            "`$AENV_HOME/secrets/api-key`")
    log_level: str = setting(
        "AENV_LOG_LEVEL", "info", flag="--log-level", parse=_lower,
        check=_one_of(*LOG_LEVELS), doc=f"{', '.join(LOG_LEVELS)}")

    # -- where data lives
    home: Path = setting(
        "AENV_HOME", default_factory=_default_home,
        shown="`/var/lib/aenv` as root, else `~/.local/share/aenv`",
        doc="state: database, VM working dirs, snapshots, template layers, secrets")
    cache_home: Path | None = setting(
        "AENV_CACHE_HOME", None, shown="`AENV_HOME`",
        doc="rebuildable artifacts: guest kernels, base images, downloads")

    # -- capacity
    max_sandboxes: int = setting(
        "AENV_MAX_SANDBOXES", 64, flag="--max-sandboxes", check=_at_least(0),
        doc="sandboxes holding a VM at once")
    max_starting: int = setting(
        "AENV_MAX_STARTING", 8, flag="--max-starting", check=_at_least(0),
        doc="sandboxes being created or resumed at once")
    start_queue: int = setting(
        "AENV_START_QUEUE", 256, check=_at_least(0),
        doc="creates that wait, first come first served, while `AENV_MAX_STARTING` start; "
            "more are refused with 429 and `Retry-After`")
    start_queue_timeout: float = setting(
        "AENV_START_QUEUE_TIMEOUT", 30.0, check=_above(0),
        doc="seconds a create waits in that queue before a 429 (the request's deadline: "
            "under the E2B SDKs' 60 s request timeout)")
    max_fork: int = setting(
        "AENV_MAX_FORK", 16, flag="--max-fork", check=_at_least(0),
        doc="most children of one fork")
    retention_hours: float = setting(
        "AENV_RETENTION_HOURS", 24.0, check=_at_least(0),
        doc="killed and lost sandboxes are forgotten this long after they ended")
    cpu_overcommit: float = setting(
        "AENV_CPU_OVERCOMMIT", 64.0, check=_above(0),
        doc="guest vCPUs admitted per host CPU (idle sandboxes cost little CPU; starts are "
            "held to `AENV_MAX_STARTING`)")
    memory_overcommit: float = setting(
        "AENV_MEMORY_OVERCOMMIT", 2.0, check=_above(0),
        doc="guest memory admitted per byte of host RAM")
    disk_reserve_mb: int = setting(
        "AENV_DISK_RESERVE_MB", 1024, check=_at_least(0),
        doc="MiB kept free in `AENV_HOME`: starts and pauses that would use it are refused")
    max_sandbox_cpu: int = setting(
        "AENV_MAX_SANDBOX_CPU", 8, check=_at_least(1),
        doc="most vCPUs of one sandbox")
    max_sandbox_memory_mb: int = setting(
        "AENV_MAX_SANDBOX_MEMORY_MB", 16384, check=_at_least(1),
        doc="most memory of one sandbox, MiB")
    max_sandbox_disk_mb: int = setting(
        "AENV_MAX_SANDBOX_DISK_MB", 65536, check=_at_least(1),
        doc="largest disk of one sandbox, MiB")
    volume_size_mb: int = setting(
        "AENV_VOLUME_SIZE_MB", 1024, check=_at_least(16),
        doc="size of each new volume, MiB: its quota (a sparse ext4 image, "
            "`$AENV_HOME/volumes/<id>/data.img`)")
    # As many as a fork's default cap (16 children): made on demand during a fork, the
    # slots cost each child 0.4-0.6 s under contention; kept warm they cost ~100 KiB of
    # kernel memory each and a fork finds them all made.
    warm_slots: int = setting(
        "AENV_WARM_SLOTS", 16, check=_at_least(0),
        doc="network slots kept made ahead of demand")
    vmm_pool_size: int = setting(
        "AENV_VMM_POOL_SIZE", 4, check=_at_least(0),
        doc="VMMs kept started ahead of demand per template snapshot, waiting for a create "
            "to load its state (at most; sized by the creates of the last minute); 0: none")
    vmm_pool_memory_mb: int = setting(
        "AENV_VMM_POOL_MEMORY_MB", 4096, check=_at_least(0),
        doc="guest memory all pre-started VMMs together may stand for (each counts its "
            "snapshot's; while it waits it holds ~40 MiB)")
    snapshot_base: bool = setting(
        "AENV_SNAPSHOT_BASE", True, flag="--snapshot-base/--no-snapshot-base",
        doc="keep the `base` template as a snapshot, so creates restore instead of "
            "booting")
    track_writes: bool = setting(
        "AENV_TRACK_WRITES", True,
        doc="QEMU: restored VMs record which guest pages they write (userfaultfd, Linux "
            "6.7+; a small library built with the host's C compiler), so a snapshot copies "
            "only what changed since the last one; `0`: compare every written page")
    pause_memory_in_background: bool = setting(
        "AENV_PAUSE_MEMORY_IN_BACKGROUND", True,
        doc="a pause answers once device state and disk are saved; guest memory is "
            "written from the frozen VMM after the answer (QEMU, restored VMs); `0`: "
            "within the request")
    resume_in_place: bool = setting(
        "AENV_RESUME_IN_PLACE", True,
        doc="a resume that arrives while its pause's memory is still being written "
            "continues the frozen VMM (same slot and drives) and abandons that snapshot; "
            "`0`: it waits for the write, then restores")

    # -- host objects
    # One /32 per network slot.
    host_cidr: str = setting(
        "AENV_HOST_CIDR", "10.11.0.0/16", check=_ipv4_network,
        doc="range of the host-reachable sandbox addresses; must not overlap anything "
            "this host routes to")
    # One /31 per slot.
    veth_cidr: str = setting(
        "AENV_VETH_CIDR", "10.12.0.0/16", check=_ipv4_network,
        doc="range of the veth pairs between the host and each sandbox's namespace")
    # So leftovers of a crash can be found and nothing else is touched.
    name_prefix: str = setting(
        "AENV_NAME_PREFIX", "aenv", check=_prefix,
        doc="prefix of every host object aenv makes (netns, veth, nft table, cgroups); "
            "one server per prefix")
    runtime: str = setting(
        "AENV_RUNTIME", "qemu", check=_one_of(*RUNTIMES),
        doc="which VMM drives guests: `qemu` or `firecracker`")

    # -- image pulls (aenv/storage/registry.py)
    insecure_registries: str | None = setting(
        "AENV_INSECURE_REGISTRIES", None, check=_registry_hosts,
        doc="comma-separated `host[:port]`s pulled from over plain HTTP (or HTTPS without "
            "verification); loopback registries need no entry")
    registry_ca: Path | None = setting(
        "AENV_REGISTRY_CA", None, check=_file,
        doc="PEM file of CA certificates trusted for registries, besides the public ones")
    # -- the egress proxy (aenv/egress): domain allow/deny and header transforms
    egress_hosts: Path | None = setting(
        "AENV_EGRESS_HOSTS", None, check=_file,
        doc="hosts(5) file the egress proxy resolves names with before the system "
            "resolver (split-horizon names, pinned addresses)")
    egress_upstream_ca: Path | None = setting(
        "AENV_EGRESS_UPSTREAM_CA", None, check=_file,
        doc="PEM file of CA certificates the egress proxy trusts, besides the public ones, "
            "for the HTTPS hosts whose requests it changes")
    egress_proxy_networks: str | None = setting(
        "AENV_EGRESS_PROXY_NETWORKS", None, check=_ipv4_networks,
        doc="comma-separated IPv4 CIDRs where a sandbox's `egressProxy` may be although "
            "they are private (E2B refuses private and internal proxy addresses); the "
            "host's own and aenv's ranges stay refused")
    layer_cache_mb: int = setting(
        "AENV_LAYER_CACHE_MB", 20480, check=_at_least(0),
        doc="MiB of pulled image blobs kept (least recently used go first)")

    # -- many nodes (aenv/cluster): a node joins when cluster is set
    cluster: str | None = setting(
        "AENV_CLUSTER", None, flag="--cluster", check=_redis_url,
        doc="`redis://HOST:PORT/DB` of the cluster's Redis: the node registers there and "
            "publishes its sandboxes (`aenv gateway` reads it)")
    node_id: str | None = setting(
        "AENV_NODE_ID", None, flag="--node-id", check=_node_id, shown="the host name",
        doc="this node's name in the cluster (letters, digits, `.`, `_`, `-`)")
    advertise_url: str | None = setting(
        "AENV_ADVERTISE_URL", None, flag="--advertise", check=_http_url,
        shown="`http://<host>:<port>` of the listener",
        doc="the URL gateways reach this node at")
    cluster_secret: str | None = setting(
        "AENV_CLUSTER_SECRET", None, secret=True, check=_cluster_secret,
        doc="shared by gateways and nodes (32+ printable characters): gateway-to-node "
            "calls carry it, and a node in a cluster accepts it instead of its API key")
    shared_store: Path | None = setting(
        "AENV_SHARED_STORE", None,
        doc="in a cluster, a directory every node mounts (NFS, CephFS, EFS): pauses and "
            "snapshots are published there, content-addressed, and a node fetches one it "
            "lacks from there, so a paused sandbox resumes on another node; volumes live "
            "there too, and any node serves them (docs/volumes.md)")
    drain_timeout: float = setting(
        "AENV_DRAIN_TIMEOUT", 30.0, check=_at_least(0),
        doc="in a cluster, seconds a node told to stop (SIGTERM) stays up `draining` (no "
            "new creates) while sandboxes still run; a second SIGTERM stops it at once")

    # -- layout ---------------------------------------------------------------------------

    @cached_property
    def artifacts(self) -> Path:
        return self.cache_home or self.home

    @cached_property
    def native_dir(self) -> Path:
        """Libraries built on this host from the package's C sources (write tracking)."""
        return self.artifacts / "native"

    @cached_property
    def kernels_dir(self) -> Path:
        """Guest kernels and initramfs images, one directory per kernel build."""
        return self.artifacts / "kernels"

    @cached_property
    def images_dir(self) -> Path:
        """Content-addressed read-only root-filesystem images."""
        return self.artifacts / "images"

    @cached_property
    def snapshots_dir(self) -> Path:
        """VM snapshots (pauses, persistent snapshots, fork captures, templates): state."""
        return self.home / "snapshots"

    @cached_property
    def layers_dir(self) -> Path:
        """Read-only layers committed by template builds (state: they back templates)."""
        return self.home / "layers"

    @cached_property
    def vms_dir(self) -> Path:
        """One working directory per running VM (fixed relative paths inside)."""
        return self.home / "vms"

    @cached_property
    def cache_dir(self) -> Path:
        """Downloads and build scratch space (Debian packages, wheels, debootstrap trees)."""
        return self.artifacts / "cache"

    @cached_property
    def registry_blobs_dir(self) -> Path:
        """Blobs pulled from registries (manifests, configs, layers) by digest, shared."""
        return self.cache_dir / "registry-blobs"

    @cached_property
    def secrets_dir(self) -> Path:
        return self.home / "secrets"


DEFAULT_URL = "http://127.0.0.1:3000"


@dataclass(frozen=True, repr=False)
class ClientSettings(_Declared):
    """How the CLI (and aenv's HTTP clients) reach a server: apart from ``Settings`` so a
    client on another machine needs none of the server's variables to be valid."""

    url: str = setting(
        ("AENV_URL", "E2B_API_URL"), DEFAULT_URL, flag="--url",
        doc="the server the CLI talks to")
    api_key: str | None = setting(
        ("AENV_API_KEY", "E2B_API_KEY"), None, secret=True,
        doc="the key the CLI sends; unset, a local server's `$AENV_HOME/secrets/api-key`")
    tls_verify: bool = setting(
        "AENV_TLS_VERIFY", True, parse=_tls_verify,
        doc="`0`, `false` or `no`: do not verify `https://` servers' certificates "
            "(`SSL_CERT_FILE`/`SSL_CERT_DIR` name other CAs)")


def main() -> None:
    """``python -m aenv.config``: the tables of docs/install.md."""
    print("Server (`aenv server`, and `AENV_HOME`/`AENV_CACHE_HOME` for every command):\n")
    print(Settings.markdown_table())
    print("\nClient (the `aenv` CLI's sandbox and template commands):\n")
    print(ClientSettings.markdown_table())


if __name__ == "__main__":
    main()
