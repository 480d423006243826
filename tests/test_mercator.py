"""Tests of oelm_nb.studies.mercator.method: the Mercator loss, presets, stages, KV extraction and distillation end to end."""
from __future__ import annotations
import math, os, time

import pytest
import torch
from hypothesis import given, strategies as st

from oelm_nb.base.core import ConfigError
from oelm_nb.model.gpt import GPT, model_config
from oelm_nb.studies.mercator.method import (mercator_loss, mse_loss, MercatorConfig, mercator_config, MERCATOR_PRESETS, ElasticBottleneck,
                              KVProjector, kv_projector, cosine_stage, centered_cosine, layer_map, gpt_kv, hf_kv, extract_kv,
                              flatten_heads, kv_width, distill_hook, load_causal_lm, ModelLoadError)

# ---------------------------------------------------------------- helpers
def vec(seed: int, shape=(4, 6, 16)) -> torch.Tensor:
    "Random vectors whose norms are bounded away from zero (so the safe norm's eps is negligible)."
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(shape, generator=g, dtype=torch.float64)
    return v / v.norm(dim=-1, keepdim=True) * (0.5 + torch.rand(shape[:-1] + (1,), generator=g, dtype=torch.float64))

seeds = st.integers(0, 2**31 - 1)
scales = st.floats(1e-2, 1e2)

# ---------------------------------------------------------------- direction term
@given(seeds, scales)
def test_direction_zero_for_parallel(seed, c):
    s = vec(seed)
    assert mercator_loss(s, c * s, beta=0.0).item() == pytest.approx(0.0, abs=1e-6)

@given(seeds, scales)
def test_direction_two_for_opposite(seed, c):
    s = vec(seed)
    assert mercator_loss(s, -c * s, beta=0.0).item() == pytest.approx(2.0, abs=1e-6)

@given(seeds, scales, scales)
def test_direction_invariant_to_positive_rescaling(seed, a, b):
    s, t = vec(seed), vec(seed + 1)
    base = mercator_loss(s, t, beta=0.0).item()
    assert mercator_loss(a * s, t, beta=0.0).item() == pytest.approx(base, abs=1e-5)
    assert mercator_loss(s, b * t, beta=0.0).item() == pytest.approx(base, abs=1e-5)
    assert 0.0 <= base <= 2.0

@given(seeds, st.floats(1.5, 100.0))
def test_magnitude_term_is_squared_log_ratio(seed, c):
    s = vec(seed)
    assert mercator_loss(s, c * s, beta=0.1).item() == pytest.approx(0.1 * math.log(c) ** 2, rel=1e-4)

def test_gradients_finite_for_zero_vectors():
    for s_zero, t_zero in ((True, False), (False, True), (True, True)):
        s = (torch.zeros(3, 8) if s_zero else torch.randn(3, 8)).requires_grad_()
        t = (torch.zeros(3, 8) if t_zero else torch.randn(3, 8)).requires_grad_()
        loss = mercator_loss(s, t, beta=0.01)
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(s.grad).all() and torch.isfinite(t.grad).all()

@given(seeds, st.integers(1, 5))
def test_mask_excludes_padding(seed, n_pad):
    s, t = vec(seed, (3, 6, 8)), vec(seed + 1, (3, 6, 8))
    mask = torch.ones(3, 6, dtype=torch.bool); mask[:, 6 - n_pad:] = False
    s2, t2 = s.clone(), t.clone()
    s2[:, 6 - n_pad:] = torch.randn(3, n_pad, 8, dtype=torch.float64) * 1e3
    t2[:, 6 - n_pad:] = float('nan')
    for f in (mercator_loss, mse_loss):
        ref = f(s[:, :6 - n_pad], t[:, :6 - n_pad])
        assert f(s, t, mask=mask).item() == pytest.approx(ref.item(), rel=1e-6)
        assert f(s2, t2, mask=mask).item() == pytest.approx(ref.item(), rel=1e-6)

def test_mse_baseline_not_scale_invariant():
    s, t = vec(0), vec(1)
    assert mse_loss(s, t).item() != pytest.approx(mse_loss(10 * s, t).item(), rel=1e-3)
    assert mse_loss(s, 100 * s).item() > 1.0  # the Mercator guide's example: same direction, large MSE
    assert mercator_loss(s, 100 * s, beta=0.0).item() == pytest.approx(0.0, abs=1e-6)

def test_shape_mismatch_is_explained():
    with pytest.raises(ValueError, match='project the teacher'): mercator_loss(torch.randn(2, 3), torch.randn(2, 4))

# ---------------------------------------------------------------- presets, stages, collapse guard
def test_presets_and_validation():
    assert mercator_config('pure-direction').beta == 0.0
    assert mercator_config('weak').beta == 0.01 and mercator_config('strong').beta == 0.1
    assert mercator_config('high-capacity').mlp_ratio == 2.0 and mercator_config('low-capacity').mlp_ratio == 0.5
    assert all(mercator_config(k).alpha == 1.0 for k in MERCATOR_PRESETS)
    assert MercatorConfig().projector_lr_scale(5e-5) == pytest.approx(20.0)
    with pytest.raises(ConfigError, match='MercatorConfig.mlp_ratio'): MercatorConfig(mlp_ratio=0.0)
    with pytest.raises(ConfigError, match='MercatorConfig.loss'): MercatorConfig(loss='l1')
    with pytest.raises(ConfigError, match='MercatorConfig.dropout'): MercatorConfig(dropout=1.0)
    with pytest.raises(ConfigError, match='choose from'): mercator_config('nope')

@pytest.mark.parametrize('c,stage', [(-0.3, 'Adapting'), (0.4999, 'Adapting'), (0.5, 'Learning'), (0.6999, 'Learning'), (0.7, 'Good'),
                                     (0.8999, 'Good'), (0.9, 'Great'), (0.9499, 'Great'), (0.95, 'Excellent'), (1.0, 'Excellent')])
def test_cosine_stage_boundaries(c, stage):
    assert cosine_stage(c) == stage

def test_centered_cosine_detects_collapse():
    u = torch.randn(1, 16)
    s, t = u + 0.01 * torch.randn(200, 16), u + 0.01 * torch.randn(200, 16)
    assert centered_cosine(s, t).abs() < 0.3
    w = torch.randn(200, 16)
    assert centered_cosine(w + 3, 2 * w - 1).item() == pytest.approx(1.0, abs=1e-5)

def test_layer_map():
    m = layer_map(28, 24)
    assert len(m) == 24 and m[0] == 0 and m[-1] == 27 and all(b > a for a, b in zip(m, m[1:]))
    assert layer_map(3, 2) == [0, 2] and layer_map(5, 5) == list(range(5)) and layer_map(6, 1) == [5]
    with pytest.raises(ConfigError): layer_map(3, 0)

def test_elastic_bottleneck_widths():
    assert ElasticBottleneck(32, 8, 0.5).hidden == 16 and ElasticBottleneck(32, 8, 2.0).hidden == 64
    assert ElasticBottleneck(32, 8)(torch.randn(2, 3, 32)).shape == (2, 3, 8)

# ---------------------------------------------------------------- KV extraction
def test_gpt_kv_matches_manual_projection():
    g = GPT(model_config('tiny', vocab_size=50, block_size=16, n_layer=3, n_head=4, n_embd=32, dropout=0.0), init_seed=3).eval()
    idx = torch.randint(0, 50, (2, 10))
    logits, kv = gpt_kv(g, idx)
    assert len(kv) == 3 and logits.shape == (2, 10, 50)
    with torch.no_grad():
        x = g.transformer.tok(idx) + g.transformer.wpe(torch.arange(10))
        for block, (k, v) in zip(g.transformer.h, kv):
            a = block.ln_1(x)
            assert k.shape == v.shape == (2, 4, 10, 8)
            torch.testing.assert_close(k, block.attn.k_proj(a).view(2, 10, 4, 8).transpose(1, 2))
            torch.testing.assert_close(flatten_heads(v), block.attn.v_proj(a))
            x = block(x)
        torch.testing.assert_close(logits, g(idx)[0])
    assert all(len(b.attn.k_proj._forward_hooks) == 0 and len(b.attn.v_proj._forward_hooks) == 0 for b in g.transformer.h)

def qwen2(n_layers, n_heads, n_kv, head_dim, hidden, seed):
    transformers = pytest.importorskip('transformers')
    torch.manual_seed(seed)
    cfg = transformers.Qwen2Config(vocab_size=128, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=n_layers,
                                   num_attention_heads=n_heads, num_key_value_heads=n_kv, head_dim=head_dim, max_position_embeddings=64)
    return transformers.Qwen2ForCausalLM(cfg)

def test_hf_kv_shapes_grouped_query():
    t = qwen2(3, 4, 2, 16, 64, 0).eval()
    logits, kv = hf_kv(t, torch.randint(0, 128, (2, 7)))
    assert logits.shape == (2, 7, 128) and len(kv) == 3
    assert kv[0][0].shape == kv[2][1].shape == (2, 2, 7, 16)
    assert kv_width(t) == (3, 32)

def test_qwen2_distillation_end_to_end():
    teacher, student = qwen2(3, 4, 2, 16, 64, 0), qwen2(2, 2, 1, 8, 32, 1)
    before = {k: v.clone() for k, v in teacher.state_dict().items()}
    cfg = mercator_config('weak', dropout=0.0)
    proj = kv_projector(teacher, student, cfg)
    assert isinstance(proj, KVProjector) and proj.k[0].net[1].in_features == 32 and proj.k[0].net[-1].out_features == 8
    hook = distill_hook(teacher, proj, layer_map(3, 2), cfg, weight=1.0, pad_id=0)
    opt = torch.optim.AdamW([{'params': student.parameters(), 'lr': 1e-3}, {'params': proj.parameters(), 'lr': 1e-2}])
    g = torch.Generator().manual_seed(0)
    x = torch.randint(1, 128, (4, 12), generator=g); x[:, -3:] = 0  # right padding
    y = x.roll(-1, 1)
    s_before = {k: v.clone() for k, v in student.state_dict().items()}
    p_before = [p.clone() for p in proj.parameters()]
    student.train(); losses, logs = [], []
    for _ in range(4):
        loss, log = hook(student, (x, y, None))
        assert torch.isfinite(loss)
        opt.zero_grad(); loss.backward(); opt.step()
        losses.append(loss.item()); logs.append(log)
    assert set(logs[-1]) == {'ce_loss', 'kv_loss', 'kv_cos', 'kv_cos_centered', 'kv_stage'}
    assert all(math.isfinite(l['kv_loss']) and -1 <= l['kv_cos'] <= 1 for l in logs)
    assert losses[-1] < losses[0]
    assert not teacher.training and all(not p.requires_grad for p in teacher.parameters())
    for k, v in teacher.state_dict().items(): torch.testing.assert_close(v, before[k], rtol=0, atol=0)
    assert any(not torch.equal(v, student.state_dict()[k]) for k, v in s_before.items() if 'k_proj' in k)
    assert any(not torch.equal(a, b) for a, b in zip(p_before, proj.parameters()))
    _, s_kv = extract_kv(student, x)
    assert s_kv[0][0].shape == (4, 1, 12, 8)

def test_distill_with_gpt_through_trainer(tmp_path):
    from oelm_nb.base.core import TrainConfig
    from oelm_nb.base.metrics import read_metrics
    from oelm_nb.train.trainer import Trainer
    from oelm_nb.train.trainer import copy_task_data  # the train chapter's copying task (its examples use it too)
    data = copy_task_data(n_seqs=64, seed=0)
    teacher = GPT(model_config('tiny', vocab_size=64, block_size=32, n_layer=3, n_head=4, n_embd=32, dropout=0.0), init_seed=0)
    student = GPT(model_config('tiny', vocab_size=64, block_size=32, n_layer=2, n_head=2, n_embd=16, dropout=0.0), init_seed=1)
    cfg, lr_student = mercator_config('mse', lr_projector=1e-2), 1e-3
    proj = kv_projector(teacher, student, cfg)
    tc = TrainConfig(max_steps=6, batch_size=4, lr=lr_student, min_lr=1e-4, warmup_steps=1, eval_every=0, eval_batches=1,
                     log_every=1, device='cpu', progress=False)
    tr = Trainer(student, tc, data, out_dir=tmp_path, loss_fn=distill_hook(teacher, proj, layer_map(3, 2), cfg),
                 extra_modules={'projector': (proj, cfg.projector_lr_scale(lr_student))})
    tr.fit()
    lrs = {g['name']: g['lr'] for g in tr.opt.param_groups}
    assert lrs['projector.decay'] == pytest.approx(10 * lrs['decay'])
    recs = read_metrics(tmp_path)
    assert len(recs) == 6 and all('kv_cos_centered' in r and math.isfinite(r['train_loss']) for r in recs)

def test_layer_map_mismatch_is_explained():
    teacher = GPT(model_config('tiny', vocab_size=64, block_size=16, n_layer=3, n_head=2, n_embd=16), init_seed=0)
    student = GPT(model_config('tiny', vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=16), init_seed=1)
    hook = distill_hook(teacher, kv_projector(teacher, student), [0, 1, 2])
    x = torch.randint(0, 64, (2, 8))
    with pytest.raises(ConfigError, match=r'layer_map\(3, 2\)'): hook(student, (x, x, None))

# ---------------------------------------------------------------- loading checkpoints
def test_offline_hub_name_fails_fast(monkeypatch):
    pytest.importorskip('transformers')
    monkeypatch.setenv('HF_HUB_OFFLINE', '1')
    with pytest.raises(ModelLoadError, match='--local-dir') as e:
        load_causal_lm('Qwen/Qwen2.5-0.5B-not-cached-here', local_files_only=False)
    assert 'HF_HUB_OFFLINE' in str(e.value)

def test_load_from_local_directory(tmp_path):
    m = qwen2(2, 2, 1, 8, 16, 0)
    m.save_pretrained(tmp_path)
    m2 = load_causal_lm(tmp_path)
    x = torch.randint(0, 128, (1, 5))
    torch.testing.assert_close(m2.eval()(x).logits, m.eval()(x).logits)
    empty = tmp_path / 'empty'; empty.mkdir()
    with pytest.raises(ModelLoadError, match='no config.json'): load_causal_lm(empty)


# ---------------------------------------------------------------- logit distillation, the pass line, the centered loss
def test_logit_kd_matches_an_independent_kl():
    "tau^2 KL(teacher || student) of the softened distributions, computed here in float64 numpy from the definition."
    import numpy as np
    from oelm_nb.studies.mercator.method import logit_kd_loss
    g = torch.Generator().manual_seed(0)
    zs, zt = torch.randn(2, 7, 13, generator=g) * 3, torch.randn(2, 7, 13, generator=g) * 3
    mask = torch.ones(2, 7, dtype=torch.bool); mask[1, 4:] = False
    for tau in (1.0, 2.0, 4.0):
        def softmax(z): e = np.exp(z / tau - (z / tau).max(-1, keepdims=True)); return e / e.sum(-1, keepdims=True)
        p, q = softmax(zt.double().numpy()), softmax(zs.double().numpy())
        kl = (p * (np.log(p) - np.log(q))).sum(-1)
        expected = tau ** 2 * kl[mask.numpy()].mean()
        assert logit_kd_loss(zs, zt, tau, mask).item() == pytest.approx(expected, rel=1e-5)
    assert logit_kd_loss(zt, zt, 2.0).item() == pytest.approx(0.0, abs=1e-6)
    with pytest.raises(ConfigError, match='share a tokenizer'): logit_kd_loss(zs, torch.randn(2, 7, 20))
    padded = torch.cat([zt, torch.full((2, 7, 5), 50.0)], -1)  # padding rows beyond the tokenizer would dominate if not cut
    assert logit_kd_loss(zs, padded, 2.0, mask, vocab=13).item() == pytest.approx(logit_kd_loss(zs, zt, 2.0, mask).item(), rel=1e-6)


def test_stage_and_pass_labels_at_their_boundaries():
    from oelm_nb.studies.mercator.method import pass_label, collapsed
    assert [cosine_stage(c) for c in (0.4999, 0.5, 0.6999, 0.7, 0.8999, 0.9, 0.9499, 0.95)] == \
        ['Adapting', 'Learning', 'Learning', 'Good', 'Good', 'Great', 'Great', 'Excellent']
    assert [pass_label(c) for c in (0.7999, 0.8, 0.8999, 0.9, 0.9499, 0.95, 1.0)] == \
        ['below pass', 'pass', 'pass', 'good', 'good', 'excellent', 'excellent']
    assert collapsed(0.95, 0.84) and not collapsed(0.95, 0.85 + 1e-9) and not collapsed(0.3, 0.3)


def test_centered_loss_gives_no_credit_for_a_shared_direction():
    "Collapsed vectors (one shared direction plus noise) score ~0 loss raw but ~1 (orthogonal) centered."
    from oelm_nb.studies.mercator.method import center
    g = torch.Generator().manual_seed(1)
    u = torch.randn(1, 1, 16, generator=g) * 10
    s, t = u + 0.1 * torch.randn(4, 32, 16, generator=g), u + 0.1 * torch.randn(4, 32, 16, generator=g)
    assert mercator_loss(s, t, beta=0.0).item() < 0.01
    assert mercator_loss(center(s), center(t), beta=0.0).item() == pytest.approx(1.0, abs=0.1)
    mask = torch.rand(4, 32, generator=g) > 0.5
    c = center(s, mask)
    assert c[mask].mean(0).abs().max().item() < 1e-4
