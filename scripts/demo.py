"""`make run`'s demo: the unmodified E2B Python SDK against a running aenv server.

Configured only through E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY (scripts/run.sh sets
them). Creates a microVM sandbox from `base`, runs and streams a command, writes and reads a
file, shows `aenv sandbox ls`, and kills the sandbox.
"""

import subprocess
import sys
import time

from e2b import Sandbox

t0 = time.monotonic()
sbx = Sandbox.create("base", metadata={"demo": "make-run"})
print(f"demo: sandbox {sbx.sandbox_id} ready in {time.monotonic() - t0:.1f} s")
try:
    result = sbx.commands.run(
        "echo kernel $(uname -r); echo guest ip $(ip -4 -o addr show eth0 | awk '{print $4}');"
        " for i in 1 2 3; do echo tick $i; sleep 0.2; done",
        on_stdout=lambda chunk: [print(f"  stdout | {line}") for line in chunk.splitlines()],
    )
    print(f"demo: command exited {result.exit_code}")
    sbx.files.write("/home/user/hello.txt", "hello from the host\n")
    print(f"demo: read back {sbx.files.read('/home/user/hello.txt')!r}")
    print("demo: /home/user has", sorted(e.name for e in sbx.files.list("/home/user")))
    subprocess.run([sys.prefix + "/bin/aenv", "sandbox", "ls"], check=False)
finally:
    sbx.kill()
    print(f"demo: sandbox {sbx.sandbox_id} killed")
