"""What ``soak.py`` and ``kill_loop.py`` share: a server they may crash, a guest writer whose
state can be checked at any moment, and an audit of everything a server may leak.

The **writer** (``start_writer``) is a Python loop in the guest that appends ``1\\n``,
``2\\n``, ... to ``~/soak/log`` and after each line replaces ``~/soak/state`` (atomically)
with ``<n> <sha256 of the first n lines>``, computed incrementally in its own memory. So at
any moment, in any sandbox descended from it (paused and resumed, snapshotted, forked),
``read_state`` can check three things at once: the writer process is alive (same pid), its
in-memory digest equals the digest of the file's first ``n`` lines, and both equal the
digest of the sequence ``1..n`` computed here. Memory and disk that went out of step, a
lost or torn page, a process that did not survive: each shows as a mismatch.

The **audit** (``audit``) compares the host with the server's database, the store of
record: VMM processes, VM working directories, guest-RAM files, network namespaces, veths
and nft tables of the server's prefix must each belong to a live record; every file in
``snapshots/`` and ``layers/`` must be reachable from the records' roots (as the server's
own garbage collection computes them, ``snapshot_store.dependencies``), and collection
should keep no more than what the roots' own manifests read (``snapshots_retained_unneeded``:
directories reachable only through another kept directory's manifest); no record may sit
in a transitional state, no paused record may lack its snapshot, and no build may be left
``building``. The node's pre-started VMMs (``aenv.runtime.vmm_pool``: working directories
named ``vp...``) belong to its VMM pool, not to a record: each may hold a process, its
directory and one slot beyond the slot pool's warm ones. Run it while no operation is in
flight.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import re
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from aenv.config import Settings
from aenv.network.addressing import Addressing
from aenv.runtime.vmm_pool import PREFIX as POOLED_VMM_DIR
from aenv.storage import disks, snapshot_store
from aenv.store import Database, SandboxStore, TemplateStore
from benchmarks._server import VMServer, leftovers, log

SOAK_DIR = "/home/user/soak"

WRITER = r'''
import hashlib, os, time
d = "/home/user/soak"
with open(d + "/pid.tmp", "w") as f:
    f.write("%d\n" % os.getpid())
os.replace(d + "/pid.tmp", d + "/pid")
h = hashlib.sha256()
n = 0
log = open(d + "/log", "ab", buffering=0)
while True:
    n += 1
    line = b"%d\n" % n
    log.write(line)
    h.update(line)
    with open(d + "/state.tmp", "w") as s:
        s.write("%d %s\n" % (n, h.hexdigest()))
    os.replace(d + "/state.tmp", d + "/state")
    time.sleep(0.05)
'''

# One round trip, two programs exec'd (every exec costs its translation again under TCG):
# the state line, the digest of the first n lines of the log, whether the writer lives,
# the marker (what the source held when it was captured) and ``who`` (what this sandbox
# alone wrote since).
_READ = ("cd " + SOAK_DIR + " && read n d < state && read p < pid && "
         "{ read m < marker || m=-; } 2>/dev/null; { read w < who || w=-; } 2>/dev/null; "
         "if [ -d /proc/$p ]; then a=alive; else a=dead; fi; "
         "f=$(head -n \"$n\" log | sha256sum) && echo \"$n $d ${f%% *} $a $p $m $w\"")


class Server(Protocol):
    """What the loops need of a server: ``tests/server/conftest.ServerProcess`` and
    ``CrashableServer`` both fit."""

    url: str
    settings: Settings
    log_path: Path

    @property
    def api_key(self) -> str: ...

    def start(self) -> None: ...

    def kill9(self) -> None: ...


class CrashableServer(VMServer):
    """``benchmarks._server.VMServer`` with a name prefix and address ranges of the caller's
    choosing, few warm slots (a 2-core host), and ``kill9``."""

    def __init__(self, home: Path, net: int, prefix: str, warm_slots: int = 1) -> None:
        cache = Settings.from_env().artifacts
        super().__init__(home, net, cache)
        self.settings = Settings(home=home, cache_home=cache, name_prefix=prefix,
                                 host_cidr=f"10.{net}.0.0/24", veth_cidr=f"10.{net}.1.0/24",
                                 warm_slots=warm_slots)

    @property
    def api_key(self) -> str:
        return (self.settings.secrets_dir / "api-key").read_text().strip()

    def kill9(self) -> None:
        """SIGKILL the server process alone: its VMMs live in their own sessions."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


def sdk_opts(srv: Server, request_timeout: float = 300) -> dict[str, Any]:
    """E2B SDK options that reach ``srv`` and nothing else (no environment needed)."""
    return {"api_key": srv.api_key, "api_url": srv.url, "sandbox_url": srv.url,
            "request_timeout": request_timeout}


# -- the writer ---------------------------------------------------------------------------


class SeqDigests:
    """sha256 of ``b"1\\n2\\n...n\\n"`` for any n, from checkpoints every ``STEP`` lines."""

    STEP = 4096

    def __init__(self) -> None:
        self._marks = [hashlib.sha256()]

    def __call__(self, n: int) -> str:
        i = n // self.STEP
        while len(self._marks) <= i:
            k = len(self._marks)
            h = self._marks[-1].copy()
            h.update(b"".join(b"%d\n" % j for j in range((k - 1) * self.STEP + 1,
                                                         k * self.STEP + 1)))
            self._marks.append(h)
        h = self._marks[i].copy()
        h.update(b"".join(b"%d\n" % j for j in range(i * self.STEP + 1, n + 1)))
        return h.hexdigest()


EXPECTED = SeqDigests()


@dataclass(frozen=True)
class WriterState:
    n: int
    digest: str  # what the writer computed in memory
    file_digest: str  # of the first n lines of its log, as the guest reads them
    alive: bool
    pid: int
    marker: str
    who: str

    def problems(self, *, floor: int = 0, pid: int | None = None,
                 marker: str | None = None, who: str | None = None) -> list[str]:
        """What is wrong with this state, given what must hold: the counter at least
        ``floor``, the writer ``pid``, the ``marker`` and ``who`` files' contents."""
        out = []
        if self.n < floor:
            out.append(f"counter went back: {self.n} < {floor}")
        if self.digest != self.file_digest:
            out.append(f"writer's digest {self.digest[:12]} != file's {self.file_digest[:12]} "
                       f"at n={self.n}")
        if self.file_digest != EXPECTED(self.n):
            out.append(f"file's first {self.n} lines are not 1..{self.n}")
        if not self.alive:
            out.append(f"writer {self.pid} is dead")
        if pid is not None and self.pid != pid:
            out.append(f"writer pid changed: {pid} -> {self.pid}")
        if marker is not None and self.marker != marker:
            out.append(f"marker {self.marker!r}, expected {marker!r}")
        if who is not None and self.who != who:
            out.append(f"who {self.who!r}, expected {who!r}")
        return out


def read_state(sbx: Any, *, marker: str | None = None, who: str | None = None,
               then_marker: str | None = None) -> WriterState:
    """The writer's state in ``sbx`` (an ``e2b.Sandbox``), after writing ``marker`` and
    ``who`` in the same round trip; ``then_marker`` replaces the marker after the read and
    removes ``who`` (the source, ready for its next capture)."""
    pre = []
    if marker is not None:
        pre.append(f"echo {marker} > {SOAK_DIR}/marker")
    if who is not None:
        pre.append(f"echo {who} > {SOAK_DIR}/who")
    cmd = " && ".join([*pre, _READ])
    if then_marker is not None:
        cmd = (f"{cmd} && echo {then_marker} > {SOAK_DIR}/marker && "
               f"{{ [ ! -e {SOAK_DIR}/who ] || rm -f {SOAK_DIR}/who; }}")
    out = sbx.commands.run(cmd, timeout=60).stdout.split()
    if len(out) != 7:
        raise RuntimeError(f"unexpected state line {out!r}")
    n, digest, file_digest, alive, pid, mark, w = out
    return WriterState(int(n), digest, file_digest, alive == "alive", int(pid), mark, w)


def start_writer(sbx: Any, timeout: float = 60) -> WriterState:
    """Start the writer in ``sbx`` and return its first state."""
    sbx.files.write(f"{SOAK_DIR}/w.py", WRITER)
    # Nothing of the command's may keep envd's pipes open, or the command never ends.
    sbx.commands.run(f"mkdir -p {SOAK_DIR}; cd {SOAK_DIR}; "
                     "nohup python3 w.py </dev/null >/dev/null 2>&1 &", timeout=60)
    deadline = time.monotonic() + timeout
    while True:
        r = sbx.commands.run(f"test -s {SOAK_DIR}/state && test -s {SOAK_DIR}/pid && echo ok "
                             "|| echo wait", timeout=60)
        if r.stdout.strip() == "ok":
            return read_state(sbx)
        if time.monotonic() > deadline:
            raise TimeoutError("the soak writer did not start")
        time.sleep(0.2)


# -- the audit ----------------------------------------------------------------------------


def vmm_processes(settings: Settings) -> dict[int, str]:
    """pid -> working directory of every process whose cwd is under ``vms_dir``."""
    vms = str(settings.vms_dir)
    out = {}
    for e in os.scandir("/proc"):
        if e.name.isdigit():
            try:
                cwd = os.readlink(f"/proc/{e.name}/cwd")
            except OSError:
                continue
            if cwd == vms or cwd.startswith(vms + "/"):
                out[int(e.name)] = cwd
    return out


def host_objects(settings: Settings) -> dict[str, list[str]]:
    """Netns, host veths, nft tables and guest-RAM files named with the server's prefix."""
    prefix = settings.name_prefix
    netns = sorted(n for n in os.listdir("/run/netns") if n.startswith(prefix + "-")) \
        if os.path.isdir("/run/netns") else []
    veths = sorted(n for n in os.listdir("/sys/class/net")
                   if re.fullmatch(rf"{re.escape(prefix)}-v[0-9]+", n))
    import subprocess

    tables = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True,
                            check=False).stdout.split("\n")
    names = [t.split()[-1] for t in tables if t.strip()]
    shm = sorted(p.name for p in Path("/dev/shm").glob(f"{prefix}-*"))
    return {"netns": netns, "veths": veths,
            "nft_tables": [n for n in names if n == prefix or n.startswith(prefix + "-")],
            "shm_files": shm}


def reachable(settings: Settings, roots: set[str]) -> set[Path]:
    """Snapshot directories and layer files reachable from ``roots``: the server's own walk
    (``snapshot_store.reachable``, what ``collect`` keeps), deleting nothing."""
    return snapshot_store.reachable(settings.snapshots_dir, settings.layers_dir, roots)


def dangling_overlays(settings: Settings) -> list[str]:
    """Entries of ``vms_dir/.overlays`` (``storage.disks``' cache of empty overlays, one per
    base a disk was made over) whose base no longer exists: nothing can use them again."""
    d = settings.vms_dir / ".overlays"
    out = []
    for e in sorted(d.iterdir()) if d.is_dir() else ():
        try:
            backing = disks.qcow2_backing_file(e)
        except OSError:
            continue
        if backing and not os.path.exists(backing):
            out.append(f"{e.name} -> {backing}")
    return out


def needed_directly(settings: Settings, roots: set[str]) -> set[Path]:
    """The snapshot directories of ``roots`` and those their own manifests read from."""
    snaps, layers = settings.snapshots_dir, settings.layers_dir
    out: set[Path] = set()
    for r in roots:
        if not r.startswith(snapshot_store.SNAPSHOT):
            continue
        try:
            d = snapshot_store.directory(snaps, r)
        except Exception:
            continue
        if d.exists():
            out.add(d)
            out |= snapshot_store.dependencies(d, snaps, layers)
    return out


def _dir_bytes(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_blocks * 512
            except OSError:
                pass
    return total


def audit(settings: Settings, *, settle_s: float = 20.0,
          ignore: frozenset[tuple[str, str]] = frozenset()) -> dict[str, Any]:
    """Compare the host and the home with the database (see the module docstring).
    Returns ``problems`` (lists of findings, all empty when clean), ``notes`` (states that
    are allowed but worth seeing, e.g. build reservations never started) and ``counts``.
    Network objects are given ``settle_s`` to reach their bound: the pool releases slots
    and fills its warm ones in the background; unreachable snapshots the same time to be
    collected. Findings in ``ignore`` (``(kind, item)``,
    e.g. ``baseline``'s, from before a run began) are left out."""
    deadline = time.monotonic() + settle_s
    while True:
        found = _audit_once(settings)
        found["problems"] = {k: [x for x in v if (k, x) not in ignore]
                             for k, v in found["problems"].items()}
        if not any(found["problems"][k] for k in (*_SETTLING, *_COLLECTED)) \
                or time.monotonic() > deadline:
            return found
        time.sleep(0.5)


def baseline(settings: Settings) -> frozenset[tuple[str, str]]:
    """What the audit finds before a run starts: leftovers of earlier servers with the same
    prefix (e.g. a guest-RAM file in /dev/shm), or of other users of a shared server. A
    run reports them apart and holds itself to the rest. Network objects are left out:
    the slot pool moves them in the background, and the audit gives them time instead."""
    found = _audit_once(settings)
    return frozenset((k, x) for k, v in found["problems"].items() for x in v
                     if k not in _SETTLING)


# What the slot pool brings to its bound in the background.
_SETTLING = ("netns_extra", "veths_extra", "nft_extra")
# What collection removes in the background (a resume in place leaves its abandoned
# snapshot to it): given the same time, but a finding before a run still counts as one.
_COLLECTED = ("snapshots_unreachable",)


def _audit_once(settings: Settings) -> dict[str, Any]:
    db = Database(settings.home / "aenv.db")
    try:
        sandboxes, templates = SandboxStore(db), TemplateStore(db)
        live = sandboxes.live()
        tpls = templates.list()
        builds = templates.builds_in(("waiting", "building"))
        roots = {t.image for t in tpls if t.image} | templates.tagged_images()
        for r in live:
            roots.update(x for x in (r.snapshot_id, r.restored_from) if x)
    finally:
        db.close()
    running = [r for r in live if r.state == "running"]
    p: dict[str, list[str]] = {}
    p["stuck_records"] = [f"{r.id}: {r.state}" for r in live
                          if r.state not in ("running", "paused")]
    has = lambda ref: snapshot_store.is_complete(  # noqa: E731
        snapshot_store.directory(settings.snapshots_dir, ref))
    p["paused_without_snapshot"] = [f"{r.id}: {r.snapshot_id}" for r in live
                                    if r.state == "paused"
                                    and not (r.snapshot_id and has(r.snapshot_id))]
    p["stuck_builds"] = [f"build {b.id} of {b.template_id}" for b in builds
                         if b.status == "building"]
    p["stuck_templates"] = [f"{t.id}: {t.status}" for t in tpls if t.status == "building"]

    procs = vmm_processes(settings)
    # the VMM pool's: a pre-started VMM in a directory of its own, holding one slot
    pooled = {cwd for cwd in procs.values() if Path(cwd).name.startswith(POOLED_VMM_DIR)}
    owned_dirs = {r.vm_dir for r in running if r.vm_dir} | pooled
    p["vmm_unowned"] = [f"pid {pid} in {cwd}" for pid, cwd in sorted(procs.items())
                        if cwd not in owned_dirs]
    with_vmm = set(procs.values())
    p["running_without_vmm"] = [f"{r.id} ({r.vm_dir})" for r in running
                                if r.vm_dir not in with_vmm]
    # ``.overlays`` is storage.disks' cache of empty overlays (one per base image), not a VM.
    vm_dirs = sorted(d for d in settings.vms_dir.iterdir() if d.name != ".overlays") \
        if settings.vms_dir.is_dir() else []
    overlays = settings.vms_dir / ".overlays"
    p["vm_dirs_unowned"] = [d.name for d in vm_dirs if str(d) not in owned_dirs]
    p["overlay_cache_dangling"] = dangling_overlays(settings)
    ids = {r.id for r in running}
    host = host_objects(settings)
    p["shm_unowned"] = [f for f in host["shm_files"]
                        if f.removeprefix(f"{settings.name_prefix}-vm-").removesuffix(".mem")
                        not in ids]

    keep = reachable(settings, roots)
    snap_entries = sorted(settings.snapshots_dir.iterdir()) \
        if settings.snapshots_dir.is_dir() else []
    p["snapshots_unreachable"] = [e.name for e in snap_entries if e not in keep]
    # A manifest names every file a restore of it reads (the whole memory stack, the whole
    # backing chain of each drive), so what the roots need is them and their direct
    # dependencies; what collection keeps beyond that, it keeps for nobody.
    needed = needed_directly(settings, roots)
    p["snapshots_retained_unneeded"] = [e.name for e in snap_entries
                                        if e in keep and e not in needed]
    layer_entries = sorted(settings.layers_dir.iterdir()) if settings.layers_dir.is_dir() else []
    p["layers_unreachable"] = [
        e.name for e in layer_entries
        if e.with_suffix(".qcow2") not in keep and e.with_suffix(".raw") not in keep
        and e not in keep]

    a = Addressing(settings)
    slots = {r.slot for r in running if r.slot is not None}
    spare_ns = [n for n in host["netns"] if a.index_of_netns(n) not in slots]
    spare_veth = [v for v in host["veths"] if a.index_of_veth(v) not in slots]
    # The pool keeps ``warm_slots`` ready and each pooled VMM holds one.
    spare_bound = settings.warm_slots + len(pooled)
    p["netns_extra"] = spare_ns if len(spare_ns) > spare_bound else []
    p["veths_extra"] = spare_veth if len(spare_veth) > spare_bound else []
    p["running_without_netns"] = [f"{r.id}: slot {r.slot}" for r in running
                                  if r.slot is not None
                                  and a.slot(r.slot).netns not in host["netns"]]
    p["nft_extra"] = [t for t in host["nft_tables"] if t != settings.name_prefix]

    notes = {"waiting_builds": [f"build {b.id} of {b.template_id}" for b in builds
                                if b.status == "waiting"]}
    counts = {"live_records": len(live), "running": len(running),
              "paused": sum(r.state == "paused" for r in live), "templates": len(tpls),
              "vmm_processes": len(procs), "pooled_vmms": len(pooled), "vm_dirs": len(vm_dirs),
              "netns": len(host["netns"]),
              "overlay_cache_entries": len(list(overlays.iterdir())) if overlays.is_dir() else 0,
              "snapshot_entries": len(snap_entries),
              "snapshots_mib": round(_dir_bytes(settings.snapshots_dir) / 2**20, 1)
              if settings.snapshots_dir.is_dir() else 0.0}
    return {"problems": p, "notes": notes, "counts": counts}


def process_figures(pid: int) -> dict[str, int]:
    """Resident memory (KiB) and open descriptors of a process: a server that leaks shows
    them growing with the cycles."""
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    out["rss_kib"] = int(line.split()[1])
        out["fds"] = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        pass
    return out


def log_excerpt(log_path: Path, needles: list[str], limit: int = 8,
                since: int = 0) -> list[str]:
    """Lines of the server log (from byte ``since``) that mention any of ``needles``,
    warnings and errors first, at most ``limit``."""
    try:
        with open(log_path, "rb") as f:
            f.seek(since)
            text = f.read().decode(errors="replace")
    except OSError:
        return []
    lines = [ln for ln in text.splitlines() if any(n and n in ln for n in needles)]
    bad = [ln for ln in lines if " WARNING " in ln or " ERROR " in ln or "Traceback" in ln]
    rest = [ln for ln in lines if ln not in bad]
    return [ln[:400] for ln in (bad + rest)[:limit]]


def log_size(log_path: Path) -> int:
    try:
        return log_path.stat().st_size
    except OSError:
        return 0


def stop_leftover_vmms(settings: Settings) -> list[int]:
    """SIGKILL, by pid, VMMs still running in this server's ``vms_dir`` (after it stopped:
    processes this benchmark started through it); returns their pids."""
    pids = sorted(vmm_processes(settings))
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return pids


def sweep_after_stop(settings: Settings) -> dict[str, list[str]]:
    """After the benchmark's server stopped: what of its prefix was left (network objects,
    VMM processes, which are killed), removed, and reported by kind (empty lists left out)."""
    from aenv.network import cleanup_leftovers

    left = leftovers(settings)
    vmms = stop_leftover_vmms(settings)
    if any(left.values()):
        log(f"leftovers after stop, removing: {left}")
        cleanup_leftovers(settings)
    after_stop = {k: list(v) for k, v in left.items() if v}
    if vmms:
        after_stop["vmm_processes_killed"] = [str(pid) for pid in vmms]
    return after_stop


def add_server_args(ap: argparse.ArgumentParser, *, net: int, prefix: str) -> None:
    """The options of ``benchmark_server``: the server's address ranges, name prefix, and
    where its log is kept."""
    ap.add_argument("--net", type=int, default=net, help="10.<net>.0.0/24 and 10.<net>.1.0/24")
    ap.add_argument("--prefix", default=prefix)
    ap.add_argument("--keep-log", type=Path, default=None,
                    help="copy the server log here at the end")


@contextlib.contextmanager
def benchmark_server(script: str, args: argparse.Namespace, result: dict[str, Any], *,
                     restart_crashed: bool = False) -> Iterator[CrashableServer]:
    """A benchmark's server (``script``: the benchmark's file, for the messages; ``args``:
    from ``add_server_args``): exits unless root, then a ``CrashableServer`` in a fresh
    temporary home, started. Afterwards, whatever happened: its sandboxes killed through the
    API (a server that is down is first started again with ``restart_crashed``, else left),
    the server stopped, what it left swept into ``result["leftovers_after_stop"]`` (and
    added to ``result["leak_count"]`` where there is one), its log copied to
    ``args.keep_log``, its home removed."""
    if os.geteuid() != 0:
        sys.exit(f"{script} needs root (network namespaces, VMs)")
    home = Path(tempfile.mkdtemp(prefix=f"aenv-{Path(script).stem.replace('_', '')}-"))
    srv = CrashableServer(home, args.net, args.prefix)
    try:
        log(f"starting aenv server (prefix {args.prefix}, home {home})")
        srv.start()
        yield srv
    finally:
        try:
            if srv.proc is None or srv.proc.poll() is not None:
                if restart_crashed:
                    srv.start()  # crashed between a kill and its restart: clean up for real
                    srv.kill_all()
            else:
                srv.kill_all()
        except Exception as e:
            log(f"final cleanup through the API: {e}")
        srv.stop()
        after_stop = sweep_after_stop(srv.settings)
        result["leftovers_after_stop"] = after_stop
        if "leak_count" in result:
            result["leak_count"] += sum(len(v) for v in after_stop.values())
        if args.keep_log is not None and srv.log_path.exists():
            shutil.copy(srv.log_path, args.keep_log)
        shutil.rmtree(home, ignore_errors=True)
