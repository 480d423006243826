"""`oelm_nb.lab.status` from outside: the table of a batch's runs, read from its run directories while a live process
trains one of them, without taking a lock or writing a file; what is not a batch, and damaged files, say so."""
from __future__ import annotations
import json, subprocess, sys, textwrap, time
from pathlib import Path

import pytest

from oelm_nb.base.core import ConfigError
from oelm_nb.lab.status import batch_status, format_status, run_state, show_status


def write(p: Path, obj):
    p.parent.mkdir(parents=True, exist_ok=True); p.write_text(json.dumps(obj))


def record(s: int, val_every: int = 10) -> dict:
    "A metrics record of step `s`: 256 tokens a step, 10 steps a second."
    return {'step': s, 'tokens': 256 * s, 'train_loss': 6 - s / 100, 'tokens_per_s': 2560.0, 'elapsed_s': s / 10,
            **({'val_loss': 6.2 - s / 100} if s % val_every == 0 else {})}


def metrics(run: Path, steps, val_every: int = 10):
    run.mkdir(parents=True, exist_ok=True)
    (run / 'metrics.jsonl').write_text(''.join(json.dumps(record(s, val_every)) + '\n' for s in steps))


def snapshot(d: Path) -> dict:
    "Every file under `d` with its size and modification time."
    return {str(p.relative_to(d)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(d.rglob('*'))}


TRAINER = textwrap.dedent('''
    import json, sys, time
    from pathlib import Path
    from oelm_nb.base.rundir import run_lock
    run = Path(sys.argv[1])
    with run_lock(run):
        with open(run / 'metrics.jsonl', 'a') as f:
            for s in range(1, 31):
                f.write(json.dumps({'step': s, 'tokens': 256 * s, 'train_loss': 6 - s / 100, 'tokens_per_s': 2560.0, 'elapsed_s': s / 10}) + '\\n')
                f.flush()
        (run / 'ready').write_text('')
        time.sleep(600)
''')


@pytest.fixture
def batch(tmp_path) -> Path:
    """A PCA batch: baseline-s0 completed, baseline-s1 failed (so pca-k8-s1 is blocked), pca-k8-s0 not started yet,
    lowrank-k8-s0 queued as a job, lowrank-k8-s1 with a summary cut off mid-write."""
    b = tmp_path / 'batch'
    write(b / 'batch.json', {'study': 'pca', 'preset': 'tiny', 'variants': ['baseline', 'pca-k8', 'lowrank-k8'], 'seeds': [0, 1],
                             'plan': {'baseline': {'overrides': {}, 'upstream': []}, 'pca-k8': {'overrides': {}, 'upstream': ['baseline']},
                                      'lowrank-k8': {'overrides': {}, 'upstream': []}},
                             'invocations': [], 'jobs': {'baseline-s0': '1001', 'lowrank-k8-s0': '9999'}})
    for name in ('baseline-s0', 'baseline-s1', 'pca-k8-s0', 'pca-k8-s1', 'lowrank-k8-s0', 'lowrank-k8-s1'):
        write(b / name / 'config.json', {'train': {'max_steps': 100}})
    metrics(b / 'baseline-s0', range(1, 101)); write(b / 'baseline-s0' / 'summary.json', {'status': 'completed', 'best_val_ppl': 181.3})
    metrics(b / 'baseline-s1', range(1, 21))
    write(b / 'baseline-s1' / 'summary.json', {'status': 'failed', 'error': 'TrainingDiverged: loss exploded at step 21\nTraceback (most recent call last)'})
    write(b / 'lowrank-k8-s0' / 'job.json', {'backend': 'slurm', 'job_id': '1005', 'submitted': '2026-11-24T10:00:00+0000'})
    (b / 'lowrank-k8-s1' / 'summary.json').write_text('{"status": "compl')
    return b


def test_status_of_completed_running_failed_blocked_and_pending_runs(batch):
    run = batch / 'pca-k8-s0'
    trainer = subprocess.Popen([sys.executable, '-c', TRAINER, str(run)])
    try:
        t0 = time.time()
        while not (run / 'ready').exists():
            assert time.time() - t0 < 60 and trainer.poll() is None, 'the trainer did not start'
            time.sleep(0.1)
        before = snapshot(batch)
        rows = {r['run']: r for r in batch_status(batch)}
        shown = []
        show_status(batch, out=shown.append)
        assert snapshot(batch) == before, 'status wrote into the batch'

        assert list(rows) == ['baseline-s0', 'baseline-s1', 'pca-k8-s0', 'pca-k8-s1', 'lowrank-k8-s0', 'lowrank-k8-s1']  # plan order
        r = rows['baseline-s0']
        assert (r['state'], r['job'], r['step'], r['max_steps'], r['eta_s']) == ('completed', '1001', 100, 100, None)
        assert r['train_loss'] == pytest.approx(5.0) and r['val_loss'] == pytest.approx(5.2) and r['tokens_per_s'] == 2560.0
        assert r['updated'] and r['updated_ago'].endswith('s ago')
        assert rows['baseline-s1']['state'] == 'failed' and rows['baseline-s1']['note'] == 'TrainingDiverged: loss exploded at step 21'
        r = rows['pca-k8-s0']
        assert (r['state'], r['step'], r['max_steps'], r['val_loss']) == ('running', 30, 100, None) and r['note'] == f'pid {trainer.pid}'
        assert r['eta_s'] == pytest.approx(7.0)  # 70 steps at 10 steps/s
        assert rows['pca-k8-s1']['state'] == 'blocked' and rows['pca-k8-s1']['note'] == 'upstream run(s) baseline-s1 did not complete'
        r = rows['lowrank-k8-s0']  # the run's job.json comes before batch.json's 'jobs'
        assert (r['state'], r['job'], r['step'], r['note']) == ('pending', '1005', None, 'job 1005 submitted, not started')
        assert rows['lowrank-k8-s1']['state'] == 'pending' and rows['lowrank-k8-s1']['note'] == 'summary.json is not valid JSON'

        text = shown[0]
        lines = text.splitlines()
        assert lines[0] == f'batch {batch} (study pca, preset tiny): 6 runs: 1 completed, 1 running, 1 failed, 1 blocked, 2 pending'
        assert lines[1].split()[:4] == ['run', 'state', 'job', 'step']
        table = {l.split()[0]: l for l in lines[2:]}
        assert table['baseline-s0'].split()[1:7] == ['completed', '1001', '100/100', '5.000', '5.200', '2,560']
        assert table['pca-k8-s0'].split()[1:8] == ['running', '-', '30/100', '5.700', '-', '2,560', '7s']
        assert 'Traceback' not in text and 'None' not in text and 'nan' not in text.lower()
    finally:
        trainer.kill(); trainer.wait()
    r = {r['run']: r for r in batch_status(batch)}['pca-k8-s0']  # killed: its lock record stays, naming a dead process
    assert (r['state'], r['eta_s'], r['note']) == ('pending', None, 'interrupted at step 30; resumes from its last checkpoint')


def test_what_is_not_a_batch_is_refused_with_the_fix(tmp_path):
    with pytest.raises(ConfigError, match='no such directory; give the --out directory of an `oelm run`'): batch_status(tmp_path / 'none')
    with pytest.raises(ConfigError, match='no batch.json; give the --out directory'): show_status(tmp_path)
    for content, why in [('[1, 2]', 'batch.json is not a JSON object'), ('{"variants": ["a"], "se', 'batch.json is not valid JSON'),
                         (json.dumps({'variants': ['../../etc'], 'seeds': [0]}), "'variants' is ['../../etc'], not a list of variant names"),
                         (json.dumps({'variants': ['gpt'], 'seeds': ['0']}), "'seeds' is ['0'], not a list of integers")]:
        (tmp_path / 'batch.json').write_text(content)
        with pytest.raises(ConfigError) as e: batch_status(tmp_path)
        assert why in str(e.value), (content, str(e.value))
    write(tmp_path / 'batch.json', {'variants': [], 'seeds': []})
    assert format_status(batch_status(tmp_path), tmp_path) == f'batch {tmp_path}: no runs planned yet'
    with pytest.raises(ConfigError, match='a number above 0'): show_status(tmp_path, watch=0)


def test_damaged_or_odd_files_are_shown_not_raised(tmp_path):
    b = tmp_path / 'b'
    write(b / 'batch.json', {'study': 'qk-freeze', 'variants': ['gpt', 'oelm', 'gauss'], 'seeds': [0], 'plan': [], 'jobs': {'gpt-s0': {'id': 1}}})
    run = b / 'gpt-s0'; run.mkdir(parents=True)
    (run / 'metrics.jsonl').write_text('[1, 2]\n{"step": true, "train_loss": NaN, "tokens_per_s": Infinity}\n\x00\xff garbage\n'
                                       f'{{"step": {10 ** 400}, "train_loss": 1e999}}\n{{"step": 7, "train_lo')
    write(run / 'config.json', {'train': [100]}); write(run / 'job.json', {'job_id': {'x': 1}})
    write(run / 'summary.json', {'status': 'failed', 'error': ['not', 'a', 'string']})
    write(b / 'oelm-s0' / 'summary.json', {'status': 'completed'}); (b / 'oelm-s0' / '.running').write_text('123')  # its notebook was cut short
    write(b / 'gauss-s0' / '.lock.json', {'pid': 1, 'host': 'node-07', 'started': '2026-11-24T10:00:00+00:00'})  # a SLURM job on a node
    rows = batch_status(b)
    assert [r['state'] for r in rows] == ['failed', 'pending', 'running']
    assert rows[0]['job'] is None and rows[0]['step'] is None and rows[0]['train_loss'] is None and rows[0]['max_steps'] is None
    assert rows[2]['note'] == 'pid 1 on host node-07' and rows[2]['eta_s'] is None
    text = format_status(rows, b)
    assert 'None' not in text and 'nan' not in text.lower() and 'inf' not in text.lower()
    write(run / 'summary.json', {'status': 'failed', 'error': 'not started: upstream run(s) teacher-s0 did not complete'})
    assert run_state(run) == 'blocked'


def test_the_latest_validation_loss_is_found_from_the_end_of_a_long_file(tmp_path):
    run = tmp_path / 'b' / 'gpt-s0'
    metrics(run, range(1, 40_001), val_every=5000)  # ~5 MB: validation every 5,000 steps, the last at step 40,000
    write(run / 'config.json', {'train': {'max_steps': 50_000}})
    write(tmp_path / 'b' / 'batch.json', {'variants': ['gpt'], 'seeds': [0]})
    with open(run / 'metrics.jsonl', 'a') as f:
        for s in range(40_001, 44_001): f.write(json.dumps(record(s, val_every=10 ** 9)) + '\n')
    r = batch_status(tmp_path / 'b')[0]
    assert r['step'] == 44_000 and r['val_loss'] == pytest.approx(6.2 - 400)


def test_watch_stops_when_nothing_can_change_and_on_ctrl_c(batch):
    shown = []
    def ctrl_c_on_third(text):
        shown.append(text)
        if len(shown) == 3: raise KeyboardInterrupt
    rows = show_status(batch, watch=0.01, out=ctrl_c_on_third)
    assert len(shown) == 3 and len(rows) == 6 and 'Ctrl-C stops watching, not the batch' in shown[0]  # lowrank-k8-s0 waits for its job
    for name in ('pca-k8-s0', 'lowrank-k8-s0', 'lowrank-k8-s1'): write(batch / name / 'summary.json', {'status': 'completed'})
    shown = []
    rows = show_status(batch, watch=0.01, out=shown.append)  # every run has ended: one table, and it returns
    assert len(shown) == 1 and 'Ctrl-C' not in shown[0] and [r['state'] for r in rows].count('completed') == 4
