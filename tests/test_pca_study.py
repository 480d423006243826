"""The PCA study (`oelm run pca`), from outside: its plan, its settings per preset, and one end-to-end batch.

The batch is tiny (4 baseline steps on a 300-story corpus with a 300-token vocabulary, ks 16 and 64 = d): seven
papermill runs and the report. Checks compare against independent sources: the PCA recomputed with NumPy from the
baseline's checkpoint, parameter counts from arithmetic on the config fields, the baseline's own summary.
"""
from __future__ import annotations
import json, os, shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from oelm_nb.core import ConfigError
from oelm_nb.experiment import resolve_spec
from oelm_nb.studies import get_study
from oelm_nb.pca import LORA_TARGETS
from oelm_nb.pca_study import pca_variants
from cli_helpers import run_oelm as oelm, read_json, html_text, tiny_args

TINY = tiny_args(4) + ['--set', 'train.dtype=float32']  # exact comparisons below: plain fp32
KS = (16, 64)  # 64 = d of the tiny preset: PCA keeps every direction there
V, D, L = 300, 64, 2


# ====================================================================== the plan
def test_plan_is_the_13_run_matrix():
    st = get_study('pca')
    plan = st.variants('gpt2-124m', 10_000, {'ks': [64, 128, 256, 512]})
    variants = list(plan)
    assert len(variants) == 13
    assert variants[0] == 'baseline'
    for m in ('lowrank', 'pca', 'pca-lora'):
        assert [v for v in variants if v.rpartition('-k')[0] == m] == [f'{m}-k{k}' for k in (64, 128, 256, 512)]
    assert st.planned('gpt2-124m', 10_000) == variants  # the seed's ks are gpt2-124m's default
    tiny = st.planned('tiny', 500)
    assert len(tiny) == 13 and all(int(v.rpartition('-k')[2]) < D for v in tiny[1:])
    assert {u for v in variants for u in plan[v].upstream} == {'baseline'}
    assert [v for v in variants if plan[v].upstream] == variants[5:]  # pca-* and pca-lora-* start from the baseline


def test_k_beyond_the_width_is_a_clear_error():
    with pytest.raises(ConfigError, match=r'--ks 80: k must be an integer in 1\.\.n_embd=64'): pca_variants('tiny', 500, {'ks': [8, 80]})
    with pytest.raises(ConfigError, match='n_embd=64'): resolve_spec('pca', 'pca-lora-k80', 'tiny', 0, options={'ks': [80]})
    res = oelm('run', 'pca', '--ks', '8', '80', '--out', '/nonexistent/never-written', timeout=120)
    assert res.returncode == 2 and 'n_embd=64' in res.stderr and 'Traceback' not in res.stderr
    assert not Path('/nonexistent/never-written').exists()


def test_gpt2_settings_are_the_seeds():
    b = resolve_spec('pca', 'baseline', 'gpt2-124m', 0)
    assert (b.train.max_steps, b.train.batch_size, b.train.grad_accum, b.train.lr, b.train.min_lr, b.train.warmup_steps,
            b.train.weight_decay, b.train.beta2, b.train.eval_every) == (10_000, 4, 4, 1e-4, 5e-6, 500, 0.1, 0.95, 500)
    assert (b.model.n_layer, b.model.n_head, b.model.n_embd, b.model.dropout, b.model.n_embd_wte) == (12, 12, 768, 0.1, None)
    lo = resolve_spec('pca', 'lowrank-k128', 'gpt2-124m', 0)
    assert lo.model.n_embd_wte == 128 and lo.train == b.train and lo.settings.method == 'lowrank'
    p = resolve_spec('pca', 'pca-k256', 'gpt2-124m', 0)
    assert (p.model.n_embd_wte, p.model.dropout, p.settings.method) == (256, 0.0, 'pca')
    f = resolve_spec('pca', 'pca-lora-k512', 'gpt2-124m', 0)
    assert (f.train.max_steps, f.train.lr, f.train.min_lr, f.train.warmup_steps, f.train.weight_decay, f.train.eval_every,
            f.train.batch_size, f.train.grad_accum) == (5000, 5e-5, 1e-6, 100, 0.01, 200, 4, 4)
    assert (f.settings.lora_rank, f.settings.lora_alpha, f.settings.lora_dropout, f.settings.lora_targets) == (32, 64, 0.1, LORA_TARGETS)
    t = resolve_spec('pca', 'pca-lora-k8', 'tiny', 0)
    assert t.settings.lora_alpha == 2 * t.settings.lora_rank and t.train.max_steps == resolve_spec('pca', 'baseline', 'tiny', 0).train.max_steps // 2


# ====================================================================== one batch end to end
@pytest.fixture(scope='module')
def batch(tmp_path_factory):
    out = tmp_path_factory.mktemp('pca') / 'batch'
    res = oelm('run', 'pca', '--ks', *map(str, KS), '--jobs', '2', '--out', str(out), *TINY)
    return out, res


def test_batch_runs_the_matrix(batch):
    out, res = batch
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    b = read_json(out / 'batch.json')
    want = ['baseline'] + [f'{m}-k{k}' for m in ('lowrank', 'pca', 'pca-lora') for k in KS]
    assert b['variants'] == want and b['seeds'] == [0] and b['options'] == {'ks': list(KS)}
    for v in want:
        d = out / f'{v}-s0'
        s = read_json(d / 'summary.json')
        assert s['status'] == 'completed' and s['variant'] == v and (d / 'pca.ipynb').exists() and (d / 'config.json').exists()
        assert s['method'] == (v.rpartition('-k')[0] or 'baseline') and s['k'] == (D if v == 'baseline' else int(v.rpartition('-k')[2]))
        assert np.isclose(s['best_val_ppl'], np.exp(s['val_loss']), rtol=1e-6)
    for k in KS:
        for v in (f'pca-k{k}', f'pca-lora-k{k}'):
            assert (out / f'{v}-s0' / f'wte_pca_k{k}.npy').exists() and (out / f'{v}-s0' / f'scale_mats_pca_k{k}.npz').exists()
        assert read_json(out / f'pca-k{k}-s0' / 'summary.json')['steps'] == 0
        assert not (out / f'pca-k{k}-s0' / 'checkpoints').exists()  # evaluated only


def test_pca_runs_start_from_the_baseline_checkpoint(batch):
    out, _ = batch
    base = read_json(out / 'baseline-s0' / 'summary.json')
    full = read_json(out / f'pca-k{D}-s0' / 'summary.json')
    # k = d keeps every direction: the baseline's own best checkpoint, evaluated on the same sample
    assert abs(full['val_loss'] - base['best_val_loss']) < 1e-4 and abs(full['explained_variance_k'] - 1) < 1e-9
    # the runner gave each of the 2 concurrent runs its share of the cores, and the pinned precision is recorded
    assert base['runtime']['threads'] == max(1, (os.cpu_count() or 1) // 2) and base['runtime']['dtype'] == 'float32'
    assert Path(full['baseline_checkpoint']).parent == (out / 'baseline-s0' / 'checkpoints').resolve()
    # the PCA table recomputed with NumPy from the checkpoint the run names (columns up to sign)
    w = load_file(str(Path(full['baseline_checkpoint']) / 'model.safetensors'))
    E = w.get('transformer.tok.wte.weight', w.get('lm_head.weight')).astype(np.float64)  # tied: safetensors keeps one name
    Ec = E - E.mean(0)
    _, S, Vt = np.linalg.svd(Ec, full_matrices=False)
    codes = Ec @ Vt[:16].T
    wte = np.load(out / 'pca-k16-s0' / 'wte_pca_k16.npy')
    assert wte.shape == (V, 16)
    signs = np.sign((wte * codes).sum(0))
    np.testing.assert_allclose(wte, codes * signs, atol=1e-4)
    ev = read_json(out / 'baseline-s0' / 'explained_variance.json')['ratio']
    np.testing.assert_allclose(ev, S**2 / (S**2).sum(), atol=1e-6)
    p16, l16, lo16 = (read_json(out / f'{v}-s0' / 'summary.json') for v in ('pca-k16', 'pca-lora-k16', 'lowrank-k16'))
    assert abs(p16['explained_variance_k'] - float(np.sum(ev[:16]))) < 1e-6
    assert abs(l16['pca_val_loss'] - p16['val_loss']) < 1e-6  # LoRA fine-tunes exactly the PCA model
    assert lo16['val_loss'] != p16['val_loss'] and lo16['steps'] == base['steps'] == 4 and l16['steps'] == 2
    assert abs(l16['merged_val_loss'] - l16['final_val_loss']) < 1e-4


def test_parameter_accounting_of_the_runs(batch):
    out, _ = batch
    s = {v: read_json(out / f'{v}-s0' / 'summary.json') for v in ('baseline', 'lowrank-k16', 'pca-k16', 'pca-lora-k16')}
    emb16 = V * 16 + (16 * D + D) + (D * 16 + 16)  # wte (tied head once), scale_up, scale_down with biases
    assert s['baseline']['params_embedding'] == V * D
    assert s['lowrank-k16']['params_embedding'] == s['pca-k16']['params_embedding'] == s['pca-lora-k16']['params_embedding'] == emb16
    assert s['pca-k16']['params']['total'] == s['lowrank-k16']['params']['total']
    cfg = read_json(out / 'pca-lora-k16-s0' / 'config.json')['settings']
    r, k = cfg['lora_rank'], 16
    lora = r * (V + k) + r * (k + D) + r * (D + k) + L * (4 * r * (D + D) + r * (D + 4 * D) + r * (4 * D + D))
    assert s['pca-lora-k16']['params_lora'] == s['pca-lora-k16']['params']['trainable'] == lora
    assert s['pca-k16']['params']['trainable'] == 0 and s['pca-k16']['params']['frozen'] == s['pca-k16']['params']['total']  # evaluated only


def test_report_shows_the_table_and_the_verdict(batch):
    out, _ = batch
    assert (out / 'report.html').exists()
    text = html_text(out / 'report.html')
    for label in ('low-rank (scratch)', 'PCA (no fine-tuning)', 'PCA + LoRA', 'baseline (k=d)', 'k=16', 'k=64'):
        assert label in text
    for v in ('pca-k16', 'lowrank-k16', 'pca-lora-k64'):
        assert f"{read_json(out / f'{v}-s0' / 'summary.json')['best_val_ppl']:.3f}" in text
    # the fraction of the PCA-only gap LoRA recovers, recomputed from the summaries, and the verdict it implies
    base, p16, l16 = (read_json(out / f'{v}-s0' / 'summary.json')['val_loss'] for v in ('baseline', 'pca-k16', 'pca-lora-k16'))
    if p16 - base > 1e-4:
        rec = (p16 - l16) / (p16 - base)
        phrase = ('recovers part of the gap' if 0 < rec < 1 else 'closes the whole gap' if rec >= 1 else 'does not recover any of the gap')
        assert f'k=16 ({rec:.0%})' in text and phrase in text
    assert 'no gap: PCA-only is within' in text  # k = 64 = d: PCA-only is the baseline
    assert 'Traceback' not in text and 'Error' not in text


def test_report_renders_with_a_failed_run(batch, tmp_path):
    out, _ = batch
    dst = tmp_path / 'b'
    shutil.copytree(out, dst, symlinks=True, ignore=shutil.ignore_patterns('checkpoints', 'data', '*.html', 'report.ipynb'))
    (dst / 'pca-lora-k16-s0' / 'summary.json').write_text(json.dumps({'status': 'failed', 'error': 'RuntimeError: boom'}))
    res = oelm('report', str(dst), timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    text = html_text(dst / 'report.html')
    assert 'RuntimeError: boom' in text and 'failed' in text
    assert f"{read_json(dst / 'pca-k16-s0' / 'summary.json')['best_val_ppl']:.3f}" in text


def test_pca_lora_run_is_reproducible(batch, tmp_path):
    "Rerunning a PCA + LoRA run from the same baseline gives the same losses to the last digit (LoRA's init comes from the seed)."
    out, res = batch
    assert res.returncode == 0
    again = tmp_path / 'again'; again.mkdir()
    shutil.copytree(out / 'baseline-s0', again / 'baseline-s0', symlinks=True)
    shutil.copytree(out / 'data', again / 'data')
    shutil.copy(out / 'batch.json', again / 'batch.json')
    r2 = oelm('run', 'pca', '--variants', 'pca-lora-k16', '--jobs', '2', '--no-report', '--out', str(again), *TINY)
    assert r2.returncode == 0, r2.stdout[-2000:] + r2.stderr[-2000:]
    assert 'baseline-s0: already completed' in r2.stdout
    first, second = read_json(out / 'pca-lora-k16-s0' / 'summary.json'), read_json(again / 'pca-lora-k16-s0' / 'summary.json')
    assert (second['best_val_loss'], second['final_val_loss']) == (first['best_val_loss'], first['final_val_loss'])
