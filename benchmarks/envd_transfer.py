"""envd file transfer through the E2B SDK: upload and download throughput, and envd's memory.

Run: ``.venv/bin/python benchmarks/envd_transfer.py [--size-mib 256] [--repeat 3]``. Starts
its own envd on 127.0.0.1 and drives it with the real SDK in debug mode (no control plane).
The data is random, so it does not compress: the SDK asks for gzip on every download and
envd's adaptive encoder then sends stored blocks. Prints one JSON object: per phase the
throughput in MB/s (10^6 bytes) over the repeats, the CPU seconds spent by envd and by the
client process (which shows which side is the bottleneck), and envd's peak RSS during the
phase (VmHWM after resetting it). Client and envd share the machine's 2 cores, so expect
noise of tens of percent between runs.
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import Envd, emit


def _status_kib(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _reset_peak(pid: int) -> None:
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")


def measure(pid: int, size: int, repeat: int, run: Callable[[], None]) -> dict[str, object]:
    rates, envd_cpu, client_cpu, peak = [], [], [], 0
    for _ in range(repeat):
        _reset_peak(pid)
        c0, p0, t0 = _cpu_s(pid), time.process_time(), time.perf_counter()
        run()
        elapsed = time.perf_counter() - t0
        rates.append(size / elapsed / 1e6)
        envd_cpu.append(_cpu_s(pid) - c0)
        client_cpu.append(time.process_time() - p0)
        peak = max(peak, _status_kib(pid, "VmHWM"))
    return {
        "mb_per_s": {"p50": round(statistics.median(rates)), "min": round(min(rates)),
                     "max": round(max(rates))},
        "envd_cpu_s_p50": round(statistics.median(envd_cpu), 2),
        "client_cpu_s_p50": round(statistics.median(client_cpu), 2),
        "envd_peak_rss_mib": round(peak / 1024, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where envd writes the file")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("envd_transfer.py needs root (envd chowns files; /proc/<pid>/clear_refs)")
    size = args.size_mib << 20
    data = os.urandom(size)
    target = os.path.join(args.dir, f"aenv-bench-transfer-{os.getpid()}.bin")

    with Envd(init=False) as envd:
        assert envd.proc is not None
        pid = envd.proc.pid
        os.environ.update(E2B_DEBUG="true", E2B_API_KEY="e2b_" + "0" * 40, E2B_SANDBOX_URL=envd.url)
        from e2b import Sandbox

        sandbox = Sandbox.create()
        files = sandbox.files
        files.write(target, b"warm-up")
        baseline = _status_kib(pid, "VmRSS")

        def identity_download() -> None:
            with httpx.stream("GET", envd.url + "/files", params={"path": target},
                              headers={"Accept-Encoding": "identity"}, timeout=120) as r:
                for _ in r.iter_raw(1 << 20):
                    pass

        def stream_download() -> None:
            with files.read(target, format="stream") as stream:
                for _ in stream:
                    pass

        phases: dict[str, Callable[[], None]] = {
            "upload_sdk_multipart_bytes": lambda: files.write(target, data),
            "upload_sdk_octet_stream_bytes":
                lambda: files.write(target, data, use_octet_stream=True),
            "upload_sdk_octet_stream_file_object": lambda: files.write(target, io.BytesIO(data)),
            "download_sdk_bytes": lambda: files.read(target, format="bytes"),
            "download_sdk_stream": stream_download,
            "download_httpx_identity": identity_download,
        }
        try:
            results = {name: measure(pid, size, args.repeat, run) for name, run in phases.items()}
            assert os.path.getsize(target) == size
        finally:
            if os.path.exists(target):
                os.unlink(target)

    emit({
        "benchmark": "envd_transfer",
        "size_mib": args.size_mib,
        "repeat": args.repeat,
        "envd_baseline_rss_mib": round(baseline / 1024, 1),
        "phases": results,
    })


if __name__ == "__main__":
    main()
