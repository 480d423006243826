"""The CVFP report's tables, verdicts and sentences (oelm_nb.cvfp_study) on small fake batch directories.

`make_batch` writes what `oelm run cvfp` leaves behind (batch.json, one summary.json per run, the CVFP runs'
phase1.jsonl and metrics.jsonl) with round numbers, so every expected value here is worked out by hand. Run
folders get labels that say nothing about the run: the functions must read the algorithm and sample size from the
summaries.
"""
from __future__ import annotations
import json, math
from pathlib import Path

import pytest
from oelm_nb.experiment import write_json
from oelm_nb import cvfp_study as cs

RULES = {'identity': 'zero_diff > 0.1 and token similarity < 0.95', 'convergence': 'final_diff < 0.001 and verdict CONVERGED or CONVERGING',
         'effective_rank': 'validation ER >= 30.0% of 16'}


def ppl(alg: str, n: int) -> float: return 500 * (100 * n) ** -0.3 * (1.1 if alg == 'ODCM' else 1)


def cvfp_summary(alg: str, n: int, seed: int = 0) -> dict:
    "A completed CVFP run's summary; convergence fails below 20 stories."
    return {'status': 'completed', 'algorithm': alg, 'samples': n, 'parallel': n != 40, 'dist_reg_weight': 0.9, 'context_dim': 16,
            'embed_dim': 16, 'num_layers': 2, 'train_tokens': 100 * n, 'train_converged_tokens': 10 * n, 'train_convergence_rate': 10.0,
            'val_tokens': 640, 'check_tokens': 128, 'val_converged_tokens': 128, 'val_convergence_rate': 100.0, 'train_er': 8.0,
            'train_er_dim': 16, 'train_er_percent': 50.0, 'val_er': 6.4, 'val_er_dim': 16, 'val_er_percent': 40.0, 'cvfp_loss': 0.0625,
            'final_diff': 3e-6, 'iterations': 4, 'max_iterations': 10, 'stop_reason': 'max_iterations', 'phase1_train_s': 1.25,
            'best_val_ppl': ppl(alg, n), 'final_val_ppl': 2 * ppl(alg, n), 'val_acc': 0.125, 'phase2_steps': 30, 'phase2_batch_size': 32,
            'phase2_batch_source': 'cpu budget', 'phase1_s': 2.25, 'checks_s': 0.75, 'phase2_s': 3.0, 'wall_time_s': 6.0, 'seed': seed,
            'checks': {'identity': {'passed': True, 'zero_diff': 1.5, 'token_similarity': None, 'rule': RULES['identity']},
                       'convergence': {'passed': n >= 20, 'verdict': 'CONVERGING' if n >= 20 else 'DIVERGING', 'final_diff': 3e-6,
                                       'slope': -0.0125, 'rule': RULES['convergence']},
                       'effective_rank': {'passed': True, 'val_er_percent': 40.0, 'rule': RULES['effective_rank']}}}


def speed_summary(speedup: float) -> dict:
    s = {'status': 'completed', 'tokens': 6400, 'iterations': 10, 'er_dim': 16, 'val_tokens': 640, 'speedup': speedup}
    for v, sec, er in (('sequential', 20.0, 9.6), ('parallel', 20.0 / speedup, 8.0)):
        s.update({f'{v}_s': sec, f'{v}_iterations': 10, f'{v}_converged_tokens': 64, f'{v}_convergence_rate': 1.0, f'{v}_train_er': er,
                  f'{v}_train_er_percent': 100 * er / 16, f'{v}_val_er': er / 2, f'{v}_val_er_percent': 50 * er / 16})
    return s


def make_batch(d: Path, algs=('MCDL', 'ODCM'), samples=(10, 20, 40), seeds=(0,), speedup: float = 12.5, failed=(), summaries=None,
               window: int | None = 2) -> Path:
    """A fake CVFP batch in `d`: embed and phase1-speed per seed and one CVFP run per algorithm, sample size and seed,
    labelled `run<k>`. `failed` lists (alg, n, seed) runs whose summary says failed; `summaries` maps (alg, n, seed)
    to a summary that replaces the generated one."""
    d.mkdir(parents=True)
    labels = {}
    for seed in seeds:
        runs = {'embed': {'status': 'completed', 'trained': True, 'steps': 400, 'best_val_ppl': 7.825, 'embedding_source': 'run e',
                          'embedding_rows': 64, 'embedding_dim': 16, 'samples': ['Once upon a time', 'One day']},
                'phase1-speed': speed_summary(speedup)}
        for n in samples:
            for alg in algs:
                lab = labels.setdefault((alg, n), f'run{len(labels)}')
                s = (summaries or {}).get((alg, n, seed)) or cvfp_summary(alg, n, seed)
                runs[lab] = {'status': 'failed', 'error': 'RuntimeError: boom'} if (alg, n, seed) in failed else s
        for lab, s in runs.items():
            r = d / f'{lab}-s{seed}'
            r.mkdir()
            write_json(r / 'summary.json', s)
            if s.get('status') == 'completed' and isinstance(s.get('samples'), int):
                (r / 'phase1.jsonl').write_text(''.join(json.dumps(x) + '\n' for x in
                                                        [{'iteration': 0, 'effective_rank': 40.0}, {'iteration': 1, 'cvfp': 0.5, 'effective_rank': 41.0,
                                                                                                   'val_effective_rank': 30.0}]))
                (r / 'metrics.jsonl').write_text(json.dumps({'step': 5, 'tokens': 500, 'val_ppl': 40.0}) + '\n')
    write_json(d / 'batch.json', {'study': 'cvfp', 'preset': 'tiny', 'data': 'synthetic', 'variants': ['embed', 'phase1-speed', *labels.values()],
                                  'seeds': list(seeds), 'overrides': {}, 'options': {'window_size': window} if window else {}})
    return d


@pytest.fixture
def batch(tmp_path): return make_batch(tmp_path / 'b')


def test_runs_are_read_from_summaries_not_names(tmp_path):
    b = make_batch(tmp_path / 'b', algs=('ODCM', 'MCDL'), samples=(40, 10))
    got = [(r.name, r.summary['algorithm'], r.summary['samples']) for r in cs.cvfp_runs(b)]
    # labels in planning order: ODCM-40 run0, MCDL-40 run1, ODCM-10 run2, MCDL-10 run3; embed (texts in `samples`) and speed left out
    assert got == [('run3-s0', 'MCDL', 10), ('run1-s0', 'MCDL', 40), ('run2-s0', 'ODCM', 10), ('run0-s0', 'ODCM', 40)]


def test_normal_batch_tables(batch):
    assert cs.runs_sentence(batch) == 'All 8 runs completed.'
    assert cs.embed_table(batch).loc[0].tolist() == ['run e', '64 x 16', True, 400, '7.83']
    p1 = cs.phase1_table(batch)
    assert list(p1.index) == ['run0-s0', 'run2-s0', 'run4-s0', 'run1-s0', 'run3-s0', 'run5-s0']
    assert p1.loc['run4-s0'].tolist() == ['MCDL', 40, 'sequential', '10.0% (400/4,000 tokens)', '100.0% (128/128 tokens)', '8.00/16 (50.0%)',
                                          '6.40/16 (40.0%)', '0.062500', '3.000e-06', '4/10', 'max_iterations']
    assert cs.phase1_sentence(batch).startswith('Validation ER on the first 640 validation tokens; validation convergence and the checks on the '
                                                'first 128. Dist-reg weight 0.9, context dim 16, embedding dim 16, 2 layer(s). MCDL: ')
    p2 = cs.phase2_table(batch)
    assert p2.loc['run0-s0'].tolist() == ['MCDL', 10, '1,000', f'{ppl("MCDL", 10):.2f}', f'{2 * ppl("MCDL", 10):.2f}', '12.50%', '30', '32', 'cpu budget']
    assert cs.timing_table(batch).loc['run1-s0'].tolist() == ['1,000', '1.2', '2.2', '0.8', '3.0', '6.0']
    c1 = cs.phase1_curves(batch)
    assert len(c1) == 6 and c1.iloc[0].tolist() == ['run0-s0', 'MCDL', 1, 41.0, 30.0, 0.5]
    assert cs.phase2_curves(batch)[['tokens', 'val_ppl']].values.tolist() == [[500, 40.0]] * 6


def test_speed(tmp_path):
    fast, slow = make_batch(tmp_path / 'fast', speedup=12.5), make_batch(tmp_path / 'slow', speedup=8.0)
    t = cs.speed_table(fast)
    assert t.loc[(0, 'sequential')].tolist() == ['6,400', 10, '20.00', '9.60/16 (60.0%)', '4.80/16 (30.0%)', '1.0% (64/6,400 tokens)']
    assert t.loc[(0, 'parallel'), 'seconds'] == '1.60'
    assert cs.speed_sentences(fast) == ['**Seed 0: parallel Phase 1 is 12.5x faster** than sequential on 6,400 tokens (20.00 s vs 1.60 s, '
                                        '10 iterations each; meets the 10x target). Effective rank, sequential vs parallel: training '
                                        '9.60/16 (60.0%) vs 8.00/16 (50.0%), validation 4.80/16 (30.0%) vs 4.00/16 (25.0%).']
    assert 'is 8.0x faster** ' in cs.speed_sentences(slow)[0] and 'misses the 10x target' in cs.speed_sentences(slow)[0]


def test_checks(batch):
    t = cs.checks_table(batch)
    assert t.loc['run0-s0'].tolist() == ['PASS', '1.500 / n/a (dims differ)', 'FAIL', 'DIVERGING', '3.000e-06', '-1.25e-02', 'PASS', '40.0']
    assert cs.checks_counts(batch) == {'identity': (6, 6), 'convergence': (4, 6), 'effective rank': (6, 6)}
    assert cs.checks_summary(batch) == (f"Rules: identity {RULES['identity']}; convergence {RULES['convergence']}; effective rank "
                                        f"{RULES['effective_rank']}. identity passed in 6 of 6 runs, convergence passed in 4 of 6 runs, "
                                        'effective rank passed in 6 of 6 runs.')


def test_alpha(batch):
    a = cs.report_alpha(batch)
    assert a['window'] == 2 and (batch / 'alpha_progression.json').exists()
    t = cs.alpha_table(a)
    assert t.index.tolist() == [(alg, w) for alg in ('MCDL', 'ODCM') for w in ('all points', '1', '2')]
    assert t.loc[('ODCM', 'all points')].tolist() == ['10-40', '1,000-4,000', '-0.30000', '550', '1.0000']
    s = cs.alpha_sentences(a)
    assert len(s) == 2 and s[1].startswith('**ODCM**: alpha -0.30000 (R^2 1.0000) over 3 sample sizes; window alpha -0.30000 -> -0.30000 (change ')


def test_one_seed_one_window(tmp_path):
    b = make_batch(tmp_path / 'b', algs=('MCDL',), samples=(10, 20), window=None)
    a = cs.report_alpha(b)
    assert a['window'] == 4
    assert cs.alpha_sentences(a) == ['**MCDL**: alpha -0.30000 (R^2 1.0000) over 2 sample sizes; one window of 2 points (no change to report).']
    assert cs.checks_summary(b).endswith('identity passed in 2 of 2 runs, convergence passed in 1 of 2 runs, effective rank passed in 2 of 2 runs.')
    assert 'ODCM' not in cs.phase1_sentence(b)


def test_failed_run_is_listed_and_left_out(tmp_path):
    b = make_batch(tmp_path / 'b', seeds=(0, 1), failed={('ODCM', 20, 1)})
    assert cs.runs_sentence(b) == '**1 of 16 run(s) did not complete:** `run3-s1` (failed: RuntimeError: boom)'
    rt = cs.runs_table(b)
    assert rt[rt.status != 'completed'].values.tolist() == [['run3', 1, 'failed', '', 'RuntimeError: boom']]
    assert 'run3-s1' not in cs.phase1_table(b).index and len(cs.phase2_table(b)) == 11
    assert cs.checks_counts(b)['identity'] == (11, 11)
    a = cs.batch_alpha(b, 2)
    assert a['algorithms']['ODCM']['points'][1]['runs'] == ['run3-s0']
    assert len(cs.speed_sentences(b)) == 2 and cs.embed_table(b).index.tolist() == [0, 1]


def test_missing_run_and_metrics(tmp_path):
    no_ppl = {k: v for k, v in cvfp_summary('MCDL', 20).items() if k != 'best_val_ppl'}
    no_checks = {k: v for k, v in cvfp_summary('ODCM', 20).items() if k not in ('checks', 'val_er', 'stop_reason')}
    b = make_batch(tmp_path / 'b', samples=(10, 20, 40), summaries={('MCDL', 20, 0): no_ppl, ('ODCM', 20, 0): no_checks})
    write_json(b / 'batch.json', {**json.loads((b / 'batch.json').read_text()), 'variants': ['embed', 'phase1-speed', 'run0', 'ghost']})
    assert '`ghost-s0` (missing: never ran)' in cs.runs_sentence(b)
    assert cs.phase2_table(b).loc['run2-s0', 'best val PPL'] == 'n/a'
    row = cs.checks_table(b).loc['run3-s0']
    assert row.tolist() == ['n/a', 'n/a / n/a', 'n/a', 'n/a', 'n/a', 'n/a', 'n/a', 'n/a']
    assert cs.checks_counts(b) == {'identity': (5, 5), 'convergence': (3, 5), 'effective rank': (5, 5)}
    p1 = cs.phase1_table(b).loc['run3-s0']
    assert (p1['val ER'], p1['stopped by']) == ('n/a', 'n/a')
    a = cs.batch_alpha(b, 2)  # the run without a PPL is no alpha point
    assert [p['samples'] for p in a['algorithms']['MCDL']['points']] == [10, 40]
    assert cs.alpha_table(a).loc[('MCDL', 'all points'), 'stories'] == '10-40'


def test_empty_batch(tmp_path):
    for b in (tmp_path / 'bare', tmp_path / 'asked'):
        b.mkdir()
    write_json(tmp_path / 'asked' / 'batch.json', {'study': 'cvfp', 'variants': ['embed'], 'seeds': [0]})
    assert cs.batch_runs(tmp_path / 'bare') == [] and cs.runs_sentence(tmp_path / 'bare') == '**No runs in this batch directory.**'
    assert cs.runs_sentence(tmp_path / 'asked') == '**1 of 1 run(s) did not complete:** `embed-s0` (missing: never ran)'
    for b in (tmp_path / 'bare', tmp_path / 'asked'):
        assert cs.cvfp_runs(b) == []
        for f in (cs.embed_table, cs.speed_table, cs.phase1_table, cs.checks_table, cs.phase2_table, cs.timing_table,
                  cs.phase1_curves, cs.phase2_curves):
            assert len(f(b)) == 0, f
        assert cs.speed_sentences(b) == []
        assert (cs.phase1_sentence(b), cs.checks_summary(b)) == ('No completed CVFP run.', 'No completed CVFP run to check.')
        a = cs.report_alpha(b)
        assert len(cs.alpha_table(a)) == 0 and cs.alpha_sentences(a) == ['No algorithm has completed runs to fit.']
    assert cs.checks_counts([]) == {'identity': (0, 0), 'convergence': (0, 0), 'effective rank': (0, 0)}
    assert cs.batch_sentence(tmp_path / 'bare').endswith(': study `None`, preset `None`, data `None`, seeds None, flags none, overrides {}.')
