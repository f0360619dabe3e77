"""Stage the ``code-interpreter-v1`` build context on the host (aenv/interpreter/template.py).

The libraries are installed here, for the guest's Python and platform, into
``<cache dir>/interpreter-template/<key>/site``, Deno's binary (``npm pack`` of its
platform package) into ``deno`` beside it, and the Debian packages (with apt: those the
``base`` image lacks, downloaded to ``<cache dir>/debs``) into ``debs`` with their
``Packages`` index: ``key`` is a digest of the package lists, the platforms, the guest's
Python and Deno's version, so a second build reuses them all (and the
server, seeing the same ``filesHash``, the uploaded archives) and a change to any of them
stages afresh. The kernel specs (``jupyter``) and the server's source are written at every
build (a few small files). Removing the cache directory is always safe.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import aenv
from aenv.guest import base as base_recipe
from aenv.interpreter import template
from aenv.storage import debian
from aenv.storage.errors import StorageError

from .dockerfile import Recipe, parse_dockerfile


def _sources() -> list[Path]:
    pkg = Path(template.__file__).parent
    return [Path(aenv.__file__), *sorted(p for p in pkg.iterdir() if p.suffix in (".py", ".txt"))]


def key() -> str:
    """The libraries' key: the package list, the platforms and the guest's Python."""
    h = hashlib.sha256()
    for part in (*template.PACKAGES, *template.PLATFORMS, *template.PRUNE_DIRS,
                 template.GUEST_PYTHON, template.DENO_PACKAGE, template.DENO_VERSION,
                 *template.DEBIAN_PACKAGES, template.DEB_COMPRESSION):
        h.update(part.encode() + b"\0")
    return h.hexdigest()[:16]


def pip_command(target: Path) -> list[str]:
    py = template.GUEST_PYTHON
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
           "--no-warn-script-location", "--target", str(target), "--only-binary=:all:",
           "--python-version", py, "--implementation", "cp", "--abi", "cp" + py.replace(".", "")]
    for platform in template.PLATFORMS:
        cmd += ["--platform", platform]
    return [*cmd, *template.PACKAGES]


def stage(cache_dir: Path) -> Path:
    """The build context directory: ``site``, ``deno`` and ``debs`` (staged once per
    ``key``),
    ``jupyter`` and ``server/aenv`` (refreshed on every build: a few small files)."""
    root = cache_dir / "interpreter-template"
    context = root / key()
    if not (context / "site").is_dir():
        _stage_site(root, context)
    if not (context / "deno" / "deno").is_file():
        _stage_deno(context)
    if not (context / "debs" / "Packages").is_file():
        _stage_debs(context, cache_dir / "debs")
    _write_kernel_specs(context / "jupyter")
    server = Path(tempfile.mkdtemp(prefix=".server-", dir=context))
    try:
        server.chmod(0o755)
        dest = server / "aenv"
        (dest / "interpreter").mkdir(parents=True)
        for src in _sources():
            is_top = src.name == "__init__.py" and src.parent.name == "aenv"
            shutil.copy2(src, dest / src.name if is_top else dest / "interpreter" / src.name)
        subprocess.run([sys.executable, "-m", "compileall", "-q", str(dest)], check=False)
        old = context / "server"
        if old.exists():
            old.rename(server.with_name(server.name + ".old"))
        server.rename(old)
    finally:
        for leftover in context.glob(".server-*"):
            shutil.rmtree(leftover, ignore_errors=True)
    return context


def _stage_site(root: Path, context: Path) -> None:
    root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".staging-", dir=root))
    work.chmod(0o755)
    try:
        site = work / "site"
        proc = subprocess.run(pip_command(site), capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise RuntimeError("installing the code interpreter's libraries failed:\n"
                               + (proc.stderr or proc.stdout)[-4000:])
        for name in template.PRUNE_DIRS:
            for d in sorted(site.rglob(name), reverse=True):
                if d.is_dir() and (d.parent / "__init__.py").exists():
                    shutil.rmtree(d)
        shutil.rmtree(site / "bin", ignore_errors=True)  # console scripts name this host's python
        work.rename(context)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def npm_pack_command(dest: Path) -> list[str]:
    return ["npm", "pack", "--silent", "--pack-destination", str(dest),
            f"{template.DENO_PACKAGE}@{template.DENO_VERSION}"]


def _stage_deno(context: Path) -> None:
    """``deno/deno`` from the npm registry's tarball of Deno's linux-x64 package."""
    if shutil.which("npm") is None:
        raise RuntimeError("staging the code interpreter's JavaScript kernel needs npm "
                           "(./scripts/setup.sh installs it)")
    work = Path(tempfile.mkdtemp(prefix=".deno-", dir=context))
    try:
        proc = subprocess.run(npm_pack_command(work), capture_output=True, text=True,
                              check=False, timeout=600)
        tarballs = sorted(work.glob("*.tgz"))
        if proc.returncode != 0 or not tarballs:
            raise RuntimeError(f"npm pack {template.DENO_PACKAGE} failed:\n"
                               + (proc.stderr or proc.stdout)[-4000:])
        out = work / "deno"
        out.mkdir(mode=0o755)
        with tarfile.open(tarballs[0]) as tar:
            member = tar.getmember("package/deno")
            src = tar.extractfile(member)
            assert src is not None
            with open(out / "deno", "wb") as f:
                shutil.copyfileobj(src, f)
        (out / "deno").chmod(0o755)
        out.rename(context / "deno")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _stage_debs(context: Path, cache: Path) -> None:
    """``debs``: the ``.deb`` files of ``DEBIAN_PACKAGES`` and of the dependencies the base
    image lacks (apt's resolution, ``debian.closure``), and a ``Packages`` index that makes
    the directory a flat apt repository for the guest (``template.apt_install_cmd``)."""
    if shutil.which("apt-get") is None:
        raise RuntimeError("staging the code interpreter's R kernel needs apt-get (a Debian "
                           "or Ubuntu host, as ./scripts/setup.sh expects)")
    try:
        packages = debian.closure(template.DEBIAN_PACKAGES,
                                  beside=base_recipe.BASE_PACKAGES)
        files = debian.download(packages, cache)
    except StorageError as e:
        raise RuntimeError(f"downloading the code interpreter's Debian packages failed: {e}"
                           ) from e
    work = Path(tempfile.mkdtemp(prefix=".debs-", dir=context))
    try:
        work.chmod(0o755)
        entries = []
        for deb in files:
            _repack(deb, work / deb.name)
            (work / deb.name).chmod(0o644)
            entries.append(_index_entry(work / deb.name))
        (work / "Packages").write_text("\n".join(entries))
        (work / "Packages").chmod(0o644)
        work.rename(context / "debs")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _repack(deb: Path, dest: Path) -> None:
    """``deb`` again, its contents uncompressed (``template.DEB_COMPRESSION``): the guest
    unpacks it under emulation, where decompressing (xz) was most of dpkg's work (natively
    15.6 s of CPU against 7.2 s for these packages). Control files, maintainer scripts and
    file metadata are kept as they were (``dpkg-deb -R`` then ``-b``, as root)."""
    with tempfile.TemporaryDirectory(prefix=".repack-", dir=dest.parent) as tmp:
        tree = Path(tmp) / "root"  # made by dpkg-deb as the package's root: 0755, not 0700
        for argv in (["dpkg-deb", "-R", str(deb), str(tree)],
                     ["dpkg-deb", "-b", f"-Z{template.DEB_COMPRESSION}", str(tree),
                      str(dest)]):
            proc = subprocess.run(argv, capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                raise RuntimeError(f"repacking {deb.name} failed: {proc.stderr.strip()}")


def _index_entry(deb: Path) -> str:
    """A ``Packages`` stanza (as ``dpkg-scanpackages`` writes one): the control fields,
    then where the file is and its size and digest."""
    control = subprocess.run(["dpkg-deb", "-f", str(deb)], capture_output=True, text=True,
                             check=True).stdout.rstrip("\n")
    digest = hashlib.sha256(deb.read_bytes()).hexdigest()
    return (f"{control}\nFilename: ./{deb.name}\nSize: {deb.stat().st_size}\n"
            f"SHA256: {digest}\n")


def _write_kernel_specs(jupyter: Path) -> None:
    shutil.rmtree(jupyter, ignore_errors=True)  # a kernel taken out of the definition goes
    for name, spec in template.KERNELS.items():
        d = jupyter / "kernels" / name
        d.mkdir(parents=True, exist_ok=True)
        for p in (jupyter, jupyter / "kernels", d):
            p.chmod(0o755)
        (d / "kernel.json").write_text(json.dumps(spec, indent=1, sort_keys=True) + "\n")
        (d / "kernel.json").chmod(0o644)


def recipe() -> Recipe:
    r = parse_dockerfile(template.dockerfile())
    r.ready_cmd = template.READY_CMD
    return r
