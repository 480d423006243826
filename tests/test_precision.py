"""`oelm run STUDY --precision PCT`: Stein's two-stage procedure (oelm_nb.lab.precision), from outside.

The second stage's size is checked against the formula written out here with scipy's t quantile; the end-to-end test
trains a small qk-freeze batch in this process (`execute.execute_inline`, 4 steps on the 300-story corpus) twice: once
with a half-width no pilot can reach (the cap is hit), once with a half-width computed from that pilot's own spread so
that the design needs exactly one more seed.
"""
from __future__ import annotations
import contextlib, io, json, math, subprocess, sys

import numpy as np
import pytest
from scipy import stats

from oelm_nb.base.core import ConfigError
from oelm_nb.app.cli import main
from oelm_nb.lab.study import studies
from oelm_nb.lab.precision import (MAX_SEEDS, check_precision, design_seeds, parse_precision, precision_record,
                               precision_text, run_with_precision, stein_interval, stein_seeds)
from oelm_nb.report.tables import compare, load_runs, safe_markdown
from shared_runs import SMALL_CORPUS


def by_hand(diffs, d, conf=0.95) -> int:
    "Stein's N written out: max(n0, ceil((t_{(1+c)/2, n0-1} * s0 / d)^2))."
    n0, s0 = len(diffs), float(np.std(diffs, ddof=1))
    return max(n0, math.ceil((stats.t.ppf((1 + conf) / 2, n0 - 1) * s0 / d) ** 2))


# ----------------------------------------------------------------------------- the second stage's size
@pytest.mark.parametrize('pilot', [[0.01, 0.03], [0.0, 0.1, 0.05], [0.02, -0.01, 0.04, 0.0], [0.3, 0.31, 0.29, 0.3, 0.3]])
@pytest.mark.parametrize('d', [0.01, 0.05, 0.2])
def test_second_stage_size_is_steins_formula(pilot, d):
    p = stein_seeds(pilot, d, max_seeds=10**9)
    assert p.needed == p.n == by_hand(pilot, d) and not p.capped
    assert p.n0 == len(pilot) and p.t == pytest.approx(stats.t.ppf(0.975, len(pilot) - 1))
    assert p.planned_half_width <= d + 1e-12  # uncapped: the interval is at most as wide as asked


def test_more_spread_in_the_pilot_means_more_seeds():
    "The same pilot mean (2%) with growing spread: N grows as s0 squared, exactly as the hand calculation says."
    t2 = stats.t.ppf(0.975, 2)
    ns = [stein_seeds([0.02 - s, 0.02, 0.02 + s], 0.05, max_seeds=10**6).needed for s in (0.01, 0.03, 0.04, 0.08)]
    assert ns == [max(3, math.ceil((t2 * s / 0.05) ** 2)) for s in (0.01, 0.03, 0.04, 0.08)] == [3, 7, 12, 48]
    # the pilot's mean does not enter N: shifting every difference changes nothing
    assert stein_seeds([0.5, 0.53, 0.56], 0.05).needed == stein_seeds([-0.03, 0.0, 0.03], 0.05).needed == 7
    # a looser half-width needs fewer seeds, a higher confidence more
    assert stein_seeds([0.0, 0.04, 0.08], 0.1).needed < 12 < stein_seeds([0.0, 0.04, 0.08], 0.05, confidence=0.99).needed


def test_the_cap():
    p = stein_seeds([0.0, 0.04, 0.08], 0.05, max_seeds=8)
    assert (p.needed, p.n, p.capped) == (12, 8, True)
    assert p.planned_half_width == pytest.approx(stats.t.ppf(0.975, 2) * 0.04 / math.sqrt(8)) and p.planned_half_width > 0.05
    assert stein_seeds([0.0, 0.04, 0.08], 0.05, max_seeds=12).capped is False
    assert stein_seeds([0.0, 0.04, 0.08], 0.05).max_seeds == MAX_SEEDS == 20


def test_steins_interval_uses_the_pilots_t_and_spread():
    p = stein_seeds([0.0, 0.04, 0.08], 0.05)
    diffs = [0.0, 0.04, 0.08] + [0.01] * 9
    m, lo, hi = stein_interval(diffs, p)
    half = stats.t.ppf(0.975, 2) * 0.04 / math.sqrt(12)  # not the t-interval of the 12 values (their own sd, 11 df)
    assert m == pytest.approx(np.mean(diffs)) and (lo, hi) == pytest.approx((m - half, m + half))
    assert stein_interval([float('nan')], p)[1:] == (None, None)


def test_steins_design_covers_and_peeking_does_not():
    "Simulated normal differences: Stein's interval covers about 95%; stopping when an interval first excludes 0 does not."
    rng = np.random.default_rng(1)
    cover = []
    for _ in range(1500):
        pilot = rng.normal(0.02, 0.04, 3)
        p = stein_seeds(pilot, 0.03, max_seeds=10**6)
        m, lo, hi = stein_interval(np.r_[pilot, rng.normal(0.02, 0.04, p.n - 3)], p)
        cover.append(lo <= 0.02 <= hi)
    assert 0.93 <= np.mean(cover) <= 0.97
    x = rng.normal(0.0, 0.04, (3000, 20))
    found = np.zeros(len(x), bool)
    for n in range(2, 21): found |= stats.ttest_1samp(x[:, :n], 0.0, axis=1).pvalue < 0.05
    assert found.mean() > 0.15  # nominally 0.05


def test_design_seeds():
    assert design_seeds([0, 1], 4) == [0, 1, 2, 3]
    assert design_seeds([2, 5], 5) == [2, 5, 0, 1, 3]
    assert design_seeds([0, 1, 2], 3) == [0, 1, 2]
    assert design_seeds([0, 2], 4, avoid=[0, 1, 2]) == [0, 2, 3, 4]  # a failed pilot seed (1) is not rerun in stage 2


# ----------------------------------------------------------------------------- flags
@pytest.mark.parametrize('text,value', [('5%', 0.05), ('0.05', 0.05), ('12.5%', 0.125), (' 1% ', 0.01)])
def test_precision_values(text, value):
    assert parse_precision(text) == pytest.approx(value)


@pytest.mark.parametrize('text', ['5', '1', '0', '0%', '-5%', '100%', '150%', 'five', '5%%', '', 'nan', 'inf', '%'])
def test_bad_precision_values(text):
    with pytest.raises(ConfigError, match=r'e\.g\. --precision 5% or --precision 0\.05'):
        parse_precision(text)


def oelm(*argv) -> tuple[int, str]:
    "`oelm ARGV` in this process: (exit status, stderr)."
    err = io.StringIO()
    with contextlib.redirect_stderr(err): code = main(list(argv))
    return code, err.getvalue()


@pytest.mark.parametrize('argv,message', [
    (['--precision', '5'], "--precision '5': give the interval's half-width"),
    (['--precision', 'abc'], "--precision 'abc'"),
    (['--precision', '5%', '--seeds', '0'], 'give at least 2 seeds'),
    (['--precision', '5%', '--seeds', '0', '1', '2', '--max-seeds', '2'], "--max-seeds 2: give at least the pilot's 3"),
    (['--max-seeds', '8'], '--max-seeds caps --precision'),
    (['--precision', '5%', '--variants', 'gpt,oelm'], "--variants leaves out oelm-freeze"),
])
def test_bad_flags_fail_before_anything_runs(tmp_path, argv, message):
    code, err = oelm('run', 'qk-freeze', '--out', str(tmp_path / 'b'), *argv)
    assert code == 2 and message in err, err
    assert not (tmp_path / 'b').exists()


def test_max_seeds_is_a_positive_integer():
    with contextlib.redirect_stderr(io.StringIO()), pytest.raises(SystemExit) as e:
        main(['run', 'qk-freeze', '--precision', '5%', '--max-seeds', '0'])
    assert e.value.code == 2


def test_every_study_names_a_main_comparison_it_plans():
    for name, st in studies().items():
        if st.main is None:  # optional: --precision then says what is missing
            with pytest.raises(ConfigError, match='names no main comparison'): check_precision(name, [0, 1], 0.05)
            continue
        metric, a, b = check_precision(name, list(st.default_seeds), 0.05)
        assert isinstance(metric, str) and a != b, name
    assert check_precision('qk-freeze', [0, 1], 0.05) == ('best_val_ppl', 'oelm-freeze', 'gpt')
    assert check_precision('pca', [0, 1], 0.05, options={'ks': [32, 16]}) == ('best_val_ppl', 'pca-lora-k16', 'baseline-cont')
    assert check_precision('cvfp', [0, 1], 0.05, options={'samples': [10, 40]}) == ('val_er_percent', 'ODCM-n40', 'MCDL-n40')
    with pytest.raises(ConfigError, match='--algorithms must include both'):
        check_precision('cvfp', [0, 1], 0.05, options={'algorithms': ['MCDL']})


def test_the_statistics_need_no_torch():
    code = "import sys, oelm_nb.lab.precision as p; p.precision_text('.'); assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, '-c', code], check=True)


# ----------------------------------------------------------------------------- what the report says
def test_precision_text(tmp_path):
    (tmp_path / 'batch.json').write_text(json.dumps({'study': 'qk-freeze', 'seeds': [0, 1, 2, 3, 7]}))
    assert precision_text(tmp_path).startswith('**Design: fixed seeds** (5 seeds: 0, 1, 2, 3, 7, for every variant), chosen before')
    p = stein_seeds([0.0, 0.04, 0.08], 0.05, max_seeds=4)
    diffs = {0: 0.0, 1: 0.04, 2: 0.08, 3: 0.02}
    rec = precision_record(p, ('best_val_ppl', 'oelm-freeze', 'gpt'), [0, 1, 2], [0, 1, 2, 3], dict(list(diffs.items())[:3]), diffs)
    (tmp_path / 'precision.json').write_text(json.dumps(rec))
    t = precision_text(tmp_path)
    m, lo, hi = stein_interval(diffs.values(), p)
    for part in ("Stein's two-stage procedure", '`oelm-freeze` vs `gpt`', 'A pilot of 3 seeds (0, 1, 2)', 's0 = 4.00%',
                 f't = {stats.t.ppf(0.975, 2):.2f} (95%, 2 degrees of freedom)', '= 12 seeds per variant, capped at --max-seeds 4',
                 f'{math.expm1(m):+.2%} (95% Stein interval {math.expm1(lo):+.2%} .. {math.expm1(hi):+.2%}',
                 'The batch also holds seeds 7, outside the design'):
        assert part in t, (part, t)
    for key, bad in (('a', '<img src=x onerror=alert(1)>'), ('metric', 'a`b'), ('t', 'inf'), ('needed', 2.5),
                     ('pilot_seeds', [-1]), ('mean', [1])):
        (tmp_path / 'precision.json').write_text(json.dumps({**rec, key: bad}))
        t = precision_text(tmp_path)
        assert t.startswith('**Design: unknown**') and '<img' not in safe_markdown(t).data, (key, t)


# ----------------------------------------------------------------------------- end to end
def test_precision_end_to_end_with_the_cap(tmp_path, monkeypatch):
    from oelm_nb.lab import render, execute
    rendered = []
    monkeypatch.setattr(render, 'render_report', lambda out, study, log=print: rendered.append(out) or out / 'report.html')
    monkeypatch.setattr(studies()['qk-freeze'], 'after_batch', None)  # the Q/K study's timing is not under test here
    out, lines = tmp_path / 'batch', []
    kw = dict(variants=['gpt', 'oelm-freeze'], steps=4, overrides=SMALL_CORPUS, execute=execute.execute_inline,
              out_dir=out, log=lines.append)

    # a half-width no 2-seed pilot reaches: the design is capped at 3 seeds
    res = run_with_precision('qk-freeze', 1e-6, max_seeds=3, seeds=[0, 1], **kw)
    rec = json.loads((out / 'precision.json').read_text())
    runs = load_runs(out)
    pilot = compare(runs[runs.seed.isin([0, 1])], 'oelm-freeze', 'gpt', 'best_val_ppl').diffs  # log ratios
    assert rec['pilot_differences'] == {str(k): pytest.approx(v) for k, v in pilot.items()}
    assert (rec['n0'], rec['s0']) == (2, pytest.approx(np.std(list(pilot.values()), ddof=1)))
    assert rec['needed'] == by_hand(list(pilot.values()), math.log1p(1e-6)) > 3  # the half-width on the log scale
    assert (rec['n'], rec['capped'], rec['seeds'], rec['max_seeds']) == (3, True, [0, 1, 2], 3)
    assert sorted(res.statuses) == [f'{v}-s{s}' for v in ('gpt', 'oelm-freeze') for s in (0, 1, 2)] and not res.failed
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(('gpt-', 'oelm-freeze-'))) == sorted(res.statuses)
    full = compare(load_runs(out), 'oelm-freeze', 'gpt', 'best_val_ppl').diffs
    half, m = stats.t.ppf(0.975, 1) * rec['s0'] / math.sqrt(3), np.mean(list(full.values()))
    assert rec['mean'] == pytest.approx(math.expm1(m))  # the ratio of geometric means - 1
    assert (rec['low'], rec['high']) == pytest.approx((math.expm1(m - half), math.expm1(m + half)))
    assert any('capped at --max-seeds 3; running seeds [2]' in l for l in lines), lines
    assert rendered == [out]  # the report once, at the end
    assert 'capped at --max-seeds 3' in precision_text(out)

    # the same pilot with a half-width its own spread needs 4 seeds for: one more seed runs, the rest are skipped
    d = math.expm1(rec['t'] * rec['s0'] / math.sqrt(3.5))  # (t s0 / log(1 + d))^2 = 3.5 -> N = 4
    lines.clear()
    res = run_with_precision('qk-freeze', d, max_seeds=10, seeds=[0, 1], report=False, **kw)
    rec = json.loads((out / 'precision.json').read_text())
    assert (rec['needed'], rec['n'], rec['capped'], rec['seeds']) == (4, 4, False, [0, 1, 2, 3])
    assert sum('already completed, skipped' in l for l in lines) == 2 * 2 + 2 * 3  # pilot twice, then seeds 0-2
    assert sum(l.endswith('started') for l in lines if '-s3' in l) == 2
    assert not any('-s4' in l for l in lines)
    assert math.log1p(rec['high']) - math.log1p(rec['mean']) <= math.log1p(d) + 1e-12 and rendered == [out]
