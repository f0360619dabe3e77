"""envd's place in the guest's cgroup v2 tree, and its workload's (guest only).

A sandbox must stay controllable while its processes use every cycle it has: envd sits in
``/sys/fs/cgroup/envd`` with ten times the CPU weight of ``/sys/fs/cgroup/user``, where
every process it starts goes, and the OOM killer leaves envd alone (upstream envd runs at
nice -10 with ``OOMScoreAdjust=-1000`` for the same reason). A cgroup, unlike a nice
value, covers all of the workload together, however many processes it forks.

The launcher calls ``place_envd`` once at boot and hands the workload cgroup to the server
(``--workload-cgroup``); on a host (tests, ``python -m aenv.envd``) nothing here runs.
"""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")
ENVD = "envd"
WORKLOAD = "user"
ENVD_CPU_WEIGHT = 1000  # the workload keeps the default 100
OOM_PROTECTED = -1000


def place_envd(root: Path = ROOT) -> Path:
    """Make ``envd/`` and ``user/`` under ``root`` with the CPU controller on, move this
    process into ``envd/`` (its children follow) and exempt it from the OOM killer.
    Returns the workload cgroup. Raises OSError when cgroup v2 is not usable."""
    (root / "cgroup.subtree_control").write_text("+cpu")
    envd, workload = root / ENVD, root / WORKLOAD
    for d in (envd, workload):
        d.mkdir(exist_ok=True)
    (envd / "cpu.weight").write_text(str(ENVD_CPU_WEIGHT))
    move(os.getpid(), envd)
    Path("/proc/self/oom_score_adj").write_text(str(OOM_PROTECTED))
    return workload


def move(pid: int, cgroup: Path) -> None:
    """Put process ``pid`` (not the children it already has) into ``cgroup``."""
    (cgroup / "cgroup.procs").write_text(str(pid))
