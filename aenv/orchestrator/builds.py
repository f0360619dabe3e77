"""Template builds: boot the parent template, run the steps through envd, commit the disk.

A build follows E2B's template API: ``POST /v3/templates`` reserves a template id and a
build id, COPY sources arrive as tar archives keyed by ``filesHash``, ``POST
/v2/templates/{tid}/builds/{bid}`` starts the steps, and the SDK polls the status with a
log offset. Steps run as root by default (``USER`` changes that for later steps and becomes
the sandbox's default user); ``ENV`` and ``WORKDIR`` apply to later steps and are kept in the
template. The result is a new read-only image layer on top of the parent's (the machines
decide what a layer is on this host). Step names in logs and errors follow the SDK: ``base``
for the parent, ``1``..``n`` for the steps, ``finalize`` for the commit.

A failed step reads as E2B's template manager words it (``failed to run command '<cmd>':
exit status 1``, ``failed to move files in sandbox: ...``, ...), followed by the last lines
the step printed, so the SDK's ``BuildException`` (``reason.message``) says what went
wrong without the logs. No build stays ``waiting`` for good: a start that is refused
fails its build, a newer reservation for the same template and tag supersedes an
unstarted one, and one never started within ``WAITING_DEADLINE_S`` (E2B's 40 minutes)
fails; a template without a ready image takes its status from its builds (``error`` once
none is left).

COPY follows E2B's template manager (``commands/copy.go`` and ``copy_script.sh`` in
e2b-dev/infra): the client matched the glob and the archive holds the matches, so the step
copies the part of the source before its first glob segment (``copy_source_base``) from
the unpacked archive: a directory's contents are merged into the destination directory, a
file or symlink is moved to the destination (into it when it ends in ``/``), symlinks stay
symlinks, ``mode`` applies to every copied file and directory (not to symlinks), and the
owner (``user`` or ``user:group``, default the build's user) to every copied entry. A
relative destination is under the working directory, else the build user's home.
Directories the step creates for the destination belong to the owner too (as WORKDIR's and
Docker's); existing ones keep their owner and mode.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import posixpath
import re
import shlex
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..client.envd import EnvdClient, EnvdError
from ..cluster.handover import SharedTemplates
from ..envd import ENVD_PORT
from ..storage import build_archives, images
from ..storage.errors import StorageError
from ..storage.image_ref import ImageRef
from ..storage.shared_store import SharedStore
from ..store import (
    BuildRecord,
    BuildStatus,
    SandboxRecord,
    SandboxState,
    TemplateKind,
    TemplateRecord,
    TemplateStore,
)
from . import template_records
from .admission import Admission, Ask
from .errors import Conflict, InvalidRequest, LimitReached, TemplateNotFound
from .from_image import (
    DEFAULT_USER,
    DEFAULT_WORKDIR,
    ImageRequest,
    ImageSource,
    check_request,
    is_e2b_base,
)
from .ids import new_id, new_layer_ref, new_snapshot_ref, new_token
from .machine import Machines
from .pins import Pins
from .template_records import BASE_TEMPLATE, reserved_for_build

log = logging.getLogger("aenv.builds")

DEFAULT_CPU = 2
DEFAULT_MEMORY_MB = 512
DEFAULT_DISK_MB = 4096
READY_TIMEOUT_S = 600
READY_INTERVAL_S = 1.0
STEP_TYPES = {"RUN", "ENV", "ARG", "WORKDIR", "USER", "COPY", "EXPOSE", "VOLUME", "LABEL"}
_HASH = re.compile(r"^[A-Za-z0-9]{8,128}$")
_MODE = re.compile(r"^[0-7]{3,4}$")
# E2B's API (template-manager/template_status.go): a reservation not started by then fails.
WAITING_DEADLINE_S = 40 * 60
SWEEP_INTERVAL_S = 60.0
SUPERSEDED = "The build was canceled because it was superseded by a newer one."
WAITED_TOO_LONG = "build is in waiting state for too long"
# The end of a failed step's output that its error message carries.
TAIL_LINES = 20
TAIL_BYTES = 4096
_LINE_CHARS = 8192  # a line without a newline is cut into lines of this size
# What doublestar (E2B's server side) takes for glob syntax when it splits a source.
_GLOB_META = "*?[{"
# Build commands find the usual tools whatever PATH the template's ENV steps set.
_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class StepFailed(Exception):
    def __init__(self, step: str, message: str) -> None:
        super().__init__(message)
        self.step = step


@dataclass
class BuildContext:
    """What earlier steps set for later ones."""

    user: str = "root"
    workdir: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    default_user: str | None = None


# -- COPY -----------------------------------------------------------------------------------


def copy_source_base(src: str) -> str:
    """The part of a COPY source that the step copies out of its archive: everything before
    the last ``/`` that precedes the first glob character, as E2B's template manager takes
    it (``doublestar.SplitPattern(src + "/")``), normalised and relative to the archive's
    root (``"."`` for the whole archive). ``folder/*`` → ``folder``, ``a.txt`` → ``a.txt``,
    ``*.txt`` → ``.``, ``src/**/*.py`` → ``src``. Backslash escapes are undone.

    Raises ValueError for a source that is absolute or leaves the context (the SDK refuses
    those before it uploads anything).
    """
    if src.startswith("/"):
        raise ValueError(f"COPY source '{src}' is absolute")
    pattern = src if src.endswith("/") else src + "/"
    split, i = -1, 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            i += 2
            continue
        if c == "/":
            split = i
        elif c in _GLOB_META:
            break
        i += 1
    base = re.sub(r"\\(.)", r"\1", pattern[:split]) if split > 0 else "."
    base = posixpath.normpath(base)
    if base == ".." or base.startswith("../"):
        raise ValueError(f"COPY source '{src}' leaves the context directory")
    return base


def copy_owner(owner: str, build_user: str) -> str:
    """``user:group`` for chown: the step's owner (``user`` means ``user:user``, as in
    E2B), else the build's current user."""
    owner = owner or build_user
    return owner if ":" in owner else f"{owner}:{owner}"


def extract_command(archive: str, unpack: str) -> str:
    """Unpack the uploaded archive into an empty ``unpack`` directory (gzip or not)."""
    q = shlex.quote
    return (f"rm -rf -- {q(unpack)} && mkdir -p -- {q(unpack)} && "
            f"tar -xf {q(archive)} -C {q(unpack)} && rm -f -- {q(archive)} || "
            f"{{ rc=$?; rm -rf -- {q(unpack)} {q(archive)}; exit $rc; }}")


def copy_script(*, entry: str, src: str, dest: str, owner: str, mode: str,
                workdir: str | None, user: str, cleanup: str | None = None) -> str:
    """The shell script (bash, run as root) that moves ``entry`` (the source's base in the
    unpacked archive) to ``dest``: see the module docstring. Every value reaches the shell
    as a quoted assignment, never as code. ``cleanup`` is removed when the script ends."""
    q = shlex.quote
    return f"""set -o pipefail
export PATH={_PATH}
entry={q(entry)}
src={q(src)}
target={q(dest)}
owner={q(owner)}
mode={q(mode)}
workdir={q(workdir or "")}
user={q(user)}
{f"trap 'rm -rf -- {q(cleanup)}' EXIT" if cleanup else ":"}

case "$target" in
/*) ;;
*)  if [ -z "$workdir" ]; then
        workdir=$(getent passwd "$user" | cut -d: -f6)
        if [ -z "$workdir" ]; then
            echo "cannot place '$target': user '$user' has no home directory" >&2
            exit 1
        fi
    fi
    target="${{workdir%/}}/$target" ;;
esac

# mkdir -p, and the directories it creates belong to the owner; existing ones are kept.
make_dir() {{
    local d=$1 new=
    while [ ! -e "$d" ] && [ ! -L "$d" ]; do
        new=$d
        d=$(dirname -- "$d")
    done
    mkdir -p -- "$1" || exit 1
    if [ -n "$new" ]; then chown -R -- "$owner" "$new" || exit 1; fi
}}

if [ ! -e "$entry" ] && [ ! -L "$entry" ]; then
    echo "Error: source path does not exist: $src" >&2
    exit 1
fi
# The type is checked before chown/chmod so that a symlink is never followed.
if [ -L "$entry" ] || [ -f "$entry" ]; then
    if [ -L "$entry" ]; then
        chown -h -- "$owner" "$entry" || exit 1
    else
        chown -- "$owner" "$entry" || exit 1
        if [ -n "$mode" ]; then chmod -- "$mode" "$entry" || exit 1; fi
    fi
    case "$target" in
    */) make_dir "$target" ;;
    *)  make_dir "$(dirname -- "$target")" ;;
    esac
    mv -- "$entry" "$target" || exit 1
elif [ -d "$entry" ]; then
    chown -R -- "$owner" "$entry" || exit 1
    if [ -n "$mode" ]; then chmod -R -- "$mode" "$entry" || exit 1; fi
    make_dir "$target"
    # Merged as Docker's tar-based COPY merges: existing directories are merged into (their
    # owner and mode kept, a symlink to a directory followed), existing files replaced.
    (cd -- "$entry" && tar -cf - .) | \\
        tar -xf - -C "$target" --keep-directory-symlink --no-overwrite-dir || exit 1
else
    echo "Error: $src is neither a file, a directory nor a symlink" >&2
    exit 1
fi
"""


# -- command output -------------------------------------------------------------------------


class _Output:
    """A command's output as build-log lines (a line split across chunks is one line, blank
    lines are dropped as E2B drops them) and its last lines, for the step's error."""

    def __init__(self, emit: Callable[[str], None]) -> None:
        self.emit = emit
        self.partial = {"stdout": "", "stderr": ""}
        self.tail: deque[str] = deque(maxlen=TAIL_LINES)
        self.lines = 0

    def feed(self, stream: str, text: str) -> None:
        text = self.partial.get(stream, "") + text
        *lines, rest = text.split("\n")
        while len(rest) > _LINE_CHARS:
            lines.append(rest[:_LINE_CHARS])
            rest = rest[_LINE_CHARS:]
        self.partial[stream] = rest
        for line in lines:
            self._line(line)

    def close(self) -> None:
        for stream, rest in self.partial.items():
            if rest:
                self._line(rest)
            self.partial[stream] = ""

    def _line(self, line: str) -> None:
        line = line.rstrip("\r")
        if not line.strip():
            return
        self.emit(line)
        self.lines += 1
        self.tail.append(line)

    def last_lines(self) -> list[str]:
        kept: list[str] = []
        size = 0
        for line in reversed(self.tail):
            size += len(line.encode("utf-8", "replace")) + 1
            if kept and size > TAIL_BYTES:
                break
            kept.append(line if size <= TAIL_BYTES else line[:TAIL_BYTES] + " ...")
        return kept[::-1]


def step_failure(what: str, status: str, step: str, output: _Output | None) -> str:
    """``<what>: <status>`` (E2B's words), then the end of what the step printed."""
    message = f"{what}: {status}"
    lines = output.last_lines() if output else []
    if output and lines:
        shown = (f"last {len(lines)} of {output.lines} lines" if output.lines > len(lines)
                 else "output")
        message += f"\nstep {step} {shown}:\n" + "\n".join(lines)
    return message


# -- the builder ----------------------------------------------------------------------------


class Builder:
    def __init__(self, templates: TemplateStore, machines: Machines, files_dir: Path,
                 pins: Pins | None = None, *, admission: Admission | None = None,
                 waiting_deadline: float = WAITING_DEADLINE_S,
                 images: ImageSource | None = None) -> None:
        self.templates = templates
        self.machines = machines
        self.files_dir = files_dir
        # Shared with the orchestrator's garbage collection: the parent's image is read for
        # the whole build, the new image is written before the template names it.
        self.pins = pins or Pins()
        # Shared with the orchestrator: a build VM counts against the node's budgets.
        self.admission = admission
        self.waiting_deadline = waiting_deadline
        # Where ``fromImage`` builds get their image (a registry pull); None: refused.
        self.images = images
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._sweeper: asyncio.Task[None] | None = None

    # -- requests -------------------------------------------------------------------------

    def request(self, name: str, *, tags: list[str] | None = None,
                cpu_count: int | None = None, memory_mb: int | None = None
                ) -> tuple[TemplateRecord, BuildRecord, list[str]]:
        """Reserve (or reuse, when ``name`` exists) a template and a new build.

        A new template holds its name from now on (as E2B's alias), so that a second
        request for it finds the same template; its tags are added when a build is ready.
        Earlier builds of the template for one of these tags that were never started are
        failed, superseded by this one (E2B's ``InvalidateUnstartedTemplateBuilds``).
        """
        self.expire_waiting()
        base, _, tag = name.partition(":")
        tags = list(dict.fromkeys([tag or "default", *(tags or [])]))
        now = time.time()
        existing = self.templates.get(base)
        if existing is not None and existing.kind != TemplateKind.TEMPLATE:
            raise Conflict(f"'{base}' names a snapshot, not a template")
        if existing is None:
            tpl = reserved_for_build(new_id(), base, cpu_count=cpu_count or DEFAULT_CPU,
                                     memory_mb=memory_mb or DEFAULT_MEMORY_MB,
                                     disk_size_mb=DEFAULT_DISK_MB, now=now)
            self.templates.insert(tpl)
        else:
            tpl = existing
            if cpu_count or memory_mb:
                self.templates.update(tpl.id, cpu_count=cpu_count or tpl.cpu_count,
                                      memory_mb=memory_mb or tpl.memory_mb)
        names = [base] + [f"{base}:{t}" for t in tags]
        for old in self.templates.builds_in((BuildStatus.WAITING,)):
            old_tags = set((old.spec or {}).get("names", [])[1:])
            if old.template_id == tpl.id and old_tags & set(names[1:]):
                self._fail(old.id, tpl.id, None, SUPERSEDED)
        # A UUID, as E2B's: the SDK parses build ids in tag answers as UUIDs.
        build = BuildRecord(id=str(uuid.uuid4()), template_id=tpl.id,
                            status=BuildStatus.WAITING,
                            created_at=now, spec={"names": names})
        self.templates.insert_build(build)
        self._settle(tpl.id)
        return self.templates.get(tpl.id) or tpl, build, tags

    def file_path(self, files_hash: str) -> Path:
        if not _HASH.match(files_hash):
            raise InvalidRequest(f"invalid files hash '{files_hash}'")
        return self.files_dir / f"{files_hash}.tar"

    def start(self, template_id: str, build_id: str, spec: dict[str, Any],
              registry: dict[str, Any] | None = None) -> None:
        """Start a reserved build. A start refused for what it asks (``InvalidRequest``,
        ``TemplateNotFound`` for the parent) fails the build with that reason before it
        raises: the SDK does not start a build twice, so it would wait forever.
        ``registry``: the credentials for ``fromImage`` (E2B's ``fromImageRegistry``),
        kept in memory only; ``spec`` is stored and must not hold them."""
        tpl = self.templates.get(template_id)
        build = self.templates.get_build(build_id)
        if tpl is None or build is None or build.template_id != tpl.id:
            raise TemplateNotFound(f"{template_id}/{build_id}")
        if build.status != BuildStatus.WAITING:
            raise Conflict(f"build {build_id} was already started")

        def refuse(step: str, error: Exception) -> Exception:
            self._fail(build_id, tpl.id, step, str(error))
            return error

        from_image: ImageRequest | None = None
        parent_id = spec.get("fromTemplate") or BASE_TEMPLATE
        if spec.get("fromImage") and spec.get("fromTemplate"):
            raise refuse("base", InvalidRequest("fromImage and fromTemplate are exclusive"))
        if spec.get("fromImage") and not is_e2b_base(spec["fromImage"]):
            if self.images is None:
                raise refuse("base", InvalidRequest(
                    "this node does not pull images (fromImage); build from a template"
                    " (fromTemplate)"))
            try:
                from_image = check_request(spec["fromImage"], registry)
            except InvalidRequest as e:
                raise refuse("base", e) from None
        parent: TemplateRecord | ImageRequest
        if from_image is None:
            record = self.templates.get(parent_id)
            if record is None or record.status != BuildStatus.READY:
                raise refuse("base", TemplateNotFound(parent_id))
            parent = record
        else:
            parent = from_image
        for i, step in enumerate(spec.get("steps") or [], start=1):
            kind = step.get("type")
            if kind not in STEP_TYPES:
                raise refuse(str(i), InvalidRequest(f"step {i}: unknown type '{kind}'"))
            if kind == "COPY":
                h = step.get("filesHash")
                try:
                    present = bool(h) and self.file_path(h).exists()
                except InvalidRequest as e:
                    raise refuse(str(i), e) from None
                if not present:
                    raise refuse(str(i), InvalidRequest(
                        f"step {i}: files for hash '{h}' were not uploaded"))
        if self.admission is not None:
            try:
                self.admission.check_start(Ask(tpl.cpu_count, tpl.memory_mb))
            except LimitReached as e:
                raise refuse("base", e) from None
        names = (build.spec or {}).get("names", [])
        self.templates.update_build(build_id, status=BuildStatus.BUILDING,
                                    spec={**spec, "names": names})
        self._settle(template_id)
        task = asyncio.create_task(self._run(tpl.id, build_id, parent, spec, names),
                                   name=f"aenv-build-{build_id}")
        self._tasks[build_id] = task
        task.add_done_callback(lambda _: self._tasks.pop(build_id, None))

    def expire_waiting(self, now: float | None = None) -> None:
        """Fail reservations not started within ``waiting_deadline`` of their request."""
        now = time.time() if now is None else now
        for b in self.templates.builds_in((BuildStatus.WAITING,)):
            if now - b.created_at > self.waiting_deadline:
                self._fail(b.id, b.template_id, None, WAITED_TOO_LONG)

    def recover(self) -> None:
        """Builds interrupted by a restart cannot continue: mark them failed. Reservations
        are kept (a client may still start them) until their deadline; from here on they
        are swept every ``SWEEP_INTERVAL_S`` when there is an event loop."""
        for b in self.templates.builds_in((BuildStatus.WAITING, BuildStatus.BUILDING)):
            if b.status == BuildStatus.BUILDING:
                self._fail(b.id, b.template_id, "finalize", "the server restarted during the build")
        self.expire_waiting()
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        if self._sweeper is None:
            self._sweeper = loop.create_task(self._sweep(), name="aenv-build-sweeper")

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_INTERVAL_S)
            try:
                self.expire_waiting()
            except Exception:
                log.exception("sweeping unstarted builds failed")

    async def close(self) -> None:
        tasks = list(self._tasks.values())
        if self._sweeper is not None:
            tasks.append(self._sweeper)
            self._sweeper = None
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # -- execution ------------------------------------------------------------------------

    def _log(self, build_id: str, message: str, step: str | None = None,
             level: str = "info") -> None:
        self.templates.append_log(build_id, message, level=level, step=step)

    def _fail(self, build_id: str, template_id: str, step: str | None, message: str) -> None:
        self._log(build_id, f"Build failed: {message}", step=step, level="error")
        self.templates.update_build(build_id, status=BuildStatus.ERROR, reason=message,
                                    reason_step=step, finished_at=time.time())
        self._settle(template_id)

    def _settle(self, template_id: str) -> None:
        """A template without a ready image shows the state of its builds (E2B shows the
        latest build's): ``building`` or ``waiting`` while one is, else ``error``. A ready
        template stays ready: its image still serves while it is rebuilt."""
        tpl = self.templates.get(template_id)
        if tpl is None or tpl.status == BuildStatus.READY:
            return
        live = {b.status for b in self.templates.builds_in(
            (BuildStatus.WAITING, BuildStatus.BUILDING)) if b.template_id == template_id}
        status = BuildStatus.BUILDING if BuildStatus.BUILDING in live else \
            BuildStatus.WAITING if live else BuildStatus.ERROR
        if status != tpl.status:
            self.templates.update(template_id, status=status)

    async def _run(self, template_id: str, build_id: str,
                   parent: TemplateRecord | ImageRequest, spec: dict[str, Any],
                   names: list[str]) -> None:
        if isinstance(parent, ImageRequest):
            pulled = await self._from_image(template_id, build_id, parent)
            if pulled is None:
                return
            parent = pulled
            laid = 0
        else:
            parent, laid = await self._lay_copies(template_id, build_id, parent, spec)
        image = new_snapshot_ref() if self.machines.can_pause else new_layer_ref()
        tpl = self.templates.get(template_id)
        held = self.admission.reserve(tpl.cpu_count, tpl.memory_mb, check=False) \
            if self.admission is not None and tpl is not None else contextlib.nullcontext()
        with self.pins.hold(parent.image, image), held:
            await self._build(template_id, build_id, parent, spec, names, image, laid=laid)

    async def _lay_copies(self, template_id: str, build_id: str, parent: TemplateRecord,
                          spec: dict[str, Any]) -> tuple[TemplateRecord, int]:
        """A build from ``base`` whose first steps COPY directories to new absolute paths as
        root: those are laid into a copy of the base image on the host (``images.
        base_image_with``, cached by digest) that stands in as the parent, instead of being
        uploaded through envd and unpacked under emulation. Returns the parent and how
        many leading steps it holds (0: none, the steps run in the guest as usual)."""
        if self.images is None or parent.id != BASE_TEMPLATE:
            return parent, 0
        layers: list[images.CopyLayer] = []
        for s in spec.get("steps") or []:
            src, dest, owner, mode = [*(s.get("args") or []), "", "", "", ""][:4]
            if (s.get("type") != "COPY" or not s.get("filesHash") or mode
                    or owner not in ("", "root", "root:root") or not dest.startswith("/")):
                break
            try:
                base = copy_source_base(src)
                local = self.file_path(s["filesHash"])
                verdict = await build_archives.check_before_copy(
                    local, src=src, dest=dest, files_hash=s["filesHash"])
            except (ValueError, InvalidRequest, build_archives.FilesHashMismatch):
                break  # the step fails in the guest, with its usual message
            if verdict is not build_archives.HashCheck.MATCH:
                break
            layers.append(images.CopyLayer(local, base, dest, key=s["filesHash"].lower()))
        if not layers:
            return parent, 0
        loop = asyncio.get_running_loop()

        def say(line: str) -> None:  # from the worker thread
            loop.call_soon_threadsafe(self._log, build_id, line, "base")

        steps = "step 1" if len(layers) == 1 else f"steps 1-{len(layers)}"
        self._log(build_id, f"laying {steps} (COPY) into the base image on the host",
                  step="base")
        try:
            ref = await asyncio.to_thread(self.images.base_with, layers, say)
        except asyncio.CancelledError:
            self._fail(build_id, template_id, "base", "build was cancelled")
            raise
        except Exception as e:  # NotLayerable, or the host could not: the guest copies
            if not isinstance(e, images.NotLayerable):
                log.exception("build %s: laying COPY steps on the host failed", build_id)
            self._log(build_id, f"the COPY steps run in the guest: {e}", step="base")
            return parent, 0
        tpl = self.templates.get(template_id)
        assert tpl is not None
        stand_in = template_records.from_image(tpl, ref, env=parent.env_vars, workdir="",
                                               user=parent.user or DEFAULT_USER)
        return dataclasses.replace(stand_in, workdir=parent.workdir, user=parent.user), \
            len(layers)

    async def _from_image(self, template_id: str, build_id: str,
                          request: ImageRequest) -> TemplateRecord | None:
        """The image ``request`` names, pulled and made a guest, as a stand-in parent
        template; None when that failed (the build has failed with the reason)."""
        assert self.images is not None
        tpl = self.templates.get(template_id)
        assert tpl is not None
        loop = asyncio.get_running_loop()

        def say(line: str) -> None:  # from the worker thread
            loop.call_soon_threadsafe(self._log, build_id, line, "base")

        try:
            prepared = await asyncio.to_thread(self.images.prepare, request, say)
        except asyncio.CancelledError:
            self._fail(build_id, template_id, "base", "build was cancelled")
            raise
        except StorageError as e:  # registry errors, unpacking, the tools drive
            self._fail(build_id, template_id, "base", str(e))
            return None
        except Exception as e:
            log.exception("build %s: preparing %s failed", build_id, request.reference)
            self._fail(build_id, template_id, "base", f"cannot prepare the image: {e}")
            return None
        return template_records.from_image(
            tpl, prepared.image, env=prepared.env,
            workdir=prepared.workdir or DEFAULT_WORKDIR,
            user=prepared.user or DEFAULT_USER)

    async def _build(self, template_id: str, build_id: str, parent: TemplateRecord,
                     spec: dict[str, Any], names: list[str], image: str, *,
                     laid: int = 0) -> None:
        tpl = self.templates.get(template_id)
        assert tpl is not None
        vm = SandboxRecord(
            id=new_id(), template_id=parent.id, state=SandboxState.BUILDING,
            client_id="aenv-build",
            started_at=time.time(), end_at=time.time() + 3600, cpu_count=tpl.cpu_count,
            memory_mb=tpl.memory_mb, disk_size_mb=tpl.disk_size_mb, env_vars=parent.env_vars,
            envd_token=new_token(), metadata={"aenv.build": build_id})
        ctx = BuildContext(env=dict(parent.env_vars), workdir=parent.workdir,
                           default_user=parent.user)
        started = False
        step = "base"
        try:
            self._log(build_id, f"starting from template {parent.id}", step="base")
            placement = await self.machines.start(vm, parent)
            started = True
            vm.host_ip, vm.vm_dir, vm.vm_pid, vm.slot = (
                placement.host_ip, placement.vm_dir, placement.vm_pid, placement.slot)
            envd = EnvdClient(f"http://{placement.host_ip}:{ENVD_PORT}", vm.envd_token)
            try:
                for i, s in enumerate(spec.get("steps") or [], start=1):
                    step = str(i)
                    if i <= laid:  # in the parent's image already (_lay_copies)
                        args = " ".join(s.get("args") or []).rstrip()
                        self._log(build_id, f"COPY {args} (laid on the host)", step=step)
                        continue
                    await self._step(envd, build_id, step, s, ctx)
                step = "finalize"
                if spec.get("startCmd"):
                    await self._start_and_wait(envd, build_id, spec, ctx)
                # The guest's page cache must reach the disk before it becomes a layer.
                await self._run_cmd(envd, build_id, step, "sync", user="root", ctx=ctx, cwd="/",
                                    what="error running sync command")
            finally:
                await envd.aclose()
            step = "finalize"
            if self.machines.can_pause:
                # Templates are snapshots: creating from one restores it, start command
                # and all, instead of booting.
                self._log(build_id, "snapshotting the template VM", step="finalize")
                await self.machines.pause(vm, True, image)
            else:
                self._log(build_id, "committing the root filesystem", step="finalize")
                await self.machines.commit(vm, image)
            started = False
        except StepFailed as e:
            self._fail(build_id, template_id, e.step, str(e))
            return
        except asyncio.CancelledError:
            self._fail(build_id, template_id, step, "build was cancelled")
            raise
        except Exception as e:
            log.exception("build %s failed", build_id)
            self._fail(build_id, template_id, step, f"build failed: {e}")
            return
        finally:
            if started:
                await self.machines.stop(vm)
        self.templates.update(
            template_id, status=BuildStatus.READY, build_id=build_id, image=image,
            parent_id=parent.id, env_vars=ctx.env, workdir=ctx.workdir, user=ctx.default_user,
            start_cmd=spec.get("startCmd"), ready_cmd=spec.get("readyCmd"),
            build_count=tpl.build_count + 1, envd_token=vm.envd_token)
        for name in names:
            self.templates.add_name(template_id, name)
        self.templates.update_build(build_id, status=BuildStatus.READY, finished_at=time.time())
        self._share(template_id, image)
        self._log(build_id, "build finished", step="finalize")

    def _share(self, template_id: str, image: str) -> None:
        """In a cluster with a shared store: put the template's record there, its snapshot
        having been published by the pause, so that every node can start it."""
        shelf = getattr(self.machines, "shared_templates", None)
        shared = getattr(self.machines, "shared", None)
        tpl = self.templates.get(template_id)
        if not isinstance(shelf, SharedTemplates) or not isinstance(shared, SharedStore) \
                or tpl is None:
            return
        try:
            ref = ImageRef.parse(image)
            if ref.is_snapshot and shared.has(ref.id):
                shelf.put(tpl)
        except Exception:
            log.exception("template %s: not shared with the cluster", template_id)

    async def _step(self, envd: EnvdClient, build_id: str, step: str, s: dict[str, Any],
                    ctx: BuildContext) -> None:
        kind, args = s["type"], list(s.get("args") or [])
        self._log(build_id, f"{kind} {' '.join(args)}".rstrip(), step=step)
        if kind == "RUN":
            if not args:
                raise StepFailed(step, "RUN requires command argument")
            await self._run_cmd(envd, build_id, step, args[0],
                                user=args[1] if len(args) > 1 and args[1] else ctx.user, ctx=ctx)
        elif kind in ("ENV", "ARG"):
            if not args:
                raise StepFailed(step, f"{kind} does not support passing no arguments")
            if len(args) % 2:
                raise StepFailed(step, f"{kind} requires both a key and value arguments")
            ctx.env.update(dict(zip(args[0::2], args[1::2], strict=True)))
        elif kind == "WORKDIR":
            if not args:
                raise StepFailed(step, "WORKDIR requires a path argument")
            await self._run_cmd(envd, build_id, step, f"mkdir -p {shlex.quote(args[0])}",
                                user="root", ctx=ctx, cwd="/", what="failed to create workdir")
            ctx.workdir = args[0]
        elif kind == "USER":
            if not args:
                raise StepFailed(step, "USER requires a username argument")
            name = shlex.quote(args[0])
            await self._run_cmd(
                envd, build_id, step,
                # useradd where the image has it (Debian, Fedora), else busybox's adduser
                # (alpine, busybox images); the shell is bash only where there is one.
                f"id -u {name} >/dev/null 2>&1 || {{ sh=/bin/sh; [ -x /bin/bash ] && sh=/bin/bash;"
                f" if command -v useradd >/dev/null; then useradd --create-home --shell $sh {name};"
                f" else adduser -D -s $sh {name}; fi; }}",
                user="root", ctx=ctx, cwd="/", what="failed to create user")
            ctx.user = ctx.default_user = args[0]
        elif kind == "COPY":
            await self._copy(envd, build_id, step, s, ctx)
        # EXPOSE, VOLUME, LABEL: metadata only.

    async def _run_cmd(self, envd: EnvdClient, build_id: str, step: str, cmd: str, *,
                       user: str, ctx: BuildContext, cwd: str | None = None,
                       what: str | None = None) -> None:
        """Run ``cmd``, its output into the build log; StepFailed in E2B's words when it
        cannot run or exits non-zero (``what`` is the failure's subject, by default
        ``failed to run command '<cmd>'``)."""
        what = what or f"failed to run command '{cmd}'"
        output = _Output(lambda line: self._log(build_id, line, step=step))
        try:
            result = await envd.run(cmd, user=user, cwd=cwd or ctx.workdir, envs=ctx.env,
                                    timeout=3600, on_output=output.feed)
        except EnvdError as e:
            output.close()
            raise StepFailed(step, step_failure(what, f"command failed: {e}", step,
                                                output)) from None
        output.close()
        if result.exit_code != 0:
            status = result.error or f"exit status {result.exit_code}"
            raise StepFailed(step, step_failure(what, status, step, output))

    async def _copy(self, envd: EnvdClient, build_id: str, step: str, s: dict[str, Any],
                    ctx: BuildContext) -> None:
        args = [*(s.get("args") or []), "", "", "", ""]
        src, dest, owner, mode = args[:4]
        if not src or not dest:
            raise StepFailed(step, "COPY requires a local path and a container path argument")
        if not s.get("filesHash"):
            raise StepFailed(step, "COPY requires files hash to be set")
        if mode and not _MODE.match(mode):
            raise StepFailed(step, f"COPY mode '{mode}' is not an octal file mode")
        try:
            base = copy_source_base(src)
        except ValueError as e:
            raise StepFailed(step, str(e)) from None
        work = f"/tmp/aenv-copy-{build_id}-{step}"
        archive, unpack = f"{work}.tar", f"{work}/unpack"
        local = self.file_path(s["filesHash"])
        try:
            verdict = await build_archives.check_before_copy(local, src=src, dest=dest,
                                                             files_hash=s["filesHash"])
        except build_archives.FilesHashMismatch as e:
            raise StepFailed(step, str(e)) from None
        if verdict is build_archives.HashCheck.UNVERIFIABLE:
            self._log(build_id, "the COPY files could not be checked against their filesHash "
                      "(an archive with directories from the JS SDK)", step=step, level="warn")
        try:
            await envd.upload(archive, local, user="root")
        except EnvdError as e:
            raise StepFailed(step, f"failed to copy layer tar data to sandbox: {e}") from None
        await self._run_cmd(envd, build_id, step, extract_command(archive, unpack),
                            user="root", ctx=ctx, cwd="/", what="failed to extract files")
        script = copy_script(
            entry=posixpath.normpath(posixpath.join(unpack, base)), src=src, dest=dest,
            owner=copy_owner(owner, ctx.user), mode=mode, workdir=ctx.workdir, user=ctx.user,
            cleanup=work)
        await self._run_cmd(envd, build_id, step, script, user="root", ctx=ctx, cwd="/",
                            what="failed to move files in sandbox")

    async def _start_and_wait(self, envd: EnvdClient, build_id: str, spec: dict[str, Any],
                              ctx: BuildContext) -> None:
        """Start ``startCmd`` in the background and poll ``readyCmd`` until it succeeds."""
        start, ready = spec["startCmd"], spec.get("readyCmd") or "sleep 1"
        self._log(build_id, f"start command: {start}", step="finalize")
        try:
            await envd.start_background(start, user=ctx.user, cwd=ctx.workdir, envs=ctx.env)
        except EnvdError as e:
            raise StepFailed("finalize", f"start command failed: {e}") from None
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            r = await envd.run(ready, user=ctx.user, cwd=ctx.workdir, envs=ctx.env, timeout=60)
            if r.exit_code == 0:
                self._log(build_id, "ready command succeeded", step="finalize")
                return
            if time.monotonic() > deadline:
                raise StepFailed("finalize", f"ready command failed: {ready} did not succeed "
                                             f"within {READY_TIMEOUT_S} s")
            await asyncio.sleep(READY_INTERVAL_S)
