"""Issue 61: what really kills a run, and what a run must never touch.

- a child killed by a signal (the out-of-memory killer's SIGKILL of the kernel) is an interruption: recorded with its
  signal and the step of the last checkpoint, resumed from there by the next `oelm run`;
- a moved or copied batch trains where it is now, never into the directory it came from;
- the data is part of a batch's identity by content: an edited corpus is refused, a `touch` is no change;
- a failure names the notebook's own exception and cell, not papermill's wrapper.

Only a kernel killed under papermill starts `oelm` as a process (the test finds the kernel among its children). A moved
and a copied batch rerun through `oelm_nb.app.cli.main` in this process, their notebooks executed by papermill as ever
(each notebook reads its run's config.json: the boundary these tests are about); the rest runs in-process.
"""
from __future__ import annotations
import hashlib, json, os, shutil, signal, subprocess, time
from pathlib import Path

import pytest
from oelm_nb.train.checkpoint import list_checkpoints
from cli_helpers import TIMEOUT, oelm_cmd as oelm, oelm_inline, oelm_main, read_json, read_jsonl, tiny_args
from shared_runs import SMALL_CORPUS, inline_batch


def tree_sums(d: Path) -> dict:
    "sha256 of every file under `d`, by relative path."
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.rglob('*')) if p.is_file()}


def numbers(run_dir: Path) -> list[tuple]:
    "(step, train loss, val loss) of each metrics.jsonl line: the numbers, not the times."
    return [(r['step'], r['train_loss'], r.get('val_loss')) for r in read_jsonl(run_dir / 'metrics.jsonl')]


# ====================================================================== 1. a killed kernel, then the batch moved
SETS = ['--set', 'train.ckpt_every=3', '--set', 'train.eval_every=3', '--set', 'train.dtype=float32']


@pytest.mark.slow
@pytest.mark.skipif(not Path('/proc/self/cwd').exists(), reason='needs /proc to find the kernel')
def test_a_killed_kernel_is_an_interruption_and_the_moved_batch_resumes_where_it_is(tmp_path):
    import psutil
    out, moved = tmp_path / 'orig', tmp_path / 'moved'
    args = ['run', 'qk-freeze', '--variants', 'gpt', '--seeds', '0', '--no-report', *tiny_args(12), *SETS]
    ckpts = out / 'gpt-s0' / 'checkpoints'
    # --jobs 2: one thread per run, as the in-process reference below trains (the same numbers, not merely close ones)
    proc = subprocess.Popen(oelm(*args, '--out', str(out), '--jobs', '2'), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.time() + TIMEOUT
        while not (ckpts.is_dir() and any(p.name.startswith('step_') for p in ckpts.iterdir())):
            assert proc.poll() is None, f'oelm run ended before its first checkpoint:\n{proc.communicate()}'
            assert time.time() < deadline, 'no checkpoint in time'
            time.sleep(0.05)
        kernel = next(k for k in psutil.Process(proc.pid).children(recursive=True) if 'ipykernel' in ' '.join(k.cmdline()))
        kernel.suspend()  # the run cannot finish before the kill reaches it
        kernel.send_signal(signal.SIGKILL)  # what the out-of-memory killer does
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None: os.killpg(proc.pid, signal.SIGKILL); proc.wait()
    s = read_json(out / 'gpt-s0' / 'summary.json')
    step = int(list_checkpoints(ckpts)[-1].name.removeprefix('step_'))
    assert proc.returncode == 1 and s['status'] == 'failed', stdout + stderr
    assert (s['resumable'], s['signal'], s['checkpoint_step']) == (True, 'SIGKILL', step), s
    assert f"the notebook's kernel was killed by SIGKILL; the next `oelm run` resumes from its last checkpoint, step {step}" \
           in stdout, stdout
    assert 'Executing notebook with kernel' not in stdout + s['error']

    shutil.move(out, moved)  # the rerun must train here, not into `out` (which its config.json names)
    res = oelm_main(*args, '--out', str(moved), '--jobs', '2')  # its notebook under papermill, as a batch trains
    assert res.returncode == 0, res.stdout + res.stderr
    assert f'gpt-s0: resumed from step {step}' in res.stdout and 'failed before' not in res.stdout, res.stdout
    assert 'the batch was moved or copied' in res.stdout, res.stdout
    assert not out.exists(), f'the rerun wrote into the old path: {sorted(p.name for p in out.rglob("*"))}'
    assert read_json(moved / 'gpt-s0' / 'config.json')['out_dir'] == str((moved / 'gpt-s0').resolve())
    ref = oelm_inline(*args, '--out', str(tmp_path / 'ref'))  # uninterrupted, in-process
    assert ref.returncode == 0, ref.stdout + ref.stderr
    got, want = numbers(moved / 'gpt-s0'), numbers(tmp_path / 'ref' / 'gpt-s0')
    assert [r[0] for r in got] == list(range(1, 13)) and got == want
    first = [r['elapsed_s'] for r in read_jsonl(moved / 'gpt-s0' / 'metrics.jsonl') if r['step'] <= step][-1]
    assert read_json(moved / 'gpt-s0' / 'summary.json')['wall_time_s'] > first  # both stretches count


# ====================================================================== 2. a copied batch leaves its original alone
@pytest.mark.slow
def test_a_copied_batch_reruns_in_the_copy_and_leaves_every_file_of_the_original_byte_identical(tmp_path):
    orig = inline_batch(tmp_path / 'orig', 'qk-freeze', variants=['gpt'], steps=4)  # its config.json names `orig`
    copy = shutil.copytree(orig, tmp_path / 'copy', symlinks=True)
    (copy / 'gpt-s0' / 'summary.json').unlink()  # cut off after training: its notebook is executed again
    before = tree_sums(orig)
    res = oelm_main('run', 'qk-freeze', '--variants', 'gpt', '--seeds', '0', '--no-report', '--out', str(copy), *tiny_args(4))
    assert res.returncode == 0, res.stdout + res.stderr
    assert f'gpt-s0: config.json named out_dir {orig.resolve() / "gpt-s0"}' in res.stdout, res.stdout
    assert 'the batch was moved or copied' in res.stdout, res.stdout
    assert read_json(copy / 'gpt-s0' / 'config.json')['out_dir'] == str((copy / 'gpt-s0').resolve())
    assert read_json(copy / 'gpt-s0' / 'summary.json')['status'] == 'completed'
    assert tree_sums(orig) == before


# ====================================================================== 3. a failure names the notebook's exception
def test_the_error_of_an_executed_notebook_names_type_message_and_cell(tmp_path):
    from oelm_nb.lab.execute import notebook_error
    nb = {'cells': [{'cell_type': 'code', 'source': ['# parameters\n', 'config = ""'], 'outputs': []},
                    {'cell_type': 'code', 'source': ['#| hide\n', 'spec, summary = run_in_notebook(config)\n'],
                     'outputs': [{'output_type': 'error', 'ename': 'ConfigError', 'evalue': 'bad n_head\nfix it'}]}]}
    (tmp_path / 'train_lm.ipynb').write_text(json.dumps(nb))
    assert notebook_error(tmp_path / 'train_lm.ipynb') == 'ConfigError (cell 2 of train_lm.ipynb): bad n_head\nfix it'
    for junk in ('[1, 2]', '{"cells": {"a": 1}}', '{"cells": [1, {"outputs": "x"}]}', 'not json'):
        (tmp_path / 'j.ipynb').write_text(junk)
        assert notebook_error(tmp_path / 'j.ipynb') is None, junk


@pytest.mark.parametrize('rc, stderr, nb_error, want', [
    (-9, 'Executing notebook with kernel: python3\n', None, dict(resumable=True, signal='SIGKILL')),
    (1, '[oelm] the kernel ended by signal 9\nDeadKernelError: Kernel died\n', None, dict(resumable=True, signal='SIGKILL')),
    (1, 'DeadKernelError: Kernel died\n', 'DeadKernelError (cell 3 of x.ipynb): Kernel died',
     dict(resumable=True, signal=None)),
    (1, 'Executing notebook with kernel: python3\n', 'ConfigError (cell 3 of x.ipynb): bad',
     dict(resumable=False, error='ConfigError (cell 3 of x.ipynb): bad')),
    (1, '', 'TrainingDiverged (cell 3 of x.ipynb): loss 1e9 at step 7', dict(resumable=False)),
    (1, '', 'OSError (cell 3 of x.ipynb): [Errno 28] No space left on device', dict(resumable=True)),
    (1, 'Executing notebook with kernel: python3\nValueError: boom\nExecuting notebook with kernel: python3\n', None,
     dict(resumable=False, error='ValueError: boom')),
    (0, 'Executing notebook with kernel: python3\n', None, dict(resumable=False)),
])
def test_a_child_that_died_resumes_and_a_run_that_raised_does_not(tmp_path, rc, stderr, nb_error, want):
    from oelm_nb.lab.execute import child_failure
    ck = tmp_path / 'checkpoints' / 'step_0000013'; ck.mkdir(parents=True); (ck / 'meta.json').write_text('{}')
    f = child_failure(rc, stderr, nb_error, tmp_path)
    assert {k: f.get(k) for k in want} == want, f
    assert 'Executing notebook with kernel' not in f['error']
    if f['resumable'] and 'signal' in f: assert f['checkpoint_step'] == 13 and 'resumes from its last checkpoint, step 13' in f['error']
    if not f['resumable']: assert 'a resume would repeat it' in f['not_resumable']
    if rc == 0: assert 'without writing a completed summary.json' in f['error']


def test_a_planted_error_shows_on_the_console_in_summary_json_and_in_oelm_status(tmp_path, monkeypatch):
    "The papermill child is replaced by one that leaves what papermill leaves when a cell raises: the runner's reading."
    from unittest import mock
    from oelm_nb.lab import runner, execute
    from oelm_nb.lab.status import run_row
    def child(cmd, env):
        nb_out = Path([a for a in cmd if a.endswith('.ipynb')][1])
        nb_out.write_text(json.dumps({'cells': [{'cell_type': 'code', 'source': 'spec, summary = run_in_notebook(config)',
            'outputs': [{'output_type': 'error', 'ename': 'PlantedError', 'evalue': 'planted in the notebook'}]}]}))
        return subprocess.CompletedProcess(cmd, 1, '', 'Executing notebook with kernel: python3\n'
                                                       'papermill.exceptions.PapermillExecutionError: \n')
    lines = []
    with mock.patch.object(execute, '_run_child', child):
        res = runner.run_study('qk-freeze', variants=['gpt'], seeds=[0], steps=2, out_dir=tmp_path / 'b', report=False,
                               overrides=SMALL_CORPUS,
                               log=lines.append)
    want = 'PlantedError (cell 1 of train_lm.ipynb): planted in the notebook'
    assert res.failed == ['gpt-s0']
    assert any(l.startswith('[oelm run] gpt-s0: FAILED after') and want in l for l in lines), lines
    s = read_json(tmp_path / 'b' / 'gpt-s0' / 'summary.json')
    assert s['error'].startswith(want) and s['resumable'] is False and 'repeat' in s['not_resumable'], s
    assert run_row(tmp_path / 'b' / 'gpt-s0')['note'].startswith(want)


# ====================================================================== 4. the data's identity is its content
@pytest.mark.slow
def test_an_edited_corpus_is_refused_in_one_line_and_a_touch_is_no_change(tmp_path):
    from oelm_nb.data.corpus import generate_stories
    corpus, out = tmp_path / 'corpus.txt', tmp_path / 'b'
    stories = [s.text for s in generate_stories(300, seed=1)]
    corpus.write_text('\n\n'.join(stories) + '\n')
    args = ['run', 'qk-freeze', '--variants', 'gpt', '--seeds', '0', '--data', str(corpus), '--no-report', '--out', str(out),
            *tiny_args(2)]
    assert (first := oelm_inline(*args)).returncode == 0, first.stdout + first.stderr
    data = tree_sums(out / 'data')

    st = corpus.stat(); os.utime(corpus, ns=(st.st_atime_ns, st.st_mtime_ns + 10**10))  # `touch`: a new mtime only
    again = oelm_inline(*args, '--seeds', '0', '1')
    assert again.returncode == 0 and 'gpt-s0: already completed, skipped' in again.stdout, again.stdout + again.stderr
    assert tree_sums(out / 'data') == data

    corpus.write_text('\n\n'.join(stories[:150] + [s.text for s in generate_stories(150, seed=7)]) + '\n')
    refused = oelm_inline(*args, '--seeds', '0', '1', '2')
    err = refused.stderr.strip().splitlines()
    assert refused.returncode == 2 and len(err) == 1, refused.stdout + refused.stderr
    assert f'{corpus.resolve()}: content changed (size ' in err[0] and 'another --out' in err[0] and '--restart' in err[0]
    assert tree_sums(out / 'data') == data and not (out / 'gpt-s2').exists()

    redone = oelm_inline(*args, '--seeds', '0', '1', '--restart')  # names every run: data prepared afresh, all retrained
    assert redone.returncode == 0, redone.stdout + redone.stderr
    assert 'data/ kept as data.replaced-1' in redone.stdout and tree_sums(out / 'data.replaced-1') == data
    assert read_json(out / 'data' / 'meta.json')['files'][0]['sha256'] == hashlib.sha256(corpus.read_bytes()).hexdigest()


# ====================================================================== 5. the smaller points
def test_sigterm_stops_the_batch_in_one_line_and_batch_json_records_it(tmp_path):
    import threading
    from oelm_nb.lab import runner
    def execute(job, batch, gpu_set, threads, log):  # the signal a job scheduler or `timeout` sends, while a run trains
        job.run_dir.mkdir(parents=True, exist_ok=True)  # as a run's first act
        os.kill(os.getpid(), signal.SIGTERM); time.sleep(0.3); return 'interrupted'
    assert threading.current_thread() is threading.main_thread()
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(runner.BatchInterrupted) as e:
        runner.run_study('qk-freeze', variants=['gpt'], seeds=[0], steps=2, out_dir=tmp_path / 'b', report=False,
                         overrides=SMALL_CORPUS, execute=execute, log=lambda s: None)
    assert str(e.value).startswith('interrupted (SIGTERM): gpt-s0 had no checkpoint yet; run the same command again')
    assert read_json(tmp_path / 'b' / 'batch.json')['invocations'][-1]['interrupted'] == 'SIGTERM'
    assert signal.getsignal(signal.SIGTERM) is before  # the handler is the batch's only


def test_a_validation_split_shorter_than_a_window_is_refused_once_before_any_run(tmp_path):
    from oelm_nb.lab import runner
    from oelm_nb.data.corpus import DataError
    started = []
    with pytest.raises(DataError, match=r"the val split holds [\d,]+ tokens, fewer than one window of variant 'gpt' needs "
                                        r"\(block_size \+ 1 = 513\).*--set model.block_size=\d+ or less"):
        runner.run_study('qk-freeze', variants=['gpt'], seeds=[0], steps=2, out_dir=tmp_path / 'b', report=False,
                         overrides={**SMALL_CORPUS, 'data.n_val_stories': 1, 'model.block_size': 512},
                         execute=lambda *a, **k: started.append(a) or 'completed', log=lambda s: None)
    assert not started


def test_a_full_disk_while_writing_a_checkpoint_names_the_fix(tmp_path, monkeypatch):
    import torch
    from safetensors import SafetensorError
    from oelm_nb.train import checkpoint as ck
    def full(*a, **k): raise SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, '
                                             'message: "No space left on device" })')
    monkeypatch.setattr(ck, 'save_file', full)
    with pytest.raises(ck.CheckpointError, match=r'step 3 failed: .*No space left on device.*Fix: free disk space in'):
        ck.save_checkpoint(tmp_path / 'checkpoints', 3, {'model': torch.nn.Linear(2, 2)}, None, {})
    assert not [p for p in (tmp_path / 'checkpoints').iterdir()]  # nothing half-written left
    from oelm_nb.lab.execute import resumable_error
    assert resumable_error('CheckpointError: writing the checkpoint of step 3 failed: ... No space left on device ...')


def test_sample_and_export_read_a_copied_batch_where_it_is(tmp_path_factory, tmp_path):
    "`oelm sample` and `oelm export` (through `load_run_model`) take the copy's own data, not the original's."
    from shared_runs import qk_freeze_batch
    from oelm_nb.lab.sample import load_run_model, run_codec
    src = qk_freeze_batch(tmp_path_factory)
    copy = shutil.copytree(src, tmp_path / 'copy', symlinks=True)
    assert read_json(copy / 'gpt-s0' / 'config.json')['out_dir'] == str((src / 'gpt-s0').resolve())  # as copied
    model, spec, ckpt = load_run_model(copy / 'gpt-s0', 'final', device='cpu')
    assert (spec.out_dir, spec.resolved_data_dir) == (str((copy / 'gpt-s0').resolve()), (copy / 'data').resolve())
    assert ckpt.resolve().is_relative_to(copy.resolve())
    assert run_codec(spec).encode('Once upon a time') is not None


def test_a_refusal_for_another_study_suggests_the_batch_own_runs(tmp_path_factory, tmp_path):
    "`oelm run pca` on a Q/K batch: the command it suggests is the Q/K batch's own, with the Q/K variants it has."
    import shlex
    from shared_runs import qk_freeze_batch
    from oelm_nb.lab.study import get_study
    copy = shutil.copytree(qk_freeze_batch(tmp_path_factory), tmp_path / 'qk', symlinks=True,
                           ignore=shutil.ignore_patterns('checkpoints'))
    res = oelm_main('run', 'pca', '--seeds', '0', '--out', str(copy), '--no-report', *tiny_args(2))
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and 'study: qk-freeze -> pca' in lines[0], res.stderr
    cmd = shlex.split(lines[0].split("Run it with the batch's own settings: ")[1].split(' ; ')[0])
    assert cmd[:3] == ['oelm', 'run', 'qk-freeze'], cmd
    variants = cmd[cmd.index('--variants') + 1].split(',')
    assert set(variants) == {'gpt', 'oelm-freeze'} and set(variants) <= set(get_study('qk-freeze').variants('tiny', 30, {}))
