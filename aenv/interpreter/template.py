"""The ``code-interpreter-v1`` template's definition (data only: no host-side imports).

What E2B's code-interpreter template offers, from PyPI: the kernel (ipykernel, jupyter_client)
and the everyday data libraries. They are installed on the host, for the guest's Python
(``GUEST_PYTHON``, Debian bookworm's 3.11) and platform, into one directory (``site``) that
the build COPYs to ``SITE``, and ``aenv/interpreter`` beside them; a ``.pth`` file puts it on
every guest ``python3``'s path, so the kernel, ``commands.run("python3 ...")`` and the server
see the same libraries. Installing wheels inside an emulated guest is what this avoids; and
as the libraries' COPY comes first, the server lays them into a copy of the base image on
the host (cached by their ``filesHash``) instead of pushing them through the guest.

Kernels besides python: ``bash`` (bash_kernel, from PyPI) and ``javascript``/``typescript``
(Deno's built-in Jupyter kernel: one static binary from npm, ``@deno/linux-x64-glibc``, so
the guest needs no Node.js or native zeromq build). Their kernel specs (``KERNELS``) go to
``JUPYTER_DIR``, which the server puts on ``JUPYTER_PATH``. The default bash context starts
before the snapshot with python's (a kernel start costs 20-30 s under TCG, its memory a few
tens of MB); Deno's, larger, starts on first use (about 25 s under TCG).

``r`` is IRkernel on Debian's R and ``java`` JJava (IJava's maintained successor, a JShell
kernel; its wheel on PyPI carries the jars) on Debian's OpenJDK 17 (``DEBIAN_PACKAGES``,
with the dependencies the ``base`` image lacks). Their ``.deb`` files are downloaded on the
host with apt (cached beside the build context), repacked uncompressed
(``DEB_COMPRESSION``) and COPYed with a ``Packages`` index to
``DEBS_DIR``, laid on the host like the libraries; one RUN has the guest's own apt install
them from that directory as a local repository (no network, maintainer scripts run as in
any ``apt-get install``) and delete it. Both start on first use.

The build (``aenv template build code-interpreter-v1``) starts the server as the template's
user in ``/home/user`` and snapshots it ready, so a create restores a running kernel.
"""

from __future__ import annotations

NAME = "code-interpreter-v1"
GUEST_PYTHON = "3.11"
SITE = "/opt/aenv-interpreter/site"
PTH = f"/usr/local/lib/python{GUEST_PYTHON}/dist-packages/aenv-interpreter.pth"
USER = "user"
HOME = "/home/user"

# The server's own dependencies (requirements.txt) come first; then the libraries.
PACKAGES = (
    "jupyter_client>=8.6",
    "ipykernel>=6.29",
    "starlette>=0.40",
    "uvicorn>=0.30",
    "numpy",
    "pandas",
    "matplotlib",
    "seaborn",
    "pillow",
    "requests",
    "beautifulsoup4",
    "openpyxl",
    "bash_kernel",
    "jjava==1.0a8",  # the java kernel (pre-releases only: pinned)
)
# Debian packages installed with the guest's apt from a local repository (see above).
DEBIAN_PACKAGES = ("r-base-core", "r-cran-irkernel", "openjdk-17-jdk-headless")
DEBS_DIR = "/opt/aenv-interpreter/debs"
# The staged .deb files are repacked with this compression (dpkg-deb -Z): none, so that the
# guest's dpkg does not decompress 180 MB of xz under emulation.
DEB_COMPRESSION = "none"
# Deno (its Jupyter kernel runs JavaScript and TypeScript), pinned so the staged copy is
# keyed by its version.
DENO_PACKAGE = "@deno/linux-x64-glibc"
DENO_VERSION = "2.9.6"
DENO_DIR = "/opt/aenv-interpreter/deno"
JUPYTER_DIR = "/opt/aenv-interpreter/jupyter"
# Kernel specs (``<JUPYTER_DIR>/kernels/<name>/kernel.json``). NO_COLOR: Deno colours the
# values it prints, and a result's ``text`` must be plain.
KERNELS: dict[str, dict[str, object]] = {
    "bash": {"argv": ["python3", "-m", "bash_kernel", "-f", "{connection_file}"],
             "display_name": "Bash", "language": "bash", "env": {"PS1": "$"}},
    "deno": {"argv": [f"{DENO_DIR}/deno", "jupyter", "--kernel", "--conn",
                      "{connection_file}"],
             "display_name": "Deno", "language": "typescript", "env": {"NO_COLOR": "1"}},
    # IRkernel's own spec (``IRkernel::installspec()`` writes this; Debian ships none)
    "ir": {"argv": ["R", "--slave", "-e", "IRkernel::main()", "--args", "{connection_file}"],
           "display_name": "R", "language": "R"},
    # JJava's own spec with its jars where pip put them; C1 only and the serial collector
    # (the launcher passes JJAVA_JVM_OPTS on): a JVM's start-up under TCG is mostly JIT work
    "java": {"argv": ["java", "-jar", f"{SITE}/share/jupyter/kernels/java/jjava-launcher.jar",
                      f"{SITE}/share/jupyter/kernels/java/jjava.jar", "{connection_file}"],
             "display_name": "Java", "language": "java", "interrupt_mode": "message",
             "env": {"JJAVA_JVM_OPTS": "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"}},
}
# manylinux tags the guest's glibc (bookworm: 2.36) runs, newest first.
PLATFORMS = tuple(f"{tag}_x86_64" for tag in (
    "manylinux_2_36", "manylinux_2_35", "manylinux_2_34", "manylinux_2_31", "manylinux_2_28",
    "manylinux_2_27", "manylinux_2_24", "manylinux_2_17", "manylinux2014", "manylinux_2_5",
    "manylinux1",
))
# Test suites the libraries ship (pandas alone ~45 MB): nothing imports them.
PRUNE_DIRS = ("tests",)

# The default python kernel imports these before the snapshot (as E2B's kernel start-up
# does), so a sandbox's first ``import pandas`` or plot does not pay for it under emulation.
PRELOAD = "import numpy, pandas, matplotlib.pyplot"
START_CMD = (f"python3 -m aenv.interpreter --host 0.0.0.0 --port 49999 --cwd {HOME}"
             f" --jupyter-path {JUPYTER_DIR} --languages python,bash"
             f" --preload '{PRELOAD}' --warm-up --log-level warning")
READY_CMD = "curl -sf http://127.0.0.1:49999/health"


def apt_install_cmd() -> str:
    """The guest's apt installs ``DEBIAN_PACKAGES`` from ``DEBS_DIR`` (a flat repository:
    the ``.deb`` files and their ``Packages`` index) and nothing else: its own sources and
    lists are left alone, and the directory goes once the packages are in."""
    lists = "/tmp/aenv-apt-lists"
    opts = (f"-o Dir::Etc::SourceList={DEBS_DIR}/sources.list -o Dir::Etc::SourceParts=-"
            f" -o Dir::State::Lists={lists} -o APT::Get::List-Cleanup=0")
    # man1: the base image keeps no manual pages, but OpenJDK's update-alternatives link
    # one there and fail without the directory. dpkg's unsafe-io: no fsync per file (the
    # build syncs the disk before it becomes the template).
    opts += " -o Dpkg::Options::=--force-unsafe-io"
    return (f"mkdir -p {lists}/partial /usr/share/man/man1"
            f" && echo 'deb [trusted=yes] file:{DEBS_DIR} ./' > {DEBS_DIR}/sources.list"
            f" && apt-get -qq {opts} update"
            f" && DEBIAN_FRONTEND=noninteractive apt-get -q -y {opts} install"
            f" --no-install-recommends {' '.join(DEBIAN_PACKAGES)}"
            f" && rm -rf {lists} {DEBS_DIR}")


def dockerfile() -> str:
    """The build steps; the context directory holds ``site`` (the staged libraries),
    ``deno`` (its binary), ``debs`` (the Debian packages and their index), ``jupyter``
    (the kernel specs) and ``server/aenv``
    (``aenv/__init__.py`` and ``aenv/interpreter``)."""
    return "\n".join([
        "FROM base",
        # First, as root, to a new path: the server lays the libraries into a copy of the
        # base image on the host (orchestrator/builds.py, _lay_copies), cached by their
        # filesHash, rather than pushing them through the guest. The server's source
        # (small, and new at every change to it) comes after a RUN, so through the guest:
        # the cached image changes only with the libraries.
        f"COPY site {SITE}",
        f"COPY deno {DENO_DIR}",
        f"COPY debs {DEBS_DIR}",
        f"COPY jupyter {JUPYTER_DIR}",
        f"RUN {apt_install_cmd()}",
        f"RUN python3 -c 'import sys; v = \"%d.%d\" % sys.version_info[:2]; "
        f"assert v == \"{GUEST_PYTHON}\", \"the guest has Python \" + v'",
        f"COPY server/aenv {SITE}/aenv",
        f"RUN mkdir -p $(dirname {PTH}) && echo {SITE} > {PTH}",
        # matplotlib's font cache, built once here rather than in every sandbox's first plot
        f"USER {USER}",
        f"WORKDIR {HOME}",
        "RUN python3 -c 'import matplotlib.pyplot'",
        f"CMD {START_CMD}",
    ]) + "\n"
