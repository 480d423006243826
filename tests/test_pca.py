"""PCA factorization, npy/npz files, GPT-2 import, LoRA and parameter arithmetic (oelm_nb.model.pca)."""
from __future__ import annotations
import copy
import json

import numpy as np
import pytest
import torch
from torch import nn

from oelm_nb.base.core import ConfigError
from oelm_nb.model.freeze import param_report
from oelm_nb.model.gpt import GPT, MLP
from oelm_nb.model.pca import (LORA_TARGETS, LoRAEmbedding, LoRALinear, apply_lora, embedding_pca, from_hf_gpt2, load_pca_mats,
                         lora_modules, merge_lora, pca_factorize, save_pca_mats, unmerge_lora)

SMALL = dict(vocab_size=300, n_embd=64, n_layer=2, n_head=2, block_size=32)


@pytest.fixture(scope='module')
def base():
    return GPT.from_preset('tiny', init_seed=0, **SMALL).eval()


@pytest.fixture(scope='module')
def idx():
    return torch.randint(0, SMALL['vocab_size'], (2, 16), generator=torch.Generator().manual_seed(1))


# ---------------------------------------------------------------- PCA
@pytest.mark.parametrize('bias', [True, False])
def test_full_rank_pca_reproduces_softmax(idx, bias):
    m = GPT.from_preset('tiny', init_seed=3, bias=bias, **SMALL).eval()
    f = pca_factorize(m, SMALL['n_embd']).eval()
    torch.testing.assert_close(f(idx)[0].softmax(-1), m(idx)[0].softmax(-1), atol=1e-5, rtol=0)


def test_factorized_weights_follow_the_recipe(base):
    k = 8
    f, p = pca_factorize(base, k), embedding_pca(base.transformer.tok.wte.weight)
    tok, E = f.transformer.tok, base.transformer.tok.wte.weight.double()
    assert tok.wte.weight.shape == (SMALL['vocab_size'], k) and f.cfg.n_embd_wte == k
    assert f.lm_head.weight is tok.wte.weight
    torch.testing.assert_close(tok.wte.weight.double(), (E - E.mean(0)) @ p.V[:, :k], atol=1e-6, rtol=0)
    torch.testing.assert_close(tok.scale_up.bias.double(), E.mean(0), atol=1e-7, rtol=0)
    assert torch.all(tok.scale_down.bias == 0)
    torch.testing.assert_close(tok.scale_up.weight, tok.scale_down.weight.T)
    torch.testing.assert_close(f.transformer.h[1].mlp.mlp_up.weight, base.transformer.h[1].mlp.mlp_up.weight)


@pytest.mark.parametrize('k', [1, 8, 32, 63])
def test_reconstruction_error_equals_discarded_variance(base, k):
    E = base.transformer.tok.wte.weight.detach()
    p = embedding_pca(E)
    f = pca_factorize(base, k, pca=p)
    tok = f.transformer.tok
    with torch.no_grad(): recon = tok.scale_up(tok.wte.weight).double()  # wte @ scale_up reconstructs E (projected)
    err = ((E.double() - recon) ** 2).sum()
    assert err.item() == pytest.approx((p.S[k:] ** 2).sum().item(), rel=1e-4)
    assert float(p.explained_variance_ratio[:k].sum()) == pytest.approx(1 - float(err / ((E.double() - E.double().mean(0)) ** 2).sum()), rel=1e-4)


def test_pca_rejects_bad_input(base):
    with pytest.raises(ConfigError, match='already has n_embd_wte'): pca_factorize(pca_factorize(base, 8), 4)
    with pytest.raises(ConfigError, match='1..n_embd=64'): pca_factorize(base, 0)


def test_npy_npz_round_trip(base, idx, tmp_path):
    f = pca_factorize(base, 16).eval()
    wte_path, mats_path = save_pca_mats(f, tmp_path)
    assert (wte_path.name, mats_path.name) == ('wte_pca_k16.npy', 'scale_mats_pca_k16.npz')
    wte = np.load(wte_path, allow_pickle=False)
    with np.load(mats_path, allow_pickle=False) as z:
        assert sorted(z.files) == ['scale_down_bias', 'scale_down_weight', 'scale_up_bias', 'scale_up_weight']
        assert z['scale_up_weight'].shape == (64, 16) and z['scale_down_weight'].shape == (16, 64)
    np.testing.assert_array_equal(wte, f.transformer.tok.wte.weight.detach().numpy())
    g = GPT.from_preset('tiny', init_seed=9, n_embd_wte=16, **SMALL).eval()
    g.load_state_dict({n: t for n, t in f.state_dict().items() if not n.startswith('transformer.tok.')}, strict=False)
    load_pca_mats(g, tmp_path)
    for n, t in f.state_dict().items(): torch.testing.assert_close(g.state_dict()[n], t, atol=0, rtol=0)
    torch.testing.assert_close(g(idx)[0], f(idx)[0], atol=0, rtol=0)
    with pytest.raises(FileNotFoundError, match='wte_pca_k8.npy'): load_pca_mats(g, tmp_path, k=8)


# ---------------------------------------------------------------- GPT-2 import
def test_gpt2_import_matches_hf_logits(tmp_path):
    transformers = pytest.importorskip('transformers')
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=100, n_positions=32)
    hf = transformers.GPT2LMHeadModel(cfg).eval()
    x = torch.randint(0, 100, (3, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad(): want = hf(x).logits
    ours = from_hf_gpt2(hf).eval()
    assert (ours.cfg.n_layer, ours.cfg.n_embd, ours.cfg.block_size, ours.cfg.attn_bias) == (2, 64, 32, True)
    with torch.no_grad(): torch.testing.assert_close(ours(x)[0], want, atol=1e-4, rtol=0)
    hf.save_pretrained(tmp_path)  # and from a local directory
    with torch.no_grad(): torch.testing.assert_close(from_hf_gpt2(tmp_path).eval()(x)[0], want, atol=1e-4, rtol=0)


def test_gpt2_import_uses_tanh_gelu():
    "At init the MLP is too small to tell the GELUs apart (both within 1e-4); with a louder MLP only tanh GELU matches to 1e-5."
    transformers = pytest.importorskip('transformers')
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=100, n_positions=32)).eval()
    with torch.no_grad():
        for b in hf.transformer.h: b.mlp.c_fc.weight.mul_(5); b.mlp.c_proj.weight.mul_(50)
    x = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(4))
    ours = from_hf_gpt2(hf).eval()
    with torch.no_grad():
        want = hf(x).logits
        torch.testing.assert_close(ours(x)[0], want, atol=1e-5, rtol=0)
        for b in ours.transformer.h: b.mlp.__class__ = MLP  # exact GELU
        assert (ours(x)[0] - want).abs().max() > 5e-5


# ---------------------------------------------------------------- LoRA
def test_lora_count_768():
    lin = LoRALinear(nn.Linear(768, 768), rank=32, alpha=64, dropout=0.1)
    assert lin.lora_A.numel() + lin.lora_B.numel() == 49_152
    assert lin.scaling == 2.0 and torch.all(lin.lora_B == 0) and lin.lora_A.abs().max() > 0


def test_apply_lora_freezes_base_and_counts(idx):
    m = GPT.from_preset('tiny', init_seed=0, n_embd_wte=16, **SMALL).eval()
    ref = m(idx)[0]
    names = apply_lora(m)  # the PCA document: rank 32, alpha 64, dropout 0.1, all nine targets
    assert len(names) == 3 + 6 * SMALL['n_layer'] and {n.rpartition('.')[2] for n in names} == set(LORA_TARGETS)
    torch.testing.assert_close(m(idx)[0], ref, atol=1e-6, rtol=0)  # fresh adapters change nothing
    d, k, V, L, r = 64, 16, SMALL['vocab_size'], SMALL['n_layer'], 32
    want = r * (V + k) + 2 * r * (k + d) + L * (4 * r * (d + d) + r * (d + 4 * d) + r * (4 * d + d))
    rep = param_report(m)
    assert rep.components.loc['lora', 'total'] == want == rep.trainable
    assert all(p.requires_grad == ('lora_' in n) for n, p in m.named_parameters())
    assert m.lm_head.weight is m.transformer.tok.wte.weight
    assert set(m.state_dict()) >= set(GPT.from_preset('tiny', init_seed=0, n_embd_wte=16, **SMALL).state_dict())


def test_merge_unmerge_round_trip(idx):
    m = GPT.from_preset('tiny', init_seed=0, n_embd_wte=16, **SMALL).eval()
    before = copy.deepcopy(m.state_dict())
    apply_lora(m, rank=4, alpha=8)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for mod in lora_modules(m): mod.lora_A.normal_(0, 0.1, generator=g); mod.lora_B.normal_(0, 0.1, generator=g)
    y = m(idx)[0]
    assert (y - GPT.from_preset('tiny', init_seed=0, n_embd_wte=16, **SMALL).eval()(idx)[0]).abs().max() > 1e-2
    torch.testing.assert_close(merge_lora(m)(idx)[0], y, atol=1e-5, rtol=0)
    assert all(mod.merged for mod in lora_modules(m))
    assert not torch.allclose(m.transformer.h[0].attn.q_proj.weight, before['transformer.h.0.attn.q_proj.weight'])
    torch.testing.assert_close(unmerge_lora(m)(idx)[0], y, atol=1e-5, rtol=0)
    for n, t in before.items(): torch.testing.assert_close(m.state_dict()[n], t, atol=1e-6, rtol=0)


def test_lora_rejects_unsupported():
    m = GPT.from_preset('tiny', init_seed=0, variant='oelm-freeze', **SMALL)
    with pytest.raises(ConfigError, match='OrthogonalLinear'): apply_lora(m, targets=('q_proj',))
    with pytest.raises(ConfigError, match='no module named'): apply_lora(nn.Sequential(nn.Linear(2, 2)))


class Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte, self.q_proj, self.mlp_up = nn.Embedding(50, 16), nn.Linear(16, 16), nn.Linear(16, 32)
    def forward(self, idx): return self.mlp_up(torch.tanh(self.q_proj(self.wte(idx))))


def test_matches_peft():
    peft = pytest.importorskip('peft')
    torch.manual_seed(0)
    toy = Toy().eval()
    ours = copy.deepcopy(toy)
    theirs = peft.get_peft_model(toy, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=['wte', 'q_proj', 'mlp_up'])).eval()
    apply_lora(ours, targets=('wte', 'q_proj', 'mlp_up'), rank=4, alpha=8, dropout=0.0)
    pm = theirs.base_model.model
    # same init conventions and shapes: Linear B zero; Embedding A zero, B nonzero
    assert ours.q_proj.lora_A.shape == pm.q_proj.lora_A['default'].weight.shape and torch.all(pm.q_proj.lora_B['default'].weight == 0)
    assert ours.wte.lora_A.shape == pm.wte.lora_embedding_A['default'].shape and torch.all(pm.wte.lora_embedding_A['default'] == 0)
    assert torch.all(ours.wte.lora_A == 0) and ours.wte.lora_B.abs().max() > 0
    assert ours.q_proj.scaling == pm.q_proj.scaling['default'] == 2.0
    n_trainable = lambda mod: sum(p.numel() for p in mod.parameters() if p.requires_grad)
    assert n_trainable(ours) == n_trainable(theirs)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name in ('q_proj', 'mlp_up'):
            a, b = getattr(pm, name).lora_A['default'].weight, getattr(pm, name).lora_B['default'].weight
            a.normal_(generator=g); b.normal_(generator=g)
            getattr(ours, name).lora_A.copy_(a); getattr(ours, name).lora_B.copy_(b)
        a, b = pm.wte.lora_embedding_A['default'], pm.wte.lora_embedding_B['default']
        a.normal_(generator=g); b.normal_(generator=g)
        ours.wte.lora_A.copy_(a); ours.wte.lora_B.copy_(b)
        x = torch.randint(0, 50, (4, 7), generator=g)
        torch.testing.assert_close(ours(x), theirs(x), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ours.wte.delta_weight(), pm.wte.get_delta_weight('default'))
        torch.testing.assert_close(ours.mlp_up.delta_weight(), pm.mlp_up.get_delta_weight('default'))


# ---------------------------------------------------------------- parameter arithmetic
@pytest.mark.parametrize('K', [64, 128, 256, 512])
def test_gpt2_124m_factorized_param_counts(K, capsys):
    "`oelm params --preset gpt2-124m --n-embd-wte K` against the architecture's arithmetic."
    from oelm_nb.app.cli import main
    V, d, L, T, ff = 50257, 768, 12, 2048, 3072  # the PCA document's 2,048 positions
    want = {'embedding': V * K + (K * d + d) + (d * K + K) + T * d,  # wte (tied head counted once), scale_up, scale_down, wpe
            'attention.qk': L * 2 * (d * d + d),
            'attention.vo': L * 2 * (d * d + d),
            'mlp': L * (d * ff + ff + ff * d + d),
            'norm': L * 2 * 2 * d + 2 * d}
    assert main(['params', '--preset', 'gpt2-124m', '--set', f'model.n_embd_wte={K}', '--json']) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep['config']['n_embd_wte'] == K
    assert {c: row['total'] for c, row in rep['components'].items()} == want
    assert rep['total'] == rep['trainable'] == sum(want.values()) and rep['frozen'] == 0
    # against the unfactorized model: the table shrinks from V*d to V*K + 2*K*d + d + K
    assert sum(want.values()) - (V * d + T * d + sum(v for c, v in want.items() if c != 'embedding')) == V * (K - d) + 2 * K * d + d + K


# ---------------------------------------------------------------- reconstruction metrics
@pytest.mark.parametrize('k', [1, 5, 16, 63, 64])
def test_reconstruction_metrics_match_numpy(base, k):
    "Relative Frobenius error and mean row cosine of the k-direction reconstruction, recomputed with NumPy's SVD."
    from oelm_nb.model.pca import reconstruction_curve, reconstruction_metrics
    E = base.transformer.tok.wte.weight.detach().double().numpy() * np.logspace(0, -1.5, 64)  # a decaying spectrum
    mu = E.mean(0)
    _, S, Vt = np.linalg.svd(E - mu, full_matrices=False)
    Ek = (E - mu) @ Vt[:k].T @ Vt[:k] + mu
    rel = np.linalg.norm(E - Ek) / np.linalg.norm(E)
    cos = ((E * Ek).sum(1) / (np.linalg.norm(E, axis=1) * np.linalg.norm(Ek, axis=1))).mean()
    c = reconstruction_curve(torch.from_numpy(E))
    assert c['relative_error'][k - 1] == pytest.approx(rel, abs=1e-9)
    assert c['mean_cosine'][k - 1] == pytest.approx(cos, abs=1e-9)
    assert c['explained_variance'][k - 1] == pytest.approx((S[:k] ** 2).sum() / (S ** 2).sum(), abs=1e-12)
    t = reconstruction_metrics(torch.from_numpy(E), [k])
    assert (t.loc[k, 'relative error'], t.loc[k, 'mean cosine']) == (pytest.approx(rel, abs=1e-9), pytest.approx(cos, abs=1e-9))


def test_reconstruction_metrics_are_monotone_and_reject_bad_k(base):
    from oelm_nb.model.pca import reconstruction_curve, reconstruction_metrics
    c = reconstruction_curve(base.transformer.tok.wte.weight)
    assert np.all(np.diff(c['relative_error']) <= 1e-12) and c['relative_error'][-1] < 1e-9
    assert c['mean_cosine'][-1] == pytest.approx(1, abs=1e-9)
    with pytest.raises(ConfigError, match=r'outside 1\.\.64'): reconstruction_metrics(base.transformer.tok.wte.weight, [0, 65])


# ---------------------------------------------------------------- low-rank init
def _fresh(k=8, seed=0, **kw):
    return GPT.from_preset('tiny', init_seed=seed, n_embd_wte=k, **kw)


@pytest.mark.parametrize('scheme', ['matched', 'orthogonal'])
def test_factorized_init_matches_the_full_tables_scale(scheme):
    "The token signal entering the blocks and the initial logits have the full N(0, init_std) model's scale (not ~18x below it)."
    from oelm_nb.model.pca import init_factorized_
    full = GPT.from_preset('tiny', init_seed=0)
    x = torch.randint(0, full.cfg.vocab_size, (8, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want_tok, want_logit = full.transformer.tok(x).std().item(), full(x)[0].std().item()
        for k in (8, 32):
            m = init_factorized_(_fresh(k), scheme, seed=0)
            assert m.transformer.tok(x).std().item() == pytest.approx(want_tok, rel=0.1)
            assert m(x)[0].std().item() == pytest.approx(want_logit, rel=0.1)
        old = _fresh(8)
        assert old.transformer.tok(x).std().item() < want_tok / 10  # what 'gpt' (the model's own init) starts with


def test_factorized_init_details():
    from oelm_nb.model.pca import init_factorized_
    d, k = 64, 8
    ref = _fresh(k)
    g = init_factorized_(_fresh(k), 'gpt', seed=0)
    for n, t in ref.state_dict().items(): assert torch.equal(g.state_dict()[n], t)  # 'gpt' changes nothing
    o = init_factorized_(_fresh(k), 'orthogonal', seed=0).transformer.tok
    torch.testing.assert_close(o.scale_up.weight.T @ o.scale_up.weight, torch.eye(k) * d / k, atol=1e-4, rtol=0)
    torch.testing.assert_close(o.scale_down.weight @ o.scale_down.weight.T, torch.eye(k) * d / k, atol=1e-4, rtol=0)
    f = init_factorized_(_fresh(k), 'fan-in', seed=0).transformer.tok
    assert f.scale_down.weight.std().item() == pytest.approx(1 / d ** 0.5, rel=0.1)
    m = init_factorized_(_fresh(k), 'matched', seed=0)
    tok = m.transformer.tok
    assert tok.scale_up.weight.std().item() == pytest.approx(1 / k ** 0.5, rel=0.1)
    assert tok.scale_down.weight.std().item() == pytest.approx(1 / k ** 0.5, rel=0.1)
    assert torch.all(tok.scale_up.bias == 0) and torch.all(tok.scale_down.bias == 0)
    assert torch.equal(tok.wte.weight, ref.transformer.tok.wte.weight)  # the table keeps the model's init
    # the factors come from a stream of their own, not a copy of the model's init stream (whose first draws are wte's rows)
    corr = np.corrcoef(tok.scale_up.weight.detach().flatten().numpy(), ref.transformer.tok.wte.weight[:d].detach().flatten().numpy())[0, 1]
    assert abs(corr) < 0.1
    assert not torch.equal(tok.scale_up.weight, init_factorized_(_fresh(k, seed=1), 'matched', seed=1).transformer.tok.scale_up.weight)
    with pytest.raises(ConfigError, match='no scale_up/scale_down'): init_factorized_(GPT.from_preset('tiny', init_seed=0), 'matched')
    with pytest.raises(ConfigError, match='choose from'): init_factorized_(_fresh(k), 'xavier')
