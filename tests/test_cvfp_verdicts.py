"""The CVFP report's tables, verdicts and sentences (oelm_nb.studies.cvfp.report) and alpha fits (oelm_nb.studies.cvfp.alpha) on small fake batch directories.

`make_batch` writes what `oelm run cvfp` leaves behind (batch.json, one summary.json per run, the CVFP runs'
phase1.jsonl and metrics.jsonl) with round numbers, so every expected value here is worked out by hand. Run
folders get labels that say nothing about the run: the functions must read the algorithm and sample size from the
summaries.
"""
from __future__ import annotations
import json, math
from pathlib import Path

import numpy as np
import pytest
from oelm_nb.base.rundir import write_json
from oelm_nb.studies.cvfp import report as cr, alpha as ca, guidelines as cg

RULES = {'identity': 'zero_diff > 0.1 and token similarity < 0.95', 'convergence': 'final_diff < 0.001 (GOOD) and verdict CONVERGED or CONVERGING',
         'effective_rank': 'guidelines bands', 'agreement': 'mean cosine >= 0.99: fixed point (PASS); >= 0.9: near; below: off'}
C1, C2, C3 = 'Check 1: effective rank', 'Check 2: identity mapping', 'Check 3: CVFP convergence'
C4 = 'Fixed point: parallel vs sequential'


def own(a) -> list:
    "An answer's caveats but the study's family line (the Holm family, issue 46)."
    return [c for c in a.caveats if not c.startswith('one family of')]


def crit(name, value, band, verdict): return {'criterion': name, 'value': value, 'band': band, 'verdict': verdict}


def ppl(alg: str, n: int) -> float: return 500 * (100 * n) ** -0.3 * (1.1 if alg == 'ODCM' else 1)


def agreement(n: int) -> tuple[float, str]:
    "The fixed-point agreement of a fake run: off at 10 stories, near at 20, the fixed point from 40 on."
    return (0.5, 'off') if n < 20 else (0.95, 'near') if n < 40 else (0.995, 'fixed point')


def cvfp_summary(alg: str, n: int, seed: int = 0) -> dict:
    "A completed CVFP run's summary; convergence fails below 20 stories."
    cos, regime = agreement(n)
    return {'agreement_cos_mean': cos, 'agreement_cos_min': cos - 0.25, 'agreement_mse': 1 - cos, 'agreement_regime': regime, 'status': 'completed', 'algorithm': alg, 'samples': n, 'parallel': n != 40, 'dist_reg_weight': 0.9, 'context_dim': 16,
            'embed_dim': 16, 'num_layers': 2, 'train_tokens': 100 * n, 'train_converged_tokens': 10 * n, 'train_convergence_rate': 10.0,
            'val_tokens': 640, 'check_tokens': 128, 'val_converged_tokens': 128, 'val_convergence_rate': 100.0, 'train_er': 8.0,
            'train_er_dim': 16, 'train_er_percent': 50.0, 'val_er': 6.4, 'val_er_dim': 16, 'val_er_percent': 40.0, 'cvfp_loss': 0.0625,
            'final_diff': 3e-6, 'iterations': 4, 'max_iterations': 10, 'stop_reason': 'max_iterations', 'phase1_train_s': 1.25,
            'best_val_ppl': ppl(alg, n), 'final_val_ppl': 2 * ppl(alg, n), 'val_acc': 0.125, 'phase2_steps': 30, 'phase2_batch_size': 32,
            'phase2_batch_source': 'cpu budget', 'phase1_s': 2.25, 'checks_s': 0.75, 'phase2_s': 3.0, 'wall_time_s': 6.0, 'seed': seed,
            'checks': {'effective_rank': {'passed': False, 'verdict': 'BELOW BAND', 'rule': RULES['effective_rank'],
                                          'criteria': [crit('validation effective rank (%)', 40.0, 'PASS >= 81', 'BELOW BAND'),
                                                       crit('spread', 0.75, 'global attractor (FAIL) < 0.1', 'PASS')]},
                       'identity': {'passed': True, 'zero_diff': 1.5, 'token_similarity': None, 'rule': RULES['identity'],
                                    'criteria': [crit('difference from the zero-context output', 1.5, 'PASS > 0.1', 'PASS'),
                                                 crit('cosine similarity to the token embedding', None, 'PASS < 0.95', 'n/a (dims differ)')]},
                       'convergence': {'passed': n >= 20, 'verdict': 'CONVERGING' if n >= 20 else 'DIVERGING', 'final_diff': 3e-6, 'final_grade': 'GOOD',
                                       'slope': -0.0125, 'rule': RULES['convergence'],
                                       'criteria': [crit('loss slope per pass', -0.0125, 'seed thresholds', 'CONVERGING' if n >= 20 else 'DIVERGING'),
                                                    crit('reduction, last loss vs first (%)', -62.5, 'reported', 'reported'),
                                                    crit('final diff', 3e-6, 'GOOD < 0.001, FAIL > 0.01, else MARGINAL', 'GOOD')]},
                       'agreement': {'passed': n >= 40, 'verdict': regime, 'cos_mean': cos, 'rule': RULES['agreement'],
                                     'criteria': [crit('mean cosine', cos, 'fixed point >= 0.99', regime),
                                                  crit('minimum cosine', cos - 0.25, 'reported', 'reported'),
                                                  crit('MSE', 1 - cos, 'reported', 'reported')]}}}


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
    got = [(r.name, r.summary['algorithm'], r.summary['samples']) for r in cr.cvfp_runs(b)]
    # labels in planning order: ODCM-40 run0, MCDL-40 run1, ODCM-10 run2, MCDL-10 run3; embed (texts in `samples`) and speed left out
    assert got == [('run3-s0', 'MCDL', 10), ('run1-s0', 'MCDL', 40), ('run2-s0', 'ODCM', 10), ('run0-s0', 'ODCM', 40)]


def test_normal_batch_tables(batch):
    assert cr.runs_sentence(batch) == 'All 8 runs completed.'
    assert cr.embed_table(batch).loc[0].tolist() == ['run e', '64 x 16', True, 400, '7.83']
    p1 = cr.phase1_table(batch)
    assert list(p1.index) == ['run0-s0', 'run2-s0', 'run4-s0', 'run1-s0', 'run3-s0', 'run5-s0']
    assert p1.loc['run4-s0'].tolist() == ['MCDL', 40, 'sequential', '10.0% (400/4,000 tokens)', '100.0% (128/128 tokens)', '8.00/16 (50.0%)',
                                          '6.40/16 (40.0%)', '0.062500', '3.000e-06', '4/10', 'max_iterations', '3']
    assert cr.phase1_sentence(batch).startswith('Validation ER on the first 640 validation tokens; validation convergence and the checks on the '
                                                'first 128. Dist-reg weight 0.9, context dim 16, embedding dim 16, 2 layer(s). MCDL: ')
    p2 = cr.phase2_table(batch)
    assert p2.loc['run0-s0'].tolist() == ['MCDL', 10, '1,000', f'{ppl("MCDL", 10):.2f}', f'{2 * ppl("MCDL", 10):.2f}', '12.50%', '30', '32', 'cpu budget']
    assert cr.timing_table(batch).loc['run1-s0'].tolist() == ['1,000', '1.2', '2.2', '0.8', '3.0', '6.0']
    c1 = cr.phase1_curves(batch)
    assert len(c1) == 6 and c1.iloc[0].tolist() == ['run0-s0', 'MCDL', 1, 41.0, 30.0, 0.5]
    assert cr.phase2_curves(batch)[['tokens', 'val_ppl']].values.tolist() == [[500, 40.0]] * 6


def test_speed(tmp_path):
    fast, slow = make_batch(tmp_path / 'fast', speedup=12.5), make_batch(tmp_path / 'slow', speedup=8.0)
    t = cr.speed_table(fast)
    assert t.loc[(0, 'sequential')].tolist() == ['6,400', 10, '20.00', '9.60/16 (60.0%)', '4.80/16 (30.0%)', '1.0% (64/6,400 tokens)']
    assert t.loc[(0, 'parallel'), 'seconds'] == '1.60'
    assert cr.speed_sentences(fast) == ['**Seed 0: parallel Phase 1 is 12.5x faster** than sequential on 6,400 tokens (20.00 s vs 1.60 s, '
                                        '10 iterations each; meets the 10x target). Effective rank, sequential vs parallel: training '
                                        '9.60/16 (60.0%) vs 8.00/16 (50.0%), validation 4.80/16 (30.0%) vs 4.00/16 (25.0%).']
    assert 'is 8.0x faster** ' in cr.speed_sentences(slow)[0] and 'misses the 10x target' in cr.speed_sentences(slow)[0]


def test_checks(batch):
    t = cr.checks_table(batch)
    assert list(t.columns) == ['algorithm', C1, C2, C3, C4]
    assert t.loc['run0-s0'].tolist() == ['MCDL', 'BELOW BAND', 'PASS', 'FAIL (DIVERGING, final diff GOOD)', 'FAIL (off, cos 0.5000)']
    assert t.loc['run4-s0'].tolist() == ['MCDL', 'BELOW BAND', 'PASS', 'PASS (CONVERGING, final diff GOOD)', 'PASS (fixed point, cos 0.9950)']
    assert cr.checks_counts(batch) == {C1: (0, 6), C2: (6, 6), C3: (4, 6), C4: (2, 6)}
    assert cr.checks_summary(batch) == (f"Rules. {C1}: {RULES['effective_rank']}; {C2}: {RULES['identity']}; {C3}: {RULES['convergence']}; "
                                        f"{C4}: {RULES['agreement']}. "
                                        f"{C1} passed in 0 of 6 runs, {C2} passed in 6 of 6 runs, {C3} passed in 4 of 6 runs, {C4} passed in 2 of 6 runs "
                                        "(6 run(s) between the failure line and the New-LLM guidelines' effective-rank band).")
    assert cr.agreement_sentence(batch).startswith('**Phase 1 ended at its fixed point in 2 of 6 runs**, near it in 2, off it in 2 '
                                                   "(mean cosine of the kept iteration's contexts with a sequential pass of the trained "
                                                   'block: 0.5000 to 0.9950;')
    assert "These runs' context width: 16. Why a parallel Phase 1 misses the fixed point" in cr.agreement_sentence(batch)
    d = cr.check_details(batch).reset_index()
    r0 = d[d.run == 'run0-s0']
    assert r0[['check', 'criterion', 'value', 'band', 'verdict']].values.tolist() == [
        [C1, 'validation effective rank (%)', '40.00', 'PASS >= 81', 'BELOW BAND'], [C1, 'spread', '0.7500', 'global attractor (FAIL) < 0.1', 'PASS'],
        [C2, 'difference from the zero-context output', '1.50', 'PASS > 0.1', 'PASS'],
        [C2, 'cosine similarity to the token embedding', 'n/a', 'PASS < 0.95', 'n/a (dims differ)'],
        [C3, 'loss slope per pass', '-0.0125', 'seed thresholds', 'DIVERGING'], [C3, 'reduction, last loss vs first (%)', '-62.50', 'reported', 'reported'],
        [C3, 'final diff', '3.000e-06', 'GOOD < 0.001, FAIL > 0.01, else MARGINAL', 'GOOD'],
        [C4, 'mean cosine', '0.5000', 'fixed point >= 0.99', 'off'], [C4, 'minimum cosine', '0.2500', 'reported', 'reported'],
        [C4, 'MSE', '0.5000', 'reported', 'reported']]
    assert len(d) == 6 * 10


def test_against_the_guidelines(batch, tmp_path):
    # the fake runs have 2 layers and no speed-run layer count: every CVFP run breaks the rule, by name
    s = cg.layers_sentence(batch)
    assert s.startswith("**6 of 7 run(s) break the New-LLM guidelines' one-layer rule** (num_layers = 1, \"absolutely do not change\"): `run0-s0` (2 layers)")
    one = make_batch(tmp_path / 'one', summaries={(a, n, 0): {**cvfp_summary(a, n), 'num_layers': 1} for a in ('MCDL', 'ODCM') for n in (10, 20, 40)})
    assert cg.layers_sentence(one) == "All 7 CVFP and speed runs follow the New-LLM guidelines' one-layer rule (num_layers = 1)."
    assert cg.phase1_settings_sentence(batch).startswith('**Phase 1 differs from the New-LLM guidelines:** minimum iterations n/a (guidelines 5) in 6 run(s); '
                                                         'maximum iterations 10 (guidelines 40) in 6 run(s); Adam learning rate n/a (guidelines 0.002) in 6 run(s); '
                                                         'validation tokens 640 (guidelines 10,000) in 6 run(s).')
    assert 'Stopping rule: not recorded;' in cg.phase1_settings_sentence(batch)
    like = {(a, n, 0): {**cvfp_summary(a, n), 'min_iterations': 5, 'max_iterations': 40, 'phase1_lr': 0.002, 'val_tokens': 10_000, 'iterations': 40,
                        'val_tokens_requested': 10_000, 'best_iteration': 20 + n // 10, 'stop_reason': 'max_iterations', 'val_patience': 0}
            for a in ('MCDL', 'ODCM') for n in (10, 20, 40)}
    assert cg.phase1_settings_sentence(make_batch(tmp_path / 'like', summaries=like)) == (
        'Phase 1 as the New-LLM guidelines set it: at least 5 and at most 40 iterations, Adam 0.002, validation effective rank on 10,000 tokens. '
        'Stopping rule: no early stopping, every run runs all its iterations; stopped early by validation effective rank: 0 of 6 runs; 6 kept the weights '
        "of an earlier iteration with a higher validation effective rank, chosen from the minimum iterations on (Phase 1 table: 'weights of iteration').")
    dt = cg.document_table(batch, ca.report_alpha(batch))
    assert dt.loc[('ODCM', 'ours (40 stories, 1 seed(s))')].tolist() == ['50.0', '40.0', '0.062500', '10.0', '100.0', f"{2 * ppl('ODCM', 40):.2f}",
                                                                        f"{ppl('ODCM', 40):.2f}", '12.5', '-0.300']
    assert dt.loc[('MCDL', 'the New-LLM guidelines')].tolist() == ['n/a', '82.7', 'n/a', 'n/a', 'n/a', '289.1', 'n/a', '20.3', '-0.423']
    hi = {(a, n, 0): {**cvfp_summary(a, n), 'val_er_percent': 40.0 + (5 if a == 'ODCM' and n > 10 else 0)} for a in ('MCDL', 'ODCM') for n in (10, 20, 40)}
    assert cg.odcm_sentence(make_batch(tmp_path / 'hi', summaries=hi)) == (
        '**Our ODCM raises the validation effective rank above MCDL at only 2 of 3 sample sizes**, where the New-LLM guidelines found it higher: ODCM 43.3% vs '
        'MCDL 40.0% (mean over 3 sample size(s), +3.3 points; higher at 2 of 3); training effective rank ODCM 50.0% vs MCDL 50.0% (higher at 0 of 3). '
        'The New-LLM guidelines: 86.7% vs 82.7% (+4.0 points).')
    assert cg.odcm_sentence(batch).startswith('**Our ODCM does not raise the validation effective rank above MCDL**, unlike the New-LLM guidelines')


def test_alpha(batch):
    a = ca.report_alpha(batch)
    assert a['window'] == 2 and (batch / 'alpha_progression.json').exists()
    t = ca.alpha_table(a)
    assert t.index.tolist() == [(alg, w) for alg in ('MCDL', 'ODCM') for w in ('all points', '1', '2')]
    assert t.loc[('ODCM', 'all points')].tolist() == ['10-40', '1,000-4,000', '-0.30000', '1.1e+03', '1.0000']  # the final epoch's PPL, twice the best here
    assert a['ppl'] == 'final_val_ppl' and a['protocols']['best_val_ppl']['ODCM']['overall']['A'] == pytest.approx(550)
    s = ca.alpha_sentences(a)
    assert len(s) == 2 and s[1].startswith('**ODCM**: alpha -0.30000 (R^2 1.0000) over 3 sample sizes; window alpha -0.30000 -> -0.30000 (change ')


def test_one_seed_one_window(tmp_path):
    b = make_batch(tmp_path / 'b', algs=('MCDL',), samples=(10, 20), window=None)
    a = ca.report_alpha(b)
    assert a['window'] == 4
    assert ca.alpha_sentences(a) == ['**MCDL**: alpha -0.30000 (R^2 1.0000) over 2 sample sizes; one window of 2 points (no change to report).']
    assert cr.checks_summary(b).endswith(f"{C1} passed in 0 of 2 runs, {C2} passed in 2 of 2 runs, {C3} passed in 1 of 2 runs, {C4} passed in 0 of 2 runs "
                                         "(2 run(s) between the failure line and the New-LLM guidelines' effective-rank band).")
    assert 'ODCM' not in cr.phase1_sentence(b)


def test_failed_run_is_listed_and_left_out(tmp_path):
    b = make_batch(tmp_path / 'b', seeds=(0, 1), failed={('ODCM', 20, 1)})
    assert cr.runs_sentence(b) == '**1 of 16 run(s) did not complete:** `run3-s1` (failed: RuntimeError: boom)'
    rt = cr.runs_table(b)
    assert rt[rt.status != 'completed'].values.tolist() == [['run3', 1, 'failed', '', 'RuntimeError: boom']]
    assert 'run3-s1' not in cr.phase1_table(b).index and len(cr.phase2_table(b)) == 11
    assert cr.checks_counts(b)[C2] == (11, 11)
    a = ca.batch_alpha(b, 2)
    assert a['algorithms']['ODCM']['points'][1]['runs'] == ['run3-s0']
    assert len(cr.speed_sentences(b)) == 2 and cr.embed_table(b).index.tolist() == [0, 1]


def test_missing_run_and_metrics(tmp_path):
    no_ppl = {k: v for k, v in cvfp_summary('MCDL', 20).items() if k not in ('best_val_ppl', 'final_val_ppl')}
    no_checks = {k: v for k, v in cvfp_summary('ODCM', 20).items() if k not in ('checks', 'val_er', 'stop_reason')}
    b = make_batch(tmp_path / 'b', samples=(10, 20, 40), summaries={('MCDL', 20, 0): no_ppl, ('ODCM', 20, 0): no_checks})
    write_json(b / 'batch.json', {**json.loads((b / 'batch.json').read_text()), 'variants': ['embed', 'phase1-speed', 'run0', 'ghost']})
    assert '`ghost-s0` (missing: never ran)' in cr.runs_sentence(b)
    assert cr.phase2_table(b).loc['run2-s0', 'best val PPL'] == 'n/a'
    row = cr.checks_table(b).loc['run3-s0']
    assert row.tolist() == ['ODCM', 'n/a', 'n/a', 'n/a', 'n/a']
    assert cr.check_details(b).loc['run3-s0'].values.tolist() == [['n/a', 'n/a', 'n/a']] * 4
    assert cr.checks_counts(b) == {C1: (0, 5), C2: (5, 5), C3: (3, 5), C4: (2, 5)}
    p1 = cr.phase1_table(b).loc['run3-s0']
    assert (p1['val ER'], p1['stopped by']) == ('n/a', 'n/a')
    a = ca.batch_alpha(b, 2)  # the run without a PPL is no alpha point
    assert [p['samples'] for p in a['algorithms']['MCDL']['points']] == [10, 40]
    assert ca.alpha_table(a).loc[('MCDL', 'all points'), 'stories'] == '10-40'


def test_alpha_per_seed_with_mean_and_spread(tmp_path):
    "Each seed is fitted on its own: alpha per seed, their mean, sd (n - 1) and range; the fit on the seed means beside them."
    def with_alpha(alg, n, seed, al):
        p = 500 * (100 * n) ** al
        return {**cvfp_summary(alg, n, seed), 'best_val_ppl': p / 2, 'final_val_ppl': p, 'common_val_ppl': 3 * p}
    alphas = {0: -0.30, 1: -0.36}
    b = make_batch(tmp_path / 'b', algs=('MCDL',), samples=(10, 20, 40), seeds=(0, 1),
                   summaries={('MCDL', n, sd): with_alpha('MCDL', n, sd, al) for n in (10, 20, 40) for sd, al in alphas.items()})
    a = ca.report_alpha(b)
    m = a['algorithms']['MCDL']
    assert {k: round(v['alpha'], 9) for k, v in m['seeds'].items()} == {'0': -0.3, '1': -0.36}
    sa = m['seed_alpha']
    assert (sa['n'], round(sa['mean'], 9), round(sa['min'], 9), round(sa['max'], 9)) == (2, -0.33, -0.36, -0.3)
    assert sa['sd'] == pytest.approx(0.06 / math.sqrt(2))
    # the fit on the mean PPL over seeds is another number than the mean of the seeds' alphas
    toks, mean_ppl = [1000, 2000, 4000], [(500 * t ** -0.3 + 500 * t ** -0.36) / 2 for t in (1000, 2000, 4000)]
    assert m['overall']['alpha'] == pytest.approx(np.polyfit(np.log(toks), np.log(mean_ppl), 1)[0])
    t = ca.alpha_seed_table(a)
    assert t.loc[('MCDL', ca.ALPHA_PPL['final_val_ppl'])].tolist()[1:] == ['-0.3000', '-0.3600', f'-0.3300 ± {0.06 / math.sqrt(2):.4f}', '0.0600']
    assert t.loc[('MCDL', ca.ALPHA_PPL['common_val_ppl']), 'seed 1'] == '-0.3600'  # 3x the PPL: the same slope
    assert ca.alpha_sentences(a)[0].endswith('Per seed: -0.30000 (seed 0), -0.36000 (seed 1); over seeds -0.33000 ± 0.04243 (mean ± sd), range 0.06000.')
    assert cg.document_table(b, a).loc[('MCDL', 'ours (40 stories, 2 seed(s))'), 'alpha'] == '-0.330 ± 0.042 (2 seeds)'


def test_coverage_and_embedding_without_records(batch):
    "Runs from before the coverage rule and without --train-embedding say so instead of failing."
    assert cr.coverage_sentence(batch) == 'The runs recorded no validation coverage (they predate the coverage rule).'
    assert cr.coverage_table(batch).loc['run0-s0', 'rule holds'] == 'n/a'
    assert cg.embedding_sentence(batch).startswith('No run trained the embedding (run the batch with `--train-embedding` for the comparison).')
    assert len(cg.embedding_table(batch)) == 0


def test_embedding_pairs(tmp_path):
    trained = lambda a, n, s: {**cvfp_summary(a, n, s), 'phase2_train_embedding': True, 'final_val_ppl': 3 * ppl(a, n) * (1 if n < 40 else 0.1)}
    b = make_batch(tmp_path / 'b', samples=(10, 40))
    # the trained twins: extra run folders with their own labels
    for (a, n) in (('MCDL', 10), ('MCDL', 40)):
        d = b / f'tw{a}{n}-s0'; d.mkdir(); write_json(d / 'summary.json', trained(a, n, 0))
    write_json(b / 'batch.json', {**json.loads((b / 'batch.json').read_text()), 'variants': json.loads((b / 'batch.json').read_text())['variants'] + ['twMCDL10', 'twMCDL40']})
    t = cg.embedding_table(b)
    assert t.index.tolist() == [('MCDL', 10, 0), ('MCDL', 40, 0)]
    f10, t10 = 2 * ppl('MCDL', 10), 3 * ppl('MCDL', 10)
    assert t.loc[('MCDL', 10, 0), ['frozen: val PPL', 'trained: val PPL', 'frozen vs trained (%)']].tolist() == [f'{f10:.2f}', f'{t10:.2f}', f'{100 * (f10 - t10) / t10:+.1f}']
    s = cg.embedding_sentence(b)
    assert s.startswith('**The frozen embedding gives the lower validation PPL in 1 of 2 pairs**') and 'lower in 1 of 2' in s
    assert len(cr.phase1_table(b)) == 4 and len(cr.cvfp_runs(b, None)) == 6  # the trained twins stay out of the other tables


def test_empty_batch(tmp_path):
    for b in (tmp_path / 'bare', tmp_path / 'asked'):
        b.mkdir()
    write_json(tmp_path / 'asked' / 'batch.json', {'study': 'cvfp', 'variants': ['embed'], 'seeds': [0]})
    assert cr.batch_runs(tmp_path / 'bare') == [] and cr.runs_sentence(tmp_path / 'bare') == '**No runs in this batch directory.**'
    assert cr.runs_sentence(tmp_path / 'asked') == '**1 of 1 run(s) did not complete:** `embed-s0` (missing: never ran)'
    for b in (tmp_path / 'bare', tmp_path / 'asked'):
        assert cr.cvfp_runs(b) == []
        for f in (cr.embed_table, cr.speed_table, cr.phase1_table, cr.checks_table, cr.check_details, cr.phase2_table, cr.timing_table,
                  cr.phase1_curves, cr.phase2_curves):
            assert len(f(b)) == 0, f
        assert cr.speed_sentences(b) == []
        assert (cr.phase1_sentence(b), cr.checks_summary(b)) == ('No completed CVFP run.', 'No completed CVFP run to check.')
        a = ca.report_alpha(b)
        assert len(ca.alpha_table(a)) == 0 and ca.alpha_sentences(a) == ['No algorithm has completed runs to fit.']
    assert cr.checks_counts([]) == {C1: (0, 0), C2: (0, 0), C3: (0, 0), C4: (0, 0)}
    assert cr.agreement_sentence([]) == 'No CVFP run recorded the fixed-point agreement.'
    assert cg.layers_sentence(tmp_path / 'bare') == cg.phase1_settings_sentence(tmp_path / 'bare') == 'No completed CVFP run.'
    from oelm_nb.report.tables import load_runs
    from oelm_nb.report.page import batch_line  # the one batch line of every report's provenance footer
    assert batch_line(tmp_path / 'bare', load_runs(tmp_path / 'bare')).endswith(
        ': study `None`, preset `None`, data `None`, variants none, seeds None, flags none, overrides none; budget not recorded; '
        '0 of 0 runs completed.')


# ------------------------------------------------------------------ the answers through the evidence kit (issue 38)
def three_seeds(d: Path) -> Path:
    "Three seeds: ODCM's validation effective rank 4, 5 and 6 points above MCDL's at every sample size, speed-ups 20, 21 and 22x."
    base = lambda a, n, s: {**cvfp_summary(a, n, s), 'val_er_percent': 40.0 + (4 + s if a == 'ODCM' else 0)}
    b = make_batch(d, seeds=(0, 1, 2), summaries={(a, n, s): base(a, n, s) for a in ('MCDL', 'ODCM') for n in (10, 20, 40) for s in (0, 1, 2)})
    for s in (0, 1, 2): write_json(b / f'phase1-speed-s{s}' / 'summary.json', speed_summary(20.0 + s))
    return b


def test_answers_trace_to_the_summaries(tmp_path):
    "Q1-Q4 from the runs table `oelm run` passes; Q1's and Q2's numbers recomputed here with scipy from the summaries."
    from scipy import stats
    from oelm_nb.report.tables import load_runs
    b = three_seeds(tmp_path / 'b')
    q1, q2, q3, q4 = cr.cvfp_answers(load_runs(b))
    assert [(a.qid, a.verdict) for a in (q1, q2, q3, q4)] == [('Q1', 'supported'), ('Q2', 'supported'), ('Q3', 'rejected'), ('Q4', 'rejected')]
    d = np.array([4.0, 5.0, 6.0])  # per seed, ODCM - MCDL averaged over the three sample sizes
    lo, hi = stats.t.interval(0.95, 2, loc=d.mean(), scale=stats.sem(d))
    assert (q1.estimate, q1.interval, q1.seeds) == ('+5.0 points', f'95% CI {lo:+.1f} points .. {hi:+.1f} points', '3 paired seeds')
    g = np.log([20.0, 21.0, 22.0])  # speed-up = sequential / parallel seconds: the ratio of geometric means
    glo, ghi = stats.t.interval(0.95, 2, loc=g.mean(), scale=stats.sem(g))
    assert (q2.estimate, q2.interval) == (f'{np.exp(g.mean()):.1f}x', f'95% CI {np.exp(glo):.1f}x .. {np.exp(ghi):.1f}x')
    assert q2.budget == '6,400 tokens, 10 iterations per run' and q1.budget == '10-40 stories, 1,000-4,000 training tokens, 4 Phase 1 iterations, 30 Phase 2 steps per run'
    exact = 'rests on the normal assumption: the exact sign-flip test gives p = 0.25 (with 3 seeds it cannot go below 0.25)'
    assert own(q1) == [exact] and own(q2)[-1] == exact and cr.SHARED_CPU in q2.caveats
    assert q3.estimate == f'{C1} passed in 0 of 18 runs, {C2} passed in 18 of 18 runs, {C3} passed in 12 of 18 runs' and q3.interval == ''
    assert q4.estimate == 'Phase 1 ended at its fixed point in 6 of 18 runs, near it in 6, off it in 6'  # 40, 20 and 10 stories
    assert cr.cvfp_answers(b) == [q1, q2, q3, q4]  # a batch directory gives the same answers


def test_answers_one_seed_slow_and_empty(tmp_path):
    one = cr.cvfp_answers(make_batch(tmp_path / 'one', speedup=8.0))
    assert [a.verdict for a in one[:2]] == ['inconclusive (needs >= 2 seeds)'] * 2 and one[1].estimate == '8.0x'
    assert one[0].interval == '' and cr.ONE_SEED in one[0].caveats
    (tmp_path / 'bare').mkdir()
    none = cr.cvfp_answers(tmp_path / 'bare')
    assert [a.verdict for a in none] == ['no data'] * 4
    assert none[1].method == f"no completed phase1-speed run (oelm run cvfp --out {tmp_path / 'bare'} times it)"
    mcdl = cr.cvfp_answers(make_batch(tmp_path / 'mcdl', algs=('MCDL',)))
    assert mcdl[0].verdict == 'no data' and mcdl[0].method.startswith('no sample size with completed MCDL and ODCM runs')


def test_registered_cvfp_study_answers(tmp_path):
    "`oelm run cvfp` prints `study_answers(get_study('cvfp'))(runs)`: Answers for a small batch."
    from oelm_nb.report.evidence import Answer, answers_text
    from oelm_nb.report.tables import load_runs
    from oelm_nb.lab.study import get_study, study_answers
    got = study_answers(get_study('cvfp'))(load_runs(three_seeds(tmp_path / 'b')))
    assert [a.qid for a in got] == ['Q1', 'Q2', 'Q3', 'Q4'] and all(isinstance(a, Answer) for a in got)
    assert got[0].estimate == '+5.0 points' and 'Q4' in answers_text(got)


def test_a_precision_batch_answers_the_comparison_it_sized(tmp_path):
    "--precision sized ODCM-n40 vs MCDL-n40 (relative effective rank): the answers state it with Stein's interval (issue 46)."
    from fake_runs import write_precision
    from oelm_nb.studies.cvfp.report import cvfp_answers
    root = three_seeds(tmp_path / 'b')
    write_precision(root, 'val_er_percent', 'ODCM-n40', 'MCDL-n40', mean=0.1, low=0.06, high=0.14)
    a = cvfp_answers(root)[-1]
    assert (a.qid, a.verdict, a.estimate, a.interval, a.n) == ('SIZED', 'MCDL-n40 lower', '+10.00%', '95% CI +6.00% .. +14.00%', 8)
    assert "Stein's two-stage" in a.method and any('assumes normal' in c for c in a.caveats)


def test_the_console_summary_prints_the_answers_and_writes_answers_json(tmp_path, capsys):
    "What `oelm run cvfp` prints after the batch: the answers through the kit, and answers.json beside the runs."
    import json
    from oelm_nb.app.cli import print_batch_summary
    from oelm_nb.report.evidence import Answer
    root = three_seeds(tmp_path / 'b')
    print_batch_summary(root)
    out = capsys.readouterr().out
    stored = json.loads((root / 'answers.json').read_text())
    assert stored['study'] == 'cvfp' and [a['qid'] for a in stored['answers']] == ['Q1', 'Q2', 'Q3', 'Q4']
    q1 = stored['answers'][0]  # numbers as numbers beside the text (issue 46)
    assert all(isinstance(q1[k], float) for k in ('estimate', 'low', 'high', 'p')) and q1['n'] == 3
    assert q1['estimate_text'] == f"{q1['estimate']:+.1f} points" and q1['low'] < q1['estimate'] < q1['high']
    for a in map(Answer.from_dict, stored['answers']): assert f'{a.qid:>4} {a.verdict}' in out
