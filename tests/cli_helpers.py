"""What the suites that drive the `oelm` command from outside share: the command line, tiny-run flags, and readers
for the files a run leaves behind (JSON, JSON lines, the visible text of report.html)."""
from __future__ import annotations
import contextlib, html, io, json, re, subprocess, sys
from pathlib import Path

OELM = Path(sys.executable).with_name('oelm')
TIMEOUT = 420  # seconds for one `oelm run` on a loaded 2-core machine


def oelm_cmd(*args: str) -> list[str]:
    "The command line of the installed `oelm` console script (or the module where the script is missing)."
    return [str(OELM), *args] if OELM.exists() else [sys.executable, '-m', 'oelm_nb.app.cli', *args]


def run_oelm(*args: str, timeout: int = TIMEOUT) -> subprocess.CompletedProcess:
    "Run `oelm ARGS`, capturing its output."
    return subprocess.run(oelm_cmd(*args), capture_output=True, text=True, timeout=timeout)


def oelm_main(*args: str) -> subprocess.CompletedProcess:
    """`oelm ARGS` through `oelm_nb.app.cli.main` in this process, its exit status and output as `run_oelm` returns them.
    For commands that start no batch (help, params, data, sample, export, usage errors): no interpreter and no torch
    import to pay for. The console script itself (`sys.exit(main())`) is checked in a subprocess by test_cli."""
    from oelm_nb.app.cli import main
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try: rc = main(list(args))
        except SystemExit as e: rc = e.code if isinstance(e.code, int) else int(e.code is not None)
    return subprocess.CompletedProcess(['oelm', *args], rc, out.getvalue(), err.getvalue())


def oelm_inline(*args: str) -> subprocess.CompletedProcess:
    """`oelm ARGS` in this process, as `oelm_main`, with every run of a batch trained in-process (`execute.execute_inline`
    in place of one papermill execution each; the report, unless --no-report, is still rendered by papermill). For tests
    whose subject is what `oelm run` decides, writes and prints; the notebook and the process boundary have their own
    tests (test_runner's batch, test_rundir, test_cluster). One run at a time: runs in threads of one process would share
    torch's global random state."""
    from unittest import mock
    from oelm_nb.lab import runner, execute
    assert '--jobs' not in args and '--gpus' not in args, 'an in-process batch trains one run at a time on the CPU'
    with mock.patch.object(runner, 'execute_run', execute.execute_inline):
        return oelm_main(*args)


def tiny_args(steps: int = 4) -> list[str]:
    "`oelm run` flags for seconds-long runs: `steps` optimizer steps on a 300-story corpus with a 300-token vocabulary."
    from shared_runs import SMALL_CORPUS
    return ['--steps', str(steps), *(a for k, v in SMALL_CORPUS.items() for a in ('--set', f'{k}={v}'))]


def read_json(p):
    return json.loads(Path(p).read_text())


def read_jsonl(p) -> list:
    return [json.loads(line) for line in Path(p).read_text().splitlines() if line.strip()]


def html_text(path) -> str:
    "The visible text of an HTML page, whitespace collapsed."
    t = Path(path).read_text(encoding='utf-8', errors='replace')
    t = re.sub(r'<(style|script)\b.*?</\1>', ' ', t, flags=re.S)
    t = re.sub(r'<img[^>]*>', ' ', t)
    return re.sub(r'\s+', ' ', html.unescape(re.sub(r'<[^>]+>', ' ', t)))
