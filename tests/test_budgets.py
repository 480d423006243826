"""Budgets from one run: a study's batch with `train.budgets` trains each (variant, seed) once at its longest budget and
each shorter budget as a branch run that cools down from the longer run's stable phase (`TrainConfig.budgets`,
`lab.spec.branch_spec`, `lab.run.branch_start`). The subject is the lab, so the study is the toy (not qk-freeze)."""
from __future__ import annotations
from dataclasses import replace
from unittest import mock

import pytest

from oelm_nb.base.metrics import read_metrics
from oelm_nb.base.rundir import read_json
from oelm_nb.lab.spec import resolve_spec
from oelm_nb.lab.run import train_run
from oelm_nb.lab.study import SMALL_CORPUS
from oelm_nb.train.trainer import Trainer
from shared_runs import shared_batch, completed, copy_batch, _train

LADDER = {'train.budgets': [8, 12], 'train.schedule': 'wsd', 'train.dtype': 'float32', 'model.dropout': 0.1}


@pytest.fixture(scope='module')
def ladder(tmp_path_factory):
    "The toy study at budgets 8 and 12 (cooldown 20%: the branch starts at step 6), seed 0, both depths."
    return completed(shared_batch(tmp_path_factory, 'toy-budgets', 'toy', overrides=LADDER))


def numbers(run_dir) -> list[tuple]:
    return [(r['step'], r['train_loss'], r.get('val_loss')) for r in read_metrics(run_dir)]


def test_a_batch_with_budgets_trains_a_branch_per_shorter_budget(ladder):
    runs = sorted(p.name for p in ladder.iterdir() if p.is_dir() and p.name != 'data')
    assert runs == ['depth-1-s0', 'depth-1@8-s0', 'depth-2-s0', 'depth-2@8-s0']
    trunk, branch = read_json(ladder / 'depth-1-s0' / 'summary.json'), read_json(ladder / 'depth-1@8-s0' / 'summary.json')
    assert (trunk['steps'], branch['steps']) == (12, 8)
    cfg = read_json(ladder / 'depth-1@8-s0' / 'config.json')
    assert cfg['branch_of'] == 'depth-1' and cfg['train']['max_steps'] == 8 and cfg['train']['budgets'] == [8, 12]
    assert (ladder / 'depth-1-s0' / 'branch_points' / 'step_0000006' / 'meta.json').exists()
    # the branch's history up to step 6 is its trunk's; after it, its own cooldown
    upto = lambda recs, a, b: [r for r in recs if a < r[0] <= b]
    br, tr = numbers(ladder / 'depth-1@8-s0'), numbers(ladder / 'depth-1-s0')
    assert upto(br, 0, 6) == upto(tr, 0, 6) and len(upto(br, 0, 6)) == 2
    assert [r[0] for r in upto(br, 6, 12)] == [8] and upto(br, 6, 8)[0][1] != [r for r in tr if r[0] == 9][0][1]
    b = read_json(ladder / 'batch.json')
    assert b['plan']['depth-2@8']['upstream'] == ['depth-2']
    assert set(b['invocations'][-1]['fingerprints']) == set(runs)


def test_a_branch_trains_the_numbers_of_a_run_of_its_budget_trained_alone(ladder, tmp_path):
    spec = resolve_spec('toy', 'depth-2', overrides={**SMALL_CORPUS, **LADDER}, out_dir=str(tmp_path / 'alone'),
                        data_dir=str(ladder / 'data'))
    spec = replace(spec, train=spec.train.replace(max_steps=8, budgets=()))
    train_run(spec, progress=False)
    assert numbers(tmp_path / 'alone') == numbers(ladder / 'depth-2@8-s0')


def test_a_branch_stopped_in_its_cooldown_resumes_to_the_same_numbers(ladder, tmp_path):
    out = copy_batch(ladder, tmp_path / 'b')
    branch = out / 'depth-1@8-s0'
    import shutil; shutil.rmtree(branch)
    fit = Trainer.fit
    with mock.patch.object(Trainer, 'fit', lambda self, resume=True, until=None: fit(self, resume, until=7)):
        rec = _train('toy', out, dict(variants=['depth-1@8'], overrides=LADDER))  # stops after step 7 of 8 (cooldown: 6-8)
    assert rec['failed'] == ['depth-1@8-s0']
    assert read_json(branch / 'summary.json')['status'] != 'completed'
    lines = []
    from oelm_nb.lab.runner import run_study, execute_inline
    run_study('toy', out_dir=out, seeds=[0], overrides={**SMALL_CORPUS, **LADDER}, execute=execute_inline, report=False,
              log=lines.append)
    assert any('depth-1@8-s0: resumed from step 7' in l for l in lines), lines
    assert numbers(branch) == numbers(ladder / 'depth-1@8-s0')


def test_a_branch_whose_trunk_trained_otherwise_is_refused(ladder, tmp_path):
    from oelm_nb.lab.run import branch_start
    from oelm_nb.base.rundir import RunMismatch
    out = copy_batch(ladder, tmp_path / 'b', 'checkpoints')
    spec = resolve_spec('toy', 'depth-1@8', overrides={**SMALL_CORPUS, **LADDER, 'train.lr': 1e-3},
                        out_dir=str(out / 'depth-1@8-s0'), data_dir=str(out / 'data'))
    with pytest.raises(RunMismatch, match=r"its trunk .*depth-1-s0 trained with other settings \(train.lr"):
        branch_start(spec)
