"""The shipped ``code-interpreter-v1`` definition as the CLI turns it into a build (no VM)."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from aenv.cli import interpreter_template
from aenv.cli.template import build_spec
from aenv.interpreter import template
from aenv.interpreter.kernels import KERNEL_SPECS


def test_recipe_copies_the_staged_site_and_starts_the_server_as_user() -> None:
    r = interpreter_template.recipe()
    spec = build_spec(r, {i: "h" for i, s in enumerate(r.steps) if s["type"] == "COPY"},
                      templates={"base"})
    assert spec["fromTemplate"] == "base"
    kinds = [s["type"] for s in spec["steps"]]
    assert kinds.count("COPY") == 5 and kinds.index("COPY") < kinds.index("USER")
    copies = [s for s in spec["steps"] if s["type"] == "COPY"]
    assert [c["args"][:2] for c in copies] == [["site", template.SITE],
                                               ["deno", template.DENO_DIR],
                                               ["debs", template.DEBS_DIR],
                                               ["jupyter", template.JUPYTER_DIR],
                                               ["server/aenv", template.SITE + "/aenv"]]
    # the large, rarely changing ones lead, so the server lays them on the host
    assert kinds[:4] == ["COPY"] * 4
    # then the guest's apt installs the Debian packages from the laid directory, as root
    assert spec["steps"][4]["type"] == "RUN"
    assert spec["steps"][4]["args"][0] == template.apt_install_cmd()
    assert all(c["filesHash"] == "h" for c in copies)
    assert "--preload" in spec["startCmd"] and "--warm-up" in spec["startCmd"]
    assert f"--jupyter-path {template.JUPYTER_DIR}" in spec["startCmd"]
    assert [k for k in kinds if k in ("USER", "WORKDIR")] == ["USER", "WORKDIR"]
    assert "aenv.interpreter" in spec["startCmd"] and "--port 49999" in spec["startCmd"]
    assert "49999/health" in spec["readyCmd"]


def test_pip_targets_the_guest_python_with_wheels_only(tmp_path) -> None:
    cmd = interpreter_template.pip_command(tmp_path / "site")
    assert cmd[cmd.index("--python-version") + 1] == template.GUEST_PYTHON
    assert "--only-binary=:all:" in cmd and cmd[cmd.index("--target") + 1] == str(
        tmp_path / "site")
    assert {"ipykernel>=6.29", "jupyter_client>=8.6", "numpy", "pandas",
            "matplotlib", "bash_kernel", "jjava==1.0a8"} <= set(cmd)


def test_key_follows_the_definition(monkeypatch) -> None:
    before = interpreter_template.key()
    assert interpreter_template.key() == before
    monkeypatch.setattr(template, "PACKAGES", (*template.PACKAGES, "scipy"))
    assert interpreter_template.key() != before


def test_key_follows_denos_version(monkeypatch) -> None:
    before = interpreter_template.key()
    monkeypatch.setattr(template, "DENO_VERSION", "0.0.1")
    assert interpreter_template.key() != before
    cmd = interpreter_template.npm_pack_command(Path("/x"))
    assert cmd[:2] == ["npm", "pack"] and cmd[-1] == f"{template.DENO_PACKAGE}@0.0.1"


def test_kernel_specs_are_written_afresh(tmp_path) -> None:
    jupyter = tmp_path / "jupyter"
    (jupyter / "kernels/gone").mkdir(parents=True)
    interpreter_template._write_kernel_specs(jupyter)
    names = sorted(p.name for p in (jupyter / "kernels").iterdir())
    assert names == sorted(template.KERNELS) and "gone" not in names
    deno = json.loads((jupyter / "kernels/deno/kernel.json").read_text())
    assert deno["argv"][:3] == [f"{template.DENO_DIR}/deno", "jupyter", "--kernel"]
    assert "{connection_file}" in deno["argv"] and deno["env"]["NO_COLOR"] == "1"
    bash = json.loads((jupyter / "kernels/bash/kernel.json").read_text())
    assert bash["argv"][:3] == ["python3", "-m", "bash_kernel"]
    ir = json.loads((jupyter / "kernels/ir/kernel.json").read_text())
    assert ir["argv"][:4] == ["R", "--slave", "-e", "IRkernel::main()"]
    java = json.loads((jupyter / "kernels/java/kernel.json").read_text())
    assert java["argv"][:2] == ["java", "-jar"] and java["argv"][-1] == "{connection_file}"
    # the jars where pip puts the wheel's data files in the staged site
    assert all(a.startswith(template.SITE + "/share/jupyter/kernels/java/")
               for a in java["argv"][2:4])
    # the server's languages reach these specs
    assert {KERNEL_SPECS[lang] for lang in ("javascript", "typescript", "bash", "r", "java")} \
        == set(template.KERNELS)


def test_key_follows_the_debian_packages(monkeypatch) -> None:
    before = interpreter_template.key()
    monkeypatch.setattr(template, "DEBIAN_PACKAGES", (*template.DEBIAN_PACKAGES, "r-cran-dplyr"))
    assert interpreter_template.key() != before


def test_apt_installs_from_the_laid_directory_only() -> None:
    cmd = template.apt_install_cmd()
    assert f"deb [trusted=yes] file:{template.DEBS_DIR} ./" in cmd
    # the guest's own sources and lists are not used nor changed, and the repository goes
    assert "Dir::Etc::SourceParts=-" in cmd and "Dir::State::Lists=/tmp/" in cmd
    assert "--no-install-recommends r-base-core r-cran-irkernel openjdk-17" in cmd
    assert cmd.endswith(f"rm -rf /tmp/aenv-apt-lists {template.DEBS_DIR}")


@pytest.mark.skipif(shutil.which("dpkg-deb") is None, reason="needs dpkg-deb")
def test_packages_index_entry_is_what_apt_reads(tmp_path) -> None:
    """A stanza of the flat repository's index: the package's control fields, then its
    file (relative to the repository), size and SHA-256."""
    root = tmp_path / "pkg"
    (root / "DEBIAN").mkdir(parents=True)
    (root / "DEBIAN/control").write_text(
        "Package: aenv-probe\nVersion: 1.0\nArchitecture: all\nMaintainer: t <t@t>\n"
        "Description: probe\n")
    deb = tmp_path / "aenv-probe_1.0_all.deb"
    subprocess.run(["dpkg-deb", "-Zgzip", "--build", str(root), str(deb)], check=True,
                   capture_output=True)
    entry = interpreter_template._index_entry(deb)
    fields = dict(line.split(": ", 1) for line in entry.strip().splitlines())
    assert (fields["Package"], fields["Version"]) == ("aenv-probe", "1.0")
    assert fields["Filename"] == "./aenv-probe_1.0_all.deb"
    assert int(fields["Size"]) == deb.stat().st_size
    assert fields["SHA256"] == hashlib.sha256(deb.read_bytes()).hexdigest()


@pytest.mark.skipif(shutil.which("dpkg-deb") is None, reason="needs dpkg-deb")
def test_repacked_deb_is_the_same_package_uncompressed(tmp_path) -> None:
    root = tmp_path / "pkg"
    (root / "DEBIAN").mkdir(parents=True)
    (root / "usr/share/probe").mkdir(parents=True)
    (root / "usr/share/probe/data").write_text("x" * 10000)
    (root / "DEBIAN/control").write_text(
        "Package: aenv-probe\nVersion: 1.0\nArchitecture: all\nMaintainer: t <t@t>\n"
        "Description: probe\n")
    (root / "DEBIAN/postinst").write_text("#!/bin/sh\ntrue\n")
    (root / "DEBIAN/postinst").chmod(0o755)
    deb, out = tmp_path / "in.deb", tmp_path / "out" / "in.deb"
    out.parent.mkdir()
    subprocess.run(["dpkg-deb", "-Zxz", "--build", str(root), str(deb)], check=True,
                   capture_output=True)
    interpreter_template._repack(deb, out)
    data = out.read_bytes()  # an ar archive: member names in plain text headers
    assert b"data.tar " in data or b"data.tar/" in data
    assert b"data.tar.xz" not in data
    listing = subprocess.run(["dpkg-deb", "-c", str(out)], capture_output=True, text=True,
                             check=True).stdout
    assert "./usr/share/probe/data" in listing
    assert listing.splitlines()[0].startswith("drwxr-xr-x")  # the package's root: 0755
    info = subprocess.run(["dpkg-deb", "-I", str(out)], capture_output=True, text=True,
                          check=True).stdout
    assert "postinst" in info and "Package: aenv-probe" in info
    assert list(out.parent.iterdir()) == [out]  # no work directory left
