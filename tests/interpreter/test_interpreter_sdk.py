"""The code-interpreter server (aenv/interpreter) on the host, driven by e2b-code-interpreter.

No VM: the server runs on a free loopback port with real ipykernel kernels, and the SDK's
``Sandbox`` is built around a ``ConnectionConfig`` whose ``sandbox_url`` is that port (the
SDK's ``_jupyter_url`` is ``get_sandbox_url(..., port=49999)``, which returns ``sandbox_url``
as it is when one is set, as with ``E2B_SANDBOX_URL``). Every call below is the SDK's own.
"""

from __future__ import annotations

import base64
import io
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("jupyter_client")
pytest.importorskip("ipykernel")
ci = pytest.importorskip("e2b_code_interpreter")

from e2b import ConnectionConfig  # noqa: E402
from e2b.exceptions import SandboxException, TimeoutException  # noqa: E402
from e2b_code_interpreter import Sandbox  # noqa: E402
from packaging.version import Version  # noqa: E402

from tests.conftest import PYTHON, ROOT, free_port, stop_process, wait_http  # noqa: E402


class Server:
    def __init__(self, home: Path, *extra: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.home = home
        self.log_path = home / "interpreter.log"
        self.log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [PYTHON, "-m", "aenv.interpreter", "--host", "127.0.0.1", "--port", str(self.port),
             "--cwd", str(home), "--envd-envs-url", "", "--log-level", "info", *extra],
            cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        self.kernel_pids: set[int] = set()
        wait_http(self.url + "/health", timeout=60, proc=self.proc)

    def stop(self) -> None:
        stop_process(self.proc, grace=15)
        self.log.close()
        for pid in self.kernel_pids:  # the kernels have their own sessions: never leak one
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = Server(tmp_path_factory.mktemp("interpreter"), "--preload", "import colorsys")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def sbx(server: Server) -> Sandbox:
    config = ConnectionConfig(api_key="e2b_" + "0" * 40, sandbox_url=server.url,
                              request_timeout=60)
    return Sandbox(sandbox_id="local", envd_version=Version("0.5.0"), envd_access_token=None,
                   sandbox_domain=None, connection_config=config)


def _pid(sbx: Sandbox, server: Server, **kw: object) -> int:
    pid = int(sbx.run_code("import os; os.getpid()", **kw).text)  # type: ignore[arg-type]
    server.kernel_pids.add(pid)
    return pid


def test_value_logs_and_execution_count(sbx: Sandbox, server: Server) -> None:
    _pid(sbx, server)
    first = sbx.run_code("print('out'); import sys; print('err', file=sys.stderr); 6 * 7")
    assert first.text == "42"
    assert first.logs.stdout == ["out\n"]
    assert first.logs.stderr == ["err\n"]
    assert first.error is None
    again = sbx.run_code("'hello'")
    assert again.text == "hello"  # one pair of quotes stripped, as E2B's server does
    assert again.execution_count == first.execution_count + 1
    assert sbx.run_code("x = 1").results == []


def test_preload_imports_without_names(sbx: Sandbox) -> None:
    ex = sbx.run_code("import sys; ('colorsys' in sys.modules, 'colorsys' in globals(), "
                      "'__aenv_preload' in globals())")
    assert ex.text == "(True, False, False)"


def test_rich_results(sbx: Sandbox) -> None:
    from PIL import Image

    ex = sbx.run_code(
        "import matplotlib\nmatplotlib.use('module://matplotlib_inline.backend_inline')\n"
        "%config InlineBackend.print_figure_kwargs = {'bbox_inches': None}\n"
        "import matplotlib.pyplot as plt\n"
        "fig = plt.figure(figsize=(4, 3), dpi=50)\nplt.plot([1, 2, 3], [3, 1, 2])\nplt.show()\n"
    )
    assert ex.error is None, ex.error
    pngs = [r for r in ex.results if r.png]
    assert len(pngs) == 1 and not pngs[0].is_main_result
    image = Image.open(io.BytesIO(base64.b64decode(pngs[0].png)))
    assert image.format == "PNG" and image.size == (200, 150)

    ex = sbx.run_code(
        "from IPython.display import display, HTML, Markdown, JSON, Latex\n"
        "display(HTML('<b>bold</b>'))\ndisplay(Markdown('# title'))\n"
        "display(Latex(r'$\\alpha$'))\ndisplay(JSON({'a': [1, 2]}))\n"
    )
    assert ex.error is None, ex.error
    html, md, latex, js = ex.results
    assert html.html == "<b>bold</b>"
    assert md.markdown == "# title"
    assert latex.latex == "$\\alpha$"
    assert js.json == {"a": [1, 2]}
    assert "html" in html.formats() and "json" in js.formats()


def test_charts_from_matplotlib_figures(sbx: Sandbox) -> None:
    """A shown figure's result carries chart data the SDK parses (its Chart classes)."""
    from e2b_code_interpreter.charts import BarChart, LineChart, ScatterChart, SuperChart

    ex = sbx.run_code(
        "import matplotlib\nmatplotlib.use('module://matplotlib_inline.backend_inline')\n"
        "import matplotlib.pyplot as plt\n"
        "plt.figure(); plt.plot([1, 2, 3], [3, 1, 2], label='sales')\n"
        "plt.title('T'); plt.xlabel('time (s)'); plt.ylabel('units'); plt.legend(); plt.show()")
    assert ex.error is None, ex.error
    line = next(r for r in ex.results if r.chart is not None)
    assert line.png and isinstance(line.chart, LineChart)
    c = line.chart
    assert (c.title, c.x_label, c.x_unit, c.y_label) == ("T", "time", "s", "units")
    assert [(e.label, e.points) for e in c.elements] == [("sales", [(1, 3), (2, 1), (3, 2)])]
    assert c.x_scale.value == "linear" and c.x_ticks

    ex = sbx.run_code(
        "fig, (a, b) = plt.subplots(1, 2)\n"
        "a.bar(['x', 'y'], [5, 7], label='n')\nb.scatter([1, 2], [4, 8])\nplt.show()")
    assert ex.error is None, ex.error
    sup = next(r.chart for r in ex.results if r.chart is not None)
    assert isinstance(sup, SuperChart)
    bar, scatter = sup.elements
    assert isinstance(bar, BarChart) and isinstance(scatter, ScatterChart)
    assert [(e.label, e.group, e.value) for e in bar.elements] == [("x", "n", 5), ("y", "n", 7)]
    assert scatter.elements[0].points == [(1, 4), (2, 8)]
    # a figure with nothing this reads: a png and no chart
    ex = sbx.run_code("plt.figure(); plt.show()")
    assert all(r.chart is None for r in ex.results)


def test_error(sbx: Sandbox) -> None:
    ex = sbx.run_code("def f():\n    raise ValueError('bad value')\nf()")
    assert ex.error is not None
    assert ex.error.name == "ValueError"
    assert ex.error.value == "bad value"
    assert "ValueError" in ex.error.traceback and "f()" in ex.error.traceback
    errors: list[str] = []
    sbx.run_code("undefined_name", on_error=lambda e: errors.append(e.name))
    assert errors == ["NameError"]


def test_callbacks_stream_while_the_cell_runs(sbx: Sandbox) -> None:
    seen: list[tuple[str, float]] = []
    start = time.monotonic()
    ex = sbx.run_code(
        "import sys, time\nprint('first', flush=True)\ntime.sleep(2)\n"
        "print('second', file=sys.stderr, flush=True)\n7",
        on_stdout=lambda m: seen.append(("out:" + m.line, time.monotonic() - start)),
        on_stderr=lambda m: seen.append(("err:" + m.line, time.monotonic() - start)),
        on_result=lambda r: seen.append(("result:" + str(r.text), time.monotonic() - start)),
    )
    done = time.monotonic() - start
    assert [name for name, _ in seen] == ["out:first\n", "err:second\n", "result:7"]
    # the first line came while the cell still slept, not with the rest at the end
    assert seen[0][1] < done - 1.5, (seen, done)
    assert ex.text == "7"


def test_envs_apply_to_one_run(sbx: Sandbox) -> None:
    ex = sbx.run_code("import os; os.environ['AENV_RUN_VAR']", envs={"AENV_RUN_VAR": "v 1"})
    assert ex.text == "v 1"
    assert sbx.run_code("import os; os.environ.get('AENV_RUN_VAR', 'unset')").text == "unset"


@pytest.mark.slow  # several seconds of waiting: left out of make test-fast
def test_timeout_interrupts_the_cell(sbx: Sandbox) -> None:
    start = time.monotonic()
    with pytest.raises(TimeoutException, match="Execution timed out"):
        sbx.run_code("import time; time.sleep(300)", timeout=2)
    assert time.monotonic() - start < 10
    # the server saw the client go and interrupted the kernel: the next cell is not stuck
    start = time.monotonic()
    assert sbx.run_code("1 + 1", timeout=20).text == "2"
    assert time.monotonic() - start < 10


def test_contexts_isolation_cwd_restart_remove(sbx: Sandbox, server: Server,
                                               tmp_path: Path) -> None:
    a_dir, b_dir = tmp_path / "a", tmp_path / "b"
    a_dir.mkdir()
    b_dir.mkdir()
    a = sbx.create_code_context(cwd=str(a_dir))
    b = sbx.create_code_context(language="python", cwd=str(b_dir))
    assert (a.language, a.cwd, b.cwd) == ("python", str(a_dir), str(b_dir))
    _pid(sbx, server, context=a)
    _pid(sbx, server, context=b)
    listed = [c.id for c in sbx.list_code_contexts()]
    assert listed[-2:] == [a.id, b.id]

    sbx.run_code("x = 'in a'", context=a)
    assert sbx.run_code("x", context=a).text == "in a"
    err = sbx.run_code("x", context=b).error
    assert err is not None and err.name == "NameError"
    assert sbx.run_code("import os; os.getcwd()", context=b).text == str(b_dir)
    # stdout of one context does not show up in another's run
    assert sbx.run_code("print('b only')", context=b).logs.stdout == ["b only\n"]

    sbx.restart_code_context(a)
    err = sbx.run_code("x", context=a).error
    assert err is not None and err.name == "NameError" and "'x' is not defined" in err.value
    assert sbx.run_code("import os; os.getcwd()", context=a).text == str(a_dir)
    _pid(sbx, server, context=a)

    sbx.remove_code_context(b)
    assert b.id not in [c.id for c in sbx.list_code_contexts()]
    with pytest.raises(SandboxException):
        sbx.run_code("1", context=b)
    sbx.remove_code_context(a)


def test_unknown_language_is_a_clear_error(sbx: Sandbox) -> None:
    with pytest.raises(SandboxException, match="no kernel for language 'cobol'"):
        sbx.run_code("DISPLAY 'x'", language="cobol")
    with pytest.raises(SandboxException, match="no kernel for language 'cobol'"):
        sbx.create_code_context(language="cobol")


def test_one_cell_at_a_time_per_context(sbx: Sandbox) -> None:
    ctx = sbx.create_code_context()
    out: dict[str, float] = {}

    def slow() -> None:
        sbx.run_code("import time; time.sleep(2)", context=ctx)
        out["slow"] = time.monotonic()

    t = threading.Thread(target=slow)
    t.start()
    time.sleep(0.7)
    assert sbx.run_code("'fast'", context=ctx).text == "fast"
    out["fast"] = time.monotonic()
    t.join()
    assert out["slow"] <= out["fast"]
    sbx.remove_code_context(ctx)


@pytest.mark.slow  # a server of its own: kernel start and warm-up, ~7 s
def test_warm_up_runs_a_cell_and_leaves_no_trace(tmp_path: Path) -> None:
    """--warm-up (the template's start command): /health waits for one cell sent through
    the server's own HTTP API; the user's first cell still is number 1, with ``_`` and
    ``Out`` empty, and ``_`` follows results afterwards."""
    s = Server(tmp_path, "--warm-up")
    try:
        assert "warmed up in" in s.log_path.read_text()
        config = ConnectionConfig(api_key="e2b_" + "0" * 40, sandbox_url=s.url)
        sbx = Sandbox(sandbox_id="local", envd_version=Version("0.5.0"), envd_access_token=None,
                      sandbox_domain=None, connection_config=config)
        first = sbx.run_code("import os; print(os.getpid()); repr(_), len(Out), 6 * 7")
        s.kernel_pids.add(int(first.logs.stdout[0]))
        assert (first.execution_count, first.text) == (1, '("\'\'", 0, 42)')
        again = sbx.run_code("_")
        assert again.text == first.text and again.execution_count == 2
    finally:
        s.stop()


@pytest.mark.slow  # a server of its own: kernel start, ~5 s
def test_stop_leaves_no_kernel(tmp_path: Path) -> None:
    s = Server(tmp_path)
    try:
        config = ConnectionConfig(api_key="e2b_" + "0" * 40, sandbox_url=s.url)
        sbx = Sandbox(sandbox_id="local", envd_version=Version("0.5.0"), envd_access_token=None,
                      sandbox_domain=None, connection_config=config)
        pids = {_pid(sbx, s), _pid(sbx, s, context=sbx.create_code_context())}
        assert len(pids) == 2
    finally:
        stop_process(s.proc, grace=15)
        s.log.close()
    deadline = time.monotonic() + 10
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = {p for p in pids if Path(f"/proc/{p}").exists()}
        time.sleep(0.1)
    for p in alive:
        os.kill(p, signal.SIGKILL)
    assert not alive, f"kernels {alive} outlived the server"
