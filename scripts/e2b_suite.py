#!/usr/bin/env python3
"""Run E2B's own SDK test suites, unmodified, against a real ``aenv server``.

E2B's Python (pytest) and JavaScript (vitest) suites live in a checkout of e2b-dev/E2B
(the registry packages ship no tests). This script, run as root with aenv's ``.venv``:

1. makes or reuses the suites' environments: a venv with the checkout's Python SDK and its
   test dependencies, and the checkout's pnpm workspace for the JS SDK, both kept under
   ``$AENV_CACHE_HOME/e2b-suite`` (default ``/var/lib/aenv/e2b-suite``), never aenv's
   own ``.venv``;
2. starts ``aenv server`` with a fresh ``AENV_HOME`` of its own (the kernels and base image
   come from ``AENV_CACHE_HOME``), its own network-name prefix and address ranges, so it
   can run next to another server on the same machine;
3. keeps all traffic on the machine (see ``Isolation``): the suites run in a network
   namespace whose only link is a veth to the server, and the host rejects what the
   server's sandboxes send anywhere else;
   by default the server serves TLS on port 443 for a domain of its own (``aenv.test``,
   a local CA) and a dnsmasq in the suites' namespace answers ``*.<domain>`` with its
   address, so ``https://<port>-<id>.<domain>`` from ``get_host()`` works as on E2B's
   cloud (``--plain-url``: plain HTTP on a free port instead);
   then runs the suites one after the other, serially (one pytest process, vitest with one
   worker and no file parallelism), configured only through the SDKs' environment
   variables (``E2B_API_KEY`` and ``E2B_DOMAIN`` with the CA trusted through
   ``SSL_CERT_FILE`` / ``NODE_EXTRA_CA_CERTS``; or ``E2B_API_URL`` and
   ``E2B_SANDBOX_URL`` with ``--plain-url``);
4. reads the results (pytest junit XML, vitest JSON), prints pass/fail/skip counts per
   file, sorts each failure into "environment" (listed with a reason in
   ``scripts/e2b_suite_known.toml``) or "aenv" (everything else), prints the aenv ones with
   their first error line and writes ``summary.json``;
5. always, also on Ctrl-C or SIGTERM: stops the suite, kills every sandbox through the API,
   stops the server and removes whatever network namespace, nft table or VMM process of its
   prefix is left, then deletes the server's home (its logs and results are kept).

Exit status: 0 when no failure is attributed to aenv, 1 when some are, 2 when the run
itself could not be done. See docs/e2b-suite.md.
"""

from __future__ import annotations

import argparse
import codecs
import contextlib
import fcntl
import fnmatch
import hashlib
import json
import os
import re
import select
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import tomllib
import urllib.error
import urllib.request
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from aenv.config import Settings  # noqa: E402

KNOWN_FILE = ROOT / "scripts/e2b_suite_known.toml"
# Host objects of this server are named aenves-*; its slots come from these /24s, apart
# from the defaults (10.11/10.12) and the end-to-end tests' (10.15/10.16).
PREFIX = "aenves"
HOST_CIDR = "10.47.0.0/24"
VETH_CIDR = "10.48.0.0/24"
# The suites run in a network namespace of their own whose only way out is a veth to the
# host (SUITE_NET); the server listens on the host's end of it.
SUITE_NETNS = "e2bsuite"
SUITE_HOST_IF, SUITE_NS_IF = "e2bsuite-h", "e2bsuite-c"
SUITE_HOST_IP, SUITE_NS_IP = "10.49.255.1", "10.49.255.2"
GUARD_TABLE = "e2bsuite_guard"
# The default mode: the server on SUITE_HOST_IP:443 with TLS for DOMAIN, and a dnsmasq on
# the namespace's own loopback answering DOMAIN and every name under it with that address.
# .test is reserved (RFC 2606): never a real name. `ip netns exec` bind-mounts
# /etc/netns/<ns>/resolv.conf over /etc/resolv.conf, which glibc (Node, urllib, httpx) and
# hickory (pyqwest: the Python SDK's REST and envd calls) both read.
DOMAIN = "aenv.test"
TLS_PORT = 443
SUITE_DNS_IP = "127.0.0.1"  # the namespace's loopback, not the host's
NETNS_ETC = Path("/etc/netns") / SUITE_NETNS
# The vitest projects that can run here. "browser" needs Playwright's own Chromium build,
# a download from outside the package registries, so it is not run (see the doc).
JS_PROJECTS = ("unit", "template", "connectionConfig")
# Test-only dev dependencies of the Python SDK; the rest of the group are linters.
PY_DEV_SKIP = {"ruff", "ty"}
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def log(msg: str) -> None:
    print(f"e2b-suite: {msg}", flush=True)


class RunError(Exception):
    """The run could not be done (setup failed, the server did not start ...)."""


class Interrupted(Exception):
    pass


def _on_signal(signum, _frame):
    raise Interrupted(signal.Signals(signum).name)


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def run(cmd: list[str], log_path: Path, **kw) -> None:
    """Run a set-up command, its output going to log_path; RunError with its tail on failure."""
    with open(log_path, "ab") as out:
        out.write(f"\n$ {' '.join(cmd)}\n".encode())
        out.flush()
        rc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, **kw).returncode
    if rc != 0:
        tail = log_path.read_text(errors="replace").splitlines()[-20:]
        raise RunError(f"{' '.join(cmd[:3])} ... exited {rc}:\n" + "\n".join(tail))


def git_head(repo: Path) -> str:
    return subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True,
                          text=True, check=False).stdout.strip() or "unknown"


def git_changes(repo: Path) -> list[str]:
    """Files of the work tree that differ from HEAD: the server ran with them."""
    out = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--", "aenv"],
                         capture_output=True, text=True, check=False).stdout
    return [line[3:] for line in out.splitlines()]


# -- environments ---------------------------------------------------------------------------


def setup_python(src: Path, cache: Path, setup_log: Path) -> Path:
    """A venv with the checkout's SDK (editable) and its test dependencies; reused while the
    checkout and its pyproject.toml are the same. Returns the venv's pytest."""
    sdk = src / "packages/python-sdk"
    venv = cache / "venv"
    stamp_file = venv / ".e2b-suite-stamp"
    stamp = json.dumps({"src": str(src), "pyproject": sha(sdk / "pyproject.toml"),
                        "python": sys.version.split()[0]})
    if stamp_file.exists() and stamp_file.read_text() == stamp:
        return venv / "bin/pytest"
    log(f"setting up the Python SDK's test venv in {venv} (log: {setup_log})")
    project = tomllib.loads((sdk / "pyproject.toml").read_text())
    dev = [r for r in project.get("dependency-groups", {}).get("dev", [])
           if re.split(r"[<>=!~\[ ;]", r, maxsplit=1)[0] not in PY_DEV_SKIP]
    shutil.rmtree(venv, ignore_errors=True)
    base_python = getattr(sys, "_base_executable", sys.executable)
    run([base_python, "-m", "venv", str(venv)], setup_log)
    run([str(venv / "bin/pip"), "install", "-q", "-e", str(sdk), *dev], setup_log)
    stamp_file.write_text(stamp)
    return venv / "bin/pytest"


def setup_js(src: Path, cache: Path, setup_log: Path) -> Path:
    """The checkout's pnpm workspace installed for packages/js-sdk (from the npm registry,
    the pnpm store kept in the cache); reused while pnpm-lock.yaml is the same. Returns the
    workspace's vitest."""
    sdk = src / "packages/js-sdk"
    stamp_file = src / "node_modules/.e2b-suite-stamp"
    stamp = json.dumps({"lock": sha(src / "pnpm-lock.yaml")})
    vitest = sdk / "node_modules/.bin/vitest"
    if stamp_file.exists() and stamp_file.read_text() == stamp and vitest.exists():
        return vitest
    manager = json.loads((src / "package.json").read_text()).get("packageManager", "pnpm@10")
    tools = cache / "tools"
    pnpm = tools / "node_modules/.bin/pnpm"
    if not pnpm.exists() or manager.split("@", 1)[1] not in pnpm.resolve().as_posix():
        log(f"installing {manager} into {tools}")
        tools.mkdir(parents=True, exist_ok=True)
        run(["npm", "install", "--prefix", str(tools), "--no-save", manager], setup_log)
    log(f"installing the JS SDK's workspace dependencies in {src} (log: {setup_log})")
    # engine-strict off: the build tool (tsdown) asks for Node 22, the tests run on 20.
    run([str(pnpm), "install", "--frozen-lockfile", "--config.engine-strict=false",
         "--store-dir", str(cache / "pnpm-store"), "--filter", "./packages/js-sdk"],
        setup_log, cwd=src)
    stamp_file.write_text(stamp)
    return vitest


# -- keeping the suites' traffic on this machine --------------------------------------------


class Isolation:
    """E2B's suites were written for a machine with the internet: some tests curl public
    addresses from a sandbox, the guest's resolver is a public one, a few tests may reach
    E2B's cloud from the test process. Here nothing of that may leave the machine, so:

    - the suites' processes run in the network namespace ``e2bsuite``, which has loopback
      and a veth to the host (10.49.255.2 -> .1) and no other route: the aenv server
      listens on the host's end, and anything else fails at once as unreachable;
    - an nft table ``inet e2bsuite_guard`` rejects whatever the host would forward from
      this server's sandboxes (their egress, SNAT-ed into HOST_CIDR) to any address
      outside its own ranges, and drops forwarded IPv6 from them and from the namespace;
    - with a domain (the default mode), the namespace's resolver is a dnsmasq on its own
      loopback (``/etc/netns/e2bsuite/resolv.conf``) that answers the domain and every name
      under it with the server's address, AAAA with NODATA, and no other name (it has no
      upstream): ``https://<port>-<id>.<domain>`` reaches the server, the internet's names
      resolve to nothing.

    up() first removes what a previous run that was killed may have left (also a process
    still in the namespace, which can only be that run's); down() removes it all and may
    be called any number of times."""

    def __init__(self, domain: str | None = None, dns_log: Path | None = None) -> None:
        self.domain = domain
        self.dns_log = dns_log
        self.dns: subprocess.Popen | None = None

    def up(self) -> None:
        try:
            self._up()
        except subprocess.CalledProcessError as e:
            raise RunError(f"could not isolate the suites: {' '.join(e.cmd)}: "
                           f"{(e.stderr or '').strip()}") from None

    def _up(self) -> None:
        self.down()
        ns = ["ip", "-n", SUITE_NETNS]
        for cmd in (["ip", "netns", "add", SUITE_NETNS],
                    ["ip", "link", "add", SUITE_HOST_IF, "type", "veth", "peer", "name",
                     SUITE_NS_IF, "netns", SUITE_NETNS],
                    ["ip", "addr", "add", f"{SUITE_HOST_IP}/30", "dev", SUITE_HOST_IF],
                    ["ip", "link", "set", SUITE_HOST_IF, "up"],
                    [*ns, "addr", "add", f"{SUITE_NS_IP}/30", "dev", SUITE_NS_IF],
                    [*ns, "link", "set", SUITE_NS_IF, "up"],
                    [*ns, "link", "set", "lo", "up"]):
            subprocess.run(cmd, check=True, capture_output=True)
        ranges = f"{{ {HOST_CIDR}, {VETH_CIDR} }}"
        rules = f"""table inet {GUARD_TABLE} {{
    chain forward {{
        type filter hook forward priority filter - 20; policy accept;
        iifname "{SUITE_HOST_IF}" drop
        ip saddr {ranges} ip daddr != {ranges} reject
        iifname "{PREFIX}*" meta nfproto ipv6 drop
    }}
}}
"""
        subprocess.run(["nft", "-f", "-"], input=rules, text=True, check=True,
                       capture_output=True)
        if self.domain:
            self._dns_up()

    def _dns_up(self) -> None:
        if shutil.which("dnsmasq") is None:
            raise RunError("dnsmasq is missing (run ./scripts/setup.sh: dnsmasq-base), or "
                           "use --plain-url")
        assert self.dns_log is not None
        NETNS_ETC.mkdir(parents=True, exist_ok=True)
        (NETNS_ETC / "resolv.conf").write_text(f"nameserver {SUITE_DNS_IP}\n")
        self.dns_log.unlink(missing_ok=True)
        self.dns = subprocess.Popen(
            self.wrap(["dnsmasq", "--keep-in-foreground", "--conf-file=/dev/null",
                       "--no-resolv", "--no-hosts", "--no-poll", "--bind-interfaces",
                       f"--listen-address={SUITE_DNS_IP}", "--port=53",
                       f"--local=/{self.domain}/", f"--address=/{self.domain}/{SUITE_HOST_IP}",
                       "--log-queries", f"--log-facility={self.dns_log}", "--pid-file=",
                       "--user=root"]),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True)
        deadline = time.monotonic() + 10
        while not self.dns_log.exists() or "started" not in self.dns_log.read_text():
            if self.dns.poll() is not None or time.monotonic() > deadline:
                out = self.dns.communicate()[0] if self.dns.poll() is not None else ""
                raise RunError(f"dnsmasq did not start in {SUITE_NETNS}: {out.strip()}")
            time.sleep(0.05)
        # The names the SDKs will ask, asked the way they will be (in the namespace).
        probe = subprocess.run(
            self.wrap(["getent", "ahostsv4", f"api.{self.domain}"]),
            capture_output=True, text=True, check=False)
        if SUITE_HOST_IP not in probe.stdout:
            raise RunError(f"api.{self.domain} does not resolve to {SUITE_HOST_IP} in "
                           f"{SUITE_NETNS}: {(probe.stdout + probe.stderr).strip()}")

    def down(self) -> None:
        if self.dns is not None and self.dns.poll() is None:
            self.dns.terminate()
            try:
                self.dns.wait(10)
            except subprocess.TimeoutExpired:
                self.dns.kill()
                self.dns.wait()
        # Whatever still runs in the namespace is a killed run's (its dnsmasq, a suite).
        pids = subprocess.run(["ip", "netns", "pids", SUITE_NETNS], capture_output=True,
                              text=True, check=False).stdout.split()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
        for cmd in (["nft", "delete", "table", "inet", GUARD_TABLE],
                    ["ip", "link", "del", SUITE_HOST_IF],
                    ["ip", "netns", "del", SUITE_NETNS]):
            subprocess.run(cmd, check=False, capture_output=True)
        shutil.rmtree(NETNS_ETC, ignore_errors=True)
        with contextlib.suppress(OSError):
            NETNS_ETC.parent.rmdir()  # only if empty: other namespaces may use it

    @staticmethod
    def wrap(cmd: list[str]) -> list[str]:
        return ["ip", "netns", "exec", SUITE_NETNS, *cmd]


# -- the server -----------------------------------------------------------------------------


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class Server:
    """``aenv server`` in its own session (so a Ctrl-C reaches only this script, which then
    kills the sandboxes through the API before stopping it). With a domain: on port 443
    with ``--tls-self-signed --domain <domain>``, its local CA made in its fresh home;
    without: plain HTTP on a free port, the domain left at its default (localhost)."""

    def __init__(self, home: Path, log_path: Path, host: str, domain: str | None = None) -> None:
        self.home = home
        self.host = host
        self.domain = domain
        self.log_path = log_path
        self.settings = Settings(home=home, cache_home=Settings.from_env().artifacts,
                                 name_prefix=PREFIX, host_cidr=HOST_CIDR, veth_cidr=VETH_CIDR,
                                 warm_slots=2)
        self.port = 0
        self.url = ""
        self.proc: subprocess.Popen | None = None
        self._ssl: ssl.SSLContext | None = None

    @property
    def ca(self) -> Path:
        """The local CA's certificate (TLS mode), written at the server's first start."""
        return self.home / "secrets/tls" / str(self.domain) / "ca.pem"

    def _context(self) -> ssl.SSLContext | None:
        """For this script's own calls, which go to the address: the chain is checked
        against the CA, the name is not (the suites' clients check both)."""
        if not self.domain:
            return None
        if self._ssl is None:
            self._ssl = ssl.create_default_context(cafile=str(self.ca))
            self._ssl.check_hostname = False
        return self._ssl

    def start(self, timeout: float = 900) -> None:
        s = self.settings
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AENV_", "E2B_"))}
        env.update(AENV_HOME=str(self.home), AENV_CACHE_HOME=str(s.artifacts),
                   AENV_NAME_PREFIX=PREFIX, AENV_HOST_CIDR=HOST_CIDR, AENV_VETH_CIDR=VETH_CIDR,
                   AENV_WARM_SLOTS=str(s.warm_slots), AENV_LISTEN_HOST=self.host)
        if self.domain:
            env.update(AENV_DOMAIN=self.domain, AENV_TLS_SELF_SIGNED="1")
            self.port = TLS_PORT
            self.url = f"https://{self.host}"
        else:
            self.port = free_port(self.host)
            self.url = f"http://{self.host}:{self.port}"
        self.home.mkdir(parents=True, exist_ok=True)
        log(f"starting aenv server on {self.url} (home {self.home}, log {self.log_path})"
            + (f"; TLS for {self.domain} and *.{self.domain} from a local CA, the names "
               f"resolved by a dnsmasq in {SUITE_NETNS}" if self.domain else ""))
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "aenv.cli.main", "server", "--port", str(self.port)],
                cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True)
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RunError(f"aenv server exited {self.proc.returncode}:\n{self.tail()}")
            if not self.domain or self.ca.exists():  # written whole (renamed) or not at all
                try:
                    with urllib.request.urlopen(self.url + "/health", timeout=2,
                                                context=self._context()) as r:
                        if r.status == 204:
                            return
                except OSError as e:
                    last = str(e)
            time.sleep(0.3)
        raise RunError(f"aenv server did not answer /health in {timeout:.0f} s ({last}):\n"
                       f"{self.tail()}")

    @property
    def api_key(self) -> str:
        return (self.home / "secrets/api-key").read_text().strip()

    def tail(self, n: int = 30) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        return ""

    def _api(self, method: str, path: str) -> bytes:
        req = urllib.request.Request(self.url + path, method=method,
                                     headers={"X-API-KEY": self.api_key})
        with urllib.request.urlopen(req, timeout=60, context=self._context()) as r:
            return r.read()

    def kill_all_sandboxes(self) -> int:
        listed = json.loads(self._api("GET", "/v2/sandboxes?state=running,paused&limit=100"))
        for sbx in listed:
            with contextlib.suppress(urllib.error.URLError, OSError):
                self._api("DELETE", f"/sandboxes/{sbx['sandboxID']}")
        return len(listed)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        if self.home.joinpath("secrets/api-key").exists():
            try:
                for _ in range(5):  # a page at a time, in case many were left
                    if self.kill_all_sandboxes() == 0:
                        break
            except (urllib.error.URLError, OSError, ValueError) as e:
                log(f"could not kill the sandboxes through the API: {e}")
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            log("aenv server did not stop in 60 s; killing it")
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def leftovers(self) -> dict[str, list[str]]:
        netns = sorted(n for n in os.listdir("/run/netns") if n.startswith(PREFIX + "-")) \
            if os.path.isdir("/run/netns") else []
        tables = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True,
                                check=False).stdout
        vms = str(self.settings.vms_dir)
        procs = []
        for e in os.scandir("/proc"):
            if e.name.isdigit():
                with contextlib.suppress(OSError):
                    if os.readlink(f"/proc/{e.name}/cwd").startswith(vms):
                        procs.append(e.name)
        return {"netns": netns,
                "nft": [t for t in tables.splitlines() if t.split()[-1:] == [PREFIX]],
                "vmm processes": procs}

    def clean_leftovers(self) -> dict[str, list[str]]:
        left = self.leftovers()
        if any(left.values()):
            log(f"the server left {left}; removing them")
            for pid in left["vmm processes"]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
            from aenv.network import cleanup_leftovers

            cleanup_leftovers(self.settings)
        return left


# -- the suites -----------------------------------------------------------------------------


@dataclass
class Case:
    suite: str
    file: str
    id: str  # "file::name" (pytest node id) or "file > describe > test" (vitest)
    status: str  # passed | failed | skipped
    message: str = ""


@dataclass
class SuiteResult:
    suite: str
    cases: list[Case] = field(default_factory=list)
    returncode: int | None = None
    seconds: float = 0.0
    note: str = ""


class SuiteProcess:
    """One suite's runner in its own process group, its output teed to a log and to stdout
    with the colour codes removed; stop() interrupts it (SIGINT, so pytest still writes its
    junit XML) and kills it if it does not end."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.interrupted = ""  # the signal that stopped the run, if one did

    def run(self, cmd: list[str], cwd: Path, env: dict[str, str], log_path: Path,
            timeout: float) -> int:
        log(f"$ (cd {cwd} && {' '.join(cmd)})")
        deadline = time.monotonic() + timeout
        with open(log_path, "w") as out:
            self.proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE,
                                         stderr=subprocess.STDOUT, start_new_session=True)
            try:
                self._tee(out, deadline, timeout)
            except Interrupted as e:
                self.interrupted = str(e)
                log(f"{e}: stopping the suite")
                self.stop()
        return self.proc.returncode

    def _tee(self, out, deadline: float, timeout: float) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        buf = ""
        while True:
            ready, _, _ = select.select([fd], [], [], 1.0)
            chunk = os.read(fd, 65536) if ready else b""
            if chunk:
                buf += decoder.decode(chunk)
                *lines, buf = buf.split("\n")
                for line in lines:
                    line = ANSI.sub("", line)
                    out.write(line + "\n")
                    print(line, flush=True)
                out.flush()
            elif ready or self.proc.poll() is not None:  # EOF, or the runner ended
                if buf:
                    out.write(ANSI.sub("", buf) + "\n")
                    print(ANSI.sub("", buf), flush=True)
                self.proc.wait()
                return
            if time.monotonic() > deadline:
                log(f"the suite ran past {timeout:.0f} s; stopping it")
                self.stop()

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGINT, 30), (signal.SIGKILL, 10)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)
            try:
                self.proc.wait(wait)
                return
            except subprocess.TimeoutExpired:
                pass


def trust_bundle(server: Server, out: Path) -> Path:
    """The roots the suites trust in TLS mode: the machine's (the caller's SSL_CERT_FILE,
    or OpenSSL's default file) and the server's local CA. SSL_CERT_FILE replaces Python's
    default store (ssl, httpx) and is what pyqwest's rustls-native-certs loads, so it gets
    the whole bundle rather than the CA alone."""
    bundle = out / "ca-bundle.pem"
    system = Path(os.environ.get("SSL_CERT_FILE") or ssl.get_default_verify_paths().cafile
                  or "/etc/ssl/certs/ca-certificates.crt")
    parts = [system.read_text()] if system.is_file() else []
    bundle.write_text("".join(p if p.endswith("\n") else p + "\n" for p in parts)
                      + server.ca.read_text())
    shutil.copyfile(server.ca, out / "ca.pem")  # the home may be deleted; the CA is public
    return bundle


def suite_env(server: Server, bundle: Path | None) -> dict[str, str]:
    """The caller's environment without any E2B or aenv setting, plus the variables that
    point an unmodified SDK at the server: with a domain, E2B_DOMAIN (the SDKs then build
    https://api.<domain> and https://49983-<id>.<domain> themselves) and the CA trusted;
    without, E2B_API_URL and E2B_SANDBOX_URL."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AENV_", "E2B_"))}
    env.update(E2B_API_KEY=server.api_key, PYTHONUNBUFFERED="1")
    if server.domain:
        assert bundle is not None
        # NODE_EXTRA_CA_CERTS adds to Node's own roots; REQUESTS_CA_BUNDLE is requests'.
        env.update(E2B_DOMAIN=server.domain, SSL_CERT_FILE=str(bundle),
                   REQUESTS_CA_BUNDLE=str(bundle), NODE_EXTRA_CA_CERTS=str(bundle))
    else:
        env.update(E2B_API_URL=server.url, E2B_SANDBOX_URL=server.url)
    return env


def first_line(text: str) -> str:
    for line in ANSI.sub("", text or "").splitlines():
        if line.strip():
            return line.strip()[:300]
    return ""


def run_python(src: Path, pytest: Path, server: Server, out: Path, args, proc: SuiteProcess,
               files: list[str], bundle: Path | None) -> SuiteResult:
    sdk = src / "packages/python-sdk"
    junit = out / "python-junit.xml"
    cmd = [str(pytest), "-p", "no:randomly", "-p", "no:cacheprovider", "-o",
           "junit_family=xunit1", f"--junitxml={junit}", "-q", "-rfE"]
    if args.timeout:
        cmd.append(f"--timeout={args.timeout}")
    if args.k:
        cmd += ["-k", args.k]
    cmd += files or ["tests"]
    started = time.monotonic()
    rc = proc.run(Isolation.wrap(cmd), sdk, suite_env(server, bundle), out / "python.log",
                  args.suite_timeout)
    res = SuiteResult("python", returncode=rc, seconds=time.monotonic() - started)
    if junit.exists():
        res.cases = parse_junit(junit)
    else:
        res.note = f"pytest wrote no junit XML (exit {rc}); see {out / 'python.log'}"
    return res


def parse_junit(path: Path) -> list[Case]:
    """pytest's xunit1 XML to cases; the node id is rebuilt from file + classname + name."""
    cases: dict[str, Case] = {}
    for tc in ET.parse(path).iter("testcase"):
        file = tc.get("file") or ""
        name = tc.get("name") or ""
        classname = (tc.get("classname") or "").split(".")
        module_parts = len(Path(file).with_suffix("").parts) if file else len(classname)
        node = "::".join([file or ".".join(classname), *classname[module_parts:], name])
        status, message = "passed", ""
        for child in tc:
            if child.tag in ("failure", "error"):
                status = "failed"
                text = (child.get("message") or "") + "\n" + (child.text or "")
                if child.tag == "error":
                    text = "[error in setup/teardown] " + text
                message = message or text
            elif child.tag == "skipped" and status == "passed":
                status, message = "skipped", child.get("message") or ""
        old = cases.get(node)
        if old is None or old.status != "failed":
            cases[node] = Case("python", file, node, status, message)
    return list(cases.values())


def run_js(src: Path, vitest: Path, server: Server, out: Path, args, proc: SuiteProcess,
           files: list[str], bundle: Path | None) -> SuiteResult:
    sdk = src / "packages/js-sdk"
    report = out / "js.json"
    cmd = [str(vitest), "run", *[f"--project={p}" for p in JS_PROJECTS],
           "--no-file-parallelism", "--maxWorkers=1", "--reporter=default",
           "--reporter=json", f"--outputFile.json={report}"]
    if args.timeout:
        cmd.append(f"--testTimeout={args.timeout * 1000}")
    if args.k:
        cmd += ["-t", args.k]
    cmd += files
    started = time.monotonic()
    env = suite_env(server, bundle)
    rc = proc.run(Isolation.wrap(cmd), sdk, env, out / "js.log", args.suite_timeout)
    res = SuiteResult("js", returncode=rc, seconds=time.monotonic() - started)
    if report.exists():
        res.cases = parse_vitest(report, sdk)
    else:
        res.note = f"vitest wrote no JSON report (exit {rc}); see {out / 'js.log'}"
    return res


def parse_vitest(path: Path, sdk: Path) -> list[Case]:
    cases: list[Case] = []
    data = json.loads(path.read_text())
    for tr in data.get("testResults", []):
        file = os.path.relpath(tr["name"], sdk)
        results = tr.get("assertionResults", [])
        for a in results:
            status = {"passed": "passed", "failed": "failed"}.get(a.get("status"), "skipped")
            tid = " > ".join([file, *a.get("ancestorTitles", []), a.get("title", "")])
            cases.append(Case("js", file, tid, status, "\n".join(a.get("failureMessages") or [])))
        if tr.get("status") == "failed" and not any(c.status == "failed" for c in cases
                                                     if c.file == file):
            # The file itself failed (import error, a failing hook): one case for it.
            cases.append(Case("js", file, f"{file} > (file)", "failed", tr.get("message", "")))
    return cases


# -- known environment failures -------------------------------------------------------------


# How the suites reach the server: "domain" (E2B_DOMAIN, TLS on 443, wildcard DNS; the
# default) or "plain-url" (E2B_API_URL / E2B_SANDBOX_URL). A known entry with a `mode`
# applies only to runs in that mode.
MODES = ("domain", "plain-url")


@dataclass
class Known:
    suite: str
    test: str  # a test id, or an fnmatch pattern of ids
    reason: str
    why: str


def load_known(path: Path, mode: str) -> tuple[dict[str, str], list[Known]]:
    """The reasons, and the entries that apply to a run in ``mode``."""
    data = tomllib.loads(path.read_text())
    reasons = data.get("reasons", {})
    known = []
    for entry in data.get("known", []):
        if entry["reason"] not in reasons:
            raise RunError(f"{path}: {entry['test']}: unknown reason {entry['reason']!r}")
        if entry.get("mode", mode) not in MODES:
            raise RunError(f"{path}: {entry['test']}: unknown mode {entry['mode']!r}")
        if entry.get("mode", mode) == mode:
            known.append(Known(entry["suite"], entry["test"], entry["reason"],
                               entry.get("why", "")))
    return reasons, known


def match_known(case: Case, known: list[Known]) -> Known | None:
    for k in known:
        if k.suite == case.suite and (k.test == case.id or fnmatch.fnmatchcase(case.id, k.test)):
            return k
    return None


# -- the report -----------------------------------------------------------------------------


def report(results: list[SuiteResult], reasons: dict[str, str], known: list[Known],
           out: Path, meta: dict) -> int:
    summary: dict = {**meta, "suites": {}}
    aenv_count = 0
    for res in results:
        per_file: dict[str, dict[str, int]] = {}
        for c in res.cases:
            counts = per_file.setdefault(c.file, {"passed": 0, "failed": 0, "skipped": 0})
            counts[c.status] += 1
        totals = {s: sum(f[s] for f in per_file.values())
                  for s in ("passed", "failed", "skipped")}
        env_fail: dict[str, list[tuple[Case, Known]]] = {}
        aenv_fail: list[Case] = []
        failed_by: dict[int, int] = {}  # entry -> failures it explained
        passed_by: dict[int, list[tuple[str, str]]] = {}  # entry -> (test, reason) passed
        for c in res.cases:
            k = match_known(c, known)
            if c.status == "failed":
                if k:
                    env_fail.setdefault(k.reason, []).append((c, k))
                    failed_by[id(k)] = failed_by.get(id(k), 0) + 1
                else:
                    aenv_fail.append(c)
            elif c.status == "passed" and k:
                passed_by.setdefault(id(k), []).append((c.id, k.reason))
        # An entry whose tests all passed is stale (an aenv fix, or a change of the suite),
        # unless its reason is timing: a slow-host test passes when the machine is quieter.
        passed_known = [t for key, ids in passed_by.items() if key not in failed_by
                        for t in ids]
        aenv_count += len(aenv_fail)

        print(f"\n== {res.suite}: per file (passed / failed / skipped) ==")
        width = max((len(f) for f in per_file), default=10)
        for f in sorted(per_file):
            n = per_file[f]
            print(f"  {f:<{width}}  {n['passed']:4d} {n['failed']:4d} {n['skipped']:4d}")
        print(f"  {'total':<{width}}  {totals['passed']:4d} {totals['failed']:4d} "
              f"{totals['skipped']:4d}   ({res.seconds / 60:.1f} min, exit {res.returncode})")
        if res.note:
            print(f"  note: {res.note}")
        env_total = sum(len(v) for v in env_fail.values())
        print(f"\n== {res.suite}: {env_total} failures known to come from the environment ==")
        for reason, items in sorted(env_fail.items()):
            print(f"  [{reason}] {reasons[reason]} ({len(items)})")
            for c, _ in items:
                print(f"      {c.id}")
        print(f"\n== {res.suite}: {len(aenv_fail)} failures attributed to aenv ==")
        for c in aenv_fail:
            print(f"  {c.id}\n      {first_line(c.message)}")
        if passed_known:
            print(f"\n== {res.suite}: listed as environment failures but passed "
                  f"(remove from {KNOWN_FILE.name}?; slow-host ones depend on the load) ==")
            for tid, reason in passed_known:
                print(f"  {tid}  [{reason}]")
        summary["suites"][res.suite] = {
            "totals": totals, "seconds": round(res.seconds, 1), "returncode": res.returncode,
            "note": res.note, "files": per_file,
            "environment_failures": {r: [{"id": c.id, "why": k.why,
                                          "first_line": first_line(c.message)}
                                         for c, k in items] for r, items in env_fail.items()},
            "aenv_failures": [{"id": c.id, "first_line": first_line(c.message)}
                              for c in aenv_fail],
            "known_but_passed": [{"id": t, "reason": r} for t, r in passed_known],
        }
    mode = meta.get("mode", "plain-url")
    print(f"\n== totals ({mode} mode" + (f", {meta['domain']}" if meta.get("domain") else "")
          + f"; aenv {str(meta.get('aenv_commit', '?'))[:10]}) ==")
    for res in results:
        t = summary["suites"][res.suite]["totals"]
        env_n = sum(len(v) for v in summary["suites"][res.suite]["environment_failures"].values())
        print(f"  {res.suite}: {t['passed']} passed, {t['failed']} failed "
              f"({env_n} environment, {t['failed'] - env_n} aenv), {t['skipped']} skipped")
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"\nsummary: {out / 'summary.json'}")
    return aenv_count


# -- main -----------------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Run E2B's Python and JS SDK test suites from a checkout of e2b-dev/E2B "
                    "against a fresh aenv server.")
    p.add_argument("--e2b-src", type=Path, default=os.environ.get("E2B_SRC"),
                   help="checkout of e2b-dev/E2B (default: $E2B_SRC)")
    only = p.add_mutually_exclusive_group()
    only.add_argument("--python-only", action="store_true")
    only.add_argument("--js-only", action="store_true")
    p.add_argument("-k", metavar="EXPR",
                   help="select tests: pytest -k EXPR and vitest -t EXPR (a substring works "
                        "for both)")
    p.add_argument("files", nargs="*",
                   help="test files (.py for the Python suite, .ts/.tsx for JS), relative to "
                        "the SDK's package directory, e.g. tests/sync/sandbox_sync/"
                        "test_create.py tests/sandbox/create.test.ts; only the suites with "
                        "a file given run")
    p.add_argument("--timeout", type=int, metavar="S",
                   help="per-test timeout in seconds for both suites (default: the suites' "
                        "own: pytest 30 s, 180 s for template builds; vitest 30 s, 180 s)")
    p.add_argument("--suite-timeout", type=float, default=6 * 3600, metavar="S",
                   help="stop a suite that runs longer than this (default 6 h)")
    p.add_argument("--out", type=Path,
                   help="results directory (default: $AENV_CACHE_HOME/e2b-suite/runs/TIME)")
    p.add_argument("--known", type=Path, default=KNOWN_FILE,
                   help=f"known environment failures (default: {KNOWN_FILE.relative_to(ROOT)})")
    p.add_argument("--report", type=Path, metavar="DIR",
                   help="run nothing: classify and print the results of an earlier run in DIR "
                        "again (after editing the known-failures file)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--domain", default=DOMAIN,
                      help=f"the server's domain in the default mode (default {DOMAIN}): "
                           "TLS on port 443 from a local CA, *.<domain> resolved in the "
                           "suites' namespace, the SDKs given E2B_DOMAIN")
    mode.add_argument("--plain-url", action="store_true",
                      help="plain HTTP on a free port and the SDKs given E2B_API_URL and "
                           "E2B_SANDBOX_URL instead (get_host() URLs then do not resolve)")
    p.add_argument("--keep-home", action="store_true",
                   help="keep the server's AENV_HOME (database, snapshots) after the run")
    return p.parse_args(argv)


def report_again(out: Path, known_file: Path) -> int:
    """--report DIR: the results of an earlier run, classified with the current list."""
    meta = json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() \
        else {}
    # Runs from before the domain mode existed were all plain-url runs.
    reasons, known = load_known(known_file, meta.get("mode", "plain-url"))
    before = meta.pop("suites", {})
    results = []
    if (out / "python-junit.xml").exists():
        results.append(SuiteResult("python", parse_junit(out / "python-junit.xml")))
    if (out / "js.json").exists():
        sdk = Path(meta.get("e2b_src", ".")) / "packages/js-sdk"
        results.append(SuiteResult("js", parse_vitest(out / "js.json", sdk)))
    for res in results:
        old = before.get(res.suite, {})
        res.seconds, res.returncode = old.get("seconds", 0.0), old.get("returncode")
        res.note = old.get("note", "")
    return 1 if report(results, reasons, known, out, meta) else 0


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.report:
        return report_again(args.report.resolve(), args.known)
    if args.e2b_src is None:
        print("e2b-suite: give a checkout of e2b-dev/E2B: --e2b-src DIR or E2B_SRC=DIR",
              file=sys.stderr)
        return 2
    src = args.e2b_src.resolve()
    if not (src / "packages/python-sdk/tests").is_dir():
        print(f"e2b-suite: {src} is not a checkout of e2b-dev/E2B", file=sys.stderr)
        return 2
    if os.geteuid() != 0:
        print("e2b-suite: needs root (aenv server makes namespaces, taps and VMs)",
              file=sys.stderr)
        return 2
    py_files = [f for f in args.files if f.endswith(".py") or "python" in f]
    js_files = [f for f in args.files if f not in py_files]
    want_py = not args.js_only and (not args.files or bool(py_files))
    want_js = not args.python_only and (not args.files or bool(js_files))
    domain = None if args.plain_url else args.domain
    reasons, known = load_known(args.known, "domain" if domain else "plain-url")

    cache = Settings.from_env().artifacts / "e2b-suite"
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    out = (args.out or cache / "runs" / stamp).resolve()
    out.mkdir(parents=True, exist_ok=True)
    setup_log = out / "setup.log"
    # One run at a time: the namespace, the guard table and the prefix are fixed names.
    cache.mkdir(parents=True, exist_ok=True)
    lock = open(cache / "run.lock", "w")  # noqa: SIM115 (held until the process exits)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        print(f"e2b-suite: another run is in progress (lock: {cache / 'run.lock'})",
              file=sys.stderr)
        return 2
    isolation = Isolation(domain, out / "dnsmasq.log")
    server = Server(out / "home", out / "server.log", SUITE_HOST_IP, domain)
    proc = SuiteProcess()
    results: list[SuiteResult] = []
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    started = time.time()
    changes = git_changes(ROOT)  # what the server runs with, besides HEAD
    try:
        pytest = setup_python(src, cache, setup_log) if want_py else None
        vitest = setup_js(src, cache, setup_log) if want_js else None
        # The guest kernel and base image, in the shared cache (a cache hit after the first).
        run([sys.executable, "-m", "aenv.cli.main", "image", "build"], setup_log, cwd=ROOT)
        isolation.up()
        server.start()
        bundle = trust_bundle(server, out) if domain else None
        if pytest:
            results.append(run_python(src, pytest, server, out, args, proc, py_files, bundle))
        if vitest and not proc.interrupted:
            results.append(run_js(src, vitest, server, out, args, proc, js_files, bundle))
    except Interrupted as e:
        log(f"{e}: stopping")
    except RunError as e:
        log(str(e))
        return 2
    finally:
        # A second Ctrl-C must not cut the clean-up short.
        signal.signal(signal.SIGINT, lambda *_: log("cleaning up, please wait"))
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        proc.stop()
        server.stop()
        left = server.clean_leftovers()
        isolation.down()
        if not args.keep_home:
            shutil.rmtree(server.home, ignore_errors=True)
        log(f"server stopped; results and logs in {out}")
    sdk_versions = {
        "python": tomllib.loads((src / "packages/python-sdk/pyproject.toml").read_text())
        ["project"]["version"],
        "js": json.loads((src / "packages/js-sdk/package.json").read_text())["version"],
    }
    meta = {"e2b_src": str(src), "e2b_commit": git_head(src), "sdk_versions": sdk_versions,
            "aenv_tree": str(ROOT), "aenv_commit": git_head(ROOT), "aenv_uncommitted": changes,
            "mode": "domain" if domain else "plain-url", "domain": domain,
            "server_url": server.url,
            "started": datetime.fromtimestamp(started, UTC).isoformat(timespec="seconds"),
            "minutes": round((time.time() - started) / 60, 1), "k": args.k,
            "files": args.files, "js_projects": list(JS_PROJECTS),
            "server_leftovers": left}
    aenv_failures = report(results, reasons, known, out, meta)
    return 1 if aenv_failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
