"""``aenv kernel build|ls`` and ``aenv image build|ls``: guest kernels and root filesystems.

Both build into the aenv home (``AENV_HOME``) and are cached: a second build of the same
input returns at once. Builds need root (ownership inside images, debootstrap).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import typer
from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TaskID, TextColumn, TimeElapsedColumn
from rich.table import Table

if TYPE_CHECKING:  # the annotation only; _settings() imports it when called
    from ..config import Settings

kernel_app = typer.Typer(no_args_is_help=True, help="Guest kernels (cloud: Debian; small: built).")
image_app = typer.Typer(no_args_is_help=True, help="Root-filesystem images for guests.")


def register(app: typer.Typer) -> None:
    app.add_typer(kernel_app, name="kernel")
    app.add_typer(image_app, name="image")


class _Steps:
    """A rich progress line per build: the current step, a count of steps, elapsed time."""

    def __init__(self, title: str) -> None:
        self.progress = Progress(
            SpinnerColumn(), TextColumn("[bold]{task.fields[title]}"),
            TextColumn("{task.completed:>5.0f}"), TextColumn("{task.description}"),
            TimeElapsedColumn(), transient=False,
        )
        self.task = self.progress.add_task("starting", total=None, title=title)

    def __enter__(self) -> _Steps:
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()

    def __call__(self, message: str) -> None:
        self.progress.update(self.task, advance=1, description=message[:90])


def _settings() -> Settings:
    from ..config import Settings, SettingsError

    try:
        return Settings.from_env()
    except SettingsError as e:
        _fail(e)


def _fail(e: Exception) -> NoReturn:
    Console(stderr=True).print(f"[red]error:[/red] {e}")
    raise typer.Exit(1)


@kernel_app.command("build")
def kernel_build(
    flavor: str = typer.Argument("cloud", help="cloud (Debian package) or small (compiled)"),
    jobs: int | None = typer.Option(None, "--jobs", "-j", help="make -j for 'small'"),
) -> None:
    """Prepare a guest kernel (``small`` compiles linux-source-6.1: ~8 min on 2 cores)."""
    from ..storage.errors import StorageError
    from ..storage.kernel import build_kernel

    t0 = time.monotonic()
    try:
        with _Steps(f"kernel {flavor}") as steps:
            kernel = build_kernel(_settings(), flavor, progress=steps, jobs=jobs)
    except StorageError as e:
        _fail(e)
    Console().print(f"{kernel.flavor} {kernel.version} in {kernel.directory} "
                    f"({time.monotonic() - t0:.1f} s)")


@kernel_app.command("ls")
def kernel_ls() -> None:
    """List prepared kernels, newest first."""
    from ..storage.kernel import list_kernels

    table = Table("flavor", "version", "vmlinux MB", "initrd", "source")
    for k in list_kernels(_settings()):
        table.add_row(k.flavor, k.version, f"{k.vmlinux.stat().st_size / 1e6:.1f}",
                      "yes" if k.initrd else "-", k.source)
    Console().print(table)


@image_app.command("build")
def image_build(
    source: Path | None = typer.Argument(
        None, help="directory, rootfs tarball, OCI layout/archive or docker-save archive; "
                   "omitted: the base image"),
    name: str | None = typer.Option(None, "--name", "-n", help="defaults to the source name"),
    kernel_flavor: str = typer.Option("cloud", "--kernel", "-k", help="cloud or small"),
    size_mib: int | None = typer.Option(None, "--size-mib", help="default: 4 GiB or more"),
    guest: bool = typer.Option(True, "--guest/--no-guest",
                               help="add aenv's init and envd (the source needs python3.11)"),
    tools: bool = typer.Option(False, "--tools",
                               help="any tree (no Python, musl, no libc): envd comes from "
                                    "the shared tools drive at boot (cloud kernel)"),
) -> None:
    """Build (or find in the cache) a root-filesystem image."""
    from ..storage.errors import StorageError
    from ..storage.images import build_image, ensure_base_image

    size = size_mib * (1 << 20) if size_mib else None
    t0 = time.monotonic()
    try:
        with _Steps(f"image {name or (source.name if source else 'base')}") as steps:
            if source is None:
                image = ensure_base_image(_settings(), steps, kernel_flavor=kernel_flavor,
                                          size_bytes=size)
            else:
                image = build_image(_settings(), name or source.name, source,
                                    kernel_flavor=kernel_flavor,
                                    guest_layer="tools" if tools else guest,
                                    size_bytes=size, progress=steps)
    except StorageError as e:
        _fail(e)
    Console().print(f"{image.name} {image.digest[:12]} {image.path} "
                    f"({time.monotonic() - t0:.1f} s)"
                    + (f"; a template names it image:{image.digest}" if image.uses_tools else ""))


@image_app.command("ls")
def image_ls() -> None:
    """List built images, newest first."""
    from ..storage.images import list_images

    table = Table("name", "digest", "kernel", "size GiB", "built", "source")
    for i in list_images(_settings()):
        table.add_row(i.name, i.digest[:12], f"{i.kernel_flavor} {i.kernel_version}".strip(),
                      f"{i.size_bytes / (1 << 30):.1f}",
                      time.strftime("%Y-%m-%d %H:%M", time.localtime(i.built_at)), i.source)
    Console().print(table)


@image_app.command("prune")
def image_prune(
    keep: int = typer.Option(1, min=1, help="newest images to keep per name and kernel flavor"),
    yes: bool = typer.Option(False, "--yes", "-y", help="delete without asking"),
) -> None:
    """Delete superseded images (only when no sandbox or snapshot still uses them)."""
    from ..storage.images import UsersUnknown, image_users, remove_image, superseded_images

    settings = _settings()
    old = superseded_images(settings, keep)
    if not old:
        Console().print("nothing to prune")
        return
    if settings.cache_home is not None and settings.cache_home != settings.home:
        # Other homes (tests, a second server) may share this cache's images: their
        # snapshots and disks are not looked at.
        Console().print(f"note: images in {settings.images_dir} may be shared with other "
                        f"homes; only {settings.home}'s snapshots and disks are checked")
    try:
        users = image_users(settings, _store_roots(settings))
    except UsersUnknown as e:
        _fail(UsersUnknown(f"nothing deleted: {e}"))
    unused = []
    for image in old:
        line = f"{image.name} {image.digest[:12]} {image.kernel_flavor}"
        if image.digest in users:
            shown = ", ".join(users[image.digest][:3])
            more = len(users[image.digest]) - 3
            Console().print(f"{line}: kept, still used by {shown}"
                            + (f" and {more} more" if more > 0 else ""))
        else:
            Console().print(line)
            unused.append(image)
    if not unused:
        Console().print("nothing to prune: every superseded image is still used")
        return
    if not yes and not typer.confirm(f"delete these {len(unused)} images?"):
        raise typer.Exit(1)
    for image in unused:
        remove_image(settings, image)


def _store_roots(settings: Settings) -> set[str]:
    """The image references the node's store still names, as the server's garbage
    collection takes them (``Orchestrator.gc_roots``, less its in-flight pins, whose files
    ``image_users`` finds on disk): templates (and the older builds a tag names), and the
    snapshots live sandboxes were paused to or restored from."""
    from ..store import Database, SandboxStore, TemplateStore

    path = settings.home / "aenv.db"
    if not path.is_file():
        return set()
    db = Database(path)
    try:
        templates = TemplateStore(db)
        roots = {t.image for t in templates.list() if t.image}
        roots |= templates.tagged_images()
        for r in SandboxStore(db).live():
            roots.update(x for x in (r.snapshot_id, r.restored_from) if x)
        return roots
    finally:
        db.close()


@image_app.command("pull")
def image_pull(
    reference: str = typer.Argument(..., help="e.g. alpine:3.19, ghcr.io/org/img@sha256:..."),
    username: str | None = typer.Option(None, "--username", "-u", help="registry username"),
    password_stdin: bool = typer.Option(False, "--password-stdin",
                                        help="read the password from standard input"),
) -> None:
    """Pull an image from a registry into the shared layer cache (no ext4 is built)."""
    import sys

    from rich.progress import BarColumn, DownloadColumn, TransferSpeedColumn

    from ..storage.registry import BlobProgress, pull_image
    from ..storage.registry_auth import RegistryCredentials
    from ..storage.registry_errors import RegistryError

    credentials = None
    if password_stdin:
        if not username:
            _fail(ValueError("--password-stdin needs --username"))
        credentials = RegistryCredentials(username, sys.stdin.readline().rstrip("\r\n"))
    elif username:
        _fail(ValueError("--username needs --password-stdin (passwords are never flags)"))
    progress = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                        TransferSpeedColumn())
    tasks: dict[str, TaskID] = {}

    def on_blob(event: BlobProgress) -> None:
        task = tasks.get(event.digest)
        if task is None:
            label = f"{event.kind} {event.digest[7:19]}"
            task = tasks[event.digest] = progress.add_task(label, total=event.total or None)
        progress.update(task, completed=event.done,
                        description=f"{event.kind} {event.digest[7:19]}"
                                    f"{' (cached)' if event.cached else ''}")

    t0 = time.monotonic()
    try:
        with progress, pull_image(_settings(), reference, credentials=credentials,
                                  progress=on_blob) as image:
            pass
    except RegistryError as e:
        _fail(e)
    Console().print(f"{image.reference} {image.digest} {len(image.layers)} layers, "
                    f"{image.bytes_transferred / 1e6:.1f} MB transferred "
                    f"({time.monotonic() - t0:.1f} s)")
