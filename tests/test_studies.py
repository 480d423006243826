"""The study framework from outside: typed settings per study, run names, the registry, and the verdict functions of the
Q/K freeze and PCA studies on hand-made run directories (one seed, failed runs, missing metrics); every registered study
answers through the evidence kit."""
from __future__ import annotations
import json, math

import numpy as np
import pytest
from hypothesis import given, strategies as st_

from oelm_nb.base.core import ConfigError
from oelm_nb.lab.spec import resolve_spec
from oelm_nb.base.rundir import parse_run_name, run_name
from oelm_nb.report.tables import compare, load_runs
from oelm_nb.lab.study import studies, get_study, study_names
from oelm_nb.studies.qk_freeze.answers import hypotheses
from oelm_nb.studies.pca.study import ppl_table, recovery_table, recovery_verdict, pca_answers
from oelm_nb.report.evidence import Answer
from fake_runs import failed, fake_batch
from cli_helpers import oelm_main


# ====================================================================== settings and names
def own(a) -> list:
    "An answer's caveats but the study's family line (the Holm family, issue 46)."
    return [c for c in a.caveats if not c.startswith('one family of')]


@pytest.mark.parametrize('study', list(studies()))
def test_every_study_rejects_an_unknown_settings_field_by_name(study):
    st = get_study(study)
    variant = st.planned()[-1]
    with pytest.raises(ConfigError) as e: resolve_spec(study, variant, overrides={'settings.no_such_field': 1})
    msg = str(e.value)
    assert f"study {study!r}" in msg and "['no_such_field']" in msg and 'valid fields' in msg
    for f in st.settings.field_names():  # the allowed values: every field is listed
        assert f in msg


@pytest.mark.parametrize('study,field,value,expect', [
    ('pca', 'lora_rank', 'four', 'PCASettings.lora_rank=\'four\' is invalid: must be of type int'),
    ('pca', 'method', 'svd', "must be one of ('baseline', 'baseline-cont', 'lowrank', 'pca', 'pca-lora')"),
    ('cvfp', 'samples', 2.5, 'CVFPSettings.samples=2.5 is invalid: must be of type int | None'),
    ('cvfp', 'diversity', 'WMSE', 'must be one of'),
    ('mercator', 'role', 'judge', "must be one of ('teacher', 'pretrain', 'student')"),
    ('mercator', 'beta', 'x', 'must be of type float'),
])
def test_ill_typed_settings_name_study_field_and_allowed_values(study, field, value, expect):
    with pytest.raises(ConfigError) as e: resolve_spec(study, get_study(study).planned()[-1], overrides={f'settings.{field}': value})
    assert f'study {study!r}, settings:' in str(e.value) and expect in str(e.value)


def test_settings_errors_reach_the_command_line_before_anything_runs(tmp_path):
    res = oelm_main('run', 'pca', '--ks', '8', '--set', 'settings.lora_rnak=2', '--out', str(tmp_path / 'b'))
    assert res.returncode == 2 and "study 'pca', settings: PCASettings has no field(s) ['lora_rnak']" in res.stderr
    assert not (tmp_path / 'b' / 'batch.json').exists()


@given(st_.from_regex(r'[a-z][a-z0-9.\-]{0,20}', fullmatch=True), st_.integers(0, 10_000))
def test_run_names_round_trip(variant, seed):
    assert parse_run_name(run_name(variant, seed)) == (variant, seed)


def test_variant_names_are_labels_never_parsed():
    "The numbers of a variant live in its overrides: renaming a variant changes nothing it does."
    v = get_study('pca').variant('pca-lora-k16')
    assert v.overrides['model.n_embd_wte'] == 16 and v.overrides['settings.method'] == 'pca-lora' and v.upstream == ('baseline',)
    with pytest.raises(ConfigError, match="no variant 'pca-lora-k20'"): resolve_spec('pca', 'pca-lora-k20')


# ====================================================================== Q/K freeze verdicts
def qk_summary(ppl, tps=1000.0, trainable=1000, **more):
    return {'status': 'completed', 'best_val_ppl': ppl, 'best_val_loss': math.log(ppl), 'tokens_per_s': tps,
            'params': {'total': 1000, 'trainable': trainable, 'frozen': 1000 - trainable}, **more}


def qk_batch(root, seeds=(0, 1, 2), freeze_ppl=10.2, **kw):
    runs = {'gpt': lambda s: qk_summary(10.0 + 0.1 * s), 'oelm': lambda s: qk_summary(10.0 + 0.1 * s),
            'oelm-freeze': lambda s: qk_summary(freeze_ppl + 0.1 * s + 0.01 * (s % 2), trainable=930)}
    runs.update(kw)
    return fake_batch(root, 'qk-freeze', runs, seeds)


def test_hypotheses_on_three_seeds(tmp_path):
    h = hypotheses(load_runs(qk_batch(tmp_path)))
    assert list(h.index) == ['H1', 'H2', 'H3', 'H4', 'R1', 'R2', 'H2-trend', 'H4-trend']  # R: when the recall circuit forms (issue 29)
    assert h.loc['H1', 'verdict'] == 'rejected' and '7.00% fewer' in h.loc['H1', 'evidence']
    assert h.loc['H2', 'verdict'] == 'supported' and '3 seeds' in h.loc['H2', 'evidence']


def test_one_seed_gives_no_interval_and_no_verdict(tmp_path):
    runs = load_runs(qk_batch(tmp_path, seeds=(0,)))
    c = compare(runs, 'oelm-freeze', 'oelm')
    assert c.n == 1 and c.low is None and c.high is None and not c.resolvable
    h = hypotheses(runs)
    for hid in ('H2', 'H4'):
        assert h.loc[hid, 'verdict'] == 'inconclusive (needs >= 2 seeds)'
        assert 'inf' not in h.loc[hid, 'evidence'] and 'needs >= 2 seeds' in h.loc[hid, 'evidence']
    assert h.loc['H3', 'verdict'] == 'no data'  # H3 comes from the batch's interleaved timing, which this batch lacks


def timing_row(variant, ratio, low, high):
    return {'variant': variant, 'step_time_median_s': 0.1 * ratio, 'ratio_to_first_median': ratio, 'ratio_to_first_q1': low,
            'ratio_to_first_q3': high, 'ratio_low': low, 'ratio_high': high, 'ratio_level': 0.9586, 'ratio_p': 0.5, 'rounds': 20,
            'ratios': [low + (high - low) * i / 19 for i in range(20)]}  # the rounds: from the interval's low to its high


@pytest.mark.parametrize('low, high, verdict', [(0.93, 0.99, 'supported'), (0.97, 1.02, 'inconclusive'), (1.01, 1.08, 'rejected')])
def test_h3_reads_the_interleaved_timing_not_the_concurrent_runs(tmp_path, low, high, verdict):
    root = qk_batch(tmp_path, **{'oelm-freeze': lambda s: qk_summary(10.2 + 0.1 * s, tps=1.0, trainable=930)})  # concurrent tokens/s say 'much slower'
    (root / 'timing.json').write_text(json.dumps([timing_row('oelm', 1.0, 1.0, 1.0), timing_row('oelm-freeze', (low + high) / 2, low, high)]))
    h = hypotheses(load_runs(root))
    assert h.loc['H3', 'verdict'] == verdict and 'interleaved rounds' in h.loc['H3', 'evidence']
    assert f'95% CI {low - 1:+.1%} .. {high - 1:+.1%}' in h.loc['H3', 'evidence'] and 'sign test inverted' in h.loc['H3', 'evidence']
    (root / 'timing.json').write_text('[{"variant": "oelm"')  # truncated: no data rather than a crash
    assert hypotheses(load_runs(root)).loc['H3', 'verdict'] == 'no data'


def test_failed_run_is_left_out_and_a_failed_variant_gives_no_data(tmp_path):
    runs = load_runs(qk_batch(tmp_path, gpt=lambda s: failed()))
    assert set(runs[runs.variant == 'gpt'].status) == {'failed'} and set(runs[runs.variant == 'gpt'].error) == {'RuntimeError: boom'}
    h = hypotheses(runs)
    assert h.loc['H4', 'verdict'] == 'no data' and h.loc['H2', 'verdict'] == 'supported'


def test_one_failed_seed_shrinks_the_pairing(tmp_path):
    runs = load_runs(qk_batch(tmp_path, oelm=lambda s: failed() if s == 2 else qk_summary(10.0 + 0.1 * s)))
    assert compare(runs, 'oelm-freeze', 'oelm').n == 2


def test_missing_metrics_give_no_data(tmp_path):
    no_tps = {v: (lambda s, v=v: {k: x for k, x in qk_summary(10.0).items() if k != 'tokens_per_s'}) for v in ('gpt', 'oelm', 'oelm-freeze')}
    no_params = {v: (lambda s, v=v: {k: x for k, x in qk_summary(10.0).items() if k != 'params'}) for v in ('gpt', 'oelm', 'oelm-freeze')}
    h = hypotheses(load_runs(qk_batch(tmp_path / 'b', **no_params)))
    assert h.loc['H1', 'verdict'] == 'no data'
    assert hypotheses(load_runs(fake_batch(tmp_path / 'c', 'qk-freeze', {}))).verdict.eq('no data').all()


# ====================================================================== PCA verdicts and answers
PCA_PLAN = {'baseline': {'settings.method': 'baseline'},
            **{f'{m}-k{k}': {'settings.method': m, 'model.n_embd_wte': k} for m in ('pca', 'pca-lora') for k in (8, 64)}}


def pca_summary(method, k, loss):
    return {'status': 'completed', 'method': method, 'k': k, 'val_loss': loss, 'best_val_loss': loss, 'best_val_ppl': math.exp(loss)}


def test_pca_recovery_from_run_directories(tmp_path):
    runs = {'baseline': lambda s: pca_summary('baseline', 64, 2.0), 'pca-k8': lambda s: pca_summary('pca', 8, 3.0),
            'pca-lora-k8': lambda s: pca_summary('pca-lora', 8, 2.5), 'pca-k64': lambda s: pca_summary('pca', 64, 2.0),
            'pca-lora-k64': lambda s: failed()}
    table = load_runs(fake_batch(tmp_path, 'pca', runs, plan=PCA_PLAN))
    gaps = recovery_table(table)
    assert gaps.loc[8, 'recovered vs baseline'] == pytest.approx(0.5) and gaps.loc[8, '95% CI vs baseline'] == 'needs >= 2 seeds'
    assert gaps.loc[64, 'note'] == 'no seed with completed PCA and PCA + LoRA runs'  # the failed run's k comes from the plan
    assert recovery_verdict(gaps) == ('**Against the baseline (PCA + LoRA trained its fine-tuning steps on top of it: not matched in compute), '
                                      'PCA + LoRA recovers part of the gap at k=8: 50% (1 seed: needs >= 2 seeds).**')
    assert ppl_table(table).loc['PCA + LoRA', 'k=64'] == 'failed'


def test_pca_verdict_without_a_baseline(tmp_path):
    runs = {'baseline': lambda s: failed(), 'pca-k8': lambda s: pca_summary('pca', 8, 3.0), 'pca-lora-k8': lambda s: pca_summary('pca-lora', 8, 2.5)}
    gaps = recovery_table(load_runs(fake_batch(tmp_path, 'pca', runs, plan=PCA_PLAN)))
    assert recovery_verdict(gaps).startswith('**No verdict:**')


def test_pca_answers_trace_to_the_losses(tmp_path):
    "Two seeds: the recovered fraction per seed, its mean and t-interval recomputed here from the losses the runs wrote."
    from scipy import stats
    loss = {'baseline': (2.0, 2.1), 'pca-k8': (3.0, 3.1), 'pca-lora-k8': (2.4, 2.6), 'pca-k64': (2.0, 2.1), 'pca-lora-k64': (2.0, 2.1)}
    method = lambda v: 'baseline' if v == 'baseline' else v.rpartition('-k')[0]
    runs = {v: (lambda s, v=v: pca_summary(method(v), 64 if v == 'baseline' else int(v.rpartition('-k')[2]), loss[v][s])) for v in loss}
    table = load_runs(fake_batch(tmp_path, 'pca', runs, seeds=(0, 1), plan=PCA_PLAN))
    got = {a.qid: a for a in pca_answers(table)}
    assert list(got) == ['k=8 vs baseline', 'k=64 vs baseline']  # no baseline-cont runs in this batch
    rec = np.array([(3.0 - 2.4) / (3.0 - 2.0), (3.1 - 2.6) / (3.1 - 2.1)])  # 60% and 50%
    lo, hi = stats.t.interval(0.95, 1, loc=rec.mean(), scale=stats.sem(rec))
    a = got['k=8 vs baseline']
    assert (a.verdict, a.estimate, a.interval, a.seeds) == ('open', f'{rec.mean():.0%} of the gap', f'95% CI {lo:.0%} .. {hi:.0%}', '2 paired seeds')
    assert lo < 0 and hi > 1  # the interval straddles 0% and 100%: open
    assert own(a) == ['against baseline, PCA + LoRA trained its fine-tuning steps on top of it: not matched in compute (baseline-cont is)']
    assert got['k=64 vs baseline'].verdict == 'no gap'  # k = d: PCA-only is the baseline


def test_pca_answers_one_seed_says_so(tmp_path):
    runs = {'baseline': lambda s: pca_summary('baseline', 64, 2.0), 'pca-k8': lambda s: pca_summary('pca', 8, 3.0),
            'pca-lora-k8': lambda s: pca_summary('pca-lora', 8, 2.5)}
    (a,) = pca_answers(load_runs(fake_batch(tmp_path, 'pca', runs, plan=PCA_PLAN)))
    assert (a.verdict, a.estimate, a.interval, a.seeds) == ('part', '50% of the gap', '', '1 paired seed')
    assert any(c.startswith('rests on one seed') for c in a.caveats)
    none = pca_answers(load_runs(fake_batch(tmp_path / 'none', 'pca', {**runs, 'pca-lora-k8': lambda s: failed()}, plan=PCA_PLAN)))
    assert [(x.verdict, x.method) for x in none] == [('no data', 'needs completed PCA, PCA + LoRA and reference runs of a common seed')]


@pytest.mark.parametrize('study', study_names())  # every registered study (tests/toy_study among them)
def test_every_study_answers_through_the_kit(study, tmp_path):
    "Each study answers its questions itself (`Study.answers`), as evidence.Answer rows, even for a batch with no run."
    from oelm_nb.lab.study import study_answers
    st = get_study(study)
    answers = study_answers(st)  # a 'module:function' string (a study whose report sits above it) imported here
    if st.answers is None: return  # optional (`Study.answers`): `oelm run` then prints none and writes no answers.json
    assert callable(answers), f'{study}: answers={st.answers!r} is not a function'
    assert sum(study_answers(s) is answers for s in studies().values()) == 1, f'{study} shares another study\'s answers'
    empty = answers(load_runs(fake_batch(tmp_path, study, {})))
    assert empty and all(isinstance(a, Answer) for a in empty), empty


def test_a_pca_precision_batch_answers_the_comparison_it_sized(tmp_path):
    "--precision sized pca-lora-k8 vs baseline-cont: pca_answers state it with Stein's interval, design's seeds (issue 46)."
    from fake_runs import write_precision
    runs = {'baseline': lambda s: pca_summary('baseline', 64, 2.0 + 0.1 * s), 'pca-k8': lambda s: pca_summary('pca', 8, 3.0 + 0.1 * s),
            'pca-lora-k8': lambda s: pca_summary('pca-lora', 8, 2.4 + 0.1 * s)}
    root = fake_batch(tmp_path, 'pca', runs, seeds=(0, 1), plan=PCA_PLAN)
    write_precision(root, 'best_val_ppl', 'pca-lora-k8', 'baseline-cont', mean=0.02, low=-0.01, high=0.05, n=6)
    got = get_study('pca').answers(load_runs(root))
    assert [a.qid for a in got] == ['k=8 vs baseline', 'SIZED']
    assert (got[1].verdict, got[1].n, got[1].seeds) == ('no resolvable difference', 6, '6 paired seeds')


def test_registered_pca_study_answers(tmp_path):
    "`oelm run pca` prints `get_study('pca').answers(runs)`: Answers for a small batch."
    runs = {'baseline': lambda s: pca_summary('baseline', 64, 2.0 + 0.1 * s), 'pca-k8': lambda s: pca_summary('pca', 8, 3.0 + 0.1 * s),
            'pca-lora-k8': lambda s: pca_summary('pca-lora', 8, 2.4 + 0.1 * s)}
    got = get_study('pca').answers(load_runs(fake_batch(tmp_path, 'pca', runs, seeds=(0, 1), plan=PCA_PLAN)))
    assert all(isinstance(a, Answer) for a in got) and [a.qid for a in got] == ['k=8 vs baseline']
    assert (got[0].estimate, got[0].verdict) == ('60% of the gap', 'part')  # 60% at both seeds: no spread
    d = got[0].to_dict()  # answers.json's record: numbers beside the text (issue 46)
    assert (round(d['estimate'], 9), round(d['low'], 9), round(d['high'], 9), d['p'], d['n']) == (0.6, 0.6, 0.6, 0.5, 2), d
    assert any('rests on the normal assumption' in c for c in got[0].caveats)  # two seeds: the exact test cannot go below 0.5


def test_every_study_tests_take_the_studies_from_the_registry():
    """A test over every study takes them from the registry (`studies()`, `study_names()`, the toy of tests/toy_study
    among them), never from a list of names: a new study is covered without editing a test."""
    import ast
    from pathlib import Path
    assert 'toy' in study_names(), 'tests/toy_study is not registered: the every-study tests would not cover it'
    names, found = set(study_names()), []
    for p in sorted(Path(__file__).parent.glob('*.py')):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
                listed = {e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}
                if len(listed & names) >= 3: found.append(f'{p.name}:{node.lineno} {sorted(listed & names)}')
    assert not found, f'lists of studies by name (take them from oelm_nb.lab.study.studies()): {found}'
