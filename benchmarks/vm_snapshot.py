"""VM snapshot latency and memory under the qemu driver: resume, pause, persistent snapshot,
fork x16, and the host memory each forked child costs; for a 256 MiB and a 2 GiB guest.

Run as root: ``.venv/bin/python benchmarks/vm_snapshot.py [--cycles 10] [--forks 16]
[--fork-rounds 5] [--sizes 256,2048] [--flavor cloud|small]``. Per guest size it boots the
``base`` image once, pauses it into a template snapshot (the first pause of a booted VM
copies its RAM file: reported apart), and then measures, on restored VMs as every sandbox is one:

- ``resume``: ``Runtime.restore`` of a paused sandbox into a fresh working directory and a
  pre-made network slot, to the vCPUs running (``running_ms``) and to envd's ``/health``
  answering (``healthy_ms``); ``pause``: ``VM.snapshot(stop=True)`` after a little guest
  activity, ``freeze_ms`` (vCPUs stopped until the VMM is gone) and ``total_ms``. The two
  alternate on one sandbox (a chain of pause/resume, compacted by the driver as it grows).
- ``persistent_snapshot``: ``VM.snapshot(stop=False)`` of a running VM, source freeze/total.
- ``fork``: one capture of a running source plus N concurrent restores, to all N children
  answering ``/health`` (slots are made beforehand, as the warm pool would); then the
  marginal host memory of a child (``/proc/<pid>/smaps_rollup`` of its QEMU: RSS, PSS,
  private) right after the fork and after every child dirtied 16 MiB.
- ``pause_after_dirtying`` (largest size only): pause after the guest wrote 16 MiB / 1 GiB.

Prints one JSON object (milliseconds, MiB). It uses its own name prefix and addresses and
removes every VM, slot and snapshot it made. The host has 2 shared cores and other work
runs on it: compare runs, not single numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aenv.client.envd import ENVD_PORT, EnvdClient
from aenv.config import Settings
from aenv.guest.bootargs import guest_boot_args
from aenv.network import NetworkSlot, SlotPool, cleanup_leftovers
from aenv.runtime import Drive, RestoreOverrides, VMSpec
from aenv.runtime import guest_memory as gm
from aenv.runtime import workdir as wd
from aenv.runtime.kvm import host_accel
from aenv.runtime.qemu import QemuRuntime, QemuVM
from aenv.runtime.ready import boot_until_ready
from aenv.storage import snapshots
from aenv.storage.disks import create_disk
from aenv.storage.images import ensure_base_image
from aenv.storage.kernel import ensure_kernel
from benchmarks._common import emit, phase_summaries, private_settings, summary

GOALS = {"resume_healthy_p50_ms": 250, "pause_total_p50_ms": 300, "fork16_all_ready_p50_ms": 3000,
         "restore_ratio_2g_256m": 1.3, "marginal_anonymous_mib_per_child": 50}
MIB = 1 << 20
HEALTH_POLL_S = 0.005


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def ms(seconds: float) -> float:
    return round(seconds * 1000, 2)


async def dirty_guest(sbx: Any, size: int) -> None:
    """A guest process fills ``size`` MiB with one non-zero byte, repeated: distinct pages
    with non-zero content (zero-filled pages equal to the base would not count as changed)."""
    await sbx.envd.start_background(
        f"python3 -c \"import time; x = bytearray(b'\\xa5') * ({size} << 20); "
        f"open('/tmp/dirty-ready', 'w').close(); time.sleep(3600)\"")
    deadline = time.monotonic() + 300
    while (await sbx.envd.run("test -e /tmp/dirty-ready")).exit_code != 0:
        if time.monotonic() > deadline:
            raise TimeoutError("the guest did not finish dirtying memory")
        await asyncio.sleep(0.2)


@dataclass
class Sandbox:
    vm: QemuVM
    slot: NetworkSlot
    envd: EnvdClient


def smaps(vm: QemuVM) -> dict[str, float]:
    """MiB figures of one VMM from ``smaps_rollup``. ``anonymous`` is its marginal cost: the
    snapshot's pages it only reads are shared page cache (in ``rss``, split in ``pss``), so
    what it adds is the guest pages it wrote (``guest_ram_written``, private copies in the
    RAM mapping) plus QEMU's own memory (``vmm_anonymous``: under TCG mostly the translation
    cache, which grows with the guest code run; heap, device buffers)."""
    kb: dict[str, int] = {}
    with open(f"/proc/{vm.pid}/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) == 3 and parts[2] == "kB":
                kb[parts[0].rstrip(":")] = int(parts[1])
    size = json.loads((vm.workdir / wd.MANIFEST).read_text())["machine"]["memory_mib"] * MIB
    mapping = gm.find_mapping(vm.pid, vm.workdir / wd.BASE_MEMORY, size)
    guest = sum(n for _, n in gm.private_runs(vm.pid, mapping)) * gm.PAGE_SIZE / MIB
    anon = kb["Anonymous"] / 1024
    return {"rss": round(kb["Rss"] / 1024, 1), "pss": round(kb["Pss"] / 1024, 1),
            "anonymous": round(anon, 1), "guest_ram_written": round(guest, 1),
            "vmm_anonymous": round(anon - guest, 1)}


def mean(rows: list[dict[str, float]]) -> dict[str, float]:
    return {k: round(sum(r[k] for r in rows) / len(rows), 1) for k in rows[0]}


class Bench:
    def __init__(self, settings: Settings, pool: SlotPool, kernel, image, root: Path) -> None:
        self.settings, self.pool, self.kernel, self.image, self.root = (
            settings, pool, kernel, image, root)
        # As the server's node makes it (write tracking unless AENV_TRACK_WRITES=0).
        self.runtime = QemuRuntime(
            track_writes=settings.native_dir if settings.track_writes else None)
        self.token = secrets.token_hex(16)
        self.live: list[Sandbox] = []
        self._n = 0

    def name(self, what: str) -> str:
        self._n += 1
        return f"sb-{what}-{self._n}"

    async def slots(self, n: int) -> list[NetworkSlot]:
        return [await asyncio.to_thread(self.pool.acquire) for _ in range(n)]

    async def destroy(self, sbx: Sandbox) -> None:
        self.live.remove(sbx)
        await sbx.envd.aclose()
        await sbx.vm.stop()
        wd.remove(sbx.vm.workdir)
        await asyncio.to_thread(self.pool.release, sbx.slot)

    @classmethod
    async def open(cls, prefix: str, net: int, flavor: str) -> Bench:
        """A bench on settings of its own (name prefix, address block, no warm slots), with
        the guest kernel and base image ready and its slot pool started."""
        settings = private_settings(prefix, net, warm_slots=0)
        kernel = ensure_kernel(settings, flavor)
        image = ensure_base_image(settings, kernel_flavor=kernel.flavor)
        pool = SlotPool(settings, warm_size=0)
        await asyncio.to_thread(pool.start)
        return cls(settings, pool, kernel, image,
                   settings.home / "bench-snapshots" / settings.name_prefix)

    async def close(self) -> None:
        """Every sandbox still live destroyed, the slot pool closed, this run's snapshots
        deleted, and whatever of the prefix is left swept (and said)."""
        for sbx in list(self.live):
            await self.destroy(sbx)
        await asyncio.to_thread(self.pool.close)
        shutil.rmtree(self.root, ignore_errors=True)
        try:
            self.root.parent.rmdir()  # only when no other run's snapshots are in it
        except OSError:
            pass
        left = await asyncio.to_thread(cleanup_leftovers, self.settings)
        if left.namespaces or left.killed_pids:
            log(f"cleaned leftovers: {left}")

    async def template(self, mib: int) -> tuple[Path, dict[str, Any]]:
        """Boot a guest of ``mib`` MiB, init envd, pause it into a template snapshot."""
        (slot,) = await self.slots(1)
        name = self.name(f"boot{mib}")
        workdir = self.settings.vms_dir / name
        disk = create_disk(self.image.path, workdir)
        spec = VMSpec(
            vm_id=name, workdir=workdir, kernel=self.kernel.vmlinux, initrd=self.kernel.initrd,
            boot_args=guest_boot_args(self.kernel), memory_mib=mib,
            drives=(Drive("rootfs", disk.path, format=disk.format),), tap=slot.tap_name,
            netns=slot.netns, mac=slot.guest_mac,
            memory_file=wd.default_memory_file(name, workdir, self.settings.name_prefix))
        url = f"http://{slot.host_ip}:{ENVD_PORT}"
        vm, phases = await boot_until_ready(self.runtime, spec, url)
        envd = EnvdClient(url)
        sbx = Sandbox(vm, slot, envd)
        self.live.append(sbx)
        await envd.init(access_token=self.token, env_vars={})
        directory = self.root / f"template-{mib}"
        info = await vm.snapshot(directory, stop=True)
        await self.destroy(sbx)
        log(f"{mib} MiB: booted in {phases.total:.2f} s, template paused in "
            f"{info.total_s * 1000:.0f} ms ({info.memory_bytes / MIB:.0f} MiB of RAM copied)")
        return directory, {"boot_to_healthy_ms": ms(phases.total), "freeze_ms": ms(info.freeze_s),
                           "total_ms": ms(info.total_s),
                           "memory_copied_mib": round(info.memory_bytes / MIB, 1)}

    async def restore(self, snapshot: Path, slot: NetworkSlot, what: str) -> tuple[Sandbox, dict]:
        t0 = time.monotonic()
        vm = await self.runtime.restore(snapshot, RestoreOverrides(
            vm_id=(name := self.name(what)), workdir=self.settings.vms_dir / name,
            netns=slot.netns))
        t_run = time.monotonic()
        envd = EnvdClient(f"http://{slot.host_ip}:{ENVD_PORT}", self.token)
        sbx = Sandbox(vm, slot, envd)
        self.live.append(sbx)
        await envd.wait_healthy(30, HEALTH_POLL_S, alive=vm.is_alive)
        t_ok = time.monotonic()
        await envd.init(access_token=self.token, env_vars={}, current_token=self.token)
        t_init = time.monotonic()
        timing = {"running_ms": ms(t_run - t0), "healthy_ms": ms(t_ok - t0),
                  "init_ms": ms(t_init - t0),
                  **{f"{k}_ms": ms(v) for k, v in vm.boot_timings.items()}}
        return sbx, timing

    async def cycles(self, template: Path, n: int, mib: int) -> dict[str, Any]:
        """Alternate pause and resume ``n`` times on one sandbox."""
        first, resumes, pauses = None, [], []
        (slot,) = await self.slots(1)
        sbx, first = await self.restore(template, slot, f"cyc{mib}")
        for i in range(n):
            await sbx.envd.run(f"echo {i} > /tmp/cycle; ls / > /dev/null")
            directory = self.root / f"cycle-{mib}-{i}"
            info = await sbx.vm.snapshot(directory, stop=True)
            pauses.append({"freeze_ms": ms(info.freeze_s), "total_ms": ms(info.total_s),
                           "memory_kib": info.memory_bytes >> 10,
                           "layers": info.memory_layers, "compacted": info.compacted})
            slot_next = (await self.slots(1))[0]
            await self.destroy(sbx)
            sbx, timing = await self.restore(directory, slot_next, f"cyc{mib}")
            resumes.append(timing)
        await self.destroy(sbx)
        keys_r = ("running_ms", "healthy_ms", "init_ms", "qmp_ready_ms", "state_loaded_ms",
                  "prepare_ms")
        return {
            "restore_from_template": first,
            "resume": {k: summary([r[k] for r in resumes]) for k in keys_r},
            "pause": {k: summary([p[k] for p in pauses]) for k in ("freeze_ms", "total_ms")},
            "pause_memory_kib": summary([p["memory_kib"] for p in pauses]),
            "pause_layers": [p["layers"] for p in pauses],
        }

    async def persistent(self, template: Path, n: int, mib: int) -> dict[str, Any]:
        (slot,) = await self.slots(1)
        sbx, _ = await self.restore(template, slot, f"per{mib}")
        rows = []
        for i in range(n):
            await sbx.envd.run(f"echo {i} > /tmp/snap; ls / > /dev/null")
            info = await sbx.vm.snapshot(self.root / f"persistent-{mib}-{i}")
            rows.append({"freeze_ms": ms(info.freeze_s), "total_ms": ms(info.total_s),
                         "memory_kib": info.memory_bytes >> 10})
        ok = await sbx.envd.run("cat /tmp/snap")
        assert ok.stdout.strip() == str(n - 1), ok
        await self.destroy(sbx)
        return {k: summary([r[k] for r in rows]) for k in ("freeze_ms", "total_ms", "memory_kib")}

    async def fork(self, template: Path, count: int, rounds: int, mib: int) -> dict[str, Any]:
        (slot,) = await self.slots(1)
        source, _ = await self.restore(template, slot, f"src{mib}")
        await source.envd.run("echo source > /tmp/who")
        per_round, memory = [], None
        for r in range(rounds):
            slots = await self.slots(count)
            mem_before = _mem_available()
            t0 = time.monotonic()
            info = await source.vm.snapshot(self.root / f"fork-{mib}-{r}")
            children = await asyncio.gather(
                *(self.restore(info.directory, s, f"fork{mib}") for s in slots))
            t_all = time.monotonic()
            per_round.append({"all_ready_ms": ms(t_all - t0), "capture_ms": ms(info.total_s),
                              "source_freeze_ms": ms(info.freeze_s),
                              "child_healthy_ms": [c[1]["healthy_ms"] for c in children]})
            log(f"{mib} MiB fork x{count} round {r + 1}: all ready in {(t_all - t0):.2f} s")
            if r == 0:
                await asyncio.sleep(1.0)
                after_fork = [smaps(c[0].vm) for c in children]
                avail_fork = _mem_available()
                await asyncio.gather(*(c[0].envd.run(
                    "head -c 16777216 /dev/urandom > /dev/shm/dirty", user="root")
                    for c in children))
                await asyncio.sleep(0.5)
                after_dirty = [smaps(c[0].vm) for c in children]
                avail_dirty = _mem_available()
                memory = {
                    "per_child_after_fork_mib": mean(after_fork),
                    "per_child_after_dirtying_16mib_mib": mean(after_dirty),
                    "host_memavailable_drop_per_child_mib": {
                        "after_fork": round((mem_before - avail_fork) / count, 1),
                        "after_dirtying": round((mem_before - avail_dirty) / count, 1)},
                    "source_after_fork_mib": smaps(source.vm),
                }
            for c in children:
                await self.destroy(c[0])
        await self.destroy(source)
        all_child = [h for p in per_round for h in p["child_healthy_ms"]]
        return {
            "count": count,
            "all_ready_ms": summary([p["all_ready_ms"] for p in per_round]),
            "source_freeze_ms": summary([p["source_freeze_ms"] for p in per_round]),
            "capture_total_ms": summary([p["capture_ms"] for p in per_round]),
            "child_healthy_ms": summary(all_child),
            "memory": memory,
        }

    async def dirty_pause(self, template: Path, sizes_mib: list[int], reps: int,
                          mib: int) -> dict[str, Any]:
        out = {}
        for size in sizes_mib:
            rows = []
            for i in range(reps):
                (slot,) = await self.slots(1)
                sbx, _ = await self.restore(template, slot, f"dirty{size}")
                await dirty_guest(sbx, size)
                info = await sbx.vm.snapshot(self.root / f"dirty-{mib}-{size}-{i}", stop=True)
                rows.append({"freeze_ms": ms(info.freeze_s), "total_ms": ms(info.total_s),
                             "memory_mib": round(info.memory_bytes / MIB, 1),
                             "phases_ms": {k: ms(v) for k, v in info.phases.items()}})
                await self.destroy(sbx)
                snapshots.remove(self.root / f"dirty-{mib}-{size}-{i}")
                log(f"{mib} MiB guest, dirtied {size} MiB: pause {rows[-1]['total_ms']:.0f} ms")
            out[f"{size}mib"] = {"freeze_ms": summary([r["freeze_ms"] for r in rows]),
                                 "total_ms": summary([r["total_ms"] for r in rows]),
                                 "memory_written_mib": [r["memory_mib"] for r in rows],
                                 "phases_ms": phase_summaries([r["phases_ms"] for r in rows]),
                                 "phases_ms_last": rows[-1]["phases_ms"]}
        return out


def _mem_available() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


async def run(args: argparse.Namespace) -> dict[str, Any]:
    bench = await Bench.open("sb", 97, args.flavor)
    sizes = [int(s) for s in args.sizes.split(",")]
    out: dict[str, Any] = {}
    try:
        for mib in sizes:
            template, first = await bench.template(mib)
            res: dict[str, Any] = {"first_pause_of_booted_vm": first}
            res.update(await bench.cycles(template, args.cycles, mib))
            log(f"{mib} MiB: resume healthy p50 {res['resume']['healthy_ms']['p50']} ms, "
                f"pause p50 {res['pause']['total_ms']['p50']} ms")
            res["persistent_snapshot"] = await bench.persistent(template, args.cycles, mib)
            if args.forks:
                res["fork"] = await bench.fork(template, args.forks, args.fork_rounds, mib)
            if mib == max(sizes) and args.dirty:
                res["pause_after_dirtying"] = await bench.dirty_pause(
                    template, [16, 1024], args.dirty_reps, mib)
            out[f"{mib}mib"] = res
    finally:
        await bench.close()
    return out


def goals(out: dict[str, Any]) -> dict[str, Any]:
    small, big = out.get("256mib"), out.get("2048mib")
    rows: dict[str, Any] = {}
    for key, res in out.items():
        rows[f"{key}_resume_healthy_p50_ms"] = res["resume"]["healthy_ms"]["p50"]
        rows[f"{key}_pause_total_p50_ms"] = res["pause"]["total_ms"]["p50"]
        if "fork" in res:
            rows[f"{key}_fork_all_ready_p50_ms"] = res["fork"]["all_ready_ms"]["p50"]
            mem = res["fork"]["memory"]
            rows[f"{key}_anonymous_mib_per_child_after_fork"] = (
                mem["per_child_after_fork_mib"]["anonymous"])
            rows[f"{key}_anonymous_mib_per_child_after_dirtying_16mib"] = (
                mem["per_child_after_dirtying_16mib_mib"]["anonymous"])
    if small and big:
        for k in ("running_ms", "healthy_ms"):
            rows[f"restore_ratio_2g_256m_{k}"] = round(
                big["resume"][k]["p50"] / small["resume"][k]["p50"], 2)
    return {"targets": GOALS, "measured": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cycles", type=int, default=10, help="pause/resume cycles per size")
    ap.add_argument("--forks", type=int, default=16)
    # Five rounds at least: a p50 of two rounds is only their mean, and of one, the one.
    ap.add_argument("--fork-rounds", type=int, default=5)
    ap.add_argument("--sizes", default="256,2048", help="guest sizes in MiB")
    ap.add_argument("--dirty-reps", type=int, default=5)
    ap.add_argument("--no-dirty", dest="dirty", action="store_false")
    ap.add_argument("--flavor", default="cloud",
                    help="guest kernel: cloud, or small once 'aenv kernel build small' ran")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("vm_snapshot.py needs root (network namespaces and taps)")
    accel = host_accel()
    out = asyncio.run(run(args))
    emit({"benchmark": "vm_snapshot", "runtime": "qemu", "kernel_flavor": args.flavor,
          "accel": accel.accel,
          "accel_reason": accel.reason, "cycles": args.cycles,
          "note": "2 shared host cores, other work running: expect +-20% between runs; "
                  "slots are made before each timed restore (a warm pool's job)",
          "sizes": out, "goals": goals(out)})


if __name__ == "__main__":
    main()
