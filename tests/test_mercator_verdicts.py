"""The Mercator report's tables and verdicts (`oelm_nb.studies.mercator.report`) on small fake batch directories.

Each test writes a batch the way the runner does (batch.json, per-run summary.json and metrics.jsonl) and checks
the sentences the report would print and the study's answers (`mercator_answers`, through the evidence kit).
Expected intervals are recomputed here with scipy, not taken from `report.compare`.
"""
from __future__ import annotations
import json, math
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from oelm_nb.base.rundir import write_json
from oelm_nb.studies.mercator.report import (BASELINE, ONE_SEED_NOTE, acc_table, agreement_table, collapse_guard,
                                     failed_runs_note, headline, mercator_answers, mercator_runs, ppl_table, protocol_text, runs_table,
                                     student_variants, style_acc, style_agreement, style_ppl, style_runs_table)
from oelm_nb.report.page import batch_line
from oelm_nb.studies.mercator.diagnosis import alignment, cause_sentence, mse_sentence, mse_table


def own(a) -> list:
    "An answer's caveats but the study's family line (the Holm family, issue 46)."
    return [c for c in a.caveats if not c.startswith('one family of')]


def fake_batch(root: Path, ppl: dict, raw: dict | None = None, centered: dict | None = None, name: str = 'batch',
               acc: dict | None = None, ce: dict | None = None, task: str | None = None, roles: bool = False) -> Path:
    """A Mercator batch directory under `root`: a teacher (PPL 10) and the students of `ppl`.

    `ppl` maps a variant to its best_val_ppl per seed (None: the run failed). `raw` / `centered` map a variant to its
    final KV cosine (default 0.6 / 0.55); with `centered` given, a variant left out of it records no centered cosine.
    `acc` maps a variant to its task accuracy per seed (`task` names the task), `ce` to the training ce_loss of its last
    records (default 2.0); `roles` writes each summary's role, as the new protocol's runs do.
    """
    out = root / name; out.mkdir(parents=True)
    n_seeds = max((len(v) for v in ppl.values()), default=1)
    variants = ['teacher', *ppl] if ppl else []
    write_json(out / 'batch.json', {'study': 'mercator', 'preset': 'tiny', 'data': 'synthetic', 'variants': variants,
                                    'seeds': list(range(n_seeds)), 'steps': 30, 'options': {}})
    for v in variants:
        for s in range(n_seeds):
            d = out / f'{v}-s{s}'; d.mkdir()
            p = 10.0 if v == 'teacher' else ppl[v][s]
            if p is None:
                write_json(d / 'summary.json', {'status': 'failed', 'error': 'RuntimeError: CUDA out of memory'}); continue
            summ = {'status': 'completed', 'best_val_ppl': p, 'steps': 30, 'wall_time_s': 3.0}
            if roles: summ['role'] = v if v in ('teacher', 'pretrain') else 'student'
            if acc and v in acc: summ |= {'task_acc': acc[v][s], 'task': task or 'recall'}
            if v not in ('teacher', 'pretrain'):
                r = (raw or {}).get(v, 0.6)
                c = (centered or {}).get(v) if centered is not None else 0.55
                summ['final_kv_cos'] = r
                if c is not None: summ |= {'final_kv_cos_centered': c, 'kv_cos_centered_layers': [c - 0.1, c + 0.1]}
            write_json(d / 'summary.json', summ)
            last = (ce or {}).get(v, 2.0)
            (d / 'metrics.jsonl').write_text(''.join(json.dumps({'step': k, 'ce_loss': last + 3 - k, 'val_ppl': p + 5 - k}) + '\n'
                                                     for k in (1, 2, 3)) + ''.join(json.dumps({'step': k, 'ce_loss': last}) + '\n' for k in (4, 5)))
    return out


def t_interval(a: list[float], b: list[float]) -> tuple[float, float, float]:
    """The paired relative difference on the log scale (independent of report.compare): exp(mean log(a/b)) - 1, the ratio
    of geometric means - 1, with the 95% t-interval of the log ratios taken back the same way."""
    d = np.log(np.array(a) / np.array(b))
    half = stats.t.ppf(0.975, len(d) - 1) * d.std(ddof=1) / math.sqrt(len(d))
    return math.expm1(d.mean()), math.expm1(d.mean() - half), math.expm1(d.mean() + half)


def verdict_of(tmp_path, ppl, **kw) -> str:
    "The report's answer (`headline`, which also gives the PPL verdict) on a fake batch."
    return headline(mercator_runs(fake_batch(tmp_path, ppl, **kw)))


Q = '**Does any distillation variant beat `no-distill`?** '
NO_ACC = "on task accuracy, cannot say (no distilled student has a run paired with the baseline's)"


# ------------------------------------------------------------------ did distillation help? one seed
def test_one_seed_helped_has_no_interval(tmp_path):
    v = verdict_of(tmp_path, {'mercator-b0': [30.0], 'mse': [33.0], BASELINE: [32.0]})
    assert v == (Q + "On validation PPL, untested: better for 1 of 2 (mercator-b0) in a single paired seed, the best `mercator-b0` at -6.25% "
                 "(1 seed: needs >= 2 seeds)" + ONE_SEED_NOTE + '; ' + NO_ACC + '.')
    assert 'CI' not in v and 'not tested against seed-to-seed noise' in v and 'needs >= 2 seeds' in v
    ppl = ppl_table(mercator_runs(tmp_path / 'batch'))
    assert ppl.loc[['mercator-b0', 'mse', BASELINE], 'best val PPL'].tolist() == [30.0, 33.0, 32.0]
    assert ppl.loc['mse', 'vs no-distill'] == pytest.approx(33 / 32 - 1)  # the other one is worse (+3.12%)


def test_one_seed_did_not_help(tmp_path):
    v = verdict_of(tmp_path, {'mercator-b0': [34.0], 'mse': [33.0], BASELINE: [32.0]})
    assert v.startswith(Q + "On validation PPL, no: even the best, `mse` at +3.12% (1 seed: needs >= 2 seeds), is not better")
    assert v.endswith(ONE_SEED_NOTE + '; ' + NO_ACC + '.') and 'CI' not in v


def test_one_seed_ppl_table_shows_no_interval(tmp_path):
    ppl = ppl_table(mercator_runs(fake_batch(tmp_path, {'mercator-b0': [30.0], BASELINE: [32.0]})))
    assert np.isnan(ppl.loc['mercator-b0', 'low']) and ppl.loc['mercator-b0', 'paired seeds'] == 1
    html = style_ppl(ppl).to_html()
    assert '-6.25% (1 seed: needs >= 2 seeds)' in html and 'CI' not in html and 'baseline' in html


# ------------------------------------------------------------------ three seeds: intervals
def test_three_seeds_helped(tmp_path):
    a, b = [30.0, 30.5, 29.8], [32.0, 32.2, 31.9]
    v = verdict_of(tmp_path, {'mercator-b0': a, 'mse': [32.1, 31.8, 32.3], BASELINE: b})
    m, lo, hi = t_interval(a, b)
    assert v == (Q + f"On validation PPL, yes: 1 of 2 (mercator-b0) beat it beyond seed-to-seed noise, the best `mercator-b0` at "
                 f"{m:+.2%} (95% CI {lo:+.2%} .. {hi:+.2%}, 3 seeds); " + NO_ACC + '.')
    assert 'resolvably worse' not in v and ONE_SEED_NOTE not in v
    ppl = ppl_table(mercator_runs(tmp_path / 'batch'))
    assert ppl.loc[BASELINE, 'best val PPL'] == pytest.approx(32.0333, abs=1e-4) and ppl.loc['mercator-b0', 'best val PPL'] == pytest.approx(30.1)


def test_three_seeds_not_resolvably(tmp_path):
    a, b = [30.0, 34.0, 31.0], [32.0, 32.0, 32.0]
    v = verdict_of(tmp_path, {'mercator-b0': a, BASELINE: b})
    m, lo, hi = t_interval(a, b)
    assert lo < 0 < hi and m < 0
    assert v == (Q + "On validation PPL, not resolvably: better on average for 1 of 1 (mercator-b0) but within seed-to-seed noise, the best "
                 f"`mercator-b0` at {m:+.2%} (95% CI {lo:+.2%} .. {hi:+.2%}, 3 seeds); " + NO_ACC + '.')
    ppl = ppl_table(mercator_runs(tmp_path / 'batch'))
    assert ppl.loc[['mercator-b0', BASELINE], 'best val PPL'].tolist() == pytest.approx([31.6667, 32.0], abs=1e-4)


def test_three_seeds_did_not_help_and_resolvably_worse(tmp_path):
    v = verdict_of(tmp_path, {'mercator-b0': [33.0, 34.0, 33.5], 'mse': [32.5, 31.0, 33.0], BASELINE: [32.0, 32.0, 32.0]})
    m, lo, hi = t_interval([32.5, 31.0, 33.0], [32.0] * 3)  # the ratio of geometric means: +0.49%, not the mean ratio's +0.52%
    assert lo < 0 < m < hi
    assert v.startswith(Q + f"On validation PPL, no: even the best, `mse` at {m:+.2%} (95% CI {lo:+.2%} .. {hi:+.2%}, 3 seeds)")
    assert v.endswith('3 seeds), is not better, and resolvably worse: 1 of 2 (mercator-b0); ' + NO_ACC + '.')
    ppl = ppl_table(mercator_runs(tmp_path / 'batch'))
    assert ppl.loc[['mse', BASELINE], 'best val PPL'].tolist() == pytest.approx([32.1667, 32.0], abs=1e-4)


def test_three_seeds_ppl_table_interval(tmp_path):
    a, b = [30.0, 30.5, 29.8], [32.0, 32.2, 31.9]
    ppl = ppl_table(mercator_runs(fake_batch(tmp_path, {'mercator-b0': a, BASELINE: b})))
    m, lo, hi = t_interval(a, b)
    assert ppl.loc['mercator-b0', ['vs no-distill', 'low', 'high']].tolist() == pytest.approx([m, lo, hi])
    assert f'{m:+.2%} (95% CI {lo:+.2%} .. {hi:+.2%}, 3 seeds)' in style_ppl(ppl).to_html()


# ------------------------------------------------------------------ failed runs
def test_failed_student_run_is_listed_and_left_out(tmp_path):
    runs = mercator_runs(fake_batch(tmp_path, {'mercator-b0': [None], 'mse': [31.0], BASELINE: [32.0]}))
    tab = runs_table(runs)
    assert tab.set_index('variant').loc['mercator-b0', ['status', 'error']].tolist() == ['failed', 'RuntimeError: CUDA out of memory']
    assert failed_runs_note(runs) == '**1 run(s) did not complete:** `mercator-b0-s0` (failed: RuntimeError: CUDA out of memory)'
    assert 'fde0dd' in style_runs_table(tab).to_html()
    assert 'mercator-b0' not in ppl_table(runs).index and 'mercator-b0' not in agreement_table(runs).index
    assert headline(runs).startswith(Q + 'On validation PPL, untested: better for 1 of 1 (mse) in a single paired seed')
    assert mse_sentence(mse_table(runs)) == 'The comparison needs completed `mse` and Mercator runs.'


def test_failed_baseline_cannot_say(tmp_path):
    runs = mercator_runs(fake_batch(tmp_path, {'mercator-b0': [30.0], 'mse': [31.0], BASELINE: [None]}))
    assert headline(runs) == Q + 'Cannot say: the `no-distill` baseline did not complete.'
    assert alignment(agreement_table(runs)) == ''
    assert 'no-distill-s0' in failed_runs_note(runs)


def test_failed_seed_of_the_baseline_pairs_the_rest(tmp_path):
    "Seed 1 of the baseline failed: the comparison pairs seeds 0 and 2 only."
    a, b = [30.0, 30.5, 29.8], [32.0, None, 31.9]
    ppl = ppl_table(mercator_runs(fake_batch(tmp_path, {'mercator-b0': a, BASELINE: b})))
    assert ppl.loc['mercator-b0', 'paired seeds'] == 2 and ppl.loc[BASELINE, 'seeds'] == 2
    m, lo, hi = t_interval([30.0, 29.8], [32.0, 31.9])
    assert ppl.loc['mercator-b0', ['low', 'high']].tolist() == pytest.approx([lo, hi])


# ------------------------------------------------------------------ KV agreement
def test_missing_centered_metric(tmp_path):
    runs = mercator_runs(fake_batch(tmp_path, {'mercator-b0': [30.0], BASELINE: [32.0]}, centered={}))
    assert runs.final_kv_cos_centered.isna().all()
    tab = runs_table(runs).set_index('variant')
    assert tab.loc['mercator-b0', ['pass (centered)', 'pass (raw)', 'collapsed']].tolist() == ['', 'below pass', '']
    agree = agreement_table(runs)
    assert agree.loc['mercator-b0', 'centered per layer'] == '' and agree.loc['mercator-b0', 'stage (centered)'] == ''
    assert collapse_guard(agree) == "**Collapse guard:** no completed student recorded a centered cosine; the guard cannot be checked."
    style_agreement(agree).to_html()
    assert headline(runs).startswith(Q + 'On validation PPL, untested: better for 1 of 1 (mercator-b0)')


def test_collapse_guard_fires(tmp_path):
    runs = mercator_runs(fake_batch(tmp_path, {'mercator-b0': [30.0], 'mse': [31.0], BASELINE: [32.0]},
                                    raw={'mercator-b0': 0.92, 'mse': 0.8, BASELINE: 0.5}, centered={'mercator-b0': 0.4, 'mse': 0.75, BASELINE: 0.45}))
    agree = agreement_table(runs)
    assert agree.loc['mercator-b0', 'raw - centered'] == pytest.approx(0.52)
    assert agree.loc['mse', 'centered per layer'] == '0.65, 0.85'
    assert collapse_guard(agree) == ("**Collapse guard:** 1 variant(s) lose more than 0.1 of cosine to centering: `mercator-b0` raw 0.920 (Great) "
                                     "but centered 0.400 (Adapting). Their raw agreement is largely one shared direction, not token-by-token agreement.")
    assert alignment(agree).startswith("KV agreement: the most aligned distilled student, `mse`, reached a centered cosine of 0.750 (Good; raw 0.800) "
                                       "against 0.450 for the probe of the undistilled student (higher: distillation did make")


def test_collapse_guard_quiet(tmp_path):
    runs = mercator_runs(fake_batch(tmp_path, {'mercator-b0': [30.0], BASELINE: [32.0]},
                                    raw={'mercator-b0': 0.62, BASELINE: 0.5}, centered={'mercator-b0': 0.55, BASELINE: 0.52}))
    agree = agreement_table(runs)
    assert collapse_guard(agree) == ("**Collapse guard:** no variant loses more than 0.1 of cosine to centering; the raw cosines reflect "
                                     "token-by-token agreement.")
    assert 'not higher: distillation did not make' in alignment(agree.assign(**{'centered cosine': [0.5, 0.52]}))


# ------------------------------------------------------------------ Mercator against MSE
def test_mercator_against_mse(tmp_path):
    runs = mercator_runs(fake_batch(tmp_path, {'mercator-b0': [30.0, 30.2], 'mercator-b0.1': [33.0, 33.4], 'mse': [31.0, 31.1], BASELINE: [32.0, 32.0]},
                                    centered={'mercator-b0': 0.7, 'mercator-b0.1': 0.5, 'mse': 0.6, BASELINE: 0.4}))
    mm = mse_table(runs)
    m, lo, hi = t_interval([30.0, 30.2], [31.0, 31.1])
    assert mm.loc['mercator-b0', 'PPL vs MSE'] == f'{m:+.2%} (95% CI {lo:+.2%} .. {hi:+.2%}, 2 seeds)'
    m2 = np.mean([33 / 31 - 1, 33.4 / 31.1 - 1])
    assert mse_sentence(mm) == (f"**1 of 2 Mercator variants reached a lower validation perplexity than MSE** (mercator-b0 {m:+.2%}, "
                                f"mercator-b0.1 {m2:+.2%}), and 1 of 2 a higher centered KV cosine (MSE 0.600).")


# ------------------------------------------------------------------ an empty batch
def test_empty_batch(tmp_path):
    out = fake_batch(tmp_path, {})
    runs = mercator_runs(out)
    assert runs.empty
    assert style_runs_table(runs_table(runs)).to_html()
    assert failed_runs_note(runs) == ''
    assert agreement_table(runs).empty and ppl_table(runs).empty and mse_table(runs).empty
    assert headline(runs) == Q + 'Cannot say: the `no-distill` baseline did not complete.'
    assert alignment(agreement_table(runs)) == ''
    assert mse_sentence(mse_table(runs)) == 'The comparison needs completed `mse` and Mercator runs.'
    assert batch_line(out, runs).endswith('variants none, seeds [0], flags none, overrides none; budget not recorded; 0 of 0 runs completed.')


def test_single_paired_seed_of_one_variant_gives_no_interval(tmp_path):
    "Two of mse's three seeds failed: the answer names it, and gives an interval only where there are paired seeds for one."
    v = verdict_of(tmp_path, {'mercator-b0': [30.0, 30.5, 29.8], 'mse': [31.0, None, None], BASELINE: [32.0, 32.2, 31.9]})
    assert v.startswith(Q + 'On validation PPL, yes: 1 of 2 (mercator-b0) beat it beyond seed-to-seed noise')
    assert v.count('CI') == 1 and '3 seeds) (one paired seed for mse: the differences are not tested against seed-to-seed noise' in v
    ppl = ppl_table(mercator_runs(tmp_path / 'batch'))
    assert ppl.loc['mse', 'vs no-distill'] < 0 and np.isnan(ppl.loc['mse', 'low'])  # lower, untested


# ------------------------------------------------------------------ the headline and the cause (the new protocol)


def diff_interval(a: list[float], b: list[float]) -> tuple[float, float, float]:
    "Mean and 95% t-interval of the paired absolute differences a - b (independent of the module)."
    d = np.array(a) - np.array(b)
    half = stats.t.ppf(0.975, len(d) - 1) * d.std(ddof=1) / math.sqrt(len(d))
    return d.mean(), d.mean() - half, d.mean() + half


def test_headline_mercator_beats_no_distill(tmp_path):
    a, b = [30.0, 30.5, 29.8], [32.0, 32.2, 31.9]
    acc_a, acc_b = [0.30, 0.34, 0.31], [0.20, 0.22, 0.23]
    runs = mercator_runs(fake_batch(tmp_path, {'mercator-b0': a, 'mse': [32.1, 31.8, 32.3], BASELINE: b}, roles=True,
                                    acc={'mercator-b0': acc_a, 'mse': [0.2, 0.2, 0.2], BASELINE: acc_b}, task='recall'))
    m, lo, hi = t_interval(a, b)
    am, alo, ahi = diff_interval(acc_a, acc_b)
    assert lo < hi < 0 and alo > 0
    assert headline(runs) == (Q + f"On validation PPL, yes: 1 of 2 (mercator-b0) beat it beyond seed-to-seed noise, the best `mercator-b0` at "
                              f"{m:+.2%} (95% CI {lo:+.2%} .. {hi:+.2%}, 3 seeds); on recall accuracy, yes: 1 of 2 (mercator-b0) beat it "
                              f"beyond seed-to-seed noise, the best `mercator-b0` at {100 * am:+.1f} points (95% CI {100 * alo:+.1f} points .. "
                              f"{100 * ahi:+.1f} points, 3 seeds).")
    assert cause_sentence(runs) == ''  # a Mercator student wins: nothing to explain
    tab = acc_table(runs)
    assert tab.loc['mercator-b0', ['vs no-distill', 'low', 'high']].tolist() == pytest.approx([100 * am, 100 * alo, 100 * ahi])
    assert f'{100 * am:+.1f} points (95% CI {100 * alo:+.1f} points .. {100 * ahi:+.1f} points, 3 seeds)' in style_acc(tab, 'recall accuracy').to_html()


def test_all_lose_and_collapsed(tmp_path):
    "Every Mercator student is worse and collapsed: the cause sentence gives the loss and names collapse with its count."
    a1, a2, b = [34.0, 35.0], [33.0, 33.6], [32.0, 32.2]
    runs = mercator_runs(fake_batch(tmp_path, {'mercator-b0': a1, 'mercator-b0.01': a2, BASELINE: b}, roles=True,
                                    raw={'mercator-b0': 0.97, 'mercator-b0.01': 0.96, BASELINE: 0.5},
                                    centered={'mercator-b0': 0.30, 'mercator-b0.01': 0.35, BASELINE: 0.45},
                                    acc={'mercator-b0': [0.1, 0.1], 'mercator-b0.01': [0.1, 0.12], BASELINE: [0.15, 0.14]},
                                    ce={'mercator-b0': 2.5, 'mercator-b0.01': 2.4, BASELINE: 2.0}))
    m, lo, hi = t_interval(a2, b)
    am, alo, ahi = diff_interval([0.1, 0.12], [0.15, 0.14])
    assert headline(runs).startswith(Q + f"On validation PPL, no: even the best, `mercator-b0.01` at {m:+.2%} (95% CI {lo:+.2%} .. {hi:+.2%}, "
                                     "2 seeds), is not better; on recall accuracy, no")
    s = cause_sentence(runs)
    assert s.startswith(f"**No Mercator student beats `no-distill`:** the best, `mercator-b0.01`, loses: PPL {m:+.2%} (95% CI {lo:+.2%} .. "
                        f"{hi:+.2%}, 2 seeds) and recall accuracy {100 * am:+.1f} points (95% CI {100 * alo:+.1f} points .. {100 * ahi:+.1f} "
                        "points, 2 seeds); checked in order, (a) collapse: 4 of 4 Mercator runs are collapsed (raw - centered > 0.1); (b) projector: ")
    assert "final training cross-entropy 2.450 against 2.000 for `no-distill` (+0.450 nats, higher in 2 of 2 paired seeds)" in s
    assert s.endswith(': this points to collapse (also consistent with a conflict between the KV term and cross-entropy).')
    tab = runs_table(runs).set_index(['variant', 'seed'])
    assert tab.loc[('mercator-b0', 0), ['pass (centered)', 'pass (raw)', 'collapsed']].tolist() == ['below pass', 'excellent', 'yes']
    assert tab.loc[(BASELINE, 0), 'collapsed'] == 'no'


def test_all_lose_projector_does_the_aligning(tmp_path):
    "Nothing collapsed; every capacity below the pass line and the probe as aligned as the students: the cause is the projector."
    v = ['low-capacity', 'mercator-b0.01', 'high-capacity']
    runs = mercator_runs(fake_batch(tmp_path, {**{x: [33.0, 33.5] for x in v}, BASELINE: [32.0, 32.1]}, roles=True,
                                    raw={x: 0.42 for x in [*v, BASELINE]}, centered={'low-capacity': 0.38, 'mercator-b0.01': 0.40,
                                                                                     'high-capacity': 0.41, BASELINE: 0.39},
                                    ce={x: 2.0 for x in [*v, BASELINE]}))
    s = cause_sentence(runs)
    assert ('(a) collapse: 0 of 6 Mercator runs are collapsed (raw - centered > 0.1); (b) projector: centered cosine 0.380 / 0.400 / 0.410 at '
            'low / default / high capacity (below the pass line 0.80 at every capacity), the `no-distill` probe 0.390 against 0.397 for the '
            'Mercator students (about the same, margin 0.05)') in s
    assert '(d) KV term against cross-entropy: the Mercator students\' final training cross-entropy 2.000 against 2.000' in s
    assert s.endswith(': this points to the projector.')
    weak = mercator_runs(fake_batch(tmp_path, {**{x: [33.0, 33.5] for x in v}, BASELINE: [32.0, 32.1]}, roles=True, name='weak',
                                    raw={x: 0.42 for x in [*v, BASELINE]}, centered={'low-capacity': 0.38, 'mercator-b0.01': 0.40,
                                                                                     'high-capacity': 0.41, BASELINE: 0.10},
                                    ce={x: 2.0 for x in [*v, BASELINE]}))
    assert cause_sentence(weak).endswith('(not the same, margin 0.05); (c) learning-rate ratio / warm-up: not measured (needs '
                                         '`mercator-warmup` and `mercator-b0.01`); (d) KV term against cross-entropy: the Mercator students\' '
                                         'final training cross-entropy 2.000 against 2.000 for `no-distill` (+0.000 nats, higher in 0 of 2 '
                                         'paired seeds): no single measurement explains it.')


def test_headline_one_seed_has_no_interval(tmp_path):
    runs = mercator_runs(fake_batch(tmp_path, {'mercator-b0': [34.0], 'mse': [33.0], BASELINE: [32.0]},
                                    acc={'mercator-b0': [0.1], 'mse': [0.3], BASELINE: [0.2]}))
    h = headline(runs)
    assert h == (Q + "On validation PPL, no: even the best, `mse` at +3.12% (1 seed: needs >= 2 seeds), is not better" + ONE_SEED_NOTE + "; "
                 "on recall accuracy, untested: better for 1 of 2 (mse) in a single paired seed, the best `mse` at +10.0 points (1 seed: needs "
                 ">= 2 seeds).")
    assert 'CI' not in h
    s = cause_sentence(runs)
    assert s.startswith("**No Mercator student beats `no-distill`:** the best, `mercator-b0`, loses: PPL +6.25% (1 seed: needs >= 2 seeds) "
                        "and recall accuracy -10.0 points (1 seed: needs >= 2 seeds)")
    assert 'CI' not in s


def test_headline_baseline_failed(tmp_path):
    runs = mercator_runs(fake_batch(tmp_path, {'mercator-b0': [30.0, 31.0], 'mse': [31.0, 31.5], BASELINE: [None, None]}))
    assert headline(runs) == Q + 'Cannot say: the `no-distill` baseline did not complete.'
    assert cause_sentence(runs) == '' and acc_table(runs).empty


def test_gsm8k_label_comes_from_the_task(tmp_path):
    runs = mercator_runs(fake_batch(tmp_path, {'mercator-b0': [30.0], BASELINE: [32.0]}, task='gsm8k',
                                    acc={'mercator-b0': [0.25], BASELINE: [0.25]}))
    assert 'GSM8K exact-match accuracy' in runs_table(runs).columns
    assert headline(runs).endswith('on GSM8K exact-match accuracy, no: even the best, `mercator-b0` at +0.0 points (1 seed: needs >= 2 seeds), '
                                   'is not better.')
    assert 'recall accuracy' not in headline(runs)


def test_roles_and_old_summaries(tmp_path):
    "The pre-training is no student whether the summaries record roles or not."
    for name, roles in (('new', True), ('old', False)):
        runs = mercator_runs(fake_batch(tmp_path, {'pretrain': [40.0], 'mercator-b0': [30.0], BASELINE: [32.0]}, roles=roles, name=name))
        assert student_variants(runs) == ['mercator-b0', BASELINE]
    assert 'pretrain' not in ppl_table(runs).index
    p = protocol_text(runs)
    assert p.startswith('**Protocol (read from the runs):** the student is first pre-trained as a language model for 30 steps (best val PPL 40.000')
    assert 'fine-tunes for 30 steps' in p and 'Loss 0.8234 | CosSim 0.1766' in p


def test_runs_table_escapes_run_data(tmp_path):
    "An error text is data: the styled runs table escapes it once it passes through safe_table."
    from oelm_nb.report.tables import safe_table
    out = fake_batch(tmp_path, {'mercator-b0': [None], BASELINE: [32.0]})
    write_json(out / 'mercator-b0-s0' / 'summary.json', {'status': 'failed', 'error': '<img src=x onerror=alert(1)>'})
    html = safe_table(style_runs_table(runs_table(mercator_runs(out)))).to_html()
    assert '<img' not in html and '&lt;img src=x' in html


# ------------------------------------------------------------------ the answers through the evidence kit (issue 38)
EXACT_3 = 'rests on the normal assumption: the exact sign-flip test gives p = 0.25 (with 3 seeds it cannot go below 0.25)'


def test_answers_three_seeds_trace_to_the_summaries(tmp_path):
    "PPL and accuracy answers: verdicts from the intervals, the best student's numbers recomputed here from the summaries."
    a, b, worse = [30.0, 30.5, 29.8], [32.0, 32.2, 31.9], [33.0, 34.0, 33.5]
    acc_a, acc_b = [0.30, 0.34, 0.31], [0.20, 0.22, 0.23]
    out = fake_batch(tmp_path, {'mercator-b0': a, 'mse': worse, BASELINE: b}, roles=True,
                     acc={'mercator-b0': acc_a, 'mse': [0.2, 0.2, 0.2], BASELINE: acc_b}, task='recall')
    from oelm_nb.report.tables import load_runs
    ppl, acc = mercator_answers(load_runs(out))  # the runs table `oelm run` passes, without the report's columns
    m, lo, hi = t_interval(a, b)
    assert (ppl.qid, ppl.verdict) == ('PPL', 'yes: 1 of 2 (mercator-b0) beat it; resolvably worse: 1 of 2 (mse)')
    assert (ppl.estimate, ppl.interval) == (f'best mercator-b0 {m:+.2%}', f'95% CI {lo:+.2%} .. {hi:+.2%}')
    assert 'ratio of geometric means (log scale)' in ppl.method and 'exact sign-flip p = 0.25' in ppl.method
    assert (ppl.side, ppl.test) == ('two-sided', 't-test (paired)') and ppl.p < 0.05  # the claim's p: its t-test
    assert ppl.seeds == '3 paired seeds' and ppl.budget == '30 steps per run' and own(ppl) == [EXACT_3]
    am, alo, ahi = (100 * x for x in diff_interval(acc_a, acc_b))
    assert (acc.qid, acc.verdict) == ('ACC', 'yes: 1 of 2 (mercator-b0) beat it')
    assert (acc.estimate, acc.interval) == (f'best mercator-b0 {am:+.1f} points', f'95% CI {alo:+.1f} points .. {ahi:+.1f} points')
    assert 'recall accuracy' in acc.question and own(acc) == [EXACT_3]
    assert mercator_answers(mercator_runs(out)) == [ppl, acc]  # the report's table gives the same answers


def test_answers_one_seed_and_no_baseline(tmp_path):
    one = mercator_answers(mercator_runs(fake_batch(tmp_path, {'mercator-b0': [34.0], 'mse': [33.0], BASELINE: [32.0]},
                                                   acc={'mercator-b0': [0.1], 'mse': [0.3], BASELINE: [0.2]}, name='one')))
    assert [x.verdict for x in one] == ['no: none is better on average', 'untested: better for 1 of 2 (mse) in a single paired seed']
    assert (one[0].estimate, one[0].interval) == (f'best mse {33 / 32 - 1:+.2%}', '')  # one seed: the ratio itself, no interval
    assert one[1].estimate == f'best mse {100 * (0.3 - 0.2):+.1f} points'
    assert all(x.caveats == [ONE_SEED_NOTE.strip()[1:-1]] for x in one)
    gone = mercator_answers(mercator_runs(fake_batch(tmp_path, {'mercator-b0': [30.0], BASELINE: [None]}, name='gone')))
    assert [(x.qid, x.verdict, x.method) for x in gone] == [(q, 'no data', 'the no-distill baseline did not complete') for q in ('PPL', 'ACC')]
    zero = mercator_answers(mercator_runs(fake_batch(tmp_path, {'mercator-b0': [30.0], BASELINE: [32.0]},
                                                    acc={'mercator-b0': [0.0], BASELINE: [0.0]}, name='zero')))
    assert (zero[1].verdict, zero[1].estimate) == ('cannot tell', 'every student and no-distill score 0.0% (2 runs)')


def test_registered_study_answers_through_the_kit(tmp_path):
    "`oelm run mercator` prints `study_answers(get_study('mercator'))(runs)`: Answers for a small batch."
    from oelm_nb.report.evidence import Answer, answers_text
    from oelm_nb.report.tables import load_runs
    from oelm_nb.lab.study import get_study, study_answers
    out = fake_batch(tmp_path, {'mercator-b0': [30.0, 30.5], 'mse': [31.0, 31.2], BASELINE: [32.0, 32.2]}, roles=True)
    got = study_answers(get_study('mercator'))(load_runs(out))
    assert [a.qid for a in got] == ['PPL', 'ACC'] and all(isinstance(a, Answer) for a in got)
    m = t_interval([30.0, 30.5], [32.0, 32.2])[0]
    assert got[0].estimate == f'best mercator-b0 {m:+.2%}' and got[1].verdict == 'no data'
    assert 'PPL' in answers_text(got)


def test_a_precision_batch_answers_the_comparison_it_sized(tmp_path):
    "--precision sized mercator-b0.01 vs no-distill: the answers state it with Stein's interval (issue 46)."
    from fake_runs import write_precision
    from oelm_nb.report.tables import load_runs
    out = fake_batch(tmp_path, {'mercator-b0': [30.0, 30.5], 'mse': [31.0, 31.2], BASELINE: [32.0, 32.2]}, roles=True)
    write_precision(out, 'best_val_ppl', 'mercator-b0.01', BASELINE, mean=-0.05, low=-0.09, high=-0.01)
    a = mercator_answers(load_runs(out))[-1]
    assert (a.qid, a.verdict, a.low, a.high, a.n) == ('SIZED', 'mercator-b0.01 lower', -0.09, -0.01, 8)


def test_the_console_summary_prints_the_answers_and_writes_answers_json(tmp_path, capsys):
    "What `oelm run mercator` prints after the batch: the answers through the kit, and answers.json beside the runs."
    import json
    from oelm_nb.app.cli import print_batch_summary
    from oelm_nb.report.evidence import Answer
    out_dir = fake_batch(tmp_path, {'mercator-b0': [30.0, 30.5], 'mse': [31.0, 31.2], BASELINE: [32.0, 32.2]}, roles=True)
    print_batch_summary(out_dir)
    out = capsys.readouterr().out
    stored = json.loads((out_dir / 'answers.json').read_text())
    assert stored['study'] == 'mercator' and [a['qid'] for a in stored['answers']] == ['PPL', 'ACC']
    ppl = stored['answers'][0]  # numbers as numbers beside the text (issue 46)
    assert all(isinstance(ppl[k], float) for k in ('estimate', 'low', 'high', 'p')) and ppl['n'] == 2 and ppl['side'] == 'two-sided'
    assert ppl['estimate_text'] == f"best mercator-b0 {ppl['estimate']:+.2%}" and ppl['low'] < ppl['estimate'] < ppl['high']
    for a in map(Answer.from_dict, stored['answers']): assert f'{a.qid:>4} {a.verdict}' in out
