"""The family's rule (issue: verdicts that print what they decide): every claim a report makes (supported, rejected,
earlier, later, lower) stands only where its own p, Holm-adjusted over the study's family, is at most 5%; each answer's
p is the p of the claim it makes, with its side and test named. One test per way the rule has been got wrong, each
named for the mistake it catches, then the familywise error at the boundary by simulation."""
from __future__ import annotations
import json, math

import numpy as np
import pandas as pd
import pytest

from oelm_nb.report.evidence import (Answer, family_answers, comparison_answer, paired, is_claim, simulate_familywise,
                                     FAMILY_ALPHA)

ONE = 'one-sided, non-inferiority with margin 5%'


def test_a_claim_significant_alone_is_not_printed_when_holm_does_not_back_it():  # mutant: no adjustment
    fam = family_answers([Answer('H2', 'gap < 5%', 'supported', p=0.015, side='less'),
                          Answer('H4', 'gap < 10%', 'rejected', p=0.02, side='greater')], {'H2': ONE, 'H4': ONE})
    assert [a.p for a in fam] == [0.015, 0.02]  # 0.03 and 0.04 doubled: each at most 5% alone
    assert [a.p_holm for a in fam] == pytest.approx([0.06, 0.06])
    assert all(2 * a.p <= FAMILY_ALPHA < a.p_holm for a in fam)  # the batch where p <= 0.05 < p_holm
    assert [a.verdict for a in fam] == ['inconclusive', 'inconclusive']
    assert all(any("'supported' alone" in c or "'rejected' alone" in c for c in a.caveats) for a in fam)


def test_the_adjustment_is_holm_not_bonferroni():  # mutant: Bonferroni
    fam = family_answers([Answer('A', 'q', 'supported', p=0.006, side='less'),
                          Answer('B', 'q', 'rejected', p=0.015, side='greater')], {'A': ONE, 'B': ONE})
    # doubled 0.012 and 0.03: Holm 0.024 and 0.03 (both claims stand); Bonferroni would make B 0.06
    assert [a.p_holm for a in fam] == pytest.approx([0.024, 0.03])
    assert [a.verdict for a in fam] == ['supported', 'rejected']


def test_a_one_sided_p_is_doubled_before_the_adjustment():  # mutant: one-sided p not doubled
    fam = family_answers([Answer('H2', 'gap < 5%', 'supported', p=0.04, side='less')], {'H2': ONE})
    assert fam[0].p_holm == pytest.approx(0.08) and fam[0].verdict == 'inconclusive'


def test_formation_claims_fall_after_holm_like_every_claim():  # mutant: no R1/R2 downgrade after Holm
    fam = family_answers([Answer('R1', 'as early', 'oelm-freeze later', p=0.02, side='greater'),
                          Answer('H2', 'gap < 5%', 'supported', p=0.02, side='less')],
                         {'R1': 'one-sided, later than its control', 'H2': ONE})
    assert fam[0].p_holm == pytest.approx(0.04 * 2) and fam[0].verdict == 'inconclusive'
    ok = family_answers([Answer('R1', 'as early', 'oelm-freeze later', p=0.005, side='greater')],
                        {'R1': 'one-sided, later than its control'})
    assert ok[0].verdict == 'oelm-freeze later'


def test_h3s_sign_test_is_one_sided_in_the_direction_of_its_claim(tmp_path):  # mutant: H3 two-sided
    from oelm_nb.studies.qk_freeze.answers import h3_answer
    from oelm_nb.studies.qk_freeze.timing import load_timing
    from oelm_nb.report.evidence import sign_test_p
    faster = [0.97] * 15 + [1.02] * 5  # 15 of 20 rounds faster: one-sided p = P(B <= 5) = 0.0207
    rows = [{'variant': 'oelm', 'step_time_median_s': 1.0, 'ratio_to_first_median': 1.0, 'ratio_to_first_q1': 1.0,
             'ratio_to_first_q3': 1.0, 'rounds': 20, 'ratios': [1.0] * 20},
            {'variant': 'oelm-freeze', 'step_time_median_s': 0.97, 'ratio_to_first_median': 0.97, 'ratio_to_first_q1': 0.97,
             'ratio_to_first_q3': 1.0, 'rounds': 20, 'ratio_low': 0.97, 'ratio_high': 0.99, 'ratio_level': 0.96,
             'ratio_p': sign_test_p(faster, 1.0, 'less'), 'ratios': faster}]
    (tmp_path / 'timing.json').write_text(json.dumps(rows))
    h3 = h3_answer(load_timing(tmp_path))
    assert h3.p == pytest.approx(sum(math.comb(20, i) for i in range(6)) / 2 ** 20)
    assert h3.p < sign_test_p(faster, 1.0) and (h3.side, h3.verdict) == ('less', 'supported')


def test_every_answer_carries_the_claims_p_side_and_test_and_no_unbacked_claim(tmp_path):
    from test_budgets import qk_ladder
    from oelm_nb.lab.render import write_answers
    from oelm_nb.lab.study import get_study
    out = qk_ladder(tmp_path / 'b', {400: 1.5, 600: 1.3, 800: 1.2})
    assert write_answers(out, get_study('qk-freeze'))
    recs = json.loads((out / 'answers.json').read_text())['answers']
    for a in recs:
        if is_claim(a['verdict']): assert a['p_holm'] is not None and a['p_holm'] <= FAMILY_ALPHA, a
        if a['p'] is not None: assert a['side'] in ('less', 'greater', 'two-sided') and a['test'], a
    h4 = next(a for a in recs if a['qid'] == 'H4@400')
    assert (h4['verdict'], h4['side']) == ('rejected', 'greater')  # the gap is above the margin: the test of that


@pytest.mark.parametrize('n', [4, 8])
def test_the_familywise_error_at_the_boundary_is_at_most_5_percent(n):
    for shared in (0.0, 0.5):
        rate, _ = simulate_familywise(n, m=11, batches=10_000, shared=shared, seed=n)
        assert rate <= FAMILY_ALPHA + 0.01, (n, shared, rate)
        assert rate >= FAMILY_ALPHA - 0.03  # Holm is not far below its level here: the test has power to fail
