"""What an idle sandbox costs the host: memory (PSS) and CPU per sandbox, N at once.

Run as root: ``.venv/bin/python benchmarks/density.py [--n 30] [--window 20] [--settle 10]``
(``--tree DIR``: the aenv of another source tree, e.g. ``git archive <commit>`` unpacked, for
an A/B of two commits run back to back on the same host; ``--memory-overcommit``: the
server's admission of guest memory per byte of host RAM, whose default 2 lets a 24 GiB host
admit 94 guests of 512 MiB, whatever they really use)

Method: starts ``aenv server`` in a child process (``benchmarks/_server.py``: its own home,
name prefix and address ranges, 10.<--net>.0/24, default 133; the host's kernel and image
cache; base kept as a snapshot, so each create is a restore) with room for ``--n``
sandboxes, creates ``--n`` sandboxes from ``base`` through the E2B SDK (``AsyncSandbox``,
``--batch`` at a time), lets them settle ``--settle`` seconds, and then, with nothing asked
of them:

- ``pss_mib``: per sandbox VMM process (found by its working directory under the server's
  VM directory), ``Pss`` from ``/proc/PID/smaps_rollup``: its share of the pages it maps,
  pages shared with other VMMs (the template's memory file in the page cache, QEMU's own
  code) split between them; the sum over all VMMs is what the host spends on them.
  ``anonymous_mib``: the private part, split into ``guest_ram_written`` (guest pages
  copied on write since the restore, in the VMM's mapping of the template's memory file)
  and ``vmm_own`` (TCG's translation cache, QEMU's heap and device buffers), of which
  ``tcg_translation_cache`` is the translation cache alone (anonymous pages of the VMM's
  executable anonymous mapping: what KVM does not have). QEMU asks for transparent huge
  pages on that buffer (MADV_HUGEPAGE; AnonHugePages equals its Anonymous), so one VMM's
  figure moves in steps of 2 MiB and holds up to 2 MiB more than the code it translated:
  compare means over many VMMs.
- ``cpu_ms_per_s``: host CPU time (``utime + stime`` of ``/proc/PID/stat``, every thread of
  the VMM) over ``--window`` seconds, per second of wall time, per sandbox; ``server`` is
  the aenv server's own (TTL loop, proxy, metrics) over the same window; ``host_busy_pct``
  the whole host's, which includes other sessions' work.
- ``answers``: afterwards, one by one, ``commands.run("true")`` in each sandbox; how many
  answered within 2 s, and their latency; ``pss_after_one_command_mib``: the VMMs' PSS
  again after that (what a sandbox that did a little holds).

A sandbox's VMM is the process its record names (``vm_pid`` in the node's store, read only)
or the one running in its directory; VMMs under the VM directory that no sandbox holds
(pre-started VMMs waiting in the pool) are reported apart (``other_vmms``). Output: one
JSON object; ``goals``: issue 21's per-idle-sandbox targets (<= 40 MiB PSS, <= 5 ms/s
CPU). The host has 2 shared cores, guests run under TCG, and other sessions' VMs may run at
the same time (``host_busy_pct``, ``load_avg``): compare runs, not single numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aenv.config import Settings
from benchmarks._common import emit, summary
from benchmarks._server import VMServer, log

GOAL_PSS_MIB = 40.0
GOAL_CPU_MS_PER_S = 5.0
ANSWER_WITHIN_S = 2.0
TICK = os.sysconf("SC_CLK_TCK")


def vmm_pids(vms_dir: Path) -> dict[int, str]:
    """pid -> name of the directory under ``vms_dir`` that is the process's cwd."""
    out = {}
    root = str(vms_dir) + "/"
    for e in os.scandir("/proc"):
        if not e.name.isdigit():
            continue
        try:
            cwd = os.readlink(f"/proc/{e.name}/cwd")
            comm = Path(f"/proc/{e.name}/comm").read_text().strip()
        except OSError:
            continue
        if cwd.startswith(root) and comm.startswith("qemu"):
            out[int(e.name)] = cwd[len(root):].split("/")[0]
    return out


def record_pids(home: Path) -> dict[str, int]:
    """sandbox id -> VMM pid, from the node's store (read only)."""
    import sqlite3

    db = sqlite3.connect(f"file:{home / 'aenv.db'}?mode=ro", uri=True, timeout=10)
    try:
        rows = db.execute("SELECT id, vm_pid FROM sandboxes WHERE vm_pid IS NOT NULL")
        return {sid: int(pid) for sid, pid in rows}
    finally:
        db.close()


def rollup_kib(pid: int) -> dict[str, int]:
    kb: dict[str, int] = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) == 3 and parts[2] == "kB":
                kb[parts[0].rstrip(":")] = int(parts[1])
    return kb


def anonymous_split_kib(pid: int) -> tuple[int, int]:
    """(guest, tcg) KiB of the VMM's anonymous memory. guest: copied-on-write pages inside
    its file mappings of 64 MiB or more, i.e. guest RAM pages written since the restore.
    tcg: anonymous pages of its executable anonymous mappings, i.e. TCG's translation
    cache (the one such mapping, ``tb-size`` large), which KVM does not have. The rest of
    its anonymous memory is QEMU's own (heap, the vCPU thread's arena with TCG's soft TLB,
    device buffers, relocated library data)."""
    guest = tcg = 0
    in_file = is_code = False
    size = 0
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and not head[0].endswith(":"):
                lo, hi = (int(x, 16) for x in head[0].split("-"))
                size = hi - lo
                in_file = len(head) >= 6 and head[5].startswith("/")
                is_code = len(head) < 6 and "x" in head[1]
            elif head[0] == "Anonymous:":
                if in_file and size >= 64 << 20:
                    guest += int(head[1])
                elif is_code:
                    tcg += int(head[1])
    return guest, tcg


def cpu_ticks(pid: int) -> int:
    """utime + stime of every thread of ``pid`` (clock ticks)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # fields 14 and 15 of stat(5)


def host_ticks() -> tuple[int, int]:
    """(busy, total) ticks of the whole host from /proc/stat."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    total = sum(v[:8])
    return total - v[3] - v[4], total


async def create_all(n: int, batch: int) -> list[Any]:
    from e2b import AsyncSandbox

    made: list[Any] = []
    while len(made) < n:
        k = min(batch, n - len(made))
        made += await asyncio.gather(
            *(AsyncSandbox.create("base", timeout=3600, retries=0) for _ in range(k)))
        log(f"{len(made)}/{n} sandboxes running")
    return made


async def answers(sandboxes: list[Any]) -> list[float | None]:
    """``commands.run("true")`` in each, one at a time: ms, or None when it failed."""
    out: list[float | None] = []
    for s in sandboxes:
        t0 = time.perf_counter()
        try:
            r = await s.commands.run("true", request_timeout=30)
            out.append((time.perf_counter() - t0) * 1000 if r.exit_code == 0 else None)
        except Exception as e:
            log(f"{s.sandbox_id}: {type(e).__name__}: {e}")
            out.append(None)
    return out


def measure(srv: VMServer, args: argparse.Namespace) -> dict[str, Any]:
    key = (srv.settings.secrets_dir / "api-key").read_text().strip()
    os.environ.update({"E2B_API_KEY": key, "E2B_API_URL": srv.url,
                       "E2B_SANDBOX_URL": srv.url, "E2B_DOMAIN": "localhost"})
    return asyncio.run(_measure(srv, args))


async def _measure(srv: VMServer, args: argparse.Namespace) -> dict[str, Any]:
    sandboxes = await create_all(args.n, args.batch)
    try:
        ids = {s.sandbox_id for s in sandboxes}
        log(f"settling {args.settle} s")
        await asyncio.sleep(args.settle)
        pids = vmm_pids(srv.settings.vms_dir)
        # A sandbox given a pre-started VMM runs in that VMM's directory: the node's
        # records say which process is whose.
        held = {p: sid for sid, p in record_pids(srv.settings.home).items() if sid in ids}
        mine = {p: d for p, d in pids.items() if d in ids or p in held}
        others = {p: d for p, d in pids.items() if p not in mine}
        if len(mine) != args.n:
            log(f"found {len(mine)} sandbox VMMs for {args.n} sandboxes")
        assert srv.proc is not None
        watched = [*mine, *others, srv.proc.pid]
        before = {p: cpu_ticks(p) for p in watched}
        host_before = host_ticks()
        t0 = time.monotonic()
        await asyncio.sleep(args.window)
        wall = time.monotonic() - t0
        after = {p: cpu_ticks(p) for p in watched}
        host_after = host_ticks()
        ms_per_s = {p: (after[p] - before[p]) * 1000 / TICK / wall for p in watched}
        split = {p: anonymous_split_kib(p) for p in [*mine, *others]}
        mem = {p: {**rollup_kib(p), "guest": g, "tcg": t} for p, (g, t) in split.items()}
        ran = await answers(sandboxes)
        used = {p: {**rollup_kib(p), "tcg": anonymous_split_kib(p)[1]}
                for p in mine if os.path.exists(f"/proc/{p}")}
    finally:
        await asyncio.gather(*(s.kill() for s in sandboxes), return_exceptions=True)
    pss = [mem[p]["Pss"] / 1024 for p in mine]
    anon = [mem[p]["Anonymous"] / 1024 for p in mine]
    guest = [mem[p]["guest"] / 1024 for p in mine]
    tcg = [mem[p]["tcg"] / 1024 for p in mine]
    cpu = [ms_per_s[p] for p in mine]
    ok = [x for x in ran if x is not None and x <= ANSWER_WITHIN_S * 1000]
    busy = (host_after[0] - host_before[0]) / max(host_after[1] - host_before[1], 1)
    return {
        "sandboxes": args.n, "vmms_found": len(mine), "window_s": round(wall, 2),
        "pss_mib": {"per_sandbox_mean": round(sum(pss) / len(pss), 1), "sum": round(sum(pss), 1),
                    "spread": summary(pss)},
        "anonymous_mib": {"per_sandbox_mean": round(sum(anon) / len(anon), 1),
                          "guest_ram_written_mean": round(sum(guest) / len(guest), 1),
                          "vmm_own_mean": round((sum(anon) - sum(guest)) / len(anon), 1),
                          "tcg_translation_cache_mean": round(sum(tcg) / len(tcg), 1),
                          "spread": summary(anon)},
        # The same VMMs once each ran its one command: under TCG the translation cache
        # grows with the code a guest runs (up to the driver's tb-size), so an idle
        # sandbox that did something holds more than a fresh one.
        "pss_after_one_command_mib": {
            "per_sandbox_mean": round(sum(u["Pss"] for u in used.values()) / 1024
                                      / max(len(used), 1), 1),
            "tcg_translation_cache_mean": round(sum(u["tcg"] for u in used.values()) / 1024
                                                / max(len(used), 1), 1),
            "n": len(used)},
        "cpu_ms_per_s": {"per_sandbox_mean": round(sum(cpu) / len(cpu), 2),
                         "sum": round(sum(cpu), 1), "spread": summary(cpu),
                         "server": round(ms_per_s[srv.proc.pid], 2)},
        "other_vmms": {"count": len(others),
                       "pss_mib": round(sum(mem[p]["Pss"] for p in others) / 1024, 1),
                       "cpu_ms_per_s": round(sum(ms_per_s[p] for p in others), 2)},
        "host_busy_pct": round(100 * busy, 1),
        "answers": {"within_2s": len(ok), "failed": sum(x is None for x in ran),
                    "run_ms": summary([x for x in ran if x is not None])},
        "goals": {"pss_mib_per_sandbox": GOAL_PSS_MIB,
                  "cpu_ms_per_s_per_sandbox": GOAL_CPU_MS_PER_S,
                  "met": (sum(pss) / len(pss) <= GOAL_PSS_MIB
                          and sum(cpu) / len(cpu) <= GOAL_CPU_MS_PER_S
                          and len(ok) == args.n)},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=30, help="idle sandboxes at once")
    ap.add_argument("--batch", type=int, default=8, help="creates in flight at once")
    ap.add_argument("--settle", type=float, default=10.0,
                    help="seconds between the last create and the measurement")
    ap.add_argument("--window", type=float, default=20.0, help="seconds of CPU measurement")
    ap.add_argument("--net", type=int, default=133,
                    help="second octet of the server's host and veth /24s")
    ap.add_argument("--memory-overcommit", type=float, default=None,
                    help="the server's AENV_MEMORY_OVERCOMMIT (its default, 2, admits 94 "
                         "guests of 512 MiB on a 24 GiB host: --n 100 needs more)")
    ap.add_argument("--tree", type=Path, default=None,
                    help="run the aenv of this source tree (e.g. an older commit's "
                         "`git archive`, unpacked) instead of this one, to compare")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("density.py needs root (network namespaces, VMs)")
    if args.memory_overcommit is not None:  # the server child inherits the environment
        os.environ["AENV_MEMORY_OVERCOMMIT"] = str(args.memory_overcommit)
    home = Path(tempfile.mkdtemp(prefix="aenv-bench-density-"))
    srv = VMServer(home, args.net, Settings.from_env().artifacts,
                   server_args=("--max-sandboxes", str(args.n + 8)), tree=args.tree)
    result: dict[str, Any] = {"benchmark": "density", "load_before": os.getloadavg(),
                              "tree": str(args.tree) if args.tree else None,
                              "memory_overcommit": args.memory_overcommit}
    try:
        log(f"starting aenv server (prefix {srv.settings.name_prefix})")
        srv.start()
        result.update(measure(srv, args))
    except BaseException:
        if srv.log_path.exists():
            log("server log tail:\n" + srv.log_path.read_text(errors="replace")[-3000:])
        raise
    finally:
        srv.shut_down()
    result["load_after"] = os.getloadavg()
    emit(result)


if __name__ == "__main__":
    main()
