"""Turn a ``StartRequest`` into a running child: command line, environment, cwd, credentials,
and the file descriptors envd keeps (output pipes or a PTY master, stdin pipe).

Contract, as upstream envd:
- the command runs under ``/bin/sh -c 'cd -- "$1" && shift && echo 100 >
  /proc/$$/oom_score_adj && exec "$@"'``, so a runaway command is the OOM killer's first
  choice rather than envd, and the cd happens as the user; the wrapper execs the command, so
  the pid reported is the command's. (Upstream also resets nice and ionice through two more
  execs; we skip them, ~1 ms per command, and children inherit envd's priority.)
- uid, gid and supplementary groups are the user's; the environment is built from scratch:
  PATH (envd's), HOME, USER, LOGNAME, then the sandbox env vars, then the request's envs.
- cwd is the request's, resolved like any path for that user, else the default workdir,
  else home; it must exist.
- ``/bin/bash`` (what E2B's SDK asks for: ``-l -c CMD``, ``-i -l`` for a PTY) becomes the
  image's ``/bin/sh`` with the same flags where the image has no bash (busybox, alpine);
  long options only bash knows are dropped (``_SH_FALLBACK``).
- stdin is a pipe when the request asks for it or leaves it unset, else /dev/null. A PTY
  process gets the slave end as stdin, stdout and stderr and becomes a session leader.
Non-PTY children stay in envd's session and process group, as upstream's do.
- Inside a guest, every child goes into the workload cgroup (``aenv.envd.cgroups``) before
  the command runs: the wrapper first waits on a pipe (fd 3) until envd has moved it, so
  nothing the command forks is left in envd's cgroup.

How: ``fork`` of a 40 MB Python process costs 3-4 ms here and blocks the event loop for it,
so children start with ``posix_spawn`` (vfork-like, ~0.1 ms), switching user through
util-linux ``setpriv`` when envd is not already that user (the image's, or the argv prefix
in ``AENV_ENVD_SETPRIV``: the tools drive's own, run through its loader, since an image's
may be busybox's, which has other options). A PTY child opens the slave by
path in a spawn file action, which runs after ``setsid``, so the terminal becomes its
controlling tty. Only when a user switch is needed and ``setpriv`` is missing (minimal
images) does ``subprocess.Popen`` fork instead. ``posix_spawn`` cannot close stray
descriptors, so ``seal_inherited_descriptors`` marks everything envd inherited
close-on-exec once; all descriptors envd opens itself are close-on-exec already.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

from .. import cgroups
from ..proto import process_pb
from ..users import User, resolve_path
from .errors import InvalidRequest
from .pty import open_pty, take_controlling_tty

_WRAPPER = 'cd -- "$1" && shift && echo 100 > /proc/$$/oom_score_adj && exec "$@"'
# The same after waiting for envd's go (one line on fd 3, or its end), which comes once envd
# has put the wrapper into the workload cgroup. ``read`` and ``exec`` are shell builtins.
_PLACED_WRAPPER = "read -r _ <&3; exec 3<&-; " + _WRAPPER
_HANDSHAKE_FD = 3
_FALLBACK_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_SETPRIV: list[str] | None = (
    os.environ.get("AENV_ENVD_SETPRIV", "").split()
    or ([found] if (found := shutil.which("setpriv", path="/usr/bin:/bin:/usr/sbin:/sbin"))
        else None))
_BASH = "/bin/bash"
# bash's own long options, which a POSIX sh refuses; what remains (-l, -c, -i, -e...) the
# shells of minimal images (busybox ash, dash) know.
_SH_FALLBACK = {"--login": "-l", "--noprofile": None, "--norc": None, "--posix": None}
# Python ignores these; a child must get them back at their defaults (as Popen does).
_DEFAULT_SIGNALS = (signal.SIGPIPE, signal.SIGXFSZ)

log = logging.getLogger("envd.process")


@dataclass(frozen=True)
class LaunchSpec:
    cmd: str
    args: list[str]
    env: dict[str, str]
    cwd: str
    user: User
    stdin: bool
    pty_size: tuple[int, int] | None  # (cols, rows) for a PTY process
    cgroup: Path | None = None  # the workload cgroup (inside a guest)

    @property
    def command(self) -> str:
        """The user's command line (for logs and errors)."""
        return " ".join([self.cmd, *self.args])

    def argv(self, handshake: bool = False) -> list[str]:
        wrapper = _PLACED_WRAPPER if handshake else _WRAPPER
        return ["/bin/sh", "-c", wrapper, "sh", self.cwd, self.cmd, *self.args]


@dataclass
class Spawned:
    """A started child and the parent ends of its descriptors (non-blocking, owned by the
    caller): ``stdout``/``stderr`` for pipes, ``pty`` for a PTY master, ``stdin`` or None."""

    pid: int
    stdout: int | None
    stderr: int | None
    stdin: int | None
    pty: int | None
    popen: subprocess.Popen[bytes] | None = None

    def reaped(self, wstatus: int) -> None:
        """Record that the caller reaped the child, so ``Popen`` never waits for it again
        (it would, on garbage collection, and could reap a recycled pid)."""
        if self.popen is not None:
            self.popen.returncode = os.waitstatus_to_exitcode(wstatus)


def plan(request: process_pb.StartRequest, user: User, sandbox_env: dict[str, str],
         default_workdir: str | None, cgroup: Path | None = None) -> LaunchSpec:
    """Validate ``request`` and fix everything the child will get."""
    config = request.process
    if config is None:
        raise InvalidRequest("process config is required")
    if not config.cmd:
        raise InvalidRequest("process cmd must not be empty")
    cmd, args = shell_for(config.cmd, list(config.args))

    cwd = resolve_path(config.cwd if config.has_field("cwd") else "", user, default_workdir)
    if not os.path.exists(cwd):
        raise InvalidRequest(f"cwd '{cwd}' does not exist")

    env = {
        "PATH": os.environ.get("PATH") or _FALLBACK_PATH,
        "HOME": user.home,
        "USER": user.name,
        "LOGNAME": user.name,
    }
    env.update(sandbox_env)
    env.update(config.envs)

    pty_size = None
    if request.pty is not None:
        size = request.pty.size
        pty_size = (size.cols, size.rows) if size is not None else (0, 0)
    stdin = request.stdin if request.has_field("stdin") else True
    return LaunchSpec(cmd, args, env, cwd, user, stdin, pty_size, cgroup)


def shell_for(cmd: str, args: list[str], bash: str = _BASH) -> tuple[str, list[str]]:
    """``cmd`` and ``args``, with ``/bin/bash`` turned into ``/bin/sh`` where ``bash`` is
    missing (bash's long options translated or dropped)."""
    if cmd != _BASH or os.path.exists(bash):
        return cmd, args
    out: list[str] = []
    for i, arg in enumerate(args):
        if arg in ("-c", "--") or not arg.startswith("-"):
            return "/bin/sh", [*out, *args[i:]]  # the command and its words, untouched
        if arg not in _SH_FALLBACK:
            out.append(arg)
        elif (short := _SH_FALLBACK[arg]) is not None:
            out.append(short)
    return "/bin/sh", out


def spawn(spec: LaunchSpec) -> Spawned:
    """Start ``spec``. Raises ``InvalidRequest`` when the child cannot be started (upstream
    answers ``invalid_argument`` for that too)."""
    switch = spec.user.uid != os.geteuid() or spec.user.gid != os.getegid()
    try:
        if switch and _SETPRIV is None:
            return _spawn_forking(spec)
        return _spawn(spec, _setpriv_prefix(spec.user) if switch else [])
    except (OSError, subprocess.SubprocessError) as e:
        raise InvalidRequest(f"error starting process '{spec.command}': {e}") from e


def seal_inherited_descriptors() -> None:
    """Mark every descriptor above stderr close-on-exec, so nothing envd inherited leaks into
    children started with ``posix_spawn``."""
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd > 2:
            try:
                os.set_inheritable(fd, False)
            except OSError:
                pass  # the directory's own descriptor, closed by now


def _setpriv_prefix(user: User) -> list[str]:
    assert _SETPRIV is not None
    groups = f"--groups={','.join(map(str, user.groups))}" if user.groups else "--clear-groups"
    return [*_SETPRIV, f"--reuid={user.uid}", f"--regid={user.gid}", groups, "--"]


class _Pipes:
    """Output pipes and an optional stdin pipe, all close-on-exec until spawned."""

    def __init__(self, stdin: bool) -> None:
        self._fds: list[int] = []
        self.out_r, self.out_w = self._pipe()
        self.err_r, self.err_w = self._pipe()
        self.in_r: int | None
        self.in_w: int | None
        self.in_r, self.in_w = self._pipe() if stdin else (None, None)

    def _pipe(self) -> tuple[int, int]:
        r, w = os.pipe2(os.O_CLOEXEC)
        self._fds += [r, w]
        return r, w

    def close_child_ends(self) -> None:
        for fd in (self.out_w, self.err_w, self.in_r):
            if fd is not None:
                os.close(fd)
                self._fds.remove(fd)

    def close_all(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds = []

    def parent(self, pid: int, popen: subprocess.Popen[bytes] | None = None) -> Spawned:
        for fd in (self.out_r, self.err_r, self.in_w):
            if fd is not None:
                os.set_blocking(fd, False)
        self._fds = []
        return Spawned(pid, self.out_r, self.err_r, self.in_w, None, popen)


def _place(pid: int, cgroup: Path) -> None:
    try:
        cgroups.move(pid, cgroup)
    except OSError as e:
        log.warning("pid %d stays in envd's cgroup: %s", pid, e)


class _Handshake:
    """The pipe a placed child waits on (read end as its fd 3) until envd has moved it
    into the workload cgroup; without a cgroup it does nothing."""

    def __init__(self, cgroup: Path | None) -> None:
        self.cgroup = cgroup
        self.r = self.w = -1
        if cgroup is not None:
            self.r, self.w = os.pipe2(os.O_CLOEXEC)
            if self.r == _HANDSHAKE_FD:  # dup2 onto itself would keep close-on-exec set
                self.r = os.dup(_HANDSHAKE_FD)
                os.close(_HANDSHAKE_FD)

    def actions(self) -> list[tuple[int, int, int]]:
        return [] if self.cgroup is None else [(os.POSIX_SPAWN_DUP2, self.r, _HANDSHAKE_FD)]

    def release(self, pid: int | None) -> None:
        """Move ``pid`` (when spawned) into the cgroup, then let it go on; closes the pipe."""
        if self.cgroup is None:
            return
        try:
            if pid is not None:
                _place(pid, self.cgroup)
        finally:
            os.close(self.r)
            try:
                os.write(self.w, b"\n")
            except OSError:
                pass  # the child is gone already
            os.close(self.w)


def _spawn(spec: LaunchSpec, prefix: list[str]) -> Spawned:
    gate = _Handshake(spec.cgroup)
    argv = [*prefix, *spec.argv(handshake=spec.cgroup is not None)]
    pid: int | None = None
    try:
        if spec.pty_size is not None:
            master, slave = open_pty(*spec.pty_size)
            try:
                pid = os.posix_spawn(argv[0], argv, spec.env, file_actions=[
                    (os.POSIX_SPAWN_OPEN, 0, os.ttyname(slave), os.O_RDWR, 0),
                    (os.POSIX_SPAWN_DUP2, 0, 1),
                    (os.POSIX_SPAWN_DUP2, 0, 2),
                    *gate.actions(),
                ], setsid=True, setsigdef=_DEFAULT_SIGNALS)
            except BaseException:
                os.close(master)
                raise
            finally:
                # The child has the slave open by now (posix_spawn returns after its file
                # actions), so the master reads EIO only once the child and everything it
                # started have closed the terminal.
                os.close(slave)
            return Spawned(pid, None, None, None, master)

        pipes = _Pipes(spec.stdin)
        try:
            stdin_action = (
                (os.POSIX_SPAWN_DUP2, pipes.in_r, 0) if pipes.in_r is not None
                else (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0)
            )
            pid = os.posix_spawn(argv[0], argv, spec.env, file_actions=[
                stdin_action,
                (os.POSIX_SPAWN_DUP2, pipes.out_w, 1),
                (os.POSIX_SPAWN_DUP2, pipes.err_w, 2),
                *gate.actions(),
            ], setsigdef=_DEFAULT_SIGNALS)
            pipes.close_child_ends()
        except BaseException:
            pipes.close_all()
            raise
        return pipes.parent(pid)
    finally:
        gate.release(pid)


def _spawn_forking(spec: LaunchSpec) -> Spawned:
    """The fallback without ``setpriv``: ``Popen`` forks and switches user itself. The user
    switch comes before ``preexec_fn``, so the child cannot join the workload cgroup itself:
    envd moves it once Popen returns, and anything the command forked before that stays
    in envd's cgroup (an image without util-linux is the only way here)."""
    spawned = _spawn_forking_unplaced(spec)
    if spec.cgroup is not None:
        _place(spawned.pid, spec.cgroup)
    return spawned


def _spawn_forking_unplaced(spec: LaunchSpec) -> Spawned:
    user, group, extra_groups = spec.user.uid, spec.user.gid, list(spec.user.groups)
    if spec.pty_size is not None:
        master, slave = open_pty(*spec.pty_size)
        try:
            # preexec_fn may deadlock if another thread held a lock the child needs at fork
            # time; it only makes one ioctl, and only images without setpriv get here.
            popen = subprocess.Popen(
                spec.argv(), stdin=slave, stdout=slave, stderr=slave, env=spec.env,
                close_fds=True, start_new_session=True,
                preexec_fn=take_controlling_tty,
                user=user, group=group, extra_groups=extra_groups,
            )
        except BaseException:
            os.close(master)
            raise
        finally:
            os.close(slave)
        return Spawned(popen.pid, None, None, None, master, popen)

    pipes = _Pipes(spec.stdin)
    try:
        popen = subprocess.Popen(
            spec.argv(), stdin=pipes.in_r if pipes.in_r is not None else subprocess.DEVNULL,
            stdout=pipes.out_w, stderr=pipes.err_w, env=spec.env, close_fds=True,
            user=user, group=group, extra_groups=extra_groups,
        )
        pipes.close_child_ends()
    except BaseException:
        pipes.close_all()
        raise
    return pipes.parent(popen.pid, popen)
