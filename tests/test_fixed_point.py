"""The fixed point of a causal recurrence (issue 30): the sequential pass, parallel sweeps, settle, and the
New-LLM guidelines' parallel-vs-sequential agreement, on toy recurrences whose answers are known in closed form."""
from __future__ import annotations
import math

import pytest
import torch

from oelm_nb.studies.cvfp.fixed_point import (Agreement, GUIDELINES_AGREEMENT, compare_contexts, fixed_point_agreement, sequential, settle,
                                 shift, sweep)

N = 10
TOKENS, ZERO = torch.eye(N, dtype=torch.float64), torch.zeros(1, N, dtype=torch.float64)


def linear(a: float):
    "c_i = a c_{i-1} + t_i: contracts by a (a < 1); a = 1 forgets nothing."
    return lambda c, t: a * c + t


def test_shift_and_sequential_closed_form():
    x = torch.arange(6.0).reshape(3, 2)
    assert torch.equal(shift(x, torch.tensor([[9.0, 9.0]])), torch.tensor([[9.0, 9.0], [0.0, 1.0], [2.0, 3.0]]))
    for a in (0.0, 0.5, 1.0):  # c_i = sum_j a^(i-j) t_j with orthonormal t_j
        want = torch.stack([sum(a ** (i - j) * TOKENS[j] for j in range(i + 1)) for i in range(N)])
        torch.testing.assert_close(sequential(linear(a), TOKENS, ZERO), want)


@pytest.mark.parametrize('a', [0.3, 0.9])
def test_an_exactly_contracting_block_at_its_fixed_point_agrees_exactly(a):
    step = linear(a)
    seq = sequential(step, TOKENS, ZERO)
    torch.testing.assert_close(sweep(step, TOKENS, ZERO, seq), seq)  # the sequential pass is the fixed point
    ag = fixed_point_agreement(step, TOKENS, seq, ZERO)
    assert (ag.cos_mean, ag.cos_min, ag.mse, ag.n) == (pytest.approx(1.0, abs=1e-12), pytest.approx(1.0, abs=1e-12), 0.0, N - 1)
    assert ag.regime == 'fixed point' and ag.passed
    # settle reaches it from zero contexts, in fewer sweeps the stronger the contraction
    x, k = settle(step, TOKENS, ZERO, torch.zeros(N, N, dtype=torch.float64), 200, 1e-20)
    torch.testing.assert_close(x, seq)
    assert k <= N + 1


def test_a_block_that_ignores_its_context_gives_a_known_value():
    step = lambda c, t: 3 * t  # the context plays no part: the sequential contexts are 3 t_i whatever came before
    g = torch.Generator().manual_seed(0)
    guess = torch.randn(N, N, generator=g, dtype=torch.float64)
    ag = fixed_point_agreement(step, TOKENS, guess, ZERO)  # a guess never swept: cosine with t_i, its i-th entry's share
    want = [guess[i, i].item() / guess[i].norm().item() for i in range(N - 1)]
    assert ag.cos_mean == pytest.approx(sum(want) / (N - 1), abs=1e-12) and ag.cos_min == pytest.approx(min(want), abs=1e-12)
    assert ag.mse == pytest.approx(((guess[:-1] - 3 * TOKENS[:-1]) ** 2).mean().item(), abs=1e-12)
    ag1 = fixed_point_agreement(step, TOKENS, sweep(step, TOKENS, ZERO, guess), ZERO)  # one sweep from any guess: exact
    assert ag1.cos_mean == pytest.approx(1.0, abs=1e-12) and ag1.mse == 0.0


def test_one_lagged_sweep_of_a_memory_block():
    "Gain 1 (c_i = c_{i-1} + t_i), one sweep from zero contexts: token i gets t_i instead of t_0 + ... + t_i."
    ag = fixed_point_agreement(linear(1.0), TOKENS, sweep(linear(1.0), TOKENS, ZERO, torch.zeros(N, N, dtype=torch.float64)), ZERO)
    want = [1 / math.sqrt(i + 1) for i in range(N - 1)]
    assert ag.cos_mean == pytest.approx(sum(want) / (N - 1), abs=1e-12) and ag.cos_min == pytest.approx(want[-1], abs=1e-12)
    assert ag.regime == 'off' and not ag.passed


def test_regimes_and_the_guidelines_numbers():
    assert GUIDELINES_AGREEMENT == {'cos_mean': 0.9969, 'cos_min': 0.9890, 'mse': 0.006156, 'tokens': 56_602}
    regime = lambda c: Agreement(c, 0.0, 0.0, 1).regime
    assert (regime(0.9969), regime(0.99), regime(0.9899), regime(0.90), regime(0.8999)) == (
        'fixed point', 'fixed point', 'near', 'near', 'off')
    d = compare_contexts(torch.tensor([[1.0, 0.0], [0.0, 2.0]]), torch.tensor([[2.0, 0.0], [1.0, 0.0]])).as_dict()
    assert d == {'cos_mean': 0.5, 'cos_min': 0.0, 'mse': pytest.approx(1.5), 'n': 2, 'regime': 'off', 'passed': False}
