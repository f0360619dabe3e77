"""``QemuVM.send_fd`` hands a descriptor to QEMU under both event loops the server may run
on. uvicorn picks uvloop when it is installed, and qemu.qmp's own ``send_fd_scm`` fails
there ('PseudoSocket' has no '_sock'): every snapshot of a confined VM did. The peer is a
stand-in QMP server on a unix socket that records the descriptor it receives; no VM."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import threading
from pathlib import Path

import pytest
import uvloop
from qemu.qmp import QMPClient

from aenv.runtime.kvm import AccelChoice
from aenv.runtime.qemu import QemuVM
from aenv.runtime.vmm_process import VMMProcess


def fake_qmp(path: Path, received: list[bytes]) -> threading.Thread:
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(str(path))
    srv.listen(1)

    def serve() -> None:
        conn, _ = srv.accept()
        srv.close()
        with conn:
            conn.sendall(json.dumps({"QMP": {"version": {"qemu": {"micro": 0, "minor": 2,
                                     "major": 7}, "package": ""}, "capabilities": []}})
                         .encode() + b"\r\n")
            decoder, buf = json.JSONDecoder(), ""
            while True:
                data, fds, _, _ = socket.recv_fds(conn, 4096, 4)
                if not data:
                    return
                for fd in fds:  # the descriptor's file: read what the test wrote to it
                    os.lseek(fd, 0, os.SEEK_SET)
                    received.append(os.read(fd, 64))
                    os.close(fd)
                buf += data.decode()
                while buf.strip(" \r\n"):  # qemu.qmp sends objects with no separator
                    try:
                        msg, end = decoder.raw_decode(buf.lstrip(" \r\n"))
                    except ValueError:
                        break  # incomplete: wait for more
                    buf = buf.lstrip(" \r\n")[end:]
                    conn.sendall(json.dumps({"return": {}, "id": msg.get("id")}).encode()
                                 + b"\r\n")

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return t


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_send_fd_reaches_qemu_under_either_loop(tmp_path, loop) -> None:
    path = tmp_path / "qmp.sock"
    received: list[bytes] = []
    server = fake_qmp(path, received)
    payload = tmp_path / "state"
    payload.write_bytes(b"the descriptor's file")

    async def main() -> None:
        qmp = QMPClient("test")
        await qmp.connect(str(path))
        me = VMMProcess(os.getpid(), pidfd=os.pidfd_open(os.getpid()))  # stands in for QEMU
        vm = QemuVM(vm_id="t", workdir=tmp_path, accel=AccelChoice("tcg", "test"),
                    process=me, qmp=qmp, started_at=0.0)
        fd = os.open(payload, os.O_RDONLY)
        try:
            vm.send_fd(fd)
            await qmp.execute("query-status")  # the byte with the fd precedes a command
        finally:
            os.close(fd)
            await qmp.disconnect()
            me.abandon()

    if loop == "uvloop":
        uvloop.run(main())
    else:
        asyncio.run(main())
    server.join(5)
    assert received == [b"the descriptor's file"]
