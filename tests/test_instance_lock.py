"""The home and name-prefix locks of ``aenv server`` (aenv/instance_lock.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from aenv.config import Settings
from aenv.instance_lock import InstanceTaken, claim_instance
from tests.conftest import ROOT


def _settings(home: Path, prefix: str = "lockt") -> Settings:
    return Settings(home=home, name_prefix=prefix)


def test_a_second_claim_on_the_home_names_the_holder(tmp_path: Path) -> None:
    lock = claim_instance(_settings(tmp_path / "h"), run_dir=tmp_path / "run")
    try:
        with pytest.raises(InstanceTaken, match=f"pid {os.getpid()}.*AENV_HOME"):
            claim_instance(_settings(tmp_path / "h", "other"), run_dir=tmp_path / "run")
    finally:
        lock.release()
    claim_instance(_settings(tmp_path / "h"), run_dir=tmp_path / "run").release()


def test_a_second_claim_on_the_prefix_names_the_holder_and_its_home(tmp_path: Path) -> None:
    lock = claim_instance(_settings(tmp_path / "a"), run_dir=tmp_path / "run")
    try:
        with pytest.raises(InstanceTaken) as e:
            claim_instance(_settings(tmp_path / "b"), run_dir=tmp_path / "run")
        assert f"pid {os.getpid()}" in str(e.value)
        assert f"AENV_HOME={(tmp_path / 'a').resolve()}" in str(e.value)
        assert "AENV_NAME_PREFIX=lockt" in str(e.value)
        # The refused claim gave its own home back.
        claim_instance(_settings(tmp_path / "b", "free"), run_dir=tmp_path / "run").release()
    finally:
        lock.release()


def test_different_homes_and_prefixes_do_not_conflict(tmp_path: Path) -> None:
    a = claim_instance(_settings(tmp_path / "a", "one"), run_dir=tmp_path / "run")
    b = claim_instance(_settings(tmp_path / "b", "two"), run_dir=tmp_path / "run")
    a.release()
    b.release()


HOLDER = """
import subprocess, sys, time
from pathlib import Path
from aenv.config import Settings
from aenv.instance_lock import claim_instance
lock = claim_instance(Settings(home=Path(sys.argv[1]), name_prefix="lockt"),
                      run_dir=Path(sys.argv[2]))
vmm = subprocess.Popen(["sleep", "120"], start_new_session=True)
print(vmm.pid, flush=True)
time.sleep(120)
"""


def test_the_locks_die_with_their_holder_not_with_the_vmms_it_spawned(tmp_path: Path) -> None:
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path / "h"),
                               str(tmp_path / "run")], cwd=ROOT, stdout=subprocess.PIPE,
                              text=True)
    vmm = int(holder.stdout.readline())
    try:
        with pytest.raises(InstanceTaken, match=f"pid {holder.pid}"):
            claim_instance(_settings(tmp_path / "h"), run_dir=tmp_path / "run")
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        deadline = time.monotonic() + 5
        while True:
            try:
                claim_instance(_settings(tmp_path / "h"), run_dir=tmp_path / "run").release()
                break
            except InstanceTaken:
                assert time.monotonic() < deadline, "the spawned process kept the lock"
                time.sleep(0.05)
        os.kill(vmm, 0)  # the "VMM" still runs, without the lock
    finally:
        holder.kill()
        holder.wait()
        os.kill(vmm, signal.SIGKILL)
