"""The PCA study (`oelm run pca`), from outside: its plan, its settings per preset, and one end-to-end batch.

The batch is tiny (4 baseline steps on a 300-story corpus with a 300-token vocabulary, ks 16 and 64 = d, the
default 2 seeds): sixteen runs in-process, shared through tests/shared_runs.py, and the report. Checks compare against independent sources: the PCA recomputed with NumPy from the
baseline's checkpoint, parameter counts from arithmetic on the config fields, the baseline's own summary.
"""
from __future__ import annotations
import json, os, shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from oelm_nb.base.core import ConfigError
from oelm_nb.lab.spec import resolve_spec
from oelm_nb.lab.study import get_study
from oelm_nb.model.pca import LORA_TARGETS
from oelm_nb.studies.pca.study import pca_variants
from cli_helpers import oelm_main, oelm_inline, read_json, html_text, tiny_args
from shared_runs import pca_batch, completed, PCA_KS

pytestmark = pytest.mark.slow  # batches and processes end to end: `make test` runs them, `make test-fast` does not

TINY = tiny_args(4) + ['--set', 'train.dtype=float32']  # exact comparisons below: plain fp32
KS = PCA_KS
V, D, L = 300, 64, 2


# ====================================================================== the plan
def test_plan_is_the_13_run_matrix_plus_the_control():
    st = get_study('pca')
    plan = st.variants('gpt2-124m', 10_000, {'ks': [64, 128, 256, 512]})
    variants = list(plan)
    assert len(variants) == 14
    assert variants[:2] == ['baseline', 'baseline-cont']
    for m in ('lowrank', 'pca', 'pca-lora'):
        assert [v for v in variants if v.rpartition('-k')[0] == m] == [f'{m}-k{k}' for k in (64, 128, 256, 512)]
    assert st.planned('gpt2-124m', 10_000) == variants  # the PCA document's ks are gpt2-124m's default
    tiny = st.planned('tiny', 500)
    assert len(tiny) == 14 and all(int(v.rpartition('-k')[2]) < D for v in tiny[2:])
    assert {u for v in variants for u in plan[v].upstream} == {'baseline'}
    # baseline-cont, pca-* and pca-lora-* start from the baseline
    assert [v for v in variants if plan[v].upstream] == ['baseline-cont'] + variants[6:]
    assert st.default_seeds == (0, 1)  # the recovery intervals need two


@pytest.mark.parametrize('preset,steps', [('tiny', None), ('tiny', 40), ('gpt2-124m', None)])
def test_baseline_cont_trains_exactly_the_lora_runs_schedule(preset, steps):
    "The control's whole TrainConfig (steps, lr schedule, warmup, batch, seed, cadence) is the PCA + LoRA runs'; only the weights it trains differ."
    loras = [v for v in get_study('pca').planned(preset, 1000) if v.startswith('pca-lora-k')]
    cont, base = resolve_spec('pca', 'baseline-cont', preset, 3, steps), resolve_spec('pca', 'baseline', preset, 3, steps)
    assert len(loras) == 4
    for v in loras:
        lora = resolve_spec('pca', v, preset, 3, steps)
        assert cont.train == lora.train
    assert cont.train.max_steps == base.train.max_steps // 2 and cont.train.seed == base.train.seed == 3
    assert (cont.train.batch_size, cont.train.grad_accum, cont.model) == (base.train.batch_size, base.train.grad_accum, base.model)
    assert cont.settings.method == 'baseline-cont' and cont.model.n_embd_wte is None


def test_lowrank_with_the_models_own_init_is_the_plain_training_run(tmp_path):
    "lowrank trains through its own path (to re-draw the factors); with lowrank_init='gpt' that path gives train_run's losses exactly."
    from oelm_nb.lab.run import train_run
    from oelm_nb.studies.pca.study import pca_run
    from oelm_nb.base.metrics import read_metrics
    over = {'data.n_train_stories': 300, 'data.n_val_stories': 40, 'data.vocab_size': 300, 'model.vocab_size': 300,
            'train.eval_batches': 2, 'train.dtype': 'float32', 'settings.lowrank_init': 'gpt', 'train.progress': False}
    spec = lambda d: resolve_spec('pca', 'lowrank-k8', 'tiny', 0, 8, str(tmp_path / d / 'lowrank-k8-s0'), 'synthetic', str(tmp_path / 'data'),
                                  over, options={'ks': [8]})
    a, b = pca_run(spec('a')), train_run(spec('b'))
    assert a['lowrank_init'] == 'gpt'
    assert (a['best_val_loss'], a['final_val_loss'], a['final_train_loss']) == (b['best_val_loss'], b['final_val_loss'], b['final_train_loss'])
    assert [r.get('train_loss') for r in read_metrics(tmp_path / 'a' / 'lowrank-k8-s0')] == [r.get('train_loss') for r in read_metrics(tmp_path / 'b' / 'lowrank-k8-s0')]
    m = pca_run(resolve_spec('pca', 'lowrank-k8', 'tiny', 0, 8, str(tmp_path / 'm' / 'lowrank-k8-s0'), 'synthetic', str(tmp_path / 'data'),
                             {**over, 'settings.lowrank_init': 'matched'}, options={'ks': [8]}))
    assert m['lowrank_init'] == 'matched' and m['final_train_loss'] != a['final_train_loss']


def test_k_beyond_the_width_is_a_clear_error():
    with pytest.raises(ConfigError, match=r'--ks 80: k must be an integer in 1\.\.n_embd=64'): pca_variants('tiny', 500, {'ks': [8, 80]})
    with pytest.raises(ConfigError, match='n_embd=64'): resolve_spec('pca', 'pca-lora-k80', 'tiny', 0, options={'ks': [80]})
    res = oelm_main('run', 'pca', '--ks', '8', '80', '--out', '/nonexistent/never-written')
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
    "The whole matrix at ks 16 and 64, seeds 0 and 1, with its report: tests/shared_runs.py (in-process runs; the study's papermill batch is test_cluster's)."
    out, rec = pca_batch(tmp_path_factory)
    return out, rec


SEEDS = (0, 1)  # the study's default


def _method(v: str) -> str: return v if v in ('baseline', 'baseline-cont') else v.rpartition('-k')[0]


def test_batch_runs_the_matrix(batch):
    out = completed(batch)
    b = read_json(out / 'batch.json')
    want = ['baseline', 'baseline-cont'] + [f'{m}-k{k}' for m in ('lowrank', 'pca', 'pca-lora') for k in KS]
    assert b['variants'] == want and b['seeds'] == list(SEEDS) and b['options'] == {'ks': list(KS)}
    for seed in SEEDS:
        for v in want:
            d = out / f'{v}-s{seed}'
            s = read_json(d / 'summary.json')
            assert s['status'] == 'completed' and s['variant'] == v and (d / 'config.json').exists()
            assert s['method'] == _method(v) and s['k'] == (D if _method(v).startswith('baseline') else int(v.rpartition('-k')[2]))
            assert np.isclose(s['best_val_ppl'], np.exp(s['val_loss']), rtol=1e-6)
        for k in KS:
            for v in (f'pca-k{k}', f'pca-lora-k{k}'):
                assert (out / f'{v}-s{seed}' / f'wte_pca_k{k}.npy').exists() and (out / f'{v}-s{seed}' / f'scale_mats_pca_k{k}.npz').exists()
            assert read_json(out / f'pca-k{k}-s{seed}' / 'summary.json')['steps'] == 0
            assert not (out / f'pca-k{k}-s{seed}' / 'checkpoints').exists()  # evaluated only


def test_baseline_cont_continues_the_baseline_for_the_lora_steps(batch):
    "The control starts from the baseline's best checkpoint (same loss there), trains every weight, exactly as many steps as PCA + LoRA."
    out = completed(batch)
    for seed in SEEDS:
        base, cont = (read_json(out / f'{v}-s{seed}' / 'summary.json') for v in ('baseline', 'baseline-cont'))
        loras = [read_json(out / f'pca-lora-k{k}-s{seed}' / 'summary.json') for k in KS]
        assert cont['steps'] == loras[0]['steps'] == loras[1]['steps'] == base['steps'] // 2 == 2
        assert cont['tokens'] == loras[0]['tokens']
        assert abs(cont['start_val_loss'] - base['best_val_loss']) < 1e-5
        assert Path(cont['baseline_checkpoint']).parent == (out / f'baseline-s{seed}' / 'checkpoints').resolve()
        assert cont['params']['trainable'] == cont['params']['total'] == base['params']['total'] and cont['params']['frozen'] == 0
        cfg_c, cfg_l = (read_json(out / f'{v}-s{seed}' / 'config.json') for v in ('baseline-cont', f'pca-lora-k{KS[0]}'))
        assert cfg_c['train'] == cfg_l['train']
        assert cfg_c['model'] == read_json(out / f'baseline-s{seed}' / 'config.json')['model']
        lo = read_json(out / f'lowrank-k{KS[0]}-s{seed}' / 'summary.json')
        assert lo['lowrank_init'] == read_json(out / f'lowrank-k{KS[0]}-s{seed}' / 'config.json')['settings']['lowrank_init'] == 'orthogonal'


def test_pca_runs_start_from_the_baseline_checkpoint(batch):
    out = completed(batch)
    base = read_json(out / 'baseline-s0' / 'summary.json')
    full = read_json(out / f'pca-k{D}-s0' / 'summary.json')
    # k = d keeps every direction: the baseline's own best checkpoint, evaluated on the same sample
    assert abs(full['val_loss'] - base['best_val_loss']) < 1e-4 and abs(full['explained_variance_k'] - 1) < 1e-9
    assert base['runtime']['dtype'] == 'float32'  # the pinned precision is recorded (threads per concurrent run: test_runner)
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
    evj = read_json(out / 'baseline-s0' / 'explained_variance.json')
    ev = evj['ratio']
    np.testing.assert_allclose(ev, S**2 / (S**2).sum(), atol=1e-6)
    # reconstruction error and mean cosine per k, recomputed from the same checkpoint
    rel, cos = [], []
    for k in range(1, D + 1):
        Ek = Ec @ Vt[:k].T @ Vt[:k] + E.mean(0)
        rel.append(np.linalg.norm(E - Ek) / np.linalg.norm(E))
        cos.append(((E * Ek).sum(1) / (np.linalg.norm(E, axis=1) * np.linalg.norm(Ek, axis=1))).mean())
    np.testing.assert_allclose(evj['relative_error'], rel, atol=1e-6)
    np.testing.assert_allclose(evj['mean_cosine'], cos, atol=1e-6)
    p16s = read_json(out / 'pca-k16-s0' / 'summary.json')
    assert abs(p16s['reconstruction_error_k'] - rel[15]) < 1e-6 and abs(p16s['mean_cosine_k'] - cos[15]) < 1e-6
    p16, l16, lo16 = (read_json(out / f'{v}-s0' / 'summary.json') for v in ('pca-k16', 'pca-lora-k16', 'lowrank-k16'))
    assert abs(p16['explained_variance_k'] - float(np.sum(ev[:16]))) < 1e-6
    assert abs(l16['pca_val_loss'] - p16['val_loss']) < 1e-6  # LoRA fine-tunes exactly the PCA model
    assert lo16['val_loss'] != p16['val_loss'] and lo16['steps'] == base['steps'] == 4 and l16['steps'] == 2
    assert abs(l16['merged_val_loss'] - l16['final_val_loss']) < 1e-4


def test_parameter_accounting_of_the_runs(batch):
    out = completed(batch)
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


def _recovery(out, k, ref, seeds=SEEDS):
    """What the report must say about the recovery at k against `ref`, computed from the summaries independently of the package:
    (mean, (low, high) or None) over the seeds with a gap, or None where PCA-only is within 1e-4 nats of `ref` or better at every seed."""
    from scipy import stats
    loss = lambda v, s: read_json(out / f'{v}-s{s}' / 'summary.json')['val_loss']
    rec = [(loss(f'pca-k{k}', s) - loss(f'pca-lora-k{k}', s)) / (loss(f'pca-k{k}', s) - loss(ref, s)) for s in seeds
           if loss(f'pca-k{k}', s) - loss(ref, s) > 1e-4]
    if not rec: return None
    m = float(np.mean(rec))
    return m, (stats.t.interval(0.95, len(rec) - 1, loc=m, scale=stats.sem(rec)) if len(rec) > 1 else None)


def test_report_shows_the_table_and_the_verdict(batch):
    out = completed(batch)
    assert (out / 'report.html').exists()
    text = html_text(out / 'report.html')
    for label in ('low-rank (scratch)', 'PCA (no fine-tuning)', 'PCA + LoRA', 'baseline (k=d)', 'baseline-cont (k=d)', 'k=16', 'k=64',
                  'relative reconstruction error', 'mean cosine', 'baseline-cont starts from the baseline'):
        assert label in text
    for v in ('pca-k16', 'lowrank-k16', 'pca-lora-k64'):
        mean = np.mean([read_json(out / f'{v}-s{s}' / 'summary.json')['best_val_ppl'] for s in SEEDS])
        assert f"{mean:.3f} (2)" in text
    # the fraction of the PCA-only gap LoRA recovers, against both references, paired per seed with a t-interval over seeds
    # (on these 4-step runs baseline-cont, 2 steps at the LoRA lr, can end worse than PCA-only: then 'no gap' is what must show)
    for ref in ('baseline', 'baseline-cont'):
        r = _recovery(out, 16, ref)
        if r is None: assert f'no gap vs {ref}: PCA-only is within' in text; continue
        m, ci = r
        assert ci is not None  # both seeds have a gap here (the one-seed case is the next test's)
        assert f'{m:.1%}' in text and f'{ci[0]:.0%} .. {ci[1]:.0%}' in text and f'k=16: {m:.0%} (95% CI {ci[0]:.0%} .. {ci[1]:.0%}, 2 seeds)' in text
    assert 'Against the baseline' in text and 'Against baseline-cont' in text
    assert 'no gap vs baseline' in text  # k = 64 = d: PCA-only is the baseline
    # the reconstruction metrics at k = 16 of the baseline's table, as the run recorded them
    evj = read_json(out / 'baseline-s0' / 'explained_variance.json')
    assert f"{evj['relative_error'][15]:.3f}" in text and f"{evj['mean_cosine'][15]:.3f}" in text
    assert 'one seed: needs' not in text and '1 seed: needs' not in text and 'inf%' not in text  # both seeds completed everywhere
    assert 'Traceback' not in text and 'Error' not in text


def test_answers_trace_to_the_summaries(batch):
    "`pca_answers` (what `oelm run pca` prints and the report's table shows): each number recomputed here from the summaries."
    from oelm_nb.report.tables import load_runs
    out = completed(batch)
    got = {a.qid: a for a in get_study('pca').answers(load_runs(out))}
    assert list(got) == [f'k={k} vs {ref}' for k in KS for ref in ('baseline', 'baseline-cont')]
    text = html_text(out / 'report.html')
    for q, a in got.items():
        k, ref = int(q.split()[0][2:]), q.split(' vs ')[1]
        r = _recovery(out, k, ref)
        if r is None:  # every seed without a gap (k = d against the baseline; baseline-cont can end worse than PCA-only)
            assert (a.verdict, a.interval) == ('no gap', ''); continue
        m, ci = r
        if ci is None:  # one seed with a gap: the class from the mean, no interval
            assert (a.estimate, a.interval) == (f'{m:.0%} of the gap', '') and a.seeds.startswith('1 paired seed'); continue
        lo, hi = ci
        cls = 'whole' if lo >= 1 else 'none' if hi <= 0 else 'part' if lo > 0 and hi < 1 else 'open'
        assert (a.verdict, a.estimate, a.interval, a.seeds) == (cls, f'{m:.0%} of the gap', f'95% CI {lo:.0%} .. {hi:.0%}', '2 paired seeds')
        assert f'{m:.0%} of the gap (95% CI {lo:.0%} .. {hi:.0%})' in text  # the report's answers table
    assert got[f'k={D} vs baseline'].verdict == 'no gap'  # k = d: PCA-only is the baseline
    assert "All answers hold at the runs' budget" in text or 'Budgets: ' in text


def test_report_renders_with_a_failed_run(batch, tmp_path):
    out = completed(batch)
    dst = tmp_path / 'b'
    shutil.copytree(out, dst, symlinks=True, ignore=shutil.ignore_patterns('checkpoints', 'data', '*.html', 'report.ipynb'))
    (dst / 'pca-lora-k16-s0' / 'summary.json').write_text(json.dumps({'status': 'failed', 'error': 'RuntimeError: boom'}))
    res = oelm_main('report', str(dst))
    assert res.returncode == 0, res.stderr[-3000:]
    text = html_text(dst / 'report.html')
    assert 'RuntimeError: boom' in text and 'failed' in text
    mean = np.mean([read_json(dst / f'pca-k16-s{s}' / 'summary.json')['best_val_ppl'] for s in SEEDS])
    assert f"{mean:.3f} (2)" in text
    # k = 16 is left with one paired seed: a point value and 'needs >= 2 seeds', never an infinite interval
    m, ci = _recovery(dst, 16, 'baseline', seeds=(1,))
    assert ci is None and f'k=16: {m:.0%} (1 seed: needs >= 2 seeds)' in text
    assert '1 seed: needs >= 2 seeds' in text and 'inf%' not in text and 'nan%' not in text  # the paired PPL comparison too


def test_pca_lora_run_is_reproducible(batch, tmp_path):
    "Rerunning a PCA + LoRA run from the same baseline gives the same losses to the last digit (LoRA's init comes from the seed)."
    out = completed(batch)
    again = tmp_path / 'again'; again.mkdir()
    shutil.copytree(out / 'baseline-s0', again / 'baseline-s0', symlinks=True)
    shutil.copytree(out / 'data', again / 'data')
    shutil.copy(out / 'batch.json', again / 'batch.json')
    r2 = oelm_inline('run', 'pca', '--variants', 'pca-lora-k16', '--seeds', '0', '--ks', '16', '64', '--no-report', '--out', str(again), *TINY)
    assert r2.returncode == 0, r2.stdout[-2000:] + r2.stderr[-2000:]
    assert 'baseline-s0: already completed' in r2.stdout
    first, second = read_json(out / 'pca-lora-k16-s0' / 'summary.json'), read_json(again / 'pca-lora-k16-s0' / 'summary.json')
    assert (second['best_val_loss'], second['final_val_loss']) == (first['best_val_loss'], first['final_val_loss'])


def test_the_console_summary_prints_the_answers(batch, capsys):
    "What `oelm run pca` prints after the batch: the answers through the kit (answers.json beside the runs)."
    import json
    from oelm_nb.app.cli import print_batch_summary
    from oelm_nb.report.evidence import Answer
    out_dir = batch[0]
    print_batch_summary(out_dir)
    out = capsys.readouterr().out
    stored = json.loads((out_dir / 'answers.json').read_text())
    assert stored['study'] == 'pca' and stored['answers']
    for a in map(Answer.from_dict, stored['answers']): assert f'{a.qid:>4} {a.verdict}' in out
