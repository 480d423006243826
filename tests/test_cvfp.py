"""CVFP (the New-LLM guidelines): losses, effective rank, carry-over, determinism, power law, Phase 2 cache, config errors."""
from __future__ import annotations
import json, math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from oelm_nb.base.core import ConfigError
from oelm_nb.base.rundir import write_json
from oelm_nb.studies.cvfp.method import (CVFPConfig, CVFPModel, DIVERSITY_LOSSES, build_context_cache, combined_loss, cvfp_config, cvfp_loss,
                          effective_rank, logits_from_cache, markov_tokens, mcdl_loss, odcm_loss, odcm_cov_loss, phase2_batch_size,
                          train_phase1, train_phase2, val_effective_rank, context_scan)
from oelm_nb.studies.cvfp.study import DIVERSITY_DESCRIPTIONS
from oelm_nb.studies.cvfp.checks import (convergence_verdict, cvfp_convergence_check, identity_check, context_spread,
                                 effective_rank_check, final_diff_grade)
from oelm_nb.studies.cvfp.alpha import alpha_progression, fit_power_law

SMALL = dict(vocab_size=32, context_dim=8, embed_dim=8, num_layers=2)  # two layers: the per-layer cache is exercised


# ---------------------------------------------------------------- diversity losses
X = np.array([[1.0, 2.0, 0.5], [3.0, -1.0, 2.0], [0.0, 0.0, 1.0], [2.0, 4.0, -3.0], [1.5, 1.0, 0.0]])


def test_mcdl_matches_formula():
    n = X.shape[0]
    expected = -math.sqrt(sum((X[i, j] - X[:, j].mean()) ** 2 for i in range(n) for j in range(X.shape[1]))) / n
    assert mcdl_loss(torch.tensor(X)).item() == pytest.approx(expected, rel=1e-12)


def odcm_reference(x: np.ndarray) -> float:
    "The VICReg pair as issue 15 states it, written independently with NumPy loops."
    n, d = x.shape
    c = x - x.mean(axis=0)
    std = [math.sqrt(sum(c[i, j] ** 2 for i in range(n)) / (n - 1) + 1e-4) for j in range(d)]
    var_loss = sum(max(0.0, 1.0 - s) for s in std) / d
    cov = np.cov(x, rowvar=False)  # unbiased (n - 1)
    cov_loss = sum(cov[i, j] ** 2 for i in range(d) for j in range(d) if i != j) / d
    return var_loss + 0.04 * cov_loss


def test_odcm_cov_matches_formula():
    n, d = X.shape
    cov = np.cov(X, rowvar=False)  # unbiased (n - 1), like odcm_cov_loss
    expected = sum(cov[i, j] ** 2 for i in range(d) for j in range(d) if i != j) / d
    assert odcm_cov_loss(torch.tensor(X)).item() == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize('seed,scale', [(0, 0.1), (1, 0.5), (2, 1.0), (3, 3.0)])
def test_odcm_matches_the_vicreg_formula_on_random_inputs(seed, scale):
    x = np.random.default_rng(seed).normal(scale=scale, size=(40, 6))
    assert abs(odcm_loss(torch.tensor(x)).item() - odcm_reference(x)) < 1e-6
    assert abs(odcm_loss(torch.tensor(x, dtype=torch.float32)).item() - odcm_reference(x)) < 1e-6
    assert DIVERSITY_LOSSES['ODCM'] is odcm_loss and DIVERSITY_LOSSES['ODCM-cov'] is odcm_cov_loss


def test_odcm_gradient_spreads_collapsed_contexts():
    "Contexts collapsed onto one vector (0.01 noise): Adam steps on ODCM raise every dimension's std; the covariance term alone does not."
    def std_after(loss_fn, steps):
        g = torch.Generator().manual_seed(0)
        x = (torch.randn(1, 16, generator=g) + 0.01 * torch.randn(64, 16, generator=g)).requires_grad_(True)
        opt = torch.optim.Adam([x], lr=0.05)
        for _ in range(steps):
            opt.zero_grad(); loss_fn(x).backward(); opt.step()
        return x.detach().std(0)
    before, after, cov_only = std_after(odcm_loss, 0), std_after(odcm_loss, 50), std_after(odcm_cov_loss, 50)
    assert (after > 10 * before).all(), (before, after)
    assert cov_only.mean() < 2 * before.mean()


def test_registry_and_combined():
    assert set(DIVERSITY_LOSSES) == set(DIVERSITY_DESCRIPTIONS) == {'MCDL', 'ODCM', 'ODCM-cov'}
    assert combined_loss(torch.tensor(2.0), torch.tensor(-1.0), 0.9).item() == pytest.approx(0.1 * 2.0 - 0.9)
    assert combined_loss(torch.tensor(2.0), torch.tensor(-1.0), 0.0).item() == pytest.approx(2.0)


# ---------------------------------------------------------------- effective rank
@pytest.mark.parametrize('k', [1, 2, 5, 7])
def test_effective_rank_k_equal_singular_values(k):
    g = torch.Generator().manual_seed(k)
    u, _ = torch.linalg.qr(torch.randn(50, k, generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(12, k, generator=g, dtype=torch.float64))
    er = effective_rank(3.0 * u @ v.T)
    assert er.value == pytest.approx(k, abs=1e-9)
    assert er.dim == 12 and er.percent == pytest.approx(100 * k / 12, abs=1e-7)


def test_effective_rank_rank_one():
    x = torch.outer(torch.linspace(-2, 5, 30), torch.randn(9))
    assert effective_rank(x).value == pytest.approx(1.0, abs=1e-6)


def test_effective_rank_unequal_between_1_and_k():
    x = torch.diag(torch.tensor([10.0, 1.0, 0.1]))
    assert 1.0 < effective_rank(x).value < 3.0


# ---------------------------------------------------------------- CVFP loss
def test_cvfp_loss_is_plain_mse_not_normalized():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(20, 6, generator=g) * 3, torch.randn(20, 6, generator=g)
    assert torch.equal(cvfp_loss(a, b), F.mse_loss(a, b))
    normalized = F.mse_loss(F.normalize(a, dim=1), F.normalize(b, dim=1))
    cosine = (1 - F.cosine_similarity(a, b, dim=1)).mean()
    assert abs(cvfp_loss(a, b).item() - normalized.item()) > 1e-3
    assert abs(cvfp_loss(a, b).item() - cosine.item()) > 1e-3
    # same direction, different norm: a normalized loss sees no difference, the CVFP loss does
    assert cvfp_loss(2 * b, b).item() > 0 and F.mse_loss(F.normalize(2 * b, dim=1), F.normalize(b, dim=1)).item() < 1e-12


# ---------------------------------------------------------------- Phase 1: carry-over, detach, determinism
class Recorder:
    "Forward hook on the ContextBlock: first context row in, last final-layer context row out, per call."
    def __init__(self, block):
        self.ins, self.outs = [], []
        self.h = block.register_forward_hook(self)

    def __call__(self, mod, inputs, output):
        self.ins.append(inputs[0][0].detach().clone()); self.outs.append(output[-1][-1].detach().clone())


@pytest.mark.parametrize('parallel', [False, True])
def test_context_carried_over_between_iterations(parallel):
    cfg = CVFPConfig(**SMALL, phase1_min_iterations=4, phase1_max_iterations=4)
    ids = markov_tokens(12, cfg.vocab_size)
    model = CVFPModel(cfg)
    rec = Recorder(model.context_block)
    res = train_phase1(model, ids, parallel=parallel, track_rank=False)
    n = len(ids)
    assert res.iterations == 4
    # call indices where each iteration starts: sequential = one call per token; parallel = iteration 0 per token, then one call
    starts = [k * n for k in range(4)] if not parallel else [0, n, n + 1, n + 2]
    assert torch.equal(rec.ins[0], torch.zeros(cfg.context_dim))  # only the very first iteration starts from zero
    for k in range(1, 4):
        start_in, prev_end_out = rec.ins[starts[k]], rec.outs[starts[k] - 1]
        assert torch.equal(start_in, prev_end_out), f'iteration {k} does not start from iteration {k - 1} last context'
        assert start_in.abs().sum() > 0
    # the final (cache) pass, sequential in both versions (one call per token), starts from the last training
    # iteration's last context too
    final = len(rec.ins) - n
    assert torch.equal(res.final_start[0], rec.ins[final]) and torch.equal(rec.ins[final], rec.outs[final - 1])
    # the kept iteration's contexts and the context its token 0 read (the fixed-point agreement compares them)
    last = starts[3]
    assert torch.equal(res.iterate_start[0], rec.ins[last]) and torch.equal(res.iterate[-1], rec.outs[final - 1])


@pytest.mark.parametrize('parallel', [False, True])
def test_phase2_cache_is_the_sequential_pass_of_the_final_weights(parallel):
    "Issue 30: the parallel version's cache was one lagged sweep; it is now the final weights' fixed point, as validation's."
    cfg = CVFPConfig(**SMALL, phase1_min_iterations=4, phase1_max_iterations=4)
    ids = markov_tokens(200, cfg.vocab_size)
    model = CVFPModel(cfg)
    res = train_phase1(model, ids, parallel=parallel, track_rank=False)
    want = build_context_cache(model, ids, res.final_start)
    for got, w in zip(res.layer_outputs, want): torch.testing.assert_close(got, w, atol=1e-5, rtol=0)


def test_settle_sweeps_reach_the_fixed_point_of_the_current_weights():
    "Parallel sweeps from the last contexts are exact after one sweep per token at most; 0 sweeps: the guidelines' version."
    ids = markov_tokens(12, 32)
    for sweeps, tol in ((0, 1e-5), (100, 1e-14)):
        cfg = CVFPConfig(**SMALL, phase1_min_iterations=4, phase1_max_iterations=4, phase1_settle_sweeps=sweeps,
                         phase1_settle_tol=tol)
        model, seen = CVFPModel(cfg), []
        h = model.context_block.register_forward_hook(lambda m, inp, out: seen.append((inp[0].detach().clone(), torch.is_grad_enabled())))
        res = train_phase1(model, ids, track_rank=False)
        h.remove()
        done = [r['settle_sweeps'] for r in res.history[1:]]
        assert all(d == 0 for d in done) if sweeps == 0 else all(1 <= d <= len(ids) + 1 for d in done), done
        if sweeps:  # the learning sweep reads the settled contexts: those of the sweep before it, unchanged by it
            k = len(ids) + done[0]  # iteration 0 is one call per token, then the settling sweeps
            assert not seen[k - 1][1] and seen[k][1]
            torch.testing.assert_close(seen[k][0], seen[k - 1][0], atol=1e-6, rtol=0)


def test_sequential_detaches_between_tokens():
    cfg = CVFPConfig(**SMALL, phase1_max_iterations=2, phase1_min_iterations=2)
    model = CVFPModel(cfg)
    seen = []
    h = model.context_block.register_forward_hook(lambda m, inp, out: seen.append(inp[0].requires_grad))
    train_phase1(model, markov_tokens(6, cfg.vocab_size), parallel=False, track_rank=False)
    h.remove()
    assert len(seen) == 18 and not any(seen)  # the context entering each token carries no graph


def test_phase1_deterministic_same_seed():
    cfg = CVFPConfig(**SMALL, phase1_min_iterations=2, phase1_max_iterations=4, seed=3)
    ids = markov_tokens(150, cfg.vocab_size)
    ers = []
    for _ in range(2):
        r = train_phase1(CVFPModel(cfg), ids)
        ers.append((effective_rank(r.contexts).value, [h.get('effective_rank') for h in r.history], r.converged_tokens))
    assert ers[0] == ers[1]
    r_other = train_phase1(CVFPModel(cfg.replace(seed=4)), ids)
    assert effective_rank(r_other.contexts).value != ers[0][0]


def test_phase1_reports_counts_and_per_layer_outputs():
    cfg = CVFPConfig(**SMALL, phase1_min_iterations=2, phase1_max_iterations=3)
    r = train_phase1(CVFPModel(cfg), markov_tokens(40, cfg.vocab_size))
    assert len(r.layer_outputs) == cfg.num_layers and all(o.shape == (40, cfg.context_dim) for o in r.layer_outputs)
    assert 0 <= r.converged_tokens <= r.n_tokens == 40
    assert r.convergence_rate == r.converged_tokens / 40
    assert all('converged' in h and 'rate' in h for h in r.history[1:])


@pytest.mark.parametrize('patience', [0, 1, 2])
def test_early_stopping_on_validation_effective_rank(patience):
    cfg = CVFPConfig(**SMALL, phase1_min_iterations=2, phase1_max_iterations=8, phase1_val_patience=patience, convergence_target=1.0)
    ids, val = markov_tokens(120, cfg.vocab_size), markov_tokens(60, cfg.vocab_size, seed=7)
    model = CVFPModel(cfg)
    r = train_phase1(model, ids, val_ids=val)
    vals = [h['val_effective_rank'] for h in r.history[1:]]
    assert len(vals) == r.iterations - 1 and 'val_effective_rank' not in r.history[0]
    # the rule, replayed on the recorded values: stop once `patience` iterations in a row did not beat the best so far
    expected, best, since = cfg.phase1_max_iterations, -1.0, 0
    for it, v in enumerate(vals, start=1):
        since = 0 if v > best else since + 1
        best = max(best, v)
        if patience and it + 1 >= cfg.phase1_min_iterations and since >= patience: expected = it + 1; break
    assert r.iterations == expected
    assert r.stop_reason == ('val_effective_rank' if expected < cfg.phase1_max_iterations else 'max_iterations')
    # the best iteration's weights are restored (with or without early stopping): the final evaluation reads the best number
    best = 1 + int(np.argmax(vals))
    assert r.best_iteration == best
    assert val_effective_rank(model, val).percent == max(vals)
    assert val_effective_rank(model, val).percent == effective_rank(build_context_cache(model, val)[-1]).percent


@pytest.mark.parametrize('min_it', [3, 5])
def test_kept_iteration_is_the_best_from_the_minimum_iterations_on(min_it):
    "Keeping an iteration's weights is stopping there after the fact: only iterations with it + 1 >= phase1_min_iterations can be kept."
    cfg = CVFPConfig(**SMALL, phase1_min_iterations=min_it, phase1_max_iterations=7, convergence_target=1.0)
    ids, val = markov_tokens(120, cfg.vocab_size), markov_tokens(60, cfg.vocab_size, seed=7)
    model = CVFPModel(cfg)
    r = train_phase1(model, ids, val_ids=val)
    assert (r.iterations, r.stop_reason) == (7, 'max_iterations')  # no early stopping by default
    vals = {h['iteration']: h['val_effective_rank'] for h in r.history[1:]}
    eligible = {it: v for it, v in vals.items() if it + 1 >= min_it}
    assert r.best_iteration == max(eligible, key=eligible.get)
    assert val_effective_rank(model, val).percent == max(eligible.values())
    off = CVFPModel(cfg.replace(phase1_restore_best=False))
    r_off = train_phase1(off, ids, val_ids=val)
    assert r_off.best_iteration is None and val_effective_rank(off, val).percent == r_off.history[-1]['val_effective_rank']


def test_restored_weights_are_the_best_iterations():
    "Replay: train without early stopping, snapshot the weights after every iteration; the early-stopped model holds the best snapshot's."
    cfg = CVFPConfig(**SMALL, phase1_min_iterations=2, phase1_max_iterations=6, phase1_val_patience=2, convergence_target=1.0)
    ids, val = markov_tokens(120, cfg.vocab_size), markov_tokens(60, cfg.vocab_size, seed=7)
    model = CVFPModel(cfg)
    r = train_phase1(model, ids, val_ids=val)
    # the same training without validation: the weights after iteration k come from a run of k + 1 iterations (iteration 0 takes no step)
    snaps = []
    for k in range(1, r.iterations + 1):
        m = CVFPModel(cfg.replace(phase1_val_patience=0, phase1_max_iterations=max(2, k + 1), phase1_min_iterations=max(2, k + 1)))
        train_phase1(m, ids)
        snaps.append({n: v.clone() for n, v in m.context_block.state_dict().items()})
    got = model.context_block.state_dict()
    assert r.best_iteration is not None and all(torch.equal(got[n], snaps[r.best_iteration - 1][n]) for n in got)
    assert r.best_iteration < r.iterations - 1 or r.stop_reason == 'max_iterations'


def test_check1_spread_and_bands():
    g = torch.Generator().manual_seed(0)
    spread = torch.randn(400, 16, generator=g)
    collapsed = torch.randn(1, 16, generator=g) + 0.01 * torch.randn(400, 16, generator=g)
    x = collapsed.double()
    expected = (x - x.mean(0)).norm(dim=1).mean() / x.norm(dim=1).mean()
    assert context_spread(collapsed) == pytest.approx(expected.item(), rel=1e-12) and context_spread(collapsed) < 0.1
    assert effective_rank_check(spread, collapsed).verdict == 'FAIL'  # global attractor
    assert effective_rank_check(spread, spread).verdict == 'PASS'
    assert [final_diff_grade(x) for x in (5e-4, 5e-3, 5e-2)] == ['GOOD', 'MARGINAL', 'FAIL']


def test_val_early_stopping_does_not_change_training():
    cfg = CVFPConfig(**SMALL, phase1_min_iterations=5, phase1_max_iterations=5, phase1_val_patience=0, phase1_restore_best=False)
    ids = markov_tokens(80, cfg.vocab_size)
    a, b = train_phase1(CVFPModel(cfg), ids), train_phase1(CVFPModel(cfg), ids, val_ids=markov_tokens(30, cfg.vocab_size, seed=3))
    assert torch.equal(a.contexts, b.contexts) and a.seconds > 0 and b.seconds > 0


def test_convergence_check_counts_from_repeated_passes():
    cfg = CVFPConfig(**SMALL, convergence_threshold=1e-3)
    model = CVFPModel(cfg)
    ids = markov_tokens(50, cfg.vocab_size)
    chk = cvfp_convergence_check(model, ids, passes=4)
    # independent replay: four sequential passes, each starting from the previous pass's last context
    start, ctxs = torch.zeros(1, cfg.context_dim), []
    for _ in range(4):
        c = build_context_cache(model, ids, start)[-1]; ctxs.append(c); start = c[-1:]
    diffs = [F.mse_loss(b, a).item() for a, b in zip(ctxs, ctxs[1:])]
    assert chk.losses == pytest.approx(diffs, rel=1e-12, abs=1e-15) and chk.final_diff == chk.losses[-1]
    assert chk.converged_tokens == int((((ctxs[-1] - ctxs[-2]) ** 2).mean(-1) < 1e-3).sum()) and chk.n_tokens == 50
    assert chk.passed == (chk.final_diff < 1e-3 and chk.verdict.verdict in ('CONVERGED', 'CONVERGING'))
    with pytest.raises(ValueError, match='passes=2'): cvfp_convergence_check(model, ids, passes=2)


def test_phase2_evaluates_every_epoch_and_keeps_the_best():
    cfg = CVFPConfig(**SMALL, phase2_epochs=3, phase2_batch_size=25, phase2_lr=3e-3)
    model = CVFPModel(cfg)
    p2 = train_phase2(model, markov_tokens(101, cfg.vocab_size), val_ids=markov_tokens(40, cfg.vocab_size, seed=1))
    ev = [r for r in p2.records if 'val_ppl' in r]
    assert [r['step'] for r in ev] == [4, 8, 12] and p2.steps == 12  # 100 positions / 25 = 4 steps per epoch
    assert p2.best_val_ppl == min(r['val_ppl'] for r in ev) and p2.val_ppl == ev[-1]['val_ppl']
    assert all(r['val_ppl'] == pytest.approx(math.exp(r['val_loss'])) for r in ev)


# ---------------------------------------------------------------- checks
def test_identity_check_and_verdicts():
    e = torch.randn(10, 4)
    assert not identity_check(e, e, e).passed
    assert identity_check(e + 1, e, -e).passed
    assert convergence_verdict([0.3, 0.2, 0.1]).verdict == 'CONVERGING'
    assert convergence_verdict([1e-4, 1e-4, 1e-4]).verdict == 'CONVERGED'
    assert convergence_verdict([0.1, 0.2, 0.4]).verdict == 'DIVERGING'
    assert convergence_verdict([0.0, 0.5, 0.0, 0.5, 0.0]).verdict == 'UNSTABLE'


# ---------------------------------------------------------------- alpha scaling
def test_power_law_recovers_alpha():
    tokens = [1e4, 2e4, 4e4, 8e4, 1.6e5]
    ppl = [2.5e3 * t ** -0.423 for t in tokens]
    fit = fit_power_law(tokens, ppl)
    assert fit.alpha == pytest.approx(-0.423, abs=1e-10)
    assert fit.A == pytest.approx(2.5e3, rel=1e-8)
    assert fit.r2 == pytest.approx(1.0, abs=1e-12)
    noisy = fit_power_law(tokens, [p * f for p, f in zip(ppl, [1.1, 0.9, 1.05, 0.95, 1.0])])
    assert noisy.r2 < 1.0


def test_alpha_progression_windows(tmp_path):
    sizes = [50, 100, 200, 400, 800]
    ppl = [1e3 * s ** -0.4 for s in sizes[:3]] + [1e3 * 200 ** -0.4 * (s / 200) ** -0.6 for s in sizes[3:]]
    prog = alpha_progression(sizes, ppl, window=4)
    assert [w['samples'] for w in prog.windows] == [[50, 400], [100, 800]]
    assert prog.alpha_change < 0 and prog.trend.startswith('IMPROVING')
    write_json(tmp_path / 'alpha_progression.json', prog.to_dict())
    d = json.loads((tmp_path / 'alpha_progression.json').read_text())
    assert d['windows'] == prog.windows and d['trend'] == prog.trend and len(d['windows']) == 2
    with pytest.raises(ValueError, match='window'): alpha_progression(sizes, ppl, window=6)


# ---------------------------------------------------------------- Phase 2
def test_phase2_cache_gives_same_logits_as_recompute():
    cfg = CVFPConfig(**SMALL, phase1_min_iterations=2, phase1_max_iterations=3, phase2_epochs=2, phase2_batch_size=16)
    ids = markov_tokens(60, cfg.vocab_size)
    model = CVFPModel(cfg)
    r = train_phase1(model, ids, parallel=False)
    p2 = train_phase2(model, ids, cache=r.layer_outputs)
    assert p2.steps == 2 * math.ceil(59 / 16)
    assert not any(p.requires_grad for p in model.context_block.parameters())
    # Phase 1's cache equals a fresh pass from the same starting context, so the logits agree
    fresh = build_context_cache(model, ids, r.final_start)
    torch.testing.assert_close(logits_from_cache(model, ids, r.layer_outputs), logits_from_cache(model, ids, fresh))
    torch.testing.assert_close(logits_from_cache(model, ids, fresh), model(ids, r.final_start))


def test_phase2_trains_token_block_only():
    cfg = CVFPConfig(**SMALL, phase2_epochs=3, phase2_batch_size=32, phase2_lr=3e-3)
    model = CVFPModel(cfg)
    ctx_before = {k: v.clone() for k, v in model.context_block.state_dict().items()}
    emb_before = model.embedding.weight.clone()
    tok_before = [p.clone() for p in model.token_block.parameters()]
    p2 = train_phase2(model, markov_tokens(200, cfg.vocab_size), val_ids=markov_tokens(50, cfg.vocab_size, seed=1))
    assert all(torch.equal(v, model.context_block.state_dict()[k]) for k, v in ctx_before.items())
    assert torch.equal(emb_before, model.embedding.weight) and model.head.weight is model.embedding.weight
    assert any(not torch.equal(a, b) for a, b in zip(tok_before, model.token_block.parameters()))
    assert p2.val_ppl is not None and math.isfinite(p2.val_ppl)


def test_phase2_trains_the_tied_embedding_when_asked():
    "phase2_train_embedding: the embedding (= head) trains with the TokenBlock; the ContextBlock and the cached contexts do not change."
    cfg = CVFPConfig(**SMALL, phase2_epochs=2, phase2_batch_size=32, phase2_lr=3e-3)
    ids, val = markov_tokens(200, cfg.vocab_size), markov_tokens(50, cfg.vocab_size, seed=1)
    frozen, trained = CVFPModel(cfg), CVFPModel(cfg.replace(phase2_train_embedding=True))
    emb0 = trained.embedding.weight.clone()
    ctx0 = {k: v.clone() for k, v in trained.context_block.state_dict().items()}
    cache, val_cache = build_context_cache(trained, ids), build_context_cache(trained, val)  # through the embedding before Phase 2
    pf, pt = train_phase2(frozen, ids, val_ids=val), train_phase2(trained, ids, cache=cache, val_ids=val)
    assert not torch.equal(trained.embedding.weight, emb0) and trained.head.weight is trained.embedding.weight
    assert all(torch.equal(v, trained.context_block.state_dict()[k]) for k, v in ctx0.items())
    assert not trained.embedding.weight.requires_grad and not frozen.embedding.weight.requires_grad
    n_tok, n_emb = sum(p.numel() for p in trained.token_block.parameters()), trained.embedding.weight.numel()
    assert (pf.train_embedding, pf.trainable_params) == (False, n_tok) and (pt.train_embedding, pt.trainable_params) == (True, n_tok + n_emb)
    # the validation PPL is measured on contexts cached before Phase 2 (the old embedding), with the new embedding as token input and head
    from oelm_nb.studies.cvfp.method import evaluate_cached
    assert pt.val_ppl == pytest.approx(evaluate_cached(trained, val, val_cache)['val_ppl'], rel=1e-6)
    assert pf.val_ppl != pt.val_ppl


def test_context_scan_matches_the_module_token_by_token():
    "The fast scan computes what calling the ContextBlock token by token computes."
    model = CVFPModel(CVFPConfig(**SMALL))
    ids = markov_tokens(150, model.cfg.vocab_size)
    start = torch.randn(1, model.cfg.context_dim)
    ctx, outs = start, []
    with torch.no_grad():
        for t in range(len(ids)):
            o = model.context_block(ctx, model.embed(ids[t:t + 1])); outs.append(o); ctx = o[-1]
    ref = [torch.cat([o[l] for o in outs]) for l in range(model.cfg.num_layers)]
    got = context_scan(model.context_block, model.embed(ids), start)
    for a, b in zip(ref, got): torch.testing.assert_close(b, a, rtol=0, atol=1e-5)
    assert [tuple(g.shape) for g in got] == [(150, model.cfg.context_dim)] * 2 and not got[-1].requires_grad


def test_batch_size_from_cpu_budget():
    cfg = CVFPConfig(vocab_size=1000)
    s = phase2_batch_size(cfg, 'cpu', cpu_budget_bytes=100 * 2**20)
    assert s.source == 'cpu budget' and s.batch_size == int(100 * 2**20 * 0.5) // s.per_token_bytes
    assert phase2_batch_size(cfg, 'cpu', cpu_budget_bytes=10).batch_size == cfg.phase2_min_batch_size


# ---------------------------------------------------------------- config
@pytest.mark.parametrize('kw,field', [
    (dict(context_dim=0), 'context_dim'), (dict(dist_reg_weight=-0.1), 'dist_reg_weight'), (dict(diversity='VICReg'), 'diversity'),
    (dict(phase1_min_iterations=9, phase1_max_iterations=4), 'phase1_min_iterations'), (dict(memory_safety=0.0), 'memory_safety'),
    (dict(convergence_target=1.5), 'convergence_target'), (dict(phase2_batch_size=0), 'phase2_batch_size'), (dict(num_layers='2'), 'num_layers'),
    (dict(phase1_settle_sweeps=-1), 'phase1_settle_sweeps'), (dict(phase1_settle_tol=0.0), 'phase1_settle_tol'),
])
def test_config_errors_name_field(kw, field):
    with pytest.raises(ConfigError, match=f'CVFPConfig.{field}'): CVFPConfig(**kw)


def test_config_presets_and_embedding_shape():
    seed = cvfp_config('seed')
    assert (seed.context_dim, seed.embed_dim, seed.hidden_dim) == (768, 768, 1536)
    with pytest.raises(ConfigError, match='unknown CVFP preset'): cvfp_config('nope')
    with pytest.raises(ConfigError, match='vocab_size/embed_dim'): CVFPModel(CVFPConfig(**SMALL), torch.randn(5, 8))
    w = torch.randn(40, 12)
    m = CVFPModel.from_embedding(w, context_dim=6)
    assert (m.cfg.vocab_size, m.cfg.embed_dim) == (40, 12) and torch.equal(m.embedding.weight, w)
