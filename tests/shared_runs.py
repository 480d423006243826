"""Batches the suites share: each trained once per pytest session, in this process, and only read by the tests.

A papermill execution costs seconds of kernel start-up before its first step; `oelm_nb.lab.execute.execute_inline` runs a
batch's runs in-process with the same run directories, summaries and report. The process boundaries (papermill, the
`oelm` console script, kill and resume, detach, the lock's holder, torchrun, SLURM's local executor) are the subject of a
small named set of tests: test_runner (the papermill batch of the shared experiment notebook, kill and resume, torchrun),
test_rundir (the lock's holder, killing the runner alone), test_cluster (the local executor, detach and attach) and
test_cli (the console script). Every study's experiment notebook is the same three-cell skeleton (test_skeletons) over
`run_in_notebook` and `plot_run`, which those batches and test_skeletons execute. Every other test that trains calls the
library, and every test that only reads runs, reports, exports or verdicts uses a batch from here.

Under pytest-xdist the workers of one session share each batch through a lock file in the session's base temporary
folder: the first worker to ask trains it, the others wait and read. A test that changes a batch works on a copy.
"""
from __future__ import annotations
import fcntl, json, os, shutil, time, traceback
from pathlib import Path

from oelm_nb.lab.study import SMALL_CORPUS  # noqa: E402  (cli_helpers.tiny_args sets these on the command line)


def session_root(tmp_path_factory) -> Path:
    "The base temporary folder of this pytest session, shared by its xdist workers."
    root = tmp_path_factory.getbasetemp()
    return root.parent if os.environ.get('PYTEST_XDIST_WORKER') else root


def shared_batch(tmp_path_factory, name: str, study: str, **run_study_kwargs) -> tuple[Path, dict]:
    """`oelm_nb.lab.runner.run_study(study, ...)` with every run in-process, once per session under `name`.
    Returns (batch dir, record): record['log'] holds the lines `oelm run` would print, record['failed'] the failed runs,
    record['error'] the exception if the batch itself raised (the tests then fail with it, the batch is not retried)."""
    root = session_root(tmp_path_factory)
    out, done = root / name, root / f'{name}.result.json'
    with open(root / f'{name}.lock', 'w') as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists(): done.write_text(json.dumps(_train(study, out, run_study_kwargs)))
        return out, json.loads(done.read_text())


def _train(study: str, out: Path, kwargs: dict) -> dict:
    from oelm_nb.lab.runner import run_study
    from oelm_nb.lab.execute import execute_inline
    lines, t0 = [], time.time()
    kwargs = {'seeds': [0], 'report': False, **kwargs}
    kwargs['overrides'] = {**SMALL_CORPUS, **kwargs.get('overrides', {})}
    from unittest import mock
    from oelm_nb.lab import render
    try:
        with mock.patch.object(render, 'execute_report', execute_report_inline):  # session fixtures come before conftest's
            res = run_study(study, out_dir=out, execute=execute_inline, log=lines.append, **kwargs)
        return {'log': lines, 'failed': list(res.failed), 'error': None, 'seconds': time.time() - t0}
    except Exception as e:
        return {'log': lines, 'failed': [], 'error': f'{type(e).__name__}: {e}\n{traceback.format_exc()}', 'seconds': time.time() - t0}


def inline_batch(out: Path, study: str, **run_study_kwargs) -> Path:
    "A private batch of one test, trained in-process now (seed 0, no report, the small corpus); asserts that every run completed."
    return completed((out, _train(study, out, run_study_kwargs)))


def completed(batch: tuple[Path, dict]) -> Path:
    "The batch directory, after asserting that every run of the batch completed."
    out, rec = batch
    assert rec['error'] is None, f'the shared batch {out.name} raised:\n{rec["error"]}'
    assert not rec['failed'], f'runs failed in the shared batch {out.name}: {rec["failed"]}\n' + '\n'.join(rec['log'][-30:])
    return out


def copy_batch(src: Path, dst: Path, *ignore: str) -> Path:
    "A private copy of a shared batch for a test that changes it (`ignore`: glob patterns left out, e.g. 'checkpoints')."
    shutil.copytree(src, dst, symlinks=True, ignore=shutil.ignore_patterns(*ignore) if ignore else None)
    return dst


# ---------------------------------------------------------------------------------------------- the batches
def qk_freeze_batch(tmp_path_factory) -> Path:
    """qk-freeze gpt and oelm-freeze, seed 0, 30 steps, checkpoints and evaluations every 10 steps (steps 10, 20, 30 kept):
    the finished runs that `oelm sample` and `oelm export` read."""
    return completed(shared_batch(tmp_path_factory, 'shared-qk-freeze', 'qk-freeze', variants=['gpt', 'oelm-freeze'], steps=30,
                                  overrides={'train.ckpt_every': 10, 'train.keep_last': 5, 'train.eval_every': 10}))


PCA_KS = (16, 64)  # 64 = d of the tiny preset: PCA keeps every direction there


def pca_batch(tmp_path_factory) -> tuple[Path, dict]:
    "The PCA study's whole matrix at ks 16 and 64, seeds 0 and 1, 4 baseline steps in float32, with its report."
    return shared_batch(tmp_path_factory, 'shared-pca', 'pca', seeds=[0, 1], steps=4, options={'ks': list(PCA_KS)},
                        overrides={'train.dtype': 'float32'}, report=True)


# ---------------------------------------------------------------------------------------------- reports, in-process
def execute_report_inline(nb_in: Path, nb_out: Path, run_dir: Path) -> str | None:
    """`oelm_nb.lab.render.execute_report` without a kernel (`execute_inline_notebook` with the parameter `run_dir`). The
    conftest puts this in place for every in-process render; `oelm` started as a process (test_runner's batch, test_lab)
    still renders through papermill."""
    return execute_inline_notebook(nb_in, nb_out, run_dir, {'run_dir': str(run_dir)})


def execute_inline_notebook(nb_in: Path, nb_out: Path, cwd: Path, params: dict) -> str | None:
    """Notebook `nb_in` executed into `nb_out` as papermill would (in `cwd`, `params` injected after the cell tagged
    `parameters`), but by execnb's CaptureShell (the in-process shell nbdev_test uses) in a child forked from this
    process: the libraries this test process imported are not imported again (a papermill kernel spends about 6 of its
    12 s on imports), and nothing the notebook sets (the matplotlib backend, seaborn's theme, IPython's shell) reaches the
    next test. Returns None, or the notebook's error."""
    import multiprocessing as mp
    child = mp.get_context('fork').Process(target=_notebook_child, args=(str(nb_in), str(nb_out), str(cwd), params))
    child.start(); child.join()
    if child.exitcode == 0: return None
    from oelm_nb.lab.execute import notebook_error
    return notebook_error(Path(nb_out)) or f'the notebook process ended with exit code {child.exitcode}'


def _notebook_child(nb_in: str, nb_out: str, cwd: str, params: dict):
    ok = False
    try:
        from execnb.nbio import read_nb, write_nb, mk_cell
        from execnb.shell import CaptureShell
        os.chdir(cwd)
        nb = read_nb(nb_in)
        at = next(i for i, c in enumerate(nb.cells) if 'parameters' in c.get('metadata', {}).get('tags', []))
        nb.cells.insert(at + 1, mk_cell('# Parameters\n' + ''.join(f'{k} = {v!r}\n' for k, v in params.items())))
        shell = CaptureShell(mpl_format='png')
        try: shell.run_all(nb, exc_stop=True)
        except BaseException: pass  # the error is in the cell's outputs, as papermill leaves it
        else: ok = shell.exc is None
        write_nb(nb, nb_out)
    finally:
        os._exit(0 if ok else 1)  # no atexit handlers of the test process in the child
