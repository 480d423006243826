"""The evidence kit (oelm_nb.report.evidence) checked from outside: the paired interval's endpoints against a t table and
its coverage, Stein's two-stage size, the stated power and the sign-flip test's level by simulation, each check also
applied to a wrong method that it must catch (issue 46).

Every simulation is seeded, draws 10,000 batches here at once, independently of the kit's own `simulate_*` helpers,
and holds a rate within 1.5 points of its nominal value.
"""
from __future__ import annotations
import itertools, math

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from oelm_nb.report.evidence import (Answer, answers_frame, answers_json, answers_footer, answers_text, bimodal_gaps, bimodal_mean,
                                     exact_caveat, paired, power, seeds_for_power, signflip_p, signflip_pvalues,
                                     simulate_coverage, smallest_signflip_p, stein_size, t_bounds, t_interval,
                                     threshold_verdict)


# ====================================================================== checks that a wrong method fails (issue 46)
# Each check is a function applied to the kit's method and to a wrong one: the right method must pass and the wrong
# one fail the same check. Quantiles come from a printed t table, not from the code under test; every simulation
# draws 10,000 batches at once (vectorised), and a rate must lie within 1.5 points of its nominal value.
T975 = {2: 4.302653, 3: 3.182446, 4: 2.776445, 5: 2.570582, 7: 2.364624}  # t_{0.975, df} from a table
Z975 = 1.959964
BATCHES, BAND = 10_000, 0.015


def in_band(rate: float, nominal: float) -> bool: return abs(rate - nominal) <= BAND


def check_interval(bounds) -> dict:
    """A t-interval method `bounds(d (B, n)) -> (mean, low, high)`: its endpoints against the table, its coverage of
    the true mean over 10,000 normal batches at 3 and 4 seeds; each entry (measured, passed)."""
    out = {}
    for n in (4, 8):  # 1..n: mean (n + 1) / 2, sd sqrt(n (n + 1) / 12): 1.2909944 at 4, 2.4494897 at 8
        m, lo, hi = bounds(np.arange(1.0, n + 1)[None])
        want = (n + 1) / 2 + T975[n - 1] * {4: 1.2909944, 8: 2.4494897}[n] / math.sqrt(n)
        out[f'upper end at {n} seeds'] = (float(hi[0]), math.isclose(float(hi[0]), want, rel_tol=1e-6))
    rng = np.random.default_rng(46)
    for n in (3, 4):
        _, lo, hi = bounds(rng.normal(0.07, 0.06, (BATCHES, n)))
        cov = float(((lo <= 0.07) & (0.07 <= hi)).mean())
        out[f'coverage at {n} seeds'] = (cov, in_band(cov, 0.95))
    return out


def check_stein(size) -> dict:
    """Stein's size `size(s0 array, n0, d) -> N array`: N against the table, and the promise of --precision, the true
    mean within +-d with 95% probability, over 10,000 two-stage designs (5-seed pilots)."""
    out = {'N at s0 = 0.06, d = 0.03': (int(size(np.array([0.06]), 5, 0.03)[0]),
                                        int(size(np.array([0.06]), 5, 0.03)[0]) == math.ceil((T975[4] * 2) ** 2))}
    rng, mu, sd, d, n0 = np.random.default_rng(460), 0.02, 0.06, 0.03, 5
    pilot = rng.normal(mu, sd, (BATCHES, n0))
    n = np.asarray(size(pilot.std(1, ddof=1), n0, d))
    rest = rng.normal((n - n0) * mu, sd * np.sqrt(n - n0))  # the second stage's sum, drawn at once
    cov = float((np.abs((pilot.sum(1) + rest) / n - mu) <= d).mean())
    out['within +-d'] = (cov, in_band(cov, 0.95))
    return out


POWER_CASES = [(3, 0.10, 0.05), (4, 0.05, 0.04), (6, 0.03, 0.04)]  # (seeds, true difference, spread)


def check_power(power_fn) -> dict:
    "A power formula `power_fn(n, delta, sd)` against the rejection rate of the t-test over 10,000 normal batches."
    out, rng = {}, np.random.default_rng(4600)
    for n, delta, sd in POWER_CASES:
        x = rng.normal(delta, sd, (BATCHES, n))
        rate = float((np.abs(x.mean(1)) / (x.std(1, ddof=1) / math.sqrt(n)) > T975[n - 1]).mean())
        stated = power_fn(n, delta, sd)
        out[f'n={n} delta={delta} sd={sd}'] = ((stated, rate), in_band(rate, stated))
    return out


def check_level(pvalues, null_batches, size: float) -> dict:
    """A test `pvalues(batches) -> p per batch` on 10,000 batches drawn under its null: the share with p <= 0.05
    within 1.5 points of its attainable size (both sides: a test that never rejects fails too)."""
    rate = float((np.asarray(pvalues(null_batches)) <= 0.05).mean())
    return {'level': (rate, in_band(rate, size))}


def passed(checks: dict) -> bool: return all(ok for _, ok in checks.values())


def failed(checks: dict) -> list: return [k for k, (_, ok) in checks.items() if not ok]


# --- the interval: n - 1 degrees of freedom (the kit) against n
def wrong_df_bounds(d):
    d = np.asarray(d, float); n = d.shape[-1]
    h = stats.t.ppf(0.975, n) * d.std(-1, ddof=1) / math.sqrt(n)
    return d.mean(-1), d.mean(-1) - h, d.mean(-1) + h


def test_the_t_interval_passes_its_checks_and_n_degrees_of_freedom_fail():
    right, wrong = check_interval(t_bounds), check_interval(wrong_df_bounds)
    print('t-interval', right, '\nn df', wrong)
    assert passed(right), right
    assert {'upper end at 4 seeds', 'upper end at 8 seeds', 'coverage at 3 seeds'} <= set(failed(wrong)), wrong
    # the report's route gives the same interval as the vectorised one
    x = np.random.default_rng(1).normal(0.05, 0.1, (3, 4))
    for row in x:
        m, lo, hi = t_interval(row)
        assert (m, lo, hi) == pytest.approx(tuple(float(v) for v in t_bounds(row)))
    a, b = np.exp(x[0]) * 10, np.full(4, 10.0)
    assert paired(pd.Series(a), pd.Series(b)).high == pytest.approx(math.expm1(t_bounds(np.log(a / b))[2]))


def test_steins_size_passes_its_checks_and_z_fails():
    z_size = lambda s0, n0, d: np.maximum(n0, np.ceil((Z975 * np.asarray(s0) / d) ** 2)).astype(int)
    right, wrong = check_stein(stein_size), check_stein(z_size)
    print('Stein t', right, '\nStein z', wrong)
    assert passed(right), right
    assert set(failed(wrong)) == {'N at s0 = 0.06, d = 0.03', 'within +-d'}, wrong
    assert stein_size(0.06, 5, 0.03) == 31 and stein_size(0.06, 5, 0.03, cap=20) == 20  # scalars stay ints


def test_the_stated_power_passes_its_checks_and_a_normal_approximation_fails():
    from scipy.special import ndtr
    normal = lambda n, delta, sd: float(ndtr(delta * math.sqrt(n) / sd - Z975) + ndtr(-delta * math.sqrt(n) / sd - Z975))
    right, wrong = check_power(power), check_power(normal)
    print('noncentral t', right, '\nnormal', wrong)
    assert passed(right), right
    assert len(failed(wrong)) == len(POWER_CASES), wrong  # every parametrisation catches it
    for delta, sd in [(0.05, 0.06), (0.03, 0.05), (0.1, 0.2)]:  # the seed count is the smallest with 80% power
        n = seeds_for_power(delta, sd)
        assert power(n, delta, sd) >= 0.8 > power(n - 1, delta, sd)


def test_the_sign_flip_test_holds_its_level_and_a_constant_p_fails():
    null = np.random.default_rng(461).normal(0.0, 1.0, (BATCHES, 8))
    size = 6 / 128  # 8 seeds: 128 distinct |mean|s (a pattern and its mirror tie); p <= 0.05 takes the top 6
    right = check_level(signflip_pvalues, null, size)
    wrong = check_level(lambda d: np.ones(len(d)), null, size)
    print('sign-flip', right, '\np = 1', wrong)
    assert passed(right) and not passed(wrong), (right, wrong)
    assert [signflip_p(row) for row in null[:3]] == pytest.approx(signflip_pvalues(null[:3]).tolist())


def test_the_ratio_of_geometric_means_is_symmetric_in_the_sides():
    rng = np.random.default_rng(0)
    b = np.exp(rng.normal(1.5, 0.3, 5))
    a = b * np.exp(rng.normal(math.log1p(0.2), 0.1, 5))
    ab, ba = paired(pd.Series(a), pd.Series(b)), paired(pd.Series(b), pd.Series(a))
    assert (1 + ab.mean) * (1 + ba.mean) == pytest.approx(1.0)
    assert (1 + ab.low) * (1 + ba.high) == pytest.approx(1.0)
    assert ab.mean == pytest.approx(math.exp(np.mean(np.log(a / b))) - 1)


def test_a_bimodal_truth_costs_coverage_as_the_chapter_reports():
    "A 3:1 mix of two modes (H4's shape): the kit's simulation agrees with one drawn here, and both fall below 93.5%."
    truth = 0.75 * math.log(1.35) + 0.25 * math.log(1.057)
    assert bimodal_mean() == pytest.approx(truth)
    rng = np.random.default_rng(462)
    d = np.where(rng.random((BATCHES, 4)) < 0.75, math.log(1.35), math.log(1.057)) + rng.normal(0, 0.05, (BATCHES, 4))
    h = T975[3] * d.std(1, ddof=1) / 2
    here = float((np.abs(d.mean(1) - truth) <= h).mean())
    kit = simulate_coverage(4, BATCHES, gap=math.expm1(truth), draw=lambda r, shape: bimodal_gaps(r, shape))
    print(f'bimodal 3:1 at 4 seeds: coverage {kit:.4f} (kit), {here:.4f} (here)')
    assert abs(kit - here) <= BAND and kit < 0.95 - BAND


def test_the_sign_flip_test_against_full_enumeration():
    d = np.array([0.12, -0.03, 0.08, 0.05, 0.10])
    flips = [np.mean(d * s) for s in itertools.product([1, -1], repeat=len(d))]
    by_hand = np.mean([abs(f) >= abs(d.mean()) - 1e-12 for f in flips])
    assert signflip_p(d) == pytest.approx(by_hand)
    assert smallest_signflip_p(4) == 0.125 and signflip_p([0.1, 0.2, 0.3, 0.4]) == pytest.approx(0.125)


def test_a_verdict_on_the_normal_assumption_alone_says_so():
    c = paired(pd.Series([1.20, 1.25, 1.18, 1.22]), pd.Series([1.0] * 4))
    assert threshold_verdict(c, 0.05) == 'rejected'
    cav = exact_caveat(c, 0.05)
    assert cav and 'normal assumption' in cav and '0.125' in cav
    c8 = paired(pd.Series([1.20, 1.25, 1.18, 1.22] * 2), pd.Series([1.0] * 8))
    assert exact_caveat(c8, 0.05) is None  # 8 seeds all above: an exact p of 2/256


def test_answers_render_the_same_everywhere():
    shared = 'of 12 runs, 0 reached a plateau by a backtested forecast'
    ans = [Answer('H2', 'a vs b: gap < 5%', 'rejected', '+12.0%', '95% CI +6.0% .. +18.3%', 'ratio of geometric means',
                  '4 paired seeds', '1,800 steps per run', [shared, 'rests on the normal assumption']),
           Answer('H4', 'a vs c: gap < 10%', 'inconclusive', '+9.0%', '95% CI -1.0% .. +20.0%', 'ratio', '4 paired seeds',
                  '1,800 steps per run', [shared])]
    t = answers_frame(ans)
    assert t.loc['H2', 'answer'] == 'rejected [1][2]' and t.loc['H4', 'answer'] == 'inconclusive [1]'
    foot = answers_footer(ans)
    assert foot.count(shared) == 1 and foot.startswith("All answers hold at the runs' budget: 1,800 steps per run.")
    text = answers_text(ans)
    assert '  H2 rejected [1][2]: a vs b: gap < 5%' in text and text.count(shared) == 1
    assert Answer.from_dict(ans[0].to_dict()) == ans[0]
    with pytest.raises(ValueError): Answer.from_dict(['not', 'a', 'dict'])


def test_answers_json_holds_numbers_as_numbers():
    "answers.json: estimate, low, high, p and n as JSON numbers (or null), the text beside them; read back the same."
    import json
    c = paired(pd.Series([1.20, 1.25, 1.18, 1.22]), pd.Series([1.0] * 4))
    a = Answer('H2', 'a vs b: gap < 5%', 'rejected', f'{c.mean:+.1%}', 'CI', 'ratio', '4 paired seeds', '', [],
               value=c.mean, low=c.low, high=c.high, p=c.p_value(0.05), n=c.n)
    rec = json.loads(json.dumps(answers_json([a])))[0]
    assert {k: type(rec[k]) for k in ('estimate', 'low', 'high', 'p', 'n')} == {
        'estimate': float, 'low': float, 'high': float, 'p': float, 'n': int}
    assert rec['estimate'] == pytest.approx(c.mean) and rec['p'] == 0.125 and rec['estimate_text'] == '+21.2%'
    assert Answer.from_dict(rec) == a
    empty = json.loads(json.dumps(answers_json([Answer('H1', 'q', 'no data', value=float('nan'))])))[0]
    assert [empty[k] for k in ('estimate', 'low', 'high', 'p', 'n')] == [None] * 5
