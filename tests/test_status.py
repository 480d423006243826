"""`oelm status`: the table of a batch's runs, read from the run directories while a live process trains one of them."""
from __future__ import annotations
import json, subprocess, sys, textwrap, time
from pathlib import Path

from oelm_nb.status import batch_status, format_status
from cli_helpers import run_oelm


def write(p: Path, obj):
    p.parent.mkdir(parents=True, exist_ok=True); p.write_text(json.dumps(obj))


def metrics(run: Path, steps, val_every: int = 10):
    run.mkdir(parents=True, exist_ok=True)
    (run / 'metrics.jsonl').write_text(''.join(json.dumps({'step': s, 'tokens': 256 * s, 'train_loss': 6 - s / 100, 'tokens_per_s': 1000.0,
                                                          **({'val_loss': 6.2 - s / 100} if s % val_every == 0 else {})}) + '\n' for s in steps))


TRAINER = textwrap.dedent('''
    import json, sys, time
    from pathlib import Path
    from oelm_nb.rundir import run_lock
    run = Path(sys.argv[1])
    with run_lock(run):
        with open(run / 'metrics.jsonl', 'a') as f:
            for s in range(1, 31):
                f.write(json.dumps({'step': s, 'tokens': 256 * s, 'train_loss': 6 - s / 100, 'tokens_per_s': 1000.0}) + '\\n'); f.flush()
        (run / 'ready').write_text('')
        time.sleep(600)
''')


def test_status_of_completed_running_failed_blocked_and_pending_runs(tmp_path):
    b = tmp_path / 'batch'
    write(b / 'batch.json', {'study': 'pca', 'variants': ['baseline', 'pca-k8', 'lowrank-k8'], 'seeds': [0, 1],
                             'plan': {'baseline': {'upstream': []}, 'pca-k8': {'upstream': ['baseline']}, 'lowrank-k8': {'upstream': []}},
                             'jobs': {'baseline-s0': '1001', 'lowrank-k8-s0': '1005'}})
    for name in ('baseline-s0', 'baseline-s1', 'pca-k8-s0', 'pca-k8-s1', 'lowrank-k8-s0', 'lowrank-k8-s1'):
        write(b / name / 'config.json', {'train': {'max_steps': 100}})
    metrics(b / 'baseline-s0', range(1, 101)); write(b / 'baseline-s0' / 'summary.json', {'status': 'completed'})
    metrics(b / 'baseline-s1', range(1, 21)); write(b / 'baseline-s1' / 'summary.json', {'status': 'failed', 'error': 'TrainingDiverged: loss nan at step 21\nmore'})
    (b / 'pca-k8-s0').mkdir(exist_ok=True)
    write(b / 'lowrank-k8-s0' / 'job.json', {'backend': 'slurm', 'job_id': '1005'})
    (b / 'lowrank-k8-s1' / 'summary.json').write_text('{"status": "compl')  # cut off mid-write
    trainer = subprocess.Popen([sys.executable, '-c', TRAINER, str(b / 'pca-k8-s0')])
    try:
        t0 = time.time()
        while not (b / 'pca-k8-s0' / 'ready').exists():
            assert time.time() - t0 < 60 and trainer.poll() is None, 'the trainer did not start'
            time.sleep(0.1)
        res = run_oelm('status', str(b), timeout=120)
        assert res.returncode == 0, res.stderr
        rows = {l.split()[0]: l for l in res.stdout.splitlines()[2:]}
        assert res.stdout.splitlines()[0] == f'batch {b}: 6 runs: 2 pending, 1 running, 1 completed, 1 failed, 1 blocked'
        assert rows['baseline-s0'].split()[1:4] == ['completed', '1001', '100/100'] and '5.000' in rows['baseline-s0']
        assert rows['baseline-s1'].split()[1] == 'failed' and 'TrainingDiverged: loss nan at step 21' in rows['baseline-s1'] and 'more' not in rows['baseline-s1']
        assert rows['pca-k8-s0'].split()[1:4] == ['running', '-', '30/100'] and ' 18s ' in rows['pca-k8-s0']  # 70 steps x 256 tokens at 1,000 tokens/s
        assert rows['pca-k8-s1'].split()[1] == 'blocked' and 'upstream' in rows['pca-k8-s1']
        assert rows['lowrank-k8-s0'].split()[1:3] == ['pending', '1005'] and 'job 1005 submitted, not started' in rows['lowrank-k8-s0']
        assert rows['lowrank-k8-s1'].split()[1] == 'pending' and 'summary.json unreadable' in rows['lowrank-k8-s1']
        assert 'None' not in res.stdout and 'nan' not in res.stdout.replace('loss nan', '')
    finally:
        trainer.kill(); trainer.wait()
    row = {r['run']: r for r in batch_status(b)}['pca-k8-s0']  # the process is gone: the run waits to be resumed
    assert row['state'] == 'pending' and 'interrupted at step 30' in row['note'] and row['eta_s'] is None


def test_status_refuses_what_is_not_a_batch(tmp_path):
    res = run_oelm('status', str(tmp_path / 'none'), timeout=120)
    assert res.returncode == 2 and 'no such directory' in res.stderr and 'Traceback' not in res.stderr
    res = run_oelm('status', str(tmp_path), timeout=120)
    assert res.returncode == 2 and 'no batch.json' in res.stderr and '--out directory' in res.stderr
    (tmp_path / 'batch.json').write_text('[1, 2]')
    res = run_oelm('status', str(tmp_path), timeout=120)
    assert res.returncode == 2 and 'not a JSON object' in res.stderr
    assert format_status([], tmp_path).endswith('no runs planned yet')
