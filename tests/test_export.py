"""`oelm export` from outside: a finished run read back by transformers (same logits, same tokenizer ids) and as a
nanoGPT checkpoint (plain tensors, nanoGPT's names and shapes); what a format cannot express is refused (exit 2)."""
from __future__ import annotations
import json, math
from pathlib import Path
import pytest
import torch
from cli_helpers import run_oelm, tiny_args
from oelm_nb.sample import load_run_model, run_codec

transformers = pytest.importorskip('transformers')


@pytest.fixture(scope='module')
def run(tmp_path_factory) -> Path:
    "A finished oelm-freeze run (frozen Q/K buffers) of 20 steps on a tiny corpus."
    out = tmp_path_factory.mktemp('export') / 'batch'
    res = run_oelm('run', 'qk-freeze', '--variants', 'oelm-freeze', '--seeds', '0', '--no-report', '--out', str(out), *tiny_args(20))
    assert res.returncode == 0, res.stderr[-2000:]
    return out / 'oelm-freeze-s0'


def test_hf_export_has_our_logits_and_tokenizer(run, tmp_path):
    res = run_oelm('export', str(run), str(tmp_path / 'hf'))
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
    res = run_oelm('export', str(run), str(tmp_path / 'nano'), '--to', 'nanogpt', '--checkpoint', 'final')
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
    assert ck['iter_num'] == 20 and set(a) == {'n_layer', 'n_head', 'n_embd', 'block_size', 'bias', 'vocab_size', 'dropout'}


@pytest.mark.parametrize('args, message', [
    (('--to', 'onnx'), "invalid choice: 'onnx'"),
    (('--checkpoint', '999'), 'no checkpoint of step 999'),
])
def test_bad_requests_exit_2(run, tmp_path, args, message):
    res = run_oelm('export', str(run), str(tmp_path / 'x'), *args)
    assert res.returncode == 2 and message in res.stderr, res.stderr
    assert not (tmp_path / 'x').exists()  # nothing written


def test_a_factorized_model_is_refused_with_the_reason():
    from oelm_nb.core import ConfigError
    from oelm_nb.export import to_hf_gpt2
    from oelm_nb.model import GPT, model_config
    with pytest.raises(ConfigError, match='token table is factorized'):
        to_hf_gpt2(GPT(model_config('tiny', vocab_size=50, block_size=16, n_embd=32, n_embd_wte=8), init_seed=0))


def first_train_loss(run_dir: Path) -> float:
    rows = [json.loads(l) for l in (run_dir / 'metrics.jsonl').read_text().splitlines() if l.strip()]
    return next(r['train_loss'] for r in rows if 'train_loss' in r)


def test_a_run_starts_from_an_exported_nanogpt_checkpoint(run, tmp_path):
    assert run_oelm('export', str(run), str(tmp_path / 'nano'), '--to', 'nanogpt').returncode == 0
    out = tmp_path / 'batch'
    common = ('run', 'qk-freeze', '--variants', 'oelm-freeze', '--seeds', '1', '--no-report', *tiny_args(2),
              '--set', 'data.n_train_stories=300', '--data', str(run.parent / 'data'))
    res = run_oelm(*common, '--out', str(out), '--init-from', str(tmp_path / 'nano' / 'ckpt.pt'))
    assert res.returncode == 0, res.stderr[-2000:]
    cfg = json.loads((out / 'oelm-freeze-s1' / 'config.json').read_text())
    assert cfg['train']['init_from'] == str((tmp_path / 'nano' / 'ckpt.pt').resolve())
    trained = json.loads((run / 'summary.json').read_text())['final_train_loss']
    started, uniform = first_train_loss(out / 'oelm-freeze-s1'), math.log(cfg['model']['vocab_size'])  # a fresh init starts near ln V
    assert started < uniform - 0.3 and abs(started - trained) < 0.5, (started, uniform, trained)  # it begins where the source ended
    res = run_oelm(*common, '--out', str(tmp_path / 'x'), '--init-from', str(tmp_path / 'missing.pt'))
    assert res.returncode == 2 and 'no such file or directory' in res.stderr


def test_init_from_a_config_built_gpt2_directory_reproduces_its_logits(tmp_path):
    from oelm_nb.export import load_init_weights
    from oelm_nb.model import GPT, model_config
    cfg = transformers.GPT2Config(vocab_size=120, n_positions=64, n_embd=32, n_layer=2, n_head=4, activation_function='gelu')
    torch.manual_seed(0); hf = transformers.GPT2LMHeadModel(cfg).eval(); hf.save_pretrained(tmp_path / 'gpt2')
    ours = GPT(model_config('tiny', vocab_size=120, block_size=64, n_embd=32, n_layer=2, n_head=4, attn_bias=True), init_seed=5)
    load_init_weights(ours, tmp_path / 'gpt2').eval()
    ids = torch.randint(0, 120, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(): assert (ours(ids)[0] - hf(ids).logits).abs().max().item() < 1e-5
    from oelm_nb.core import ConfigError
    with pytest.raises(ConfigError, match='Match it with --set model.vocab_size=120 --set model.block_size=64 --set model.n_layer=2'):
        load_init_weights(GPT(model_config('tiny', vocab_size=120, block_size=64, n_embd=64, n_layer=2, n_head=4), init_seed=0), tmp_path / 'gpt2')
