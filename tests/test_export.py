"""`oelm export` from outside: a finished run read back by transformers (same logits, same tokenizer ids) and as a
nanoGPT checkpoint (plain tensors, nanoGPT's names and shapes); what a format cannot express is refused (exit 2)."""
from __future__ import annotations
import json, math
from pathlib import Path
import pytest
import torch
from cli_helpers import oelm_main, oelm_inline, tiny_args
from shared_runs import qk_freeze_batch, pca_batch, completed, inline_batch
from oelm_nb.lab.sample import load_run_model, run_codec

pytestmark = pytest.mark.slow  # batches and processes end to end: `make test` runs them, `make test-fast` does not

transformers = pytest.importorskip('transformers')


@pytest.fixture(scope='module')
def run(tmp_path_factory) -> Path:
    "A finished oelm-freeze run (frozen Q/K buffers) of 30 steps on a tiny corpus: tests/shared_runs.py."
    return qk_freeze_batch(tmp_path_factory) / 'oelm-freeze-s0'


def test_hf_export_has_our_logits_and_tokenizer(run, tmp_path):
    res = oelm_main('export', str(run), str(tmp_path / 'hf'))
    assert res.returncode == 0, res.stderr
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / 'hf').eval()
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / 'hf')
    ours, spec, _ = load_run_model(run, device='cpu')
    text = 'Once upon a time, there was a little fox named'
    assert tok.encode(text) == run_codec(spec).encode(text)
    ids = torch.tensor([tok.encode(text)])
    with torch.no_grad(): assert (hf(ids).logits - ours(ids)[0]).abs().max().item() < 1e-5
    assert hf.config.n_layer == spec.model.n_layer and hf.config.activation_function == 'gelu'
    meta = json.loads((tmp_path / 'hf' / 'oelm_export.json').read_text())
    assert (meta['variant'], meta['format']) == ('oelm-freeze', 'hf')


def test_nanogpt_export_is_plain_tensors_in_nanogpts_layout(run, tmp_path):
    res = oelm_main('export', str(run), str(tmp_path / 'nano'), '--to', 'nanogpt', '--checkpoint', 'final')
    assert res.returncode == 0, res.stderr
    ck = torch.load(tmp_path / 'nano' / 'ckpt.pt', weights_only=True)  # plain tensors and containers only
    a, sd = ck['model_args'], ck['model']
    d, L, V = a['n_embd'], a['n_layer'], a['vocab_size']
    expected = {'transformer.wte.weight': (V, d), 'transformer.wpe.weight': (a['block_size'], d), 'transformer.ln_f.weight': (d,),
                'transformer.ln_f.bias': (d,), 'lm_head.weight': (V, d)}
    for i in range(L):
        p = f'transformer.h.{i}'
        expected |= {f'{p}.ln_1.weight': (d,), f'{p}.ln_1.bias': (d,), f'{p}.ln_2.weight': (d,), f'{p}.ln_2.bias': (d,),
                     f'{p}.attn.c_attn.weight': (3 * d, d), f'{p}.attn.c_attn.bias': (3 * d,), f'{p}.attn.c_proj.weight': (d, d),
                     f'{p}.attn.c_proj.bias': (d,), f'{p}.mlp.c_fc.weight': (4 * d, d), f'{p}.mlp.c_fc.bias': (4 * d,),
                     f'{p}.mlp.c_proj.weight': (d, 4 * d), f'{p}.mlp.c_proj.bias': (d,)}
    assert {k: tuple(v.shape) for k, v in sd.items()} == expected
    ours = load_run_model(run, 'final', device='cpu')[0]
    q = ours.transformer.h[0].attn.q_proj.weight
    assert torch.equal(sd['transformer.h.0.attn.c_attn.weight'][:d], q)  # the frozen Q, now an ordinary weight
    assert ck['iter_num'] == 30 and set(a) == {'n_layer', 'n_head', 'n_embd', 'block_size', 'bias', 'vocab_size', 'dropout'}


@pytest.mark.parametrize('args, message', [
    (('--to', 'onnx'), "invalid choice: 'onnx'"),
    (('--checkpoint', '999'), 'no checkpoint of step 999'),
])
def test_bad_requests_exit_2(run, tmp_path, args, message):
    res = oelm_main('export', str(run), str(tmp_path / 'x'), *args)
    assert res.returncode == 2 and message in res.stderr, res.stderr
    assert not (tmp_path / 'x').exists()  # nothing written


SMALL = dict(vocab_size=97, block_size=32, n_layer=2, n_head=2, n_embd=32)


def _model(variant='gpt', **extra):
    from oelm_nb.model.gpt import GPT, model_config
    m = GPT(model_config('tiny', variant=variant, **SMALL, **extra), init_seed=1)
    with torch.no_grad():  # trained-like: non-zero biases everywhere, scale_up / scale_down included
        g = torch.Generator().manual_seed(2)
        for n, p in m.named_parameters():
            if n.endswith('.bias'): p.normal_(0, 0.3, generator=g)
    return m.eval()


def _lora_model():
    from oelm_nb.model.pca import apply_lora
    m = _model(n_embd_wte=8)
    apply_lora(m, rank=2, alpha=4)
    with torch.no_grad():
        g = torch.Generator().manual_seed(3)
        for n, p in m.named_parameters():
            if 'lora_' in n: p.normal_(0, 0.2, generator=g)  # adapters that change the model
    return m.eval()


def _hf_gap(model, path) -> float:
    "Export `model`, read it back with transformers.from_pretrained, and return the largest logit difference."
    from oelm_nb.lab.export import to_hf_gpt2
    to_hf_gpt2(model).save_pretrained(path)
    hf = transformers.GPT2LMHeadModel.from_pretrained(path).eval()
    ids = torch.randint(0, model.cfg.vocab_size, (3, 24), generator=torch.Generator().manual_seed(4))
    with torch.no_grad(): return (hf(ids).logits - model.eval()(ids)[0]).abs().max().item()


@pytest.mark.parametrize('name, build', [
    ('gpt', lambda: _model('gpt')), ('oelm', lambda: _model('oelm')), ('oelm-freeze', lambda: _model('oelm-freeze')),
    ('untied', lambda: _model(tie_embeddings=False)), ('factorized', lambda: _model(n_embd_wte=8)),
    ('factorized-untied', lambda: _model(n_embd_wte=8, tie_embeddings=False)), ('factorized-no-bias', lambda: _model(n_embd_wte=8, bias=False)),
    ('lora-merged', _lora_model),
])
def test_every_supported_variant_reloads_in_transformers_with_our_logits(name, build, tmp_path):
    model = build()
    gap = _hf_gap(model, tmp_path / 'hf')
    assert gap < 1e-5, (name, gap)
    cfg = json.loads((tmp_path / 'hf' / 'config.json').read_text())
    assert cfg['tie_word_embeddings'] == (name in ('gpt', 'oelm', 'oelm-freeze'))  # untied or factorized: a head of its own
    if not cfg['tie_word_embeddings']:
        from safetensors import safe_open
        with safe_open(str(tmp_path / 'hf' / 'model.safetensors'), 'pt') as z: assert 'lm_head.weight' in z.keys()


def test_the_logits_comparison_can_fail(tmp_path):
    "The check above compares numbers: an export of one model against another model's logits is far apart."
    from oelm_nb.lab.export import to_hf_gpt2
    a, b = _model(n_embd_wte=8), _model(n_embd_wte=8)
    with torch.no_grad(): b.transformer.tok.scale_down.bias.add_(0.5)  # only the bias that the export folds differs
    to_hf_gpt2(a).save_pretrained(tmp_path / 'a')
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / 'a').eval()
    ids = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad(): assert (hf(ids).logits - b(ids)[0]).abs().max().item() > 1e-2


def test_a_lora_model_is_merged_on_a_copy_and_an_unfoldable_head_is_refused():
    from oelm_nb.base.core import ConfigError
    from oelm_nb.lab.export import to_hf_gpt2
    from oelm_nb.model.pca import lora_modules
    m = _lora_model()
    to_hf_gpt2(m)
    assert not any(x.merged for x in lora_modules(m))  # the run's model keeps its adapters
    low = _model(n_embd_wte=8)
    with torch.no_grad(): low.transformer.tok.scale_down.weight[1:] = 0  # rank 1: a bias outside its range cannot be folded
    with pytest.raises(ConfigError, match='cannot be folded'): to_hf_gpt2(low)


def test_nanogpt_refuses_an_untied_or_factorized_model():
    from oelm_nb.base.core import ConfigError
    from oelm_nb.lab.export import to_nanogpt_state
    with pytest.raises(ConfigError, match="nanoGPT's GPT always ties its output head"): to_nanogpt_state(_model(tie_embeddings=False))
    with pytest.raises(ConfigError, match='token table is factorized'): to_nanogpt_state(_model(n_embd_wte=8))


def test_lora_adapters_round_trip_alone(tmp_path):
    from oelm_nb.base.core import ConfigError
    from oelm_nb.model.pca import save_lora_adapters, load_lora_adapters, lora_state, ADAPTER_FILE
    from safetensors.torch import load_file
    tuned = _lora_model()
    save_lora_adapters(tuned, tmp_path / 'ad')
    saved = load_file(tmp_path / 'ad' / ADAPTER_FILE)
    assert set(saved) == set(lora_state(tuned)) and all('lora_' in n for n in saved)  # the adapters only
    meta = json.loads((tmp_path / 'ad' / 'lora_adapters.json').read_text())
    assert (meta['rank'], meta['alpha']) == (2, 4.0) and 'q_proj' in meta['targets']
    fresh = _model(n_embd_wte=8)  # the same base, no adapters yet
    ids = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        before = fresh(ids)[0]
        after = load_lora_adapters(fresh, tmp_path / 'ad').eval()(ids)[0]
        assert (after - tuned(ids)[0]).abs().max().item() < 1e-6 and (after - before).abs().max().item() > 1e-2
    with pytest.raises(ConfigError, match=r'transformer.tok.wte.lora_B: model \(16, 2\), file \(8, 2\)'):
        from oelm_nb.model.pca import apply_lora
        wide = _model(n_embd_wte=16); apply_lora(wide, rank=2, alpha=4)
        load_lora_adapters(wide, tmp_path / 'ad')


def first_train_loss(run_dir: Path) -> float:
    rows = [json.loads(l) for l in (run_dir / 'metrics.jsonl').read_text().splitlines() if l.strip()]
    return next(r['train_loss'] for r in rows if 'train_loss' in r)


def test_a_run_starts_from_an_exported_nanogpt_checkpoint(run, tmp_path):
    assert oelm_main('export', str(run), str(tmp_path / 'nano'), '--to', 'nanogpt').returncode == 0
    out = tmp_path / 'batch'
    common = ('run', 'qk-freeze', '--variants', 'oelm-freeze', '--seeds', '1', '--no-report', *tiny_args(2),
              '--set', 'data.n_train_stories=300', '--data', str(run.parent / 'data'))
    res = oelm_inline(*common, '--out', str(out), '--init-from', str(tmp_path / 'nano' / 'ckpt.pt'))  # the run in-process
    assert res.returncode == 0, res.stderr[-2000:]
    cfg = json.loads((out / 'oelm-freeze-s1' / 'config.json').read_text())
    assert cfg['train']['init_from'] == str((tmp_path / 'nano' / 'ckpt.pt').resolve())
    trained = json.loads((run / 'summary.json').read_text())['final_train_loss']
    started, uniform = first_train_loss(out / 'oelm-freeze-s1'), math.log(cfg['model']['vocab_size'])  # a fresh init starts near ln V
    assert started < uniform - 0.3 and abs(started - trained) < 0.5, (started, uniform, trained)  # it begins where the source ended
    res = oelm_main(*common, '--out', str(tmp_path / 'x'), '--init-from', str(tmp_path / 'missing.pt'))
    assert res.returncode == 2 and 'no such file or directory' in res.stderr


def test_init_from_a_config_built_gpt2_directory_reproduces_its_logits(tmp_path):
    from oelm_nb.model.weights import load_init_weights
    from oelm_nb.model.gpt import GPT, model_config
    cfg = transformers.GPT2Config(vocab_size=120, n_positions=64, n_embd=32, n_layer=2, n_head=4, activation_function='gelu')
    torch.manual_seed(0); hf = transformers.GPT2LMHeadModel(cfg).eval(); hf.save_pretrained(tmp_path / 'gpt2')
    ours = GPT(model_config('tiny', vocab_size=120, block_size=64, n_embd=32, n_layer=2, n_head=4, attn_bias=True), init_seed=5)
    load_init_weights(ours, tmp_path / 'gpt2').eval()
    ids = torch.randint(0, 120, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(): assert (ours(ids)[0] - hf(ids).logits).abs().max().item() < 1e-5
    from oelm_nb.base.core import ConfigError
    with pytest.raises(ConfigError, match='Match it with --set model.vocab_size=120 --set model.block_size=64 --set model.n_layer=2'):
        load_init_weights(GPT(model_config('tiny', vocab_size=120, block_size=64, n_embd=64, n_layer=2, n_head=4), init_seed=0), tmp_path / 'gpt2')


def test_init_from_an_untied_gpt2_directory(tmp_path):
    "A config-built GPT-2 with tie_word_embeddings=False: an untied model reproduces its logits, a tied one is refused by name."
    from oelm_nb.base.core import ConfigError
    from oelm_nb.model.weights import load_init_weights
    from oelm_nb.model.gpt import GPT, model_config
    cfg = transformers.GPT2Config(vocab_size=120, n_positions=64, n_embd=32, n_layer=2, n_head=4, activation_function='gelu',
                                  tie_word_embeddings=False)
    torch.manual_seed(0); hf = transformers.GPT2LMHeadModel(cfg).eval(); hf.save_pretrained(tmp_path / 'gpt2')
    assert not torch.equal(hf.lm_head.weight, hf.transformer.wte.weight)
    shape = dict(vocab_size=120, block_size=64, n_embd=32, n_layer=2, n_head=4, attn_bias=True)
    ours = load_init_weights(GPT(model_config('tiny', **shape, tie_embeddings=False), init_seed=5), tmp_path / 'gpt2').eval()
    ids = torch.randint(0, 120, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(): assert (ours(ids)[0] - hf(ids).logits).abs().max().item() < 1e-5
    with pytest.raises(ConfigError, match='--set model.tie_embeddings=false'):
        load_init_weights(GPT(model_config('tiny', **shape), init_seed=5), tmp_path / 'gpt2')


def test_an_untied_run_exports_to_hf_and_is_refused_by_nanogpt(run, tmp_path):
    out = inline_batch(tmp_path / 'batch', 'qk-freeze', variants=['gpt'], steps=4, data=str(run.parent / 'data'),
                       overrides={'model.tie_embeddings': False})
    rd = out / 'gpt-s0'
    res = oelm_main('export', str(rd), str(tmp_path / 'nano'), '--to', 'nanogpt')
    assert res.returncode == 2 and 'always ties its output head' in res.stderr and not (tmp_path / 'nano').exists(), res.stderr
    assert oelm_main('export', str(rd), str(tmp_path / 'hf')).returncode == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / 'hf').eval()
    ours = load_run_model(rd, device='cpu')[0]
    assert hf.config.tie_word_embeddings is False and ours.lm_head.weight is not ours.transformer.tok.wte.weight
    ids = torch.randint(0, 300, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(): assert (hf(ids).logits - ours(ids)[0]).abs().max().item() < 1e-5


def test_pca_study_runs_export_merged_and_factorized(tmp_path_factory, tmp_path):
    "`oelm export` of a PCA + LoRA run (adapters merged, table materialized) and of an evaluated-only PCA run (no checkpoint of its own)."
    out = completed(pca_batch(tmp_path_factory))  # float32 runs of the PCA study's matrix, k = 16 among them
    for name in ('pca-lora-k16-s0', 'pca-k16-s0', 'baseline-s0'):
        res = oelm_main('export', str(out / name), str(tmp_path / name))
        assert res.returncode == 0, (name, res.stderr[-2000:])
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / name).eval()
        ours, spec, _ = load_run_model(out / name, device='cpu')  # the LoRA run: adapters unmerged, as it trained
        assert ours.cfg.factorized == (name != 'baseline-s0')
        ids = torch.randint(0, 300, (2, 20), generator=torch.Generator().manual_seed(1))
        with torch.no_grad(): gap = (hf(ids).logits - ours(ids)[0]).abs().max().item()
        assert gap < 1e-5, (name, gap)
        assert hf.config.tie_word_embeddings == (name == 'baseline-s0')
    s = json.loads((out / 'pca-k16-s0' / 'summary.json').read_text())
    from oelm_nb.studies.pca.study import _eval
    from oelm_nb.lab.run import prepare_run
    ours, spec, _ = load_run_model(out / 'pca-k16-s0', device='cpu')
    assert abs(_eval(ours, spec, prepare_run(spec)[2])['val_loss'] - s['val_loss']) < 1e-5  # the model the run evaluated


def test_dropouts_are_read_from_the_source_and_written_on_export(tmp_path):
    "GPT-2's three dropouts: --init-from carries them into the run's model (--set wins), the model applies each, export writes them back."
    transformers = pytest.importorskip('transformers')
    from oelm_nb.app.cli import build_parser, run_flags
    from oelm_nb.lab.study import get_study
    from oelm_nb.lab.export import hf_config
    from oelm_nb.model.weights import init_dropouts
    from oelm_nb.model.gpt import GPT, model_config
    from oelm_nb.model.pca import from_hf_gpt2
    src = tmp_path / 'gpt2'
    cfg = transformers.GPT2Config(vocab_size=120, n_positions=64, n_embd=32, n_layer=2, n_head=4, activation_function='gelu',
                                  resid_pdrop=0.1, attn_pdrop=0.0, embd_pdrop=0.25)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(src)
    assert init_dropouts(src) == {'model.dropout': 0.1, 'model.attn_dropout': 0.0, 'model.embd_dropout': 0.25}
    plan = lambda *a: run_flags(get_study('qk-freeze'), build_parser().parse_args(['run', 'qk-freeze', '--init-from', str(src), *a]))[1]
    assert plan()['model.embd_dropout'] == 0.25 and plan('--set', 'model.embd_dropout=0.5')['model.embd_dropout'] == 0.5
    m = GPT(model_config('tiny', vocab_size=120, block_size=64, n_layer=2, n_head=4, n_embd=32, dropout=0.1, attn_dropout=0.0, embd_dropout=0.25), init_seed=0)
    assert m.transformer.drop.p == 0.25 and m.transformer.h[0].attn.dropout == 0.0 and m.transformer.h[0].attn.resid_drop.p == 0.1
    hc = hf_config(m)
    assert (hc.resid_pdrop, hc.attn_pdrop, hc.embd_pdrop) == (0.1, 0.0, 0.25)
    back = from_hf_gpt2(str(src))
    assert (back.cfg.dropout, back.cfg.attn_p, back.cfg.embd_p) == (0.1, 0.0, 0.25)
    # defaults: one dropout for all three, as before (no new keys in older configurations)
    plain = model_config('tiny')
    assert plain.attn_dropout is None and plain.attn_p == plain.embd_p == plain.dropout
