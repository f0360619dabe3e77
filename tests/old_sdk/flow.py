"""Run by the oldest supported E2B Python SDK (2.7.0, its own venv): the v1 API generation.

2.7.0 creates with ``POST /sandboxes`` and connects with ``POST /sandboxes/{id}/connect``, and
is the first release that honours ``E2B_SANDBOX_URL``. Prints one JSON line of observations;
the pytest side decides what is right.
"""

from __future__ import annotations

import json

import e2b
from e2b import CommandExitException, Sandbox

out: dict = {"version": e2b.__version__ if hasattr(e2b, "__version__") else None}
sbx = Sandbox.create("base", metadata={"sdk": "old"}, timeout=120)
try:
    out["running"] = sbx.is_running()
    r = sbx.commands.run("echo hi; echo err >&2")
    out["stdout"], out["stderr"] = r.stdout, r.stderr
    streamed: list[str] = []
    sbx.commands.run("for i in 1 2 3; do echo $i; done", on_stdout=streamed.append)
    out["streamed"] = "".join(streamed)
    try:
        sbx.commands.run("exit 3")
    except CommandExitException as e:
        out["exit"] = e.exit_code
    bg = sbx.commands.run("sleep 600", background=True)
    out["bg_killed"] = sbx.commands.kill(bg.pid)
    out["whoami"] = sbx.commands.run("whoami", user="root").stdout
    out["env"] = sbx.commands.run("echo $X", envs={"X": "y"}, cwd="/tmp").stdout
    sbx.files.write("/home/user/d/a.txt", "old sdk")
    out["read"] = sbx.files.read("/home/user/d/a.txt")
    out["listed"] = [e.name for e in sbx.files.list("/home/user/d")]
    sbx.files.rename("/home/user/d/a.txt", "/home/user/d/b.txt")
    out["exists"] = [sbx.files.exists("/home/user/d/a.txt"), sbx.files.exists("/home/user/d/b.txt")]
    sbx.files.remove("/home/user/d")
    out["removed"] = not sbx.files.exists("/home/user/d")
    out["found"] = sbx.sandbox_id in [s.sandbox_id for s in Sandbox.list().next_items()]
    again = Sandbox.connect(sbx.sandbox_id)
    out["connected"] = again.commands.run("echo again").stdout
    sbx.set_timeout(60)
finally:
    out["killed"] = sbx.kill()
out["gone"] = not sbx.is_running()
print(json.dumps(out))
