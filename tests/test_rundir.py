"""Run directories you can trust, through `oelm run`: one writer per batch and per run, children that die with the
runner, resume and skip only into the same configuration, an appended batch.json, and flags refused before anything
runs (issue 13)."""
from __future__ import annotations
import json, os, signal, subprocess, sys, time
from pathlib import Path

import psutil
import pytest
from oelm_nb.studies.qk_freeze.study import QK_TRAIN
import torch
from cli_helpers import TIMEOUT, oelm_cmd as oelm, oelm_inline, oelm_main, run_oelm, read_json, tiny_args

from oelm_nb.lab.spec import resolve_spec
from oelm_nb.lab.run import prepare_run
from oelm_nb.base.rundir import parse_run_name
from oelm_nb.base.rundir import RunMismatch, read_workers, run_lock

pytestmark = pytest.mark.slow  # batches and processes end to end: `make test` runs them, `make test-fast` does not


def metric_steps(run_dir: Path) -> list[int]:
    return [json.loads(l)['step'] for l in (run_dir / 'metrics.jsonl').read_text().splitlines() if l.strip()]


def assert_steps_clean(out: Path, last: int):
    "Every run's metrics.jsonl: strictly increasing steps (no duplicate, none out of order) ending at `last`."
    runs = [d for d in out.iterdir() if d.is_dir() and parse_run_name(d.name)]
    assert runs, f'no run directories in {out}'
    for d in runs:
        steps = metric_steps(d)
        assert steps == sorted(set(steps)), f'{d.name}: duplicate or out-of-order steps {steps}'
        assert steps[-1] == last, f'{d.name}: ends at step {steps[-1]}, not {last}'


def wait_for(pred, what: str, proc: subprocess.Popen | None = None, timeout: float = TIMEOUT, log: Path | None = None):
    deadline = time.time() + timeout
    while not pred():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f'oelm run ended before {what}:\n{log.read_text() if log else ""}')
        assert time.time() < deadline, f'timed out waiting for {what}'
        time.sleep(0.2)


def procs_mentioning(path: Path) -> list[int]:
    "Live processes whose command line or working directory is inside `path`."
    out = []
    for p in psutil.process_iter(['pid', 'cmdline', 'cwd', 'status']):
        try:
            if p.info['status'] == psutil.STATUS_ZOMBIE: continue
            text = ' '.join(p.info['cmdline'] or []) + ' ' + (p.info['cwd'] or '')
        except (psutil.Error, TypeError): continue
        if str(path) in text and p.info['pid'] != os.getpid(): out.append(p.info['pid'])
    return out


# ====================================================================== two writers, one batch
CONTESTED_STEPS = 40  # the second `oelm run` is refused about 2 s after the first took its run's lock; the run takes longer than that


@pytest.fixture(scope='module')
def contested(tmp_path_factory):
    "A first `oelm run` that trains gpt-s0 while a second one on the same --out is started."
    out = tmp_path_factory.mktemp('contested') / 'batch'
    args = ('run', 'qk-freeze', '--variants', 'gpt', '--seeds', '0', '--no-report', '--out', str(out), *tiny_args(CONTESTED_STEPS))
    log = out.parent / 'first.log'
    with open(log, 'w') as f:
        first = subprocess.Popen(oelm(*args), stdout=f, stderr=subprocess.STDOUT)
        wait_for(lambda: (out / 'gpt-s0' / '.lock.json').exists(), 'the first run to take its lock', first, log=log)
        second = oelm_main(*args)  # in-process: the first `oelm run`, a process, holds the lock
        rc = first.wait(TIMEOUT)
    return out, args, first.pid, rc, second, log.read_text()


def test_a_second_oelm_run_on_one_out_is_refused_naming_the_holder(contested):
    out, args, pid, rc, second, first_log = contested
    assert second.returncode == 2, second.stdout + second.stderr
    assert 'batch directory' in second.stderr and f'pid {pid} ' in second.stderr and 'Traceback' not in second.stderr
    assert rc == 0, first_log
    assert_steps_clean(out, CONTESTED_STEPS)
    assert read_json(out / 'gpt-s0' / 'summary.json')['status'] == 'completed'
    assert len(read_json(out / 'batch.json')['invocations']) == 1  # the refused call recorded nothing


def test_resume_or_skip_with_another_configuration_is_refused_and_restart_sets_aside(contested):
    out, args, *_ = contested
    # the rules of resume, skip and --restart, in-process (the process boundary is the fixture's, above)
    res = oelm_inline(*args, '--set', 'train.lr=0.5')
    assert res.returncode == 2, res.stdout + res.stderr
    assert f"gpt-s0: train.lr: {QK_TRAIN['tiny']['lr']} -> 0.5" in res.stderr and '--restart' in res.stderr, res.stderr
    assert len(read_json(out / 'batch.json')['invocations']) == 1

    same = oelm_inline(*args)  # the same configuration again: skipped, and recorded as another invocation
    assert same.returncode == 0 and 'gpt-s0: already completed, skipped' in same.stdout, same.stdout + same.stderr
    b = read_json(out / 'batch.json')
    assert len(b['invocations']) == 2 and b['invocations'][-1]['statuses'] == {'gpt-s0': 'completed'}

    fresh = oelm_inline(*args, '--set', 'train.lr=0.004', '--restart', '--steps', '8')  # a short retrain is enough here
    assert fresh.returncode == 0, fresh.stdout + fresh.stderr
    assert 'gpt-s0: --restart, moved to gpt-s0.replaced-1' in fresh.stdout
    assert read_json(out / 'gpt-s0.replaced-1' / 'config.json')['train']['lr'] == QK_TRAIN['tiny']['lr']  # the old run is kept
    assert read_json(out / 'gpt-s0' / 'config.json')['train']['lr'] == 0.004
    b = read_json(out / 'batch.json')
    assert [i['restart'] for i in b['invocations']] == [False, False, True]
    assert b['overrides']['train.lr'] == 0.004 and b['invocations'][0]['overrides'].get('train.lr') is None
    fp = read_json(out / 'gpt-s0' / 'summary.json')['fingerprint']
    assert b['invocations'][-1]['fingerprints'] == {'gpt-s0': fp} and fp != b['invocations'][0]['fingerprints']['gpt-s0']


def test_a_run_directory_refuses_another_seed_and_a_second_writer(tmp_path):
    "From Python (a notebook): prepare_run refuses a directory trained with another seed; `oelm train` refuses a locked run."
    spec = resolve_spec('qk-freeze', 'gpt', 'tiny', 0, 4, str(tmp_path / 'gpt-s0'))
    (tmp_path / 'gpt-s0').mkdir()
    spec.save_json(tmp_path / 'gpt-s0' / 'config.json')
    other = resolve_spec('qk-freeze', 'gpt', 'tiny', 1, 4, str(tmp_path / 'gpt-s0'))
    with pytest.raises(RunMismatch, match=r'train\.seed: 0 -> 1'): prepare_run(other)
    with run_lock(tmp_path / 'gpt-s0'):
        res = run_oelm('train', '--config', str(tmp_path / 'gpt-s0' / 'config.json'))
    assert res.returncode == 2 and f'pid {os.getpid()} ' in res.stderr and 'Traceback' not in res.stderr, res.stderr


# ====================================================================== killing the runner alone
def test_killing_oelm_alone_stops_its_trainer_and_a_rerun_continues_cleanly(tmp_path):
    out = tmp_path / 'killed'
    # killed at step 20 or soon after (a checkpoint at step 10 and 20 each), 40 steps before the run would finish
    args = ('run', 'qk-freeze', '--variants', 'oelm', '--seeds', '0', '--no-report', '--out', str(out), *tiny_args(60), '--set', 'train.eval_every=10')
    run = out / 'oelm-s0'
    log = tmp_path / 'first.log'
    with open(log, 'w') as f:
        proc = subprocess.Popen(oelm(*args), stdout=f, stderr=subprocess.STDOUT)  # same process group: only it is killed
        try: wait_for(lambda: (run / 'metrics.jsonl').exists() and metric_steps(run)[-1] >= 20, 'step 20', proc, log=log)
        finally:
            proc.send_signal(signal.SIGKILL); proc.wait()
    workers = [w['pid'] for w in read_workers(run)]
    assert workers, 'the trainer did not record itself as working under the runner'
    wait_for(lambda: not procs_mentioning(out), 'the orphaned papermill child and kernel to stop', timeout=30)
    stopped_at = metric_steps(run)[-1]
    assert stopped_at < 60, 'the run finished before the runner was killed'
    time.sleep(2)
    assert metric_steps(run)[-1] == stopped_at, 'something still writes the run after its runner was killed'

    res = oelm_inline(*args)  # the kill was the process boundary; the resume is the runner's rule, here in-process
    assert res.returncode == 0, res.stdout + res.stderr
    assert 'oelm-s0: resumed from step' in res.stdout, res.stdout
    assert_steps_clean(out, 60)


# ====================================================================== flags refused up front
@pytest.mark.parametrize('flags, message', [
    (('--seeds', '0', '0', '--jobs', '2'), '[0] more than once'),
    (('--seeds', '-1'), "'-1' is not a non-negative integer"),
    (('--steps', '0'), 'not a positive integer'),
    (('--set', 'out_dir=/tmp/elsewhere'), 'use --out'),
    (('--set', 'name=gpt'), 'use --variants'),
    (('--set', 'study=pca'), 'use the STUDY argument'),
    (('--set', 'data_dir=/tmp/d'), 'data_dir is not set with --set'),
    (('--set', 'train.seed=3'), 'use --seeds'),
    (('--set', 'train.max_steps=50'), 'use --steps'),
    (('--set', 'model=5'), 'one field at a time'),
    (('--gpus', '0'), 'sees no CUDA GPU'),
    (('--set', 'train.batch_size=1000000'), 'batch_size=1000000'),
    (('--data', '/nonexistent/corpus.txt'), '/nonexistent/corpus.txt'),
])
def test_flags_a_batch_cannot_honour_are_refused_before_anything_runs(tmp_path, capsys, flags, message):
    "In-process through `oelm_nb.app.cli.main` (the console script's exit status and one-line error: test_cli)."
    from oelm_nb.app.cli import main
    if '--gpus' in flags and torch.cuda.is_available(): pytest.skip('this machine has CUDA')
    out = tmp_path / 'never'
    try: rc = main(['run', 'qk-freeze', '--variants', 'gpt', '--out', str(out), *flags])
    except SystemExit as e: rc = e.code  # argparse's own type errors
    std = capsys.readouterr()
    assert rc == 2, std.out + std.err
    assert message in std.err and 'error:' in std.err and 'Traceback' not in std.err, std.err
    assert not out.exists(), f'a refused call left {sorted(p.name for p in out.iterdir())} behind'


def test_the_corpus_with_fewer_names_is_a_new_data_version_and_old_runs_keep_their_identity(tmp_path):
    """Issue 47: a run recorded before `data.n_names` existed is the same run as one at the default 3,000 names (same
    fingerprint, same prepared data fingerprint), and the Q/K study's 64-name corpus is a different one, named in the
    difference a rerun of an old batch is refused with."""
    from oelm_nb.base.core import DataConfig
    from oelm_nb.base.rundir import config_diff, fingerprint
    from oelm_nb.data.corpus import _fingerprint
    from oelm_nb.lab.study import get_study
    new = resolve_spec(get_study('qk-freeze'), 'gpt', 'tiny', 0, None).to_dict()
    old = json.loads(json.dumps(new)); del old['data']['n_names']  # as recorded before the field existed
    at_default = json.loads(json.dumps(old)); at_default['data']['n_names'] = 3000
    assert new['data']['n_names'] == 64 and fingerprint(old) == fingerprint(at_default) != fingerprint(new)
    assert ('data.n_names', '<absent>', 64) in config_diff(old, new) and not config_diff(old, at_default)
    assert _fingerprint(DataConfig(vocab_size=512), 'synthetic', []) == _fingerprint(
        DataConfig(vocab_size=512, n_names=3000), 'synthetic', []) != _fingerprint(
        DataConfig(vocab_size=512, n_names=64), 'synthetic', [])
