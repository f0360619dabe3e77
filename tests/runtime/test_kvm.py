"""The accelerator decision: KVM only when /dev/kvm is a hardware KVM, TCG with a reason."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from aenv.runtime.kvm import decide

KVM = Path("/dev/kvm")
needs_kvm_node = pytest.mark.skipif(
    not (KVM.exists() and os.access(KVM, os.R_OK | os.W_OK)), reason="no usable /dev/kvm node"
)


def modules(tmp_path: Path, *names: str) -> Path:
    for n in names:
        (tmp_path / n).mkdir()
    return tmp_path


def test_missing_device_means_tcg(tmp_path: Path) -> None:
    choice = decide(dev=tmp_path / "kvm", sys_module=modules(tmp_path, "kvm_intel"))
    assert choice.accel == "tcg" and "does not exist" in choice.reason


def test_a_node_that_is_not_kvm_means_tcg(tmp_path: Path) -> None:
    fake = tmp_path / "kvm"
    fake.write_bytes(b"")
    choice = decide(dev=fake, sys_module=modules(tmp_path, "kvm_intel"))
    assert choice.accel == "tcg" and "KVM_GET_API_VERSION" in choice.reason


@needs_kvm_node
def test_pvm_backend_means_tcg(tmp_path: Path) -> None:
    choice = decide(dev=KVM, sys_module=modules(tmp_path, "kvm", "kvm_pvm"))
    assert choice.accel == "tcg" and "kvm_pvm" in choice.reason


@needs_kvm_node
def test_hardware_vendor_module_means_kvm(tmp_path: Path) -> None:
    choice = decide(dev=KVM, sys_module=modules(tmp_path, "kvm", "kvm_amd"))
    assert choice.accel == "kvm" and "kvm_amd" in choice.reason


@needs_kvm_node
def test_unknown_backend_means_tcg(tmp_path: Path) -> None:
    assert decide(dev=KVM, sys_module=modules(tmp_path, "kvm")).accel == "tcg"


def test_this_host_decision_names_its_module() -> None:
    choice = decide()
    loaded = {m for m in ("kvm_pvm", "kvm_intel", "kvm_amd") if Path("/sys/module", m).exists()}
    if choice.accel == "kvm":
        assert loaded & {"kvm_intel", "kvm_amd"}
    elif "kvm_pvm" in loaded:
        assert "kvm_pvm" in choice.reason
