"""A stand-in for Firecracker's ``jailer``: what docs/jailer.md (v1.16.1) says it does, on a
host with no jailer and no KVM, as far as a test can go.

Done as documented: parse and check the arguments (id of letters, digits and hyphens up to
64, an exec file whose name contains "firecracker", numeric uid and gid); create
``<chroot base>/<exec file name>/<id>/root`` (an existing one is kept); copy the exec file
into it; set ``--resource-limit`` (``no-file`` 2048 when none is given); create
``<cgroup root>/<parent cgroup>/<id>`` in the hierarchy of each ``--cgroup`` file (found in
/proc/mounts; v2: the controller enabled down the path), write each value, then move itself
in (``cgroup.procs``; v1: ``tasks``); join ``--netns``; chown the root to uid:gid; clear
the environment; drop to gid and uid; exec ``<exec file name> --id=<id>
--start-time-us=<n> --start-time-cpu-us=<n>`` plus the arguments after ``--``, same pid.

Not done, because the fake firecracker is a Python script that needs the host's
interpreter and libraries: no mount namespace, no pivot_root into the root, no mknod of
/dev/kvm and /dev/net/tun. It chdirs into the root instead, and sets ``FAKE_FC_JAILED=1``,
on which the fake firecracker refuses every request path that would leave its cwd (absolute,
or with ``..``), which is what the pivot would make fail. ``FAKE_FC_*`` variables survive the
cleared environment (they configure the fake); ``FAKE_JAILER_RECORD`` gets one JSON line
with the argv.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import resource
import shutil
import sys
from pathlib import Path

CLONE_NEWNET = 0x40000000


def fail(message: str) -> None:
    print(f"fake jailer: {message}", file=sys.stderr, flush=True)
    sys.exit(1)


def parse(argv: list[str]) -> tuple[dict[str, list[str]], list[str]]:
    single = {"--id", "--exec-file", "--uid", "--gid", "--chroot-base-dir", "--netns",
              "--cgroup-version", "--parent-cgroup"}
    multi = {"--cgroup", "--resource-limit"}
    flags = {"--daemonize", "--new-pid-ns"}
    opts: dict[str, list[str]] = {}
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == "--":
            return opts, argv[i + 1:]
        if a in flags:
            opts[a] = []
            i += 1
            continue
        if a not in single | multi or i + 1 >= len(argv):
            fail(f"unknown or incomplete argument {a!r}")
        if a in single and a in opts:
            fail(f"{a} given twice")
        opts.setdefault(a, []).append(argv[i + 1])
        i += 2
    return opts, []


def cgroup_mounts(version: str) -> list[tuple[str, set[str]]]:
    out = []
    for line in Path("/proc/mounts").read_text().splitlines():
        _dev, mnt, fstype, options = line.split()[:4]
        if version == "2" and fstype == "cgroup2":
            return [(mnt, set())]
        if version == "1" and fstype == "cgroup":
            out.append((mnt, set(options.split(","))))
    return out


def setup_cgroups(opts: dict[str, list[str]], vm_id: str, exec_name: str) -> None:
    values = opts.get("--cgroup", [])
    if not values:
        return
    version = opts.get("--cgroup-version", ["1"])[0]
    parent = opts.get("--parent-cgroup", [exec_name])[0]
    if parent.startswith("/") or ".." in parent.split("/"):
        fail("the parent cgroup must be relative")
    mounts = cgroup_mounts(version)
    if not mounts:
        fail(f"no cgroup v{version} hierarchy")
    dirs: dict[str, Path] = {}
    for item in values:
        file, _, value = item.partition("=")
        controller = file.split(".")[0]
        if "." not in file or not value:
            fail(f"invalid --cgroup {item!r}")
        if version == "2":
            mnt = mounts[0][0]
        else:
            mnt = next((m for m, o in mounts if controller in o), None)
            if mnt is None:
                fail(f"controller {controller} unavailable")
        location = Path(mnt) / parent / vm_id
        location.mkdir(parents=True, exist_ok=True)
        if version == "2":
            node = Path(mnt)
            for part in (None, *Path(parent).parts):
                if part is not None:
                    node = node / part
                ctl = node / "cgroup.subtree_control"
                if controller not in ctl.read_text().split():
                    ctl.write_text(f"+{controller}\n")
        (location / file).write_text(f"{value}\n")
        dirs[mnt] = location
    for location in dirs.values():
        (location / ("cgroup.procs" if version == "2" else "tasks")).write_text(
            f"{os.getpid()}\n")


def main() -> None:
    opts, extra = parse(sys.argv[1:])
    record = os.environ.get("FAKE_JAILER_RECORD")
    if record:
        with open(record, "a") as f:
            f.write(json.dumps({"argv": sys.argv, "pid": os.getpid()}) + "\n")
    for required in ("--id", "--exec-file", "--uid", "--gid"):
        if required not in opts:
            fail(f"{required} is required")
    vm_id = opts["--id"][0]
    if not re.fullmatch(r"[A-Za-z0-9-]{1,64}", vm_id):
        fail(f"invalid instance id {vm_id!r}")
    exec_file = Path(opts["--exec-file"][0])
    if not exec_file.is_file() or "firecracker" not in exec_file.name:
        fail(f"invalid exec file {exec_file}")
    uid, gid = int(opts["--uid"][0]), int(opts["--gid"][0])
    base = Path(opts.get("--chroot-base-dir", ["/srv/jailer"])[0])
    root = base / exec_file.name / vm_id / "root"
    root.mkdir(parents=True, exist_ok=True)
    shutil.copy2(exec_file, root / exec_file.name)
    limits = dict(r.split("=", 1) for r in opts.get("--resource-limit", []))
    resource.setrlimit(resource.RLIMIT_NOFILE, (int(limits.get("no-file", 2048)),) * 2)
    if "fsize" in limits:
        resource.setrlimit(resource.RLIMIT_FSIZE, (int(limits["fsize"]),) * 2)
    setup_cgroups(opts, vm_id, exec_file.name)
    if "--netns" in opts:
        fd = os.open(opts["--netns"][0], os.O_RDONLY)
        if ctypes.CDLL(None, use_errno=True).setns(fd, CLONE_NEWNET) != 0:
            fail(f"setns: {os.strerror(ctypes.get_errno())}")
        os.close(fd)
    os.chown(root, uid, gid)
    os.chdir(root)
    env = {k: v for k, v in os.environ.items() if k.startswith("FAKE_FC_")}
    env["FAKE_FC_JAILED"] = "1"
    env["PATH"] = "/usr/bin:/bin"
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)
    os.execve(f"./{exec_file.name}",
              [exec_file.name, f"--id={vm_id}", "--start-time-us=0", "--start-time-cpu-us=0",
               *extra], env)


if __name__ == "__main__":
    main()
