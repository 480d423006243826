"""`oelm doctor` from outside: a check that fails is reported failed with its error and fix and the exit status is 1,
a check that does not apply says why, and --json holds every check with its status, reason and figures.

The checks run in this process (the quick ones take seconds); the full doctor (minutes) is left to the chapter's
flagged cell and to people on GPU machines."""
from __future__ import annotations
import json, shutil, sys
from pathlib import Path

import pytest
import torch

import oelm_nb.app.doctor as D
from oelm_nb.app.cli import main

FIELDS = {'name', 'status', 'seconds', 'summary', 'reason', 'error', 'fix', 'figures', 'warning'}


def bad_kernel(root: Path) -> Path:
    "A JUPYTER_PATH whose kernel `python3` starts a Python that does not exist."
    k = root / 'jupyter' / 'kernels' / 'python3'
    k.mkdir(parents=True)
    (k / 'kernel.json').write_text(json.dumps({'argv': ['/nonexistent/bin/python', '-m', 'ipykernel_launcher', '-f',
                                                        '{connection_file}'], 'display_name': 'x', 'language': 'python'}))
    return root / 'jupyter'


def test_quick_doctor_in_a_corrupt_environment_fails_those_checks_and_exits_1(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv('OMP_NUM_THREADS', 'eight')  # OpenMP ignores it: the user believes the threads are set
    monkeypatch.setenv('JUPYTER_PATH', str(bad_kernel(tmp_path)))  # papermill's python3 is not this environment
    out = tmp_path / 'doctor.json'
    assert main(['doctor', '--quick', '--device', 'cpu', '--json', str(out)]) == 1
    rep = json.loads(out.read_text())
    checks = {c['name']: c for c in rep['checks']}
    assert list(checks) == list(D.QUICK) and all(set(c) == FIELDS for c in checks.values())
    torch_c, kernel = checks['torch'], checks['kernel']
    assert torch_c['status'] == 'failed' and "OMP_NUM_THREADS='eight' is not a positive integer" in torch_c['error']
    assert torch_c['fix'].startswith('unset OMP_NUM_THREADS') and torch_c['figures']['OMP_NUM_THREADS'] == 'eight'
    assert kernel['status'] == 'failed' and 'starts /nonexistent/bin/python' in kernel['error']
    assert 'ipykernel install --sys-prefix --name python3' in kernel['fix']
    assert kernel['figures']['argv0'] == '/nonexistent/bin/python' and kernel['figures']['kernel_prefix'] is None
    rest = [c for n, c in checks.items() if n not in ('torch', 'kernel')]
    assert all(c['status'] == 'ok' and c['summary'] and c['figures'] and not c['error'] for c in rest), rest
    assert checks['train-steps']['figures']['oelm-freeze/float32']['losses'][-1] < \
        checks['train-steps']['figures']['oelm-freeze/float32']['losses'][0]
    assert rep['counts'] == {'ok': len(D.QUICK) - 2, 'failed': 2, 'skipped': 0} and rep['quick'] is True
    assert Path(rep['scratch']).is_dir()  # kept for a look when a check failed
    shutil.rmtree(rep['scratch'])
    table = capsys.readouterr().out
    assert '5 ok, 2 failed, 0 skipped' in table and 'fix: unset OMP_NUM_THREADS' in table


@pytest.mark.parametrize('fit, error', [
    (lambda *a, **k: ([2.0, 2.1, 2.2], [0.1] * 3), 'gpt in float32: the loss did not fall on a fixed batch (2.0000 -> 2.2000)'),
    (lambda *a, **k: ([2.0, float('nan')], [0.1] * 2), 'gpt in float32: a loss is not finite ([2.0, nan])'),
    (lambda *a, **k: (_ for _ in ()).throw(RuntimeError('CUDA error: an illegal memory access')),
     'RuntimeError: CUDA error: an illegal memory access'),
], ids=['loss-rises', 'loss-not-finite', 'step-raises'])
def test_a_broken_training_step_fails_its_check_with_the_error(monkeypatch, fit, error):
    monkeypatch.setattr(D, 'fixed_batch_fit', fit)
    rep = D.doctor(only=['train-steps'], device='cpu')
    (c,) = rep.checks
    assert (c.status, rep.exit_status) == ('failed', 1) and error in c.error and c.fix and not c.summary
    shutil.rmtree(rep.scratch)


def test_a_papermill_batch_that_fails_is_reported_with_its_output_and_the_command(tmp_path, monkeypatch):
    monkeypatch.setattr(D, 'small_corpus', lambda m: tmp_path)
    monkeypatch.setattr(D, 'papermill_batch_command', lambda out, data, device: [
        sys.executable, '-c', 'import sys; print("[oelm run] FAILED runs: gpt-s0", file=sys.stderr); sys.exit(1)'])
    c = D.run_check('papermill-batch', D.check_papermill_batch, D.Machine(torch.device('cpu'), tmp_path))
    assert c.status == 'failed' and c.error.startswith('Problem: oelm run exited with 1')
    assert 'FAILED runs: gpt-s0' in c.error and 'run it by hand' in c.fix
    assert c.figures['returncode'] == 1 and c.figures['report_bytes'] is None


@pytest.mark.skipif(torch.cuda.is_available(), reason='with a CUDA device these checks run')
def test_cuda_only_checks_are_skipped_with_the_reason(tmp_path, capsys):
    out = tmp_path / 'doctor.json'
    assert main(['doctor', '--check', 'cvfp-phase2', '--check', 'nf4-teacher', '--json', str(out)]) == 0
    checks = json.loads(out.read_text())['checks']
    assert [c['name'] for c in checks] == ['cvfp-phase2', 'nf4-teacher']
    for c in checks:
        assert c['status'] == 'skipped' and c['reason'].startswith('no CUDA device: ') and not c['error'], c
    assert '0 ok, 0 failed, 2 skipped' in capsys.readouterr().out


def test_help_names_every_check_and_the_quick_ones(capsys):
    with pytest.raises(SystemExit) as e: main(['doctor', '--help'])
    text = ' '.join(capsys.readouterr().out.split())  # argparse wraps lines
    assert e.value.code == 0 and text.startswith('usage: oelm doctor')
    assert f"only {', '.join(D.QUICK)}" in text and f"{', '.join(D.CHECKS)} (default: all)" in text
