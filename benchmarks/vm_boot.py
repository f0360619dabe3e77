"""VM boot latency: VMM spawn to envd ``/health`` 204, split into phases, p50 of N boots.

Run as root: ``.venv/bin/python benchmarks/vm_boot.py [--runs 5] [--flavor cloud]``. Boots
the ``base`` image under the qemu driver in a real network slot, once per run, for each
kernel flavor available (``cloud`` always; ``small`` when it has been built), and prints
one JSON object (seconds). Phases: ``vmm_to_qmp`` (spawn -> QMP answers), ``kernel_to_init``
(-> first init marker on the console), ``init_to_envd_exec`` (-> init execs envd),
``envd_exec_to_health`` (-> /health 204). Kernels and images come from the data dir
(``AENV_HOME``) and are built there on first use. It uses its own name prefix and address
ranges and removes every VM, disk and slot it made, also when a boot fails.

``--server python`` measures the floor under envd instead: each boot gets a raw clone of
the image with two files written into it by ``debugfs`` (no mount), and the kernel runs
them in place of aenv's init: a script that mounts /proc, sets up eth0 only when nothing
did, and execs ``python3 -S`` on a standard-library asyncio server that answers every
request with 204. Same kernel, disk, slot and markers, so the phases compare one to one:
what a Python HTTP server costs at all on this host, and what envd adds to it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aenv.client.envd import ENVD_PORT
from aenv.config import Settings
from aenv.guest.bootargs import guest_boot_args
from aenv.network import SlotPool
from aenv.network.guest_link import GUEST_IP, LINK_PREFIXLEN, TAP_IP
from aenv.runtime import Drive, VMSpec, get_runtime
from aenv.runtime import workdir as wd
from aenv.runtime.firecracker_snapshot import clone
from aenv.runtime.kvm import host_accel
from aenv.runtime.ready import BootPhases, boot_until_ready
from aenv.storage.disks import create_disk
from aenv.storage.images import ensure_base_image
from aenv.storage.kernel import ensure_kernel, list_kernels
from benchmarks._common import emit, private_settings

PHASES = ("vmm_to_qmp", "kernel_to_init", "init_to_envd_exec", "envd_exec_to_health", "total")
GOALS_S = {"cloud": 3.0, "small": 2.0}  # boot to envd ready under TCG (issue 3)

FLOOR_INIT = "/aenv-floor-init"
FLOOR_SERVER = "/aenv-floor-server.py"
# Prints the markers aenv-init prints (start, envd-exec) so BootPhases splits it the same way.
_FLOOR_INIT_SH = f"""#!/bin/sh
export PATH=/usr/sbin:/usr/bin:/sbin:/bin
[ -e /proc/self ] || mount -t proc proc /proc
mark() {{ read -r up _ </proc/uptime; echo "aenv-init: $1 $up"; }}
mark start
routed=
while read -r iface dest _; do
  [ "$iface" = eth0 ] && [ "$dest" = 00000000 ] && routed=1
done </proc/net/route
[ -n "$routed" ] || ip -batch - <<NET
link set lo up
link set eth0 up
addr replace {GUEST_IP}/{LINK_PREFIXLEN} dev eth0
route replace default via {TAP_IP} dev eth0
NET
mark envd-exec
exec /usr/bin/python3 -S {FLOOR_SERVER}
"""
_FLOOR_SERVER_PY = f"""import asyncio

async def answer(reader, writer):
    try:
        await reader.readuntil(b"\\r\\n\\r\\n")
        writer.write(b"HTTP/1.1 204 No Content\\r\\nConnection: close\\r\\n\\r\\n")
        await writer.drain()
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
        pass
    writer.close()

async def main():
    server = await asyncio.start_server(answer, "0.0.0.0", {ENVD_PORT})
    await server.serve_forever()

asyncio.run(main())
"""


def floor_disk(image: Path, workdir: Path) -> Path:
    """A raw clone of ``image`` (reflink, else a sparse copy) with the floor's init and server
    in its root.

    Not the runtime's copy-on-write disk: debugfs writes only raw ext4, and the disk may be a
    qcow2 overlay on hosts without reflink. It is made before the boot is timed.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    dest = workdir / "rootfs.raw"
    clone(image, dest)
    with tempfile.TemporaryDirectory() as tmp:
        commands = []
        for guest_path, text, mode in ((FLOOR_INIT, _FLOOR_INIT_SH, 0o100755),
                                       (FLOOR_SERVER, _FLOOR_SERVER_PY, 0o100644)):
            local = Path(tmp) / Path(guest_path).name
            local.write_text(text)
            commands += [f"write {local} {guest_path}", f"sif {guest_path} mode 0{mode:o}"]
        script = Path(tmp) / "commands"
        script.write_text("\n".join(commands) + "\n")
        out = subprocess.run(["debugfs", "-w", "-f", str(script), str(dest)],
                             capture_output=True, text=True)
    # debugfs exits 0 whatever its commands did; what went wrong is on stderr after its banner.
    problems = [line for line in out.stderr.splitlines()
                if line.strip() and not line.startswith("debugfs ")]
    if out.returncode != 0 or problems:
        raise RuntimeError(f"debugfs could not write the floor files: {problems}")
    return dest


async def boot_once(settings: Settings, pool: SlotPool, kernel, image, name: str,
                    memory_mib: int, server: str = "envd",
                    tools: Path | None = None) -> BootPhases:
    """One cold boot of ``image`` in a slot of ``pool`` until envd (or the floor's server)
    answers; ``tools``: the tools drive to attach as the second drive. The VM, its disk and
    the slot are gone when this returns or raises."""
    slot = await asyncio.to_thread(pool.acquire)
    workdir = settings.vms_dir / name
    try:
        if server == "python":
            drive = Drive("rootfs", await asyncio.to_thread(floor_disk, image.path, workdir))
            extra = [f"init={FLOOR_INIT}"]  # the last init= on the command line wins
        else:
            disk = create_disk(image.path, workdir)
            drive, extra = Drive("rootfs", disk.path, format=disk.format), []
        drives = (drive,) if tools is None else (drive, Drive("tools", tools, read_only=True))
        spec = VMSpec(
            vm_id=name, workdir=workdir, kernel=kernel.vmlinux, initrd=kernel.initrd,
            boot_args=guest_boot_args(kernel, extra=extra, tools=tools is not None),
            memory_mib=memory_mib, drives=drives,
            tap=slot.tap_name, netns=slot.netns, mac=slot.guest_mac,
            memory_file=wd.default_memory_file(name, workdir, settings.name_prefix),
        )
        vm, phases = await boot_until_ready(get_runtime("qemu"), spec,
                                            f"http://{slot.host_ip}:{ENVD_PORT}")
        await vm.stop()
        return phases
    finally:
        wd.remove(workdir)
        await asyncio.to_thread(pool.release, slot)


async def bench_flavor(settings: Settings, pool: SlotPool, flavor: str, runs: int,
                       memory_mib: int, server: str) -> dict[str, object]:
    kernel = ensure_kernel(settings, flavor)
    image = ensure_base_image(settings, kernel_flavor=flavor)
    samples = []
    for i in range(runs):
        phases = await boot_once(settings, pool, kernel, image, f"bench-{flavor}-{i}",
                                 memory_mib, server)
        samples.append({p: round(getattr(phases, p), 3) for p in PHASES})
        print(f"{flavor} run {i + 1}/{runs}: {samples[-1]['total']:.2f} s", file=sys.stderr)
    p50 = {p: round(statistics.median(s[p] for s in samples), 3) for p in PHASES}
    return {"kernel": kernel.version, "image": image.digest[:12], "p50": p50,
            "min_total": min(s["total"] for s in samples), "samples": samples}


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--flavor", action="append", help="kernel flavor (default: all built)")
    ap.add_argument("--memory-mib", type=int, default=512)
    ap.add_argument("--server", choices=("envd", "python"), default="envd",
                    help="what the guest serves /health with: envd, or the stdlib floor")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("vm_boot.py needs root (network namespaces and taps)")
    settings = private_settings("ab", 98)
    flavors = args.flavor or ["cloud", *sorted(
        {k.flavor for k in list_kernels(settings)} - {"cloud"})]
    accel = host_accel()
    pool = SlotPool(settings, warm_size=1)
    pool.start()
    try:
        results = {f: await bench_flavor(settings, pool, f, args.runs, args.memory_mib,
                                         args.server)
                   for f in flavors}
    finally:
        await asyncio.to_thread(pool.close)
    emit({
        "benchmark": "vm_boot",
        "runtime": "qemu",
        "accel": accel.accel,
        "accel_reason": accel.reason,
        "server": args.server,
        "runs": args.runs,
        "memory_mib": args.memory_mib,
        "goal_total_s": GOALS_S,
        "note": "2 shared host cores: expect +-20% between runs",
        "flavors": results,
    })


if __name__ == "__main__":
    asyncio.run(main())
