"""Budgets from one run: a study's batch with `train.budgets` trains each (variant, seed) once at its longest budget and
each shorter budget as a branch run that cools down from the longer run's stable phase (`TrainConfig.budgets`,
`lab.spec.branch_spec`, `lab.run.branch_start`). The subject is the lab, so the study is the toy (not qk-freeze)."""
from __future__ import annotations
import math
from dataclasses import replace
from unittest import mock

import pytest

from oelm_nb.base.metrics import read_metrics
from oelm_nb.base.rundir import read_json
from oelm_nb.lab.spec import resolve_spec
from oelm_nb.lab.run import train_run
from oelm_nb.lab.study import SMALL_CORPUS
from oelm_nb.train.trainer import Trainer
from shared_runs import shared_batch, completed, copy_batch, _train, inline_batch

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
    from oelm_nb.lab.runner import run_study
    from oelm_nb.lab.execute import execute_inline
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


# ---------------------------------------------------------------------------------------------- answers per budget
def qk_ladder(root, ratio: dict, seeds=(0, 1, 2, 3), tokens_per_step: int = 2048):
    """A Q/K batch written by hand: gpt, oelm and oelm-freeze at budgets 400, 600, 800 (the longest the trunks);
    oelm-freeze's val PPL is gpt's times ratio[budget] (+1% per seed), oelm's gpt's + 1%."""
    from fake_runs import fake_batch
    runs = {}
    for B in (400, 600, 800):
        for arm in ('gpt', 'oelm', 'oelm-freeze'):
            scale = {'gpt': 1.0, 'oelm': 1.01, 'oelm-freeze': ratio[B]}[arm]
            runs[arm if B == 800 else f'{arm}@{B}'] = (lambda s, B=B, scale=scale: {
                'status': 'completed', 'steps': B, 'tokens': B * tokens_per_step,
                'best_val_ppl': 3.0 * scale * (1 + 0.01 * s), 'recall_acc': 0.5})
    return fake_batch(root, 'qk-freeze', runs, seeds=seeds)


def test_answers_json_has_every_budget_and_whether_each_gap_closes(tmp_path):
    from oelm_nb.lab.render import write_answers
    from oelm_nb.lab.study import get_study
    import json
    out = qk_ladder(tmp_path / 'b', {400: 1.5, 600: 1.3, 800: 1.2})
    assert write_answers(out, get_study('qk-freeze'))
    recs = {a['qid']: a for a in json.loads((out / 'answers.json').read_text())['answers']}
    for qid in ('H2@400', 'H2@600', 'H4@400', 'H4@600'):
        assert type(recs[qid]['steps']) is int and recs[qid]['tokens'] == recs[qid]['steps'] * 2048
    assert (recs['H4']['steps'], recs['H4']['tokens']) == (800, 800 * 2048) and 'H4@800' not in recs
    for qid in ('H2-trend', 'H4-trend'):
        t = recs[qid]
        assert t['verdict'] == 'supported' and t['n'] == 4 and t['estimate'] < 0 and t['low'] < t['high'] < 0
        assert t['p'] < 0.001 and (t['side'], t['test']) == ('less', 't-test (paired)') and t['sides'].startswith('one-sided')
        assert 'exact sign-flip p = 0.0625' in t['method']  # the exact test of the same claim, at its 4-seed floor
    assert recs['H4-trend']['estimate'] == pytest.approx((math.log(1.2) - math.log(1.5)) / math.log2(2), rel=0.2)


def test_a_gap_that_widens_is_not_said_to_close(tmp_path):
    from oelm_nb.report.tables import load_runs
    from oelm_nb.studies.qk_freeze.answers import qk_answers
    a = {x.qid: x for x in qk_answers(load_runs(qk_ladder(tmp_path / 'b', {400: 1.1, 600: 1.2, 800: 1.35})))}
    assert a['H4-trend'].verdict == 'rejected' and a['H4-trend'].value > 0
    line = next(c for c in a['H4-trend'].caveats if c.startswith('H4-trend:'))
    assert 'would not reach' in line or 'off by' in line, line


def test_a_batch_of_one_budget_says_the_trend_needs_a_ladder(tmp_path):
    from oelm_nb.report.tables import load_runs
    from oelm_nb.studies.qk_freeze.answers import qk_answers
    from fake_runs import fake_batch
    out = fake_batch(tmp_path / 'b', 'qk-freeze', {v: (lambda s: {'status': 'completed', 'steps': 600, 'tokens': 1,
                                                                 'best_val_ppl': 3.0 + s}) for v in ('gpt', 'oelm', 'oelm-freeze')},
                     seeds=(0, 1))
    a = {x.qid: x for x in qk_answers(load_runs(out))}
    assert a['H4-trend'].verdict == 'no data' and 'at 2 or more budgets' in a['H4-trend'].method
    assert a['H2'].steps == 600


@pytest.mark.parametrize('n', [4, 8])
def test_the_slope_interval_covers_and_claims_closing_rarely_when_flat(n):
    from oelm_nb.report.evidence import simulate_slopes
    flat, closing = simulate_slopes(n, 0.0, batches=10_000), simulate_slopes(n, -0.1, batches=10_000, rng_seed=1)
    assert 0.94 <= flat['coverage'] <= 0.96 and 0.94 <= closing['coverage'] <= 0.96
    assert flat['closes'] <= 0.025 + 0.004  # one-sided at 2.5%: a flat gap is said to close at most that often
    # power against a gap closing by 0.1 per doubling (seed sd 0.1, run noise 0.05): measured 0.49 at 4 seeds, 0.93 at 8
    assert closing['closes'] > {4: 0.4, 8: 0.85}[n]


def test_oelm_status_lists_the_branches(ladder, capsys):
    from oelm_nb.app.cli import main
    main(['status', str(ladder)])
    out = capsys.readouterr().out
    assert 'depth-1@8-s0' in out and 'completed' in out and '8/8' in out


def test_the_budgets_flag_sets_the_ladder_and_the_steps():
    import argparse
    from oelm_nb.app.cli import run_flags
    from oelm_nb.lab.study import get_study
    from oelm_nb.base.core import ConfigError
    ns = argparse.Namespace(set=None, loggers=None, init_from=None, budgets=[800, 400, 600], steps=None, variants=None)
    _, overrides, _ = run_flags(get_study('toy'), ns)
    assert overrides == {'train.budgets': [400, 600, 800]} and ns.steps == 800  # the schedule stays the preset's
    with pytest.raises(ConfigError, match='--steps 700 with --budgets 400 600 800'):
        run_flags(get_study('toy'), argparse.Namespace(set=None, loggers=None, init_from=None, budgets=[400, 600, 800],
                                                        steps=700, variants=None))


def test_under_cosine_each_budget_is_a_run_of_its_own(tmp_path):
    out = inline_batch(tmp_path / 'b', 'toy', variants=['depth-1'], overrides={**LADDER, 'train.schedule': 'cosine'})
    cfg = read_json(out / 'depth-1@8-s0' / 'config.json')
    assert 'branch_of' not in cfg and cfg['train']['schedule'] == 'cosine' and cfg['train']['max_steps'] == 8
    assert not (out / 'depth-1-s0' / 'branch_points').exists()
    assert read_json(out / 'batch.json')['plan']['depth-1@8']['upstream'] == []  # no trunk to wait for
    assert read_json(out / 'depth-1@8-s0' / 'summary.json')['steps'] == 8
