"""Contexts: one Jupyter kernel each, run one cell at a time, and turn its messages into lines.

A context owns a kernel manager and client (jupyter_client's asyncio flavour). An execution
holds the context's lock from its ``execute_request`` until the kernel reports ``idle`` for
that request, and runs as its own task that feeds a queue: the HTTP response only reads the
queue, so a client that goes away (the SDK's ``timeout``) interrupts the kernel while the task
still waits for the cell to end before the next one may start.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import queue
import urllib.request
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from jupyter_client.kernelspec import NoSuchKernel
from jupyter_client.manager import AsyncKernelManager

log = logging.getLogger("aenv.interpreter")

# The SDKs' language names (lowercased, trimmed) and the kernel spec each runs on.
ALIASES = {"": "python", "js": "javascript", "ts": "typescript", "sh": "bash"}
KERNEL_SPECS = {
    "python": "python3",
    "javascript": "deno",
    "typescript": "deno",
    "bash": "bash",
    "r": "ir",
    "java": "java",
}
# Jupyter MIME types and the keys the SDKs read; every other type goes into ``extra``.
MIME_KEYS = {
    "text/plain": "text",
    "text/html": "html",
    "text/markdown": "markdown",
    "image/svg+xml": "svg",
    "image/png": "png",
    "image/jpeg": "jpeg",
    "application/pdf": "pdf",
    "text/latex": "latex",
    "application/json": "json",
    "application/javascript": "javascript",
    "e2b/data": "data",
    "e2b/chart": "chart",
}
KEEPALIVE_S = 5.0
# A kernel start under TCG on a busy host: python's 20-30 s, Deno's about as long.
KERNEL_READY_S = 180.0
ENVD_ENVS_URL = "http://127.0.0.1:49983/envs"
# Registers charts.figure_chart in the kernel; names kept out of the user's namespace, and a
# kernel without aenv on its path (a user's own) just has no charts.
CHARTS_SETUP = ("try:\n    __import__('aenv.interpreter.charts', fromlist=['install']).install()\n"
                "except Exception:\n    pass\n")


class UnknownLanguage(Exception):
    """No kernel for the language is installed here."""


class KernelStartFailed(Exception):
    """The language's kernel is installed but did not start (or never became ready)."""


def normalise_language(language: str | None) -> str:
    name = (language or "").strip().lower()
    return ALIASES.get(name, name)


def _timestamp(msg: dict[str, Any]) -> str:
    date = msg.get("header", {}).get("date")
    if isinstance(date, datetime):
        return date.isoformat()
    return str(date) if date is not None else datetime.now().astimezone().isoformat()


def result_line(bundle: dict[str, Any], main: bool) -> dict[str, Any]:
    """A ``result`` line from a MIME bundle: the short keys present, the rest in ``extra``."""
    line: dict[str, Any] = {"type": "result", "is_main_result": main}
    extra: dict[str, Any] = {}
    for mime, value in bundle.items():
        key = MIME_KEYS.get(mime)
        if key is None:
            extra[mime] = value
            continue
        if key == "text" and isinstance(value, str) and len(value) >= 2 \
                and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        line[key] = value
    line["extra"] = extra
    return line


def _r_setenv(envs: dict[str, str]) -> str:
    # JSON's string escapes (\", \\, \n, \uXXXX) are R's too.
    return "Sys.setenv(" + ", ".join(f"{json.dumps(k)} = {json.dumps(v)}"
                                     for k, v in envs.items()) + ")"


def _permanent_env_code(language: str, envs: dict[str, str]) -> str | None:
    if language == "python":
        return f"__import__('os').environ.update({json.dumps(envs)})"
    if language == "bash":
        return "\n".join(f"export {k}={json.dumps(v)}" for k, v in envs.items())
    if language == "r":
        return f"invisible({_r_setenv(envs)})"
    return None


def _env_code(language: str, envs: dict[str, str], restore: bool) -> str | None:
    """A hidden cell that sets ``envs`` for one run (or puts the previous values back)."""
    if language in ("python",):
        if restore:
            return (
                "import os as __aenv_os\n"
                "for __aenv_k, __aenv_v in __aenv_saved_env.items():\n"
                "    if __aenv_v is None: __aenv_os.environ.pop(__aenv_k, None)\n"
                "    else: __aenv_os.environ[__aenv_k] = __aenv_v\n"
                "del __aenv_os, __aenv_saved_env\n"
                "try: del __aenv_k, __aenv_v\nexcept NameError: pass\n"
            )
        return (
            "import os as __aenv_os\n"
            f"__aenv_new = {json.dumps(envs)}\n"
            "__aenv_saved_env = {k: __aenv_os.environ.get(k) for k in __aenv_new}\n"
            "__aenv_os.environ.update(__aenv_new)\n"
            "del __aenv_os, __aenv_new\n"
        )
    if language == "bash":
        if restore:
            return "unset " + " ".join(envs)
        return "\n".join(f"export {k}={json.dumps(v)}" for k, v in envs.items())
    if language == "r":
        # a name starting with "." is out of ls()'s sight, as python's __aenv_ names
        if restore:
            return ("for (.aenv_k in names(.aenv_saved_env)) {\n"
                    "  .aenv_v <- .aenv_saved_env[[.aenv_k]]\n"
                    "  if (is.na(.aenv_v)) Sys.unsetenv(.aenv_k)\n"
                    "  else do.call(Sys.setenv, setNames(list(.aenv_v), .aenv_k))\n"
                    "}\n"
                    "rm(.aenv_saved_env, .aenv_k, .aenv_v)")
        names = ", ".join(json.dumps(k) for k in envs)
        return (f".aenv_saved_env <- as.list(Sys.getenv(c({names}), unset = NA, names = TRUE))\n"
                f"invisible({_r_setenv(envs)})")
    return None


@dataclass
class Context:
    id: str
    language: str
    cwd: str
    manager: AsyncKernelManager
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    sandbox_envs_loaded: bool = False
    restarting: bool = False

    def describe(self) -> dict[str, str]:
        return {"id": self.id, "language": self.language, "cwd": self.cwd}


class Kernels:
    """Every context of this server, in creation order, and the default one per language."""

    def __init__(self, default_cwd: str, envd_envs_url: str | None = ENVD_ENVS_URL) -> None:
        self.default_cwd = default_cwd
        self.envd_envs_url = envd_envs_url
        self.contexts: dict[str, Context] = {}
        self.defaults: dict[str, str] = {}
        self._clients: dict[str, Any] = {}
        self._default_lock = asyncio.Lock()
        # While set, cells run without history (the server's warm-up: no execution count
        # taken, nothing in ``In``/``Out`` or the history database).
        self.warming = False

    async def create(self, language: str | None = None, cwd: str | None = None) -> Context:
        language = normalise_language(language)
        spec = KERNEL_SPECS.get(language, language)
        cwd = cwd or self.default_cwd
        if not os.path.isdir(cwd):
            raise NotADirectoryError(f"cwd {cwd!r} is not a directory")
        manager = AsyncKernelManager(kernel_name=spec)
        try:
            await manager.start_kernel(cwd=cwd, env=dict(os.environ))
        except NoSuchKernel as exc:
            raise UnknownLanguage(
                f"no kernel for language {language!r} is installed in this sandbox "
                f"(kernel spec {spec!r} not found; installed: {sorted(self._installed())})"
            ) from exc
        except Exception as exc:
            raise KernelStartFailed(f"the {language} kernel did not start: {exc}") from exc
        client = manager.client()
        client.start_channels()
        try:
            await client.wait_for_ready(timeout=KERNEL_READY_S)
        except Exception as exc:
            client.stop_channels()
            with contextlib.suppress(Exception):
                await manager.shutdown_kernel(now=True)
            raise KernelStartFailed(
                f"the {language} kernel did not become ready: {exc!r}") from exc
        ctx = Context(id=str(uuid.uuid4()), language=language, cwd=cwd, manager=manager)
        self._clients[ctx.id] = client
        self.contexts[ctx.id] = ctx
        await self._setup(ctx)
        return ctx

    async def _setup(self, ctx: Context) -> None:
        """A new (or restarted) python kernel's hidden set-up: chart data for figures."""
        if ctx.language == "python":
            await self._hidden(ctx, CHARTS_SETUP)

    @staticmethod
    def _installed() -> list[str]:
        from jupyter_client.kernelspec import KernelSpecManager
        return list(KernelSpecManager().find_kernel_specs())

    async def default(self, language: str | None) -> Context:
        """The language's default context. Languages that run on one kernel spec share it:
        javascript and typescript get one Deno kernel (two Deno runtimes do not fit the
        default guest's memory beside the python and bash kernels: the kernel killed was
        seen as a 500 or a restarted context)."""
        language = normalise_language(language)
        key = KERNEL_SPECS.get(language, language)
        async with self._default_lock:
            ctx_id = self.defaults.get(key)
            if ctx_id is not None and ctx_id in self.contexts:
                return self.contexts[ctx_id]
            ctx = await self.create(language)
            self.defaults[key] = ctx.id
            return ctx

    async def preload(self, ctx: Context, code: str) -> None:
        """Run ``code`` (imports, for the snapshot) in a hidden cell, its names kept out of
        the user's namespace; an error in it is ignored."""
        body = "\n".join("    " + line for line in code.splitlines()) or "    pass"
        async with ctx.lock:
            await self._hidden(ctx, f"def __aenv_preload():\n{body}\n"
                                    "try:\n    __aenv_preload()\nfinally:\n"
                                    "    del __aenv_preload\n")

    async def forget_warm_up(self, ctx: Context) -> None:
        """After the warm-up cell: clear the display hook's cache (``_``, ``Out``) and fetch
        the sandbox's env vars again at the next run (the warm-up fetched the build's)."""
        async with ctx.lock:
            if ctx.language == "python":
                # flush() empties Out and sets _, __, ___ to ''; the hidden namespace must
                # agree, or IPython takes them for the user's and stops updating them.
                await self._hidden(ctx, "get_ipython().displayhook.flush(); "
                                        "get_ipython().user_ns_hidden.update("
                                        "_='', __='', ___='')")
            ctx.sandbox_envs_loaded = False

    async def restart(self, ctx: Context) -> None:
        ctx.restarting = True
        try:
            await ctx.manager.restart_kernel(now=True)
            await self._clients[ctx.id].wait_for_ready(timeout=KERNEL_READY_S)
            ctx.sandbox_envs_loaded = False
            await self._setup(ctx)
        finally:
            ctx.restarting = False

    async def remove(self, ctx: Context) -> None:
        self.contexts.pop(ctx.id, None)
        for lang, ctx_id in list(self.defaults.items()):
            if ctx_id == ctx.id:
                del self.defaults[lang]
        client = self._clients.pop(ctx.id, None)
        if client is not None:
            client.stop_channels()
        await ctx.manager.shutdown_kernel(now=True)

    async def shutdown(self) -> None:
        for ctx in list(self.contexts.values()):
            with contextlib.suppress(Exception):
                await self.remove(ctx)

    def _sandbox_envs(self, access_token: str | None) -> dict[str, str]:
        """The sandbox's env vars from envd (set at create, after this kernel started)."""
        if not self.envd_envs_url:
            return {}
        req = urllib.request.Request(self.envd_envs_url)
        if access_token:
            req.add_header("X-Access-Token", access_token)
        try:
            with urllib.request.urlopen(req, timeout=2) as resp:
                data = json.loads(resp.read())
        except Exception as exc:
            log.debug("no sandbox env vars from envd: %s", exc)
            return {}
        return {str(k): str(v) for k, v in data.items()} if isinstance(data, dict) else {}

    async def _hidden(self, ctx: Context, code: str) -> None:
        client = self._clients[ctx.id]
        msg_id = client.execute(code, silent=True, store_history=False)
        await self._wait_idle(client, msg_id)

    @staticmethod
    async def _wait_idle(client: Any, msg_id: str) -> None:
        while True:
            try:
                msg = await client.get_iopub_msg(timeout=KEEPALIVE_S)
            except queue.Empty:
                continue
            if msg.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            if msg["msg_type"] == "status" and msg["content"].get("execution_state") == "idle":
                return

    async def execute(
        self, ctx: Context, code: str, envs: dict[str, str] | None,
        access_token: str | None = None,
    ) -> AsyncIterator[dict[str, Any]]:
        """Run ``code`` in ``ctx``; yield the lines to stream, ``end_of_execution`` last."""
        lines: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        task = asyncio.create_task(self._run(ctx, code, envs or {}, access_token, lines))
        finished = False
        try:
            while True:
                try:
                    line = await asyncio.wait_for(lines.get(), KEEPALIVE_S)
                except TimeoutError:
                    yield {"type": "keepalive"}
                    continue
                if line is None:
                    finished = True
                    break
                yield line
            await task
        finally:
            if not finished:
                # The client went away (or the response was cancelled): stop the cell so the
                # next run is not stuck behind it; the task ends once the kernel is idle.
                log.info("execution in %s abandoned: interrupting the kernel", ctx.id)
                task.add_done_callback(_log_task_error)
                with contextlib.suppress(Exception):
                    await ctx.manager.interrupt_kernel()
        yield {"type": "end_of_execution"}

    async def _run(
        self, ctx: Context, code: str, envs: dict[str, str], access_token: str | None,
        lines: asyncio.Queue[dict[str, Any] | None],
    ) -> None:
        try:
            async with ctx.lock:
                client = self._clients.get(ctx.id)
                if client is None:
                    lines.put_nowait({"type": "error", "name": "ContextNotFound",
                                      "value": f"context {ctx.id} was removed", "traceback": ""})
                    return
                # One hidden cell before the code: the sandbox's env vars (first run of the
                # context; they stay) and this run's (put back after it).
                cells = []
                if not ctx.sandbox_envs_loaded:
                    ctx.sandbox_envs_loaded = True
                    sandbox_envs = await asyncio.to_thread(self._sandbox_envs, access_token)
                    if sandbox_envs:
                        cells.append(_permanent_env_code(ctx.language, sandbox_envs))
                setup = _env_code(ctx.language, envs, restore=False) if envs else None
                cells.append(setup)
                hidden = "\n".join(c for c in cells if c)
                if hidden:
                    await self._hidden(ctx, hidden)
                try:
                    await self._stream(ctx, client, code, lines)
                finally:
                    if setup:
                        restore = _env_code(ctx.language, envs, restore=True)
                        if restore:
                            await self._hidden(ctx, restore)
        finally:
            lines.put_nowait(None)

    async def _stream(
        self, ctx: Context, client: Any, code: str,
        lines: asyncio.Queue[dict[str, Any] | None],
    ) -> None:
        msg_id = client.execute(code, allow_stdin=False, stop_on_error=True,
                                store_history=not self.warming)
        while True:
            try:
                msg = await client.get_iopub_msg(timeout=1.0)
            except queue.Empty:
                if ctx.restarting or not await ctx.manager.is_alive():
                    lines.put_nowait({
                        "type": "error", "name": "ContextRestarting",
                        "value": "Context was restarted", "traceback": "",
                    })
                    return
                continue
            if msg.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "execute_input":
                lines.put_nowait({"type": "number_of_executions",
                                  "execution_count": content.get("execution_count")})
            elif kind == "stream":
                name = "stderr" if content.get("name") == "stderr" else "stdout"
                lines.put_nowait({"type": name, "text": content.get("text", ""),
                                  "timestamp": _timestamp(msg)})
            elif kind in ("execute_result", "display_data"):
                lines.put_nowait(result_line(content.get("data", {}),
                                             main=kind == "execute_result"))
            elif kind == "error":
                lines.put_nowait({
                    "type": "error", "name": content.get("ename", ""),
                    "value": content.get("evalue", ""),
                    "traceback": "\n".join(content.get("traceback", [])),
                })
            elif kind == "status" and content.get("execution_state") == "idle":
                return


def _log_task_error(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.warning("abandoned execution failed: %r", task.exception())
