"""The evidence kit (oelm_nb.report.evidence) checked by simulation, from outside: coverage of the paired interval on the log
scale, Stein's two-stage interval, the stated power against simulated batches, and the exact sign-flip test.

Every simulation is seeded and draws its batches here, independently of the kit's own `simulate_*` helpers; the kit
is called once per batch, as a report would.
"""
from __future__ import annotations
import itertools, math

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from oelm_nb.report.evidence import (Answer, answers_frame, answers_footer, answers_text, exact_caveat, paired, power,
                              seeds_for_power, signflip_p, smallest_signflip_p, stein_size, threshold_verdict)


def batches(n: int, count: int, gap: float, sd: float, seed: int):
    "`count` synthetic paired batches of `n` seeds: PPL of b around e^1.5, a = b x exp(normal(log(1 + gap), sd))."
    rng = np.random.default_rng(seed)
    b = np.exp(rng.normal(1.5, 0.3, (count, n)))
    return b * np.exp(rng.normal(math.log1p(gap), sd, (count, n))), b


@pytest.mark.parametrize('n', [4, 8])
def test_the_interval_covers_the_true_gap_95_percent_of_the_time(n):
    a, b = batches(n, 2500, gap=0.07, sd=0.06, seed=n)
    covered = 0
    for x, y in zip(a, b):
        c = paired(pd.Series(x), pd.Series(y))
        covered += c.low <= 0.07 <= c.high
    assert 0.93 <= covered / len(a) <= 0.97, covered / len(a)


def test_the_ratio_of_geometric_means_is_symmetric_in_the_sides():
    a, b = batches(5, 1, gap=0.2, sd=0.1, seed=0)
    ab, ba = paired(pd.Series(a[0]), pd.Series(b[0])), paired(pd.Series(b[0]), pd.Series(a[0]))
    assert (1 + ab.mean) * (1 + ba.mean) == pytest.approx(1.0)
    assert (1 + ab.low) * (1 + ba.high) == pytest.approx(1.0)
    assert ab.mean == pytest.approx(math.exp(np.mean(np.log(a[0] / b[0]))) - 1)


def test_steins_interval_covers_at_least_95_percent_with_a_5_seed_pilot():
    "The second stage's size from the pilot's spread; the interval with the pilot's t and s0 over all N seeds."
    rng, mu, sd, d, n0 = np.random.default_rng(11), 0.03, 0.06, 0.03, 5
    t = stats.t.ppf(0.975, n0 - 1)
    covered, ns = 0, []
    for _ in range(4000):
        pilot = rng.normal(mu, sd, n0)
        n = stein_size(pilot.std(ddof=1), n0, d)
        x = np.r_[pilot, rng.normal(mu, sd, n - n0)]
        covered += abs(x.mean() - mu) <= t * pilot.std(ddof=1) / math.sqrt(n)
        ns.append(n)
    # exact at 95% in theory (N depends on s0 only); 4,000 batches leave a standard error of 0.34 points
    assert covered / 4000 >= 0.95 - 2.5 * math.sqrt(0.95 * 0.05 / 4000), covered / 4000
    assert np.mean(ns) > (1.96 * sd / d) ** 2  # it oversamples against a known spread, as the tables say


@pytest.mark.parametrize('delta, sd', [(0.05, 0.06), (0.03, 0.05), (0.1, 0.2)])
def test_the_stated_power_is_within_5_points_of_a_simulation(delta, sd):
    n = seeds_for_power(delta, sd)
    assert power(n, delta, sd) >= 0.8 > power(n - 1, delta, sd)
    rng, hits = np.random.default_rng(int(delta * 1000)), 0
    for _ in range(3000):
        x = rng.normal(delta, sd, n)
        ci = stats.ttest_1samp(x, 0.0).confidence_interval(0.95)
        hits += not ci.low <= 0.0 <= ci.high
    assert abs(hits / 3000 - power(n, delta, sd)) < 0.05


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
