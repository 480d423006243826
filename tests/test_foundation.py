"""Foundation tests for oelm_nb: configuration validation, orthogonal init, Q/K freezing,
parameter accounting and the GPT variants (SPEC section 1).

These test the installed package from outside. Every check compares against an
independent source (arithmetic from the config fields, torch's own
`orthogonal_`, a state snapshot taken before training) and has a negative control
where a vacuous pass would otherwise be possible (e.g. `gpt` Q/K are *not*
orthonormal, so the orthogonality test would fail if the variant did nothing).
"""
from __future__ import annotations
import math

import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st

from oelm_nb.base.core import ConfigError, ModelConfig, TrainConfig, VARIANTS
from oelm_nb.model.orthogonal import OrthogonalLinear, init_orthogonal_, is_learnable_orthogonal
from oelm_nb.model.freeze import UnfreezeSchedule, frozen_qk_layers, param_report
from oelm_nb.model.gpt import GPT, PRESETS, model_config

MEDIUM_TOTAL, MEDIUM_FROZEN, MEDIUM_TRAINABLE = 44_896_768, 3_145_728, 41_751_040
GPT2_SMALL_TIED = 124_439_808  # the well-known GPT-2 small count (tied embeddings)


# ====================================================================== helpers
def expected_counts(cfg: ModelConfig) -> tuple[int, int, int]:
    "(total, trainable, frozen) computed by hand from the config *fields* (not the library's properties)."
    V, T, d, L = cfg.vocab_size, cfg.block_size, cfg.n_embd, cfg.n_layer
    k = cfg.n_embd_wte if cfg.n_embd_wte is not None else d
    ff = cfg.d_ff if cfg.d_ff is not None else 4 * d
    b, ab = int(cfg.bias), int(cfg.attn_bias)
    emb = V * k                                   # wte; lm_head is tied to it: counted once
    if k < d: emb += (k * d + b * d) + (d * k + b * k)  # scale_up [k->d], scale_down [d->k]
    pos = T * d                                   # learned positions
    ln = d + b * d                                # LayerNorm weight (+ bias)
    attn = 4 * (d * d + ab * d)                   # q, k, v, c_proj
    mlp = (d * ff + b * ff) + (ff * d + b * d)    # mlp_up, mlp_down
    total = emb + pos + L * (2 * ln + attn + mlp) + ln  # + final LayerNorm
    if cfg.variant in ('oelm-freeze', 'gauss-freeze'):
        n_frozen_layers = L if cfg.freeze_layers is None else cfg.freeze_layers
    else:
        n_frozen_layers = 0
    frozen = n_frozen_layers * 2 * d * d          # Q and K weights (their biases stay trainable)
    return total, total - frozen, frozen


def qk(model: GPT) -> list[tuple[torch.Tensor, torch.Tensor]]:
    "Effective (q_proj.weight, k_proj.weight) of every block, detached copies (works for parametrized weights too)."
    blocks = list(model.transformer.h)
    assert len(blocks) == model.cfg.n_layer
    return [(b.attn.q_proj.weight.detach().clone(), b.attn.k_proj.weight.detach().clone()) for b in blocks]


def orth_err(w: torch.Tensor) -> float:
    "max |W W^T - I| over the shorter side (rows when rows <= cols), in float64."
    w = w.detach().double()
    if w.shape[0] > w.shape[1]: w = w.T
    return (w @ w.T - torch.eye(w.shape[0], dtype=torch.float64)).abs().max().item()


def snapshot(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def adamw(model, lr=1e-3, weight_decay=0.1):
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                             lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=weight_decay)


def batch(vocab, B, T, seed):
    "A nanoGPT-style (x, y) batch: two contiguous tensors, y shifted by one."
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, vocab, (B, T + 1), generator=g)
    return data[:, :-1].clone(), data[:, 1:].clone()


def train_step(model, opt, seed):
    model.train()
    x, y = batch(model.cfg.vocab_size, 4, min(16, model.cfg.block_size), seed)
    _, loss = model(x, y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return loss.item()


def optimizer_tensors(opt):
    ps = [p for g in opt.param_groups for p in g['params']]
    return {id(p) for p in ps}, {p.data_ptr() for p in ps}


def ks_statistic(a: np.ndarray, b: np.ndarray) -> float:
    "Two-sample Kolmogorov-Smirnov statistic D = sup |F_a - F_b|."
    a, b = np.sort(np.ravel(a)), np.sort(np.ravel(b))
    x = np.concatenate([a, b])
    return float(np.abs(np.searchsorted(a, x, 'right') / a.size - np.searchsorted(b, x, 'right') / b.size).max())


def ks_critical(n: int, m: int, alpha: float) -> float:
    "Asymptotic two-sample KS critical value c(alpha) * sqrt((n+m)/(n m))."
    return math.sqrt(-0.5 * math.log(alpha / 2)) * math.sqrt((n + m) / (n * m))


def tiny(**kw) -> ModelConfig:
    "A small CPU model with 4 layers (the tiny preset's own size may change; these tests need >= 4 layers)."
    return model_config('tiny', **{'block_size': 32, 'n_layer': 4, 'n_head': 4, 'n_embd': 128, **kw})


@pytest.fixture(scope='module')
def medium512():
    "GPT.from_preset('medium512', variant=v, init_seed=0), built once per variant per module."
    cache = {}
    def get(variant):
        if variant not in cache: cache[variant] = GPT.from_preset('medium512', variant=variant, init_seed=0)
        return cache[variant]
    return get


# ====================================================================== parameter accounting
def test_arithmetic_reproduces_known_counts():
    # the hand formula itself is checked against two numbers from outside the library
    assert expected_counts(model_config('medium512'))[0] == MEDIUM_TOTAL
    assert expected_counts(model_config('gpt2-124m-1024'))[0] == GPT2_SMALL_TIED  # GPT-2's own 1,024 positions
    assert expected_counts(model_config('medium512', variant='oelm-freeze')) == (MEDIUM_TOTAL, MEDIUM_TRAINABLE, MEDIUM_FROZEN)
    assert MEDIUM_FROZEN == 6 * 2 * 512 * 512


@pytest.mark.parametrize('variant', ['gpt', 'oelm', 'oelm-freeze', 'oelm-learnable'])
def test_medium512_param_report(medium512, variant):
    model = medium512(variant)
    r = param_report(model)
    assert r.total == MEDIUM_TOTAL
    if variant == 'oelm-freeze':
        assert (r.trainable, r.frozen) == (MEDIUM_TRAINABLE, MEDIUM_FROZEN)
        assert round(100 * r.frozen_fraction, 1) == 7.0  # not the 15% the seed hypothesised
    else:
        assert (r.trainable, r.frozen) == (MEDIUM_TOTAL, 0)
    # independent of param_report: torch's own (deduplicated) parameter list plus the Q/K buffers
    n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    n_qk_buffers = sum(b.numel() for n, b in model.named_buffers() if n.endswith(('q_proj.weight', 'k_proj.weight')))
    assert n_trainable == r.trainable
    assert n_qk_buffers == r.frozen
    assert model.lm_head.weight is model.transformer.tok.wte.weight  # tied: one tensor
    # the per-component breakdown adds up
    assert int(r.components.total.sum()) == r.total
    assert int(r.components.loc['attention.qk', 'total']) == MEDIUM_FROZEN


@pytest.mark.parametrize('overrides', [
    dict(),
    dict(variant='oelm-freeze'),
    dict(variant='oelm-freeze', freeze_layers=1),
    dict(variant='oelm-learnable'),
    dict(n_embd_wte=32),                              # factorized embedding
    dict(n_embd_wte=32, bias=False, variant='oelm'),
    dict(attn_bias=True),
    dict(attn_bias=True, variant='oelm-freeze'),      # Q/K biases stay trainable
    dict(bias=False, d_ff=200, vocab_size=1001, block_size=17),
    dict(n_layer=3, n_head=2, n_embd=64, n_embd_wte=16, attn_bias=True, variant='oelm-freeze', freeze_layers=2),
], ids=lambda d: ','.join(f'{k}={v}' for k, v in d.items()) or 'tiny')
def test_param_report_matches_arithmetic(overrides):
    cfg = model_config('tiny', **overrides)
    r = param_report(GPT(cfg, init_seed=0))
    assert (r.total, r.trainable, r.frozen) == expected_counts(cfg)


@st.composite
def small_configs(draw):
    n_head = draw(st.integers(1, 4))
    n_embd = n_head * draw(st.integers(1, 6))
    variant = draw(st.sampled_from(VARIANTS))
    n_layer = draw(st.integers(1, 3))
    return ModelConfig(
        vocab_size=draw(st.integers(2, 200)), block_size=draw(st.integers(1, 12)),
        n_layer=n_layer, n_head=n_head, n_embd=n_embd,
        d_ff=draw(st.one_of(st.none(), st.integers(1, 40))),
        n_embd_wte=draw(st.one_of(st.none(), st.integers(1, n_embd))),
        bias=draw(st.booleans()), attn_bias=draw(st.booleans()), dropout=0.0, variant=variant,
        freeze_layers=draw(st.one_of(st.none(), st.integers(0, n_layer))) if variant == 'oelm-freeze' else None)


@given(cfg=small_configs(), seed=st.integers(0, 2**31 - 1))
def test_param_report_property(cfg, seed):
    model = GPT(cfg, init_seed=seed)
    r = param_report(model)
    assert (r.total, r.trainable, r.frozen) == expected_counts(cfg)
    assert frozen_qk_layers(model) == cfg.frozen_layers
    logits, _ = model(torch.zeros(1, cfg.block_size, dtype=torch.long))
    assert logits.shape == (1, cfg.block_size, cfg.vocab_size)


# ====================================================================== orthogonal init
@given(rows=st.integers(1, 48), cols=st.integers(1, 48), gain=st.floats(0.25, 4.0), seed=st.integers(0, 2**31 - 1))
def test_init_orthogonal_property(rows, cols, gain, seed):
    w = init_orthogonal_(torch.empty(rows, cols), gain=gain, generator=torch.Generator().manual_seed(seed))
    assert w.shape == (rows, cols) and torch.isfinite(w).all()
    assert orth_err(w / gain) < 1e-5  # rows orthonormal when rows <= cols, else columns
    # the same algorithm (QR + sign fix) as torch.nn.init.orthogonal_: same generator, same matrix
    ref = torch.nn.init.orthogonal_(torch.empty(rows, cols), gain=gain, generator=torch.Generator().manual_seed(seed))
    torch.testing.assert_close(w, ref, rtol=1e-5, atol=1e-6)


def test_init_orthogonal_float64_precision():
    w = init_orthogonal_(torch.empty(64, 64, dtype=torch.float64), generator=torch.Generator().manual_seed(0))
    ref = torch.nn.init.orthogonal_(torch.empty(64, 64, dtype=torch.float64), generator=torch.Generator().manual_seed(0))
    assert orth_err(ref) < 1e-12  # what torch achieves
    assert orth_err(w) < 1e-12


def test_init_orthogonal_rejects_non_matrix():
    for shape in [(5,), (2, 3, 4)]:
        with pytest.raises(ValueError, match='2-D'):
            init_orthogonal_(torch.empty(shape))


def test_orthogonal_linear_freeze_roundtrip():
    lin = OrthogonalLinear(16, 8, bias=True)
    w0 = lin.weight.detach().clone()
    assert orth_err(w0) < 1e-5 and isinstance(lin.weight, torch.nn.Parameter)
    lin.freeze_()
    assert lin.frozen and 'weight' in dict(lin.named_buffers()) and 'weight' not in dict(lin.named_parameters())
    assert 'bias' in dict(lin.named_parameters())  # the bias is never frozen
    assert torch.equal(lin.weight, w0) and 'weight' in lin.state_dict()
    lin.unfreeze_()
    assert not lin.frozen and isinstance(lin.weight, torch.nn.Parameter) and torch.equal(lin.weight.detach(), w0)
    x = torch.randn(3, 16)
    torch.testing.assert_close(lin(x), x @ w0.T + lin.bias)


@pytest.mark.parametrize('preset', ['tiny', 'medium512'])
def test_qk_orthonormal_only_for_oelm_variants(preset, medium512):
    build = medium512 if preset == 'medium512' else (lambda v: GPT(tiny(variant=v), init_seed=0))
    for variant in ('oelm', 'oelm-freeze', 'oelm-learnable'):
        for i, (q, k) in enumerate(qk(build(variant))):
            assert orth_err(q) < 1e-5 and orth_err(k) < 1e-5, (variant, i)
            assert orth_err(q.T) < 1e-5  # square: columns too
    # negative control: the standard N(0, 0.02) init is far from orthonormal
    for q, k in qk(build('gpt')):
        assert orth_err(q) > 0.5 and orth_err(k) > 0.5


def test_qk_entries_distributed_like_torch_orthogonal():
    d, n_layer = 128, 4
    model = GPT(model_config('tiny', n_layer=n_layer, n_head=4, n_embd=d, variant='oelm'), init_seed=0)
    ws = [w for pair in qk(model) for w in pair]
    ours = torch.stack(ws).numpy().ravel()
    g = torch.Generator().manual_seed(12345)
    ref = torch.stack([torch.nn.init.orthogonal_(torch.empty(d, d), generator=g) for _ in ws]).numpy().ravel()
    crit = ks_critical(ours.size, ref.size, alpha=1e-4)
    assert ks_statistic(ours, ref) < crit
    # moments of a Haar-orthogonal d x d matrix: mean 0, variance 1/d, kurtosis 3d/(d+2) ~ 3
    assert abs(ours.mean()) < 5 / (d ** 1.5 * math.sqrt(len(ws)))  # 5 standard errors
    assert ours.var() == pytest.approx(1 / d, rel=1e-3)
    assert (ours ** 4).mean() / ours.var() ** 2 == pytest.approx(3 * d / (d + 2), abs=0.15)
    for w in ws:  # every row has norm 1
        torch.testing.assert_close(w.norm(dim=1), torch.ones(d), rtol=0, atol=1e-5)
    # negative controls: the gpt init, and a signed permutation (orthogonal, right variance, wrong shape)
    gpt_qk = torch.stack([w for pair in qk(GPT(model_config('tiny', n_layer=n_layer, n_head=4, n_embd=d), init_seed=0)) for w in pair]).numpy()
    assert ks_statistic(gpt_qk, ref) > 10 * crit
    perm = torch.eye(d)[torch.randperm(d)] * torch.sign(torch.randn(d, 1))
    assert orth_err(perm) < 1e-6 and ks_statistic(perm.numpy(), ref) > 10 * crit


# ====================================================================== variants share everything but Q/K
def test_variants_identical_except_qk():
    models = {v: GPT(tiny(variant=v, attn_bias=True), init_seed=7) for v in VARIANTS}
    non_qk = {v: {k: t for k, t in snapshot(m).items() if '.q_proj.' not in k and '.k_proj.' not in k}
              for v, m in models.items()}
    ref = non_qk['gpt']
    assert len(ref) > 20
    for v in VARIANTS:
        assert non_qk[v].keys() == ref.keys(), v
        for k in ref: assert torch.equal(non_qk[v][k], ref[k]), (v, k)
        for b in models[v].transformer.h:  # Q/K biases are zero in every variant
            assert torch.equal(b.attn.q_proj.bias.detach(), torch.zeros(128))
    gpt_qk, oelm_qk = qk(models['gpt']), qk(models['oelm'])
    for (gq, gk), (oq, ok) in zip(gpt_qk, oelm_qk):
        assert not torch.allclose(gq, oq, atol=1e-3) and not torch.allclose(gk, ok, atol=1e-3)
    for v in ('oelm-freeze', 'oelm-learnable'):  # same seed -> same orthogonal Q/K
        for (oq, ok), (vq, vk) in zip(oelm_qk, qk(models[v])):
            torch.testing.assert_close(vq, oq, rtol=0, atol=1e-6)
            torch.testing.assert_close(vk, ok, rtol=0, atol=1e-6)
    # Q and K of one layer, and different layers, are different draws
    assert not torch.allclose(oelm_qk[0][0], oelm_qk[0][1]) and not torch.allclose(oelm_qk[0][0], oelm_qk[1][0])


def test_init_seed_controls_weights_not_global_rng():
    torch.manual_seed(1); a = snapshot(GPT(tiny(variant='oelm'), init_seed=3))
    torch.manual_seed(2); b = snapshot(GPT(tiny(variant='oelm'), init_seed=3))
    c = snapshot(GPT(tiny(variant='oelm'), init_seed=4))
    assert all(torch.equal(a[k], b[k]) for k in a)
    for k in ('transformer.tok.wte.weight', 'transformer.h.0.attn.q_proj.weight', 'transformer.h.0.mlp.mlp_up.weight'):
        assert not torch.equal(a[k], c[k]), k


# ====================================================================== freezing and training
def test_frozen_qk_are_buffers_never_optimized():
    cfg = tiny(variant='oelm-freeze')
    model = GPT(cfg, init_seed=0)
    params, buffers, sd = dict(model.named_parameters()), dict(model.named_buffers()), model.state_dict()
    names = [f'transformer.h.{i}.attn.{p}.weight' for i in range(cfg.n_layer) for p in ('q_proj', 'k_proj')]
    for n in names:
        assert n in sd and n in buffers and n not in params, n
    frozen = [buffers[n] for n in names]
    assert all(not t.requires_grad for t in frozen)
    before = snapshot(model)
    opt = adamw(model)
    ids, ptrs = optimizer_tensors(opt)
    assert not any(id(t) in ids or t.data_ptr() in ptrs for t in frozen)
    assert len(ids) == len(params)  # every trainable tensor is optimized
    for step in range(4): train_step(model, opt, seed=step)
    after = snapshot(model)
    for n in names:
        assert torch.equal(after[n], before[n]), n
    assert all(t.grad is None for t in frozen)
    for n in ('transformer.tok.wte.weight', 'transformer.wpe.weight', 'transformer.h.0.attn.v_proj.weight',
              'transformer.h.3.attn.c_proj.weight', 'transformer.h.1.mlp.mlp_up.weight', 'transformer.ln_f.weight'):
        assert not torch.equal(after[n], before[n]), n
    assert frozen_qk_layers(model) == [0, 1, 2, 3]
    for q, k in qk(model): assert orth_err(q) < 1e-5 and orth_err(k) < 1e-5


def test_oelm_trainable_qk_do_change():  # control for the test above: without freezing Q/K move
    model = GPT(tiny(variant='oelm'), init_seed=0)
    q0 = qk(model)
    opt = adamw(model)
    for step in range(2): train_step(model, opt, seed=step)
    assert all(not torch.equal(a, b) for (a, _), (b, _) in zip(q0, qk(model)))


def test_layerwise_freezing_first_n_layers():
    d = 128
    model = GPT(tiny(variant='oelm-freeze', freeze_layers=2, n_layer=4), init_seed=0)
    assert frozen_qk_layers(model) == [0, 1]
    for i, b in enumerate(model.transformer.h):
        for lin in (b.attn.q_proj, b.attn.k_proj):
            assert isinstance(lin.weight, torch.nn.Parameter) == (i >= 2), i
            assert orth_err(lin.weight) < 1e-5  # orthogonal init in every layer, frozen or not
    assert param_report(model).frozen == 2 * 2 * d * d
    assert frozen_qk_layers(GPT(tiny(variant='oelm-freeze', freeze_layers=0), init_seed=0)) == []
    assert frozen_qk_layers(GPT(tiny(variant='oelm-freeze'), init_seed=0)) == [0, 1, 2, 3]
    assert frozen_qk_layers(GPT(tiny(variant='oelm'), init_seed=0)) == []


def test_progressive_unfreezing():
    cfg = tiny(variant='oelm-freeze', unfreeze_at=(3, 6))
    model = GPT(cfg, init_seed=0)
    sched = UnfreezeSchedule.from_config(cfg)
    opt = adamw(model)
    init = qk(model)
    released_at, after_step = {}, []
    for step in range(9):
        n_groups = len(opt.param_groups)
        released = sched.apply(model, step, opt, weight_decay=0.1)
        assert len(opt.param_groups) == n_groups + len(released), step
        if released:
            released_at[step] = released
            assert len(released) == 1
            layer = released[0]
            attn = model.transformer.h[layer].attn
            group = opt.param_groups[-1]
            assert [id(p) for p in group['params']] == [id(attn.q_proj.weight), id(attn.k_proj.weight)]
            assert group['weight_decay'] == 0.1 and group['lr'] == opt.param_groups[0]['lr']
            assert attn.q_proj.weight.requires_grad and 'transformer.h.%d.attn.q_proj.weight' % layer in dict(model.named_parameters())
            # released exactly as it was: unchanged up to (and including) the moment of release
            assert torch.equal(attn.q_proj.weight.detach(), init[layer][0])
            assert torch.equal(attn.k_proj.weight.detach(), init[layer][1])
        train_step(model, opt, seed=step)
        after_step.append(qk(model))
    assert sorted(released_at) == [3, 6]
    (l3,), (l6,) = released_at[3], released_at[6]
    assert l3 != l6 and {l3, l6} <= set(cfg.frozen_layers)
    for layer, s in ((l3, 3), (l6, 6)):
        for step, state in enumerate(after_step):
            unchanged = all(torch.equal(a, b) for a, b in zip(state[layer], init[layer]))
            assert unchanged == (step < s), (layer, step)
        assert not torch.equal(after_step[-1][layer][0], after_step[s][layer][0])  # keeps training
    still_frozen = sorted(set(cfg.frozen_layers) - {l3, l6})
    assert frozen_qk_layers(model) == still_frozen
    for layer in still_frozen:
        assert all(torch.equal(a, b) for a, b in zip(after_step[-1][layer], init[layer]))
    assert param_report(model).frozen == len(still_frozen) * 2 * cfg.n_embd ** 2
    assert sched.apply(model, 100, opt) == []  # nothing released twice


def test_learnable_orthogonal_stays_orthogonal():
    model = GPT(tiny(variant='oelm-learnable'), init_seed=0)
    assert all(is_learnable_orthogonal(b.attn.q_proj) and is_learnable_orthogonal(b.attn.k_proj) for b in model.transformer.h)
    init = qk(model)
    opt = adamw(model, lr=1e-2)
    for step in range(5): train_step(model, opt, seed=step)
    for (q0, k0), (q, k) in zip(init, qk(model)):
        assert (q - q0).abs().max() > 1e-3 and (k - k0).abs().max() > 1e-3
        assert orth_err(q) < 1e-5 and orth_err(k) < 1e-5


def test_forward_accepts_sliced_targets():
    model = GPT(tiny(), init_seed=0)
    data = torch.randint(0, model.cfg.vocab_size, (2, 17))
    _, loss = model(data[:, :-1], data[:, 1:])  # the usual shift-by-one slice
    _, ref = model(data[:, :-1], data[:, 1:].contiguous())
    assert torch.equal(loss, ref)


# ====================================================================== save / load
def test_state_dict_roundtrip_restores_frozen_buffers(tmp_path):
    a = GPT(tiny(variant='oelm-freeze', freeze_layers=3), init_seed=0)
    opt = adamw(a)
    for step in range(2): train_step(a, opt, seed=step)
    b = GPT(tiny(variant='oelm-freeze', freeze_layers=3), init_seed=1)
    assert not torch.equal(qk(a)[0][0], qk(b)[0][0])  # really different before loading
    torch.save(a.state_dict(), tmp_path / 'model.pt')
    b.load_state_dict(torch.load(tmp_path / 'model.pt', weights_only=True))
    sa, sb = snapshot(a), snapshot(b)
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert frozen_qk_layers(b) == [0, 1, 2]
    assert b.lm_head.weight is b.transformer.tok.wte.weight
    a.eval(); b.eval()
    x, _ = batch(a.cfg.vocab_size, 2, 16, seed=9)
    assert torch.equal(a(x)[0], b(x)[0])


def test_safetensors_roundtrip_restores_frozen_buffers(tmp_path):
    from safetensors.torch import load_file, load_model, save_file, save_model
    a = GPT(tiny(variant='oelm-freeze'), init_seed=0)
    opt = adamw(a)
    for step in range(2): train_step(a, opt, seed=step)
    sd = a.state_dict()
    # safetensors refuses tensors that share memory (the tied lm_head): store each tensor once
    seen, flat = set(), {}
    for k, v in sd.items():
        if v.data_ptr() not in seen: seen.add(v.data_ptr()); flat[k] = v.contiguous()
    assert set(sd) - set(flat) == {'lm_head.weight'}
    save_file(flat, str(tmp_path / 'model.safetensors'))
    b = GPT(tiny(variant='oelm-freeze'), init_seed=1)
    assert not torch.equal(qk(a)[2][1], qk(b)[2][1])
    missing, unexpected = b.load_state_dict(load_file(str(tmp_path / 'model.safetensors')), strict=False)
    assert missing == ['lm_head.weight'] and unexpected == []
    sa, sb = snapshot(a), snapshot(b)
    assert all(torch.equal(sa[k], sb[k]) for k in sa)  # lm_head restored through the tie
    assert frozen_qk_layers(b) == [0, 1, 2, 3]
    # safetensors' own helpers for models with shared tensors
    c = GPT(tiny(variant='oelm-freeze'), init_seed=2)
    save_model(a, str(tmp_path / 'model2.safetensors'))
    load_model(c, str(tmp_path / 'model2.safetensors'))
    sc = snapshot(c)
    assert all(torch.equal(sa[k], sc[k]) for k in sa) and frozen_qk_layers(c) == [0, 1, 2, 3]


def test_learnable_roundtrip(tmp_path):
    a = GPT(tiny(variant='oelm-learnable'), init_seed=0)
    opt = adamw(a, lr=1e-2)
    train_step(a, opt, seed=0)
    torch.save(a.state_dict(), tmp_path / 'm.pt')
    b = GPT(tiny(variant='oelm-learnable'), init_seed=1)
    b.load_state_dict(torch.load(tmp_path / 'm.pt', weights_only=True))
    for (qa, ka), (qb, kb) in zip(qk(a), qk(b)):
        assert torch.equal(qa, qb) and torch.equal(ka, kb)


# ====================================================================== configuration errors
@pytest.mark.parametrize('make, names', [
    (lambda: ModelConfig(n_embd=100, n_head=3), ['n_head', 'n_embd']),
    (lambda: model_config('tiny', n_head=5), ['n_head']),
    (lambda: ModelConfig(variant='oelm-frozen'), ['variant']),
    (lambda: GPT.from_preset('tiny', variant='nope'), ['variant']),
    (lambda: TrainConfig(lr=-3e-4), ['lr']),
    (lambda: TrainConfig(lr=1e-4, min_lr=1e-3), ['min_lr']),
    (lambda: ModelConfig(variant='oelm', freeze_layers=2), ['freeze_layers']),
    (lambda: ModelConfig(variant='oelm', unfreeze_at=(5,)), ['unfreeze_at']),
    (lambda: ModelConfig(variant='oelm-freeze', n_layer=4, freeze_layers=5), ['freeze_layers']),
    (lambda: ModelConfig(variant='oelm-freeze', unfreeze_at=(6, 3)), ['unfreeze_at']),
    (lambda: ModelConfig(variant='oelm-freeze', n_layer=2, unfreeze_at=(1, 2, 3)), ['unfreeze_at']),
    (lambda: ModelConfig.from_dict({'n_layers': 4}), ['n_layers']),
    (lambda: TrainConfig.from_dict({'learning_rate': 1e-3}), ['learning_rate']),
    (lambda: model_config('huge'), ['huge']),
    (lambda: ModelConfig(dropout=1.5), ['dropout']),
    (lambda: ModelConfig(n_embd_wte=256, n_embd=128), ['n_embd_wte']),
], ids=['n_head_divides', 'preset_override', 'variant', 'from_preset_variant', 'neg_lr', 'min_lr_gt_lr',
        'freeze_layers_oelm', 'unfreeze_at_oelm', 'freeze_layers_range', 'unfreeze_unsorted', 'unfreeze_too_many',
        'unknown_field', 'unknown_train_field', 'unknown_preset', 'dropout', 'wte_wider'])
def test_bad_config_names_the_field(make, names):
    with pytest.raises(ConfigError) as e:
        make()
    assert isinstance(e.value, ValueError)
    for n in names: assert n in str(e.value), (n, str(e.value))


@pytest.mark.parametrize('kw, name', [(dict(dropout='0.1'), 'dropout'),
                                      (dict(variant='oelm-freeze', unfreeze_at=5), 'unfreeze_at')],
                         ids=['dropout_str', 'unfreeze_at_int'])
def test_wrong_type_raises_config_error(kw, name):
    with pytest.raises(ConfigError, match=name):
        ModelConfig(**kw)


def test_good_configs_roundtrip():
    for name in PRESETS:
        cfg = model_config(name, variant='oelm-freeze', unfreeze_at=[1, 2])
        assert ModelConfig.from_dict(cfg.to_dict()) == cfg and cfg.unfreeze_at == (1, 2)
    assert TrainConfig(lr=1e-4, min_lr=1e-4).min_lr == 1e-4  # min_lr == lr is allowed
    assert ModelConfig(dropout=0.0).dropout == 0.0


# ====================================================================== generation
def test_generate_greedy_deterministic_and_crops_to_block_size():
    cfg = model_config('tiny', block_size=16, dropout=0.1)
    model = GPT(cfg, init_seed=0)
    model.train()
    prompt = torch.randint(0, cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(3))
    with pytest.raises(ValueError, match='block_size'):
        model(prompt)  # too long for one forward pass: generate must crop
    torch.manual_seed(1); out1 = model.generate(prompt, 8, temperature=0)
    torch.manual_seed(2); out2 = model.generate(prompt, 8, temperature=0)
    assert model.training  # mode restored
    assert out1.shape == (2, 48) and torch.equal(out1[:, :40], prompt)
    assert torch.equal(out1, out2)  # no dropout, no sampling
    # each new token is the argmax over the last block_size tokens, computed here independently
    model.eval()
    with torch.no_grad():
        for t in range(40, 48):
            logits, _ = model(out1[:, t - cfg.block_size:t])
            assert torch.equal(logits[:, -1].argmax(-1), out1[:, t]), t
    # only the last block_size tokens matter
    short = model.generate(prompt[:, -cfg.block_size:], 8, temperature=0)
    assert torch.equal(short[:, cfg.block_size:], out1[:, 40:])


def test_generate_sampling_uses_generator():
    model = GPT(tiny(), init_seed=0)
    prompt = torch.zeros(1, 3, dtype=torch.long)
    a = model.generate(prompt, 12, temperature=1.0, top_k=50, generator=torch.Generator().manual_seed(0))
    b = model.generate(prompt, 12, temperature=1.0, top_k=50, generator=torch.Generator().manual_seed(0))
    assert torch.equal(a, b) and a.shape == (1, 15)


# ====================================================================== the scale controls of the Q/K study
@pytest.mark.parametrize('seed', [0, 3])
def test_gauss_controls_match_the_orthogonal_scale_without_orthogonality(seed):
    "gauss / gauss-freeze: Q/K entries N(0, 1/d) (the orthogonal matrices' std), not orthogonal; frozen only in gauss-freeze; all else as oelm."
    cfg = model_config('tiny')
    oelm, gauss, frozen = (GPT(cfg.replace(variant=v), init_seed=seed) for v in ('oelm', 'gauss', 'gauss-freeze'))
    d = cfg.n_embd
    for layer in range(cfg.n_layer):
        for proj in ('q_proj', 'k_proj'):
            wo, wg = (getattr(m.transformer.h[layer].attn, proj).weight.detach() for m in (oelm, gauss))
            assert abs(wo.std().item() - 1 / math.sqrt(d)) < 2e-3 and abs(wg.std().item() - 1 / math.sqrt(d)) < 0.01
            assert torch.allclose(wo @ wo.T, torch.eye(d), atol=1e-5) and not torch.allclose(wg @ wg.T, torch.eye(d), atol=0.1)
            assert torch.equal(wg, getattr(frozen.transformer.h[layer].attn, proj).weight)  # the same draw, frozen or not
    assert frozen_qk_layers(frozen) == list(range(cfg.n_layer)) and frozen_qk_layers(gauss) == []
    assert param_report(frozen).trainable == param_report(GPT(cfg.replace(variant='oelm-freeze'), init_seed=seed)).trainable
    same = [k for k in oelm.state_dict() if 'q_proj' not in k and 'k_proj' not in k]
    assert all(torch.equal(oelm.state_dict()[k], gauss.state_dict()[k]) for k in same)
    gpt_q = GPT(cfg, init_seed=seed).transformer.h[0].attn.q_proj.weight
    assert abs(gpt_q.std().item() - cfg.init_std) < 2e-3  # the 6x smaller scale gauss controls for
