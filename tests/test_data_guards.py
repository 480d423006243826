"""Guards against silent surprises in data and benchmark inputs (issue 13), from outside.

Damaged meta.json fields, text files that are not UTF-8, sequences longer than the position table, and steps that
cannot fit in memory are each refused with a named error (a `DataError` / `ConfigError`, exit code 2 through the
command line) before anything is trained or allocated.
"""
from __future__ import annotations
import json, re, shutil
from pathlib import Path

import pytest

from oelm_nb.train.memory import available_memory, check_step_memory, param_counts, step_memory
from oelm_nb.app.cli import main
from oelm_nb.base.core import ConfigError, DataConfig
from oelm_nb.data.corpus import DataError, load_split, prepare_data, read_meta
from oelm_nb.model.freeze import param_report
from oelm_nb.model.gpt import GPT, model_config

TINY_DATA = DataConfig(vocab_size=300, n_train_stories=200, n_val_stories=30, seed=0)


@pytest.fixture(scope='module')
def prepared(tmp_path_factory) -> Path:
    "A small prepared story corpus (with recall files); tests damage copies of it."
    return prepare_data(TINY_DATA, tmp_path_factory.mktemp('guards') / 'stories', progress=False)


def with_meta(prepared: Path, tmp_path: Path, **fields) -> Path:
    "A copy of the prepared corpus whose meta.json has `fields` replaced."
    d = tmp_path / 'copy'
    shutil.copytree(prepared, d)
    meta = json.loads((d / 'meta.json').read_text())
    (d / 'meta.json').write_text(json.dumps({**meta, **fields}, indent=2))
    return d


def data_error(fn) -> str:
    with pytest.raises(DataError) as e: fn()
    return str(e.value)


# ------------------------------------------------------------------ meta.json fields
def test_meta_n_tokens_plain_int_is_refused(prepared, tmp_path):
    d = with_meta(prepared, tmp_path, n_tokens=5)
    msg = data_error(lambda: load_split(d, 'val'))
    assert str(d / 'meta.json') in msg
    assert 'field n_tokens is 5 (int)' in msg and '{"train": n, "val": n}' in msg
    assert 'oelm data prepare' in msg


def test_meta_n_tokens_strings_are_refused(prepared, tmp_path):
    n = read_meta(prepared)['n_tokens']
    d = with_meta(prepared, tmp_path, n_tokens={k: str(v) for k, v in n.items()})
    msg = data_error(lambda: load_split(d, 'val'))
    assert f"field n_tokens.train is '{n['train']}' (str); expected a non-negative integer" in msg
    assert 'holds' not in msg  # not the old "holds N tokens but meta.json says N"
    assert 'oelm data prepare' in msg


def test_meta_recall_yes_is_refused(prepared, tmp_path):
    d = with_meta(prepared, tmp_path, recall='yes')
    msg = data_error(lambda: read_meta(d))
    assert str(d / 'meta.json') in msg and "field recall is 'yes' (str)" in msg and 'oelm data prepare' in msg


@pytest.mark.parametrize('fields, expected', [
    (dict(vocab_size=True), 'field vocab_size is True (bool); expected a positive integer'),
    (dict(vocab_size=0), 'field vocab_size is 0 (int)'),
    (dict(dtype='float32'), "field dtype is 'float32' (str)"),
    (dict(n_tokens={'train': 10.0, 'val': 5}), 'field n_tokens.train is 10.0 (float)'),
    (dict(n_tokens={'train': -1, 'val': 5}), 'field n_tokens.train is -1 (int)'),
    (dict(n_tokens={'train': 10}), 'field n_tokens.val is missing'),
    (dict(eot_id='0'), "field eot_id is '0' (str)"),
    (dict(unigram_ppl='low'), "field unigram_ppl is 'low' (str)"),
    (dict(recall={'train': {}, 'val': {}}), 'field recall.train.positions is missing'),
])
def test_meta_field_types_are_checked(prepared, tmp_path, fields, expected):
    d = with_meta(prepared, tmp_path, **fields)
    msg = data_error(lambda: load_split(d, 'train'))
    assert str(d / 'meta.json') in msg and expected in msg, msg


def test_meta_recall_fields_are_checked(prepared, tmp_path):
    rec = read_meta(prepared)['recall']
    d = with_meta(prepared, tmp_path, recall={**rec, 'chance_level': 'high'})
    assert "field recall.chance_level is 'high' (str); expected a number in [0, 1]" in data_error(lambda: load_split(d, 'val'))


@pytest.mark.parametrize('keep', [0, 1, 40, -2])
def test_meta_truncated_json_is_refused(prepared, tmp_path, keep):
    d = tmp_path / 'copy'
    shutil.copytree(prepared, d)
    text = (d / 'meta.json').read_text()
    (d / 'meta.json').write_text(text[:keep] if keep >= 0 else text[:len(text) + keep])
    msg = data_error(lambda: load_split(d, 'val'))
    assert f'{d / "meta.json"} is not valid JSON' in msg and 'oelm data prepare' in msg


def test_damaged_meta_is_rewritten_by_prepare(prepared, tmp_path):
    "The fix the messages give works: preparing again into the directory rewrites a damaged meta.json."
    d = with_meta(prepared, tmp_path, recall='yes', n_tokens=5)
    assert prepare_data(TINY_DATA, d, progress=False) == d
    assert read_meta(d)['n_tokens'] == read_meta(prepared)['n_tokens']
    assert len(load_split(d, 'val')) == read_meta(prepared)['n_tokens']['val']


# ------------------------------------------------------------------ local text sources
def prepare_cli(source: Path, out: Path, capsys) -> tuple[int, str]:
    code = main(['data', 'prepare', '--source', str(source), '--out', str(out), '--quiet', '--set', 'data.vocab_size=300'])
    return code, capsys.readouterr().err


def test_cli_prepare_refuses_nul_bytes(tmp_path, capsys):
    src = tmp_path / 'docs.txt'
    head = b'A first document.\n\nA second one.\n\n'
    src.write_bytes(head + b'bin\x00ary\x00\x00 data\n')
    code, err = prepare_cli(src, tmp_path / 'out', capsys)
    assert code == 2, err
    assert str(src) in err and f'NUL byte (0x00) at byte offset {len(head) + 3}' in err
    assert 'binary or UTF-16' in err and 'UTF-8' in err and 'iconv' in err
    assert not (tmp_path / 'out' / 'meta.json').exists()


def test_cli_prepare_refuses_utf16_jsonl(tmp_path, capsys):
    src = tmp_path / 'docs.jsonl'
    src.write_bytes('{"text": "one"}\n{"text": "two"}\n'.encode('utf-16'))  # BOM, then a NUL after each ASCII byte
    code, err = prepare_cli(src, tmp_path / 'out', capsys)
    assert code == 2, err
    assert str(src) in err and 'byte offset 3' in err and 'UTF-16 byte-order mark' in err


def test_cli_prepare_refuses_invalid_utf8(tmp_path, capsys):
    src = tmp_path / 'latin1.txt'
    src.write_bytes('Un caf\u00e9.\n\nDeux.\n'.encode('latin-1'))
    code, err = prepare_cli(src, tmp_path / 'out', capsys)
    assert code == 2, err
    assert str(src) in err and 'not valid UTF-8 text: byte offset 6 (line 1)' in err and 'iconv' in err


# ------------------------------------------------------------------ bench shapes and memory
QK = ('--variants', 'oelm,oelm-freeze')  # what `oelm bench` timed by default before it named no study

def test_bench_block_size_beyond_position_table_is_refused(capsys):
    assert main(['bench', *QK, '--block-size', '100000', '--no-memory']) == 2
    err = capsys.readouterr().err
    assert 'oelm bench: error: block_size=100000 is too long' in err
    assert 'position table (wpe)' in err and 'at most 128 tokens' in err and '--set block_size=100000' in err


@pytest.mark.parametrize('flag, value', [('--block-size', '0'), ('--block-size', '-5'), ('--batch-size', '0')])
def test_bench_non_positive_sizes_are_refused(capsys, flag, value):
    assert main(['bench', *QK, flag, value, '--no-memory']) == 2
    assert f'{flag[2:].replace("-", "_")}={value} is invalid' in capsys.readouterr().err


def _no_model(*a, **k):
    raise AssertionError('a model was built although the step cannot fit')


def test_bench_huge_batch_is_refused_before_allocating(monkeypatch, capsys):
    monkeypatch.setattr('oelm_nb.lab.bench.build_variant', _no_model)
    assert main(['bench', *QK, '--batch-size', '10000000', '--no-memory']) == 2
    err = capsys.readouterr().err
    assert 'oelm bench: error:' in err and 'Traceback' not in err
    assert 'batch_size=10000000 x block_size=128' in err
    assert re.search(r'needs about [\d.]+ GiB .* but only [\d.]+ GiB is available', err), err
    assert 'Lower --batch-size' in err


def test_bench_allocation_failure_becomes_config_error(monkeypatch, capsys):
    def oom(*a, **k): raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 4096 bytes")
    monkeypatch.setattr('oelm_nb.lab.bench.build_variant', oom)
    assert main(['bench', *QK, '--no-memory', '--dtypes', 'float32']) == 2
    err = capsys.readouterr().err
    assert 'out of memory at batch_size=1 x block_size=128' in err and "can't allocate memory" in err
    assert 'Traceback' not in err and 'Lower --batch-size' in err


def test_check_step_memory_on_tiny_preset():
    cfg = model_config('tiny')
    need = check_step_memory(cfg, 8)
    assert isinstance(need, int) and 0 < need < available_memory('cpu')[0]
    # weights, gradients and AdamW moments alone: 4 + 4 + 8 bytes per trainable weight
    assert need > 16 * param_report(GPT(cfg, init_seed=0)).trainable


def test_check_step_memory_suggests_a_fitting_accumulation(monkeypatch):
    monkeypatch.setattr('oelm_nb.train.memory.available_memory', lambda device='cpu': (2 ** 30, 'cpu (test)'))
    cfg = model_config('tiny')
    with pytest.raises(ConfigError) as e: check_step_memory(cfg, 512, None, 'cpu', grad_accum=2)
    msg = str(e.value)
    assert 'batch_size=512 x block_size=128' in msg and '1.00 GiB is available on cpu (test)' in msg
    b, acc = map(int, re.search(r'train.batch_size=(\d+) with train.grad_accum=(\d+)', msg).groups())
    assert b * acc == 512 * 2 and b < 512
    assert step_memory(cfg, b).total <= 2 ** 30


@pytest.mark.parametrize('over', [{}, dict(variant='oelm-freeze', freeze_layers=1), dict(n_embd_wte=16, bias=False)])
def test_param_counts_match_the_built_model(over):
    cfg = model_config('tiny', block_size=32, **over)
    rep = param_report(GPT(cfg, init_seed=0))
    assert param_counts(cfg) == (rep.total, rep.trainable)


def shape_counts(cfg):
    "(total, trainable) worked out from the configuration, Q/K freezing alone: what the model-built count replaced."
    C, F, k, V = cfg.n_embd, cfg.ff_dim, cfg.wte_dim, cfg.vocab_size
    lin = lambda i, o, bias: i * o + (o if bias else 0)
    ln = C * (2 if cfg.bias else 1)
    layer = 2 * ln + 4 * lin(C, C, cfg.attn_bias) + lin(C, F, cfg.bias) + lin(F, C, cfg.bias)
    total = V * k + cfg.block_size * C + cfg.n_layer * layer + ln
    if cfg.factorized: total += lin(k, C, cfg.bias) + lin(C, k, cfg.bias)
    return total, total - 2 * C * C * len(cfg.frozen_layers)


def test_counts_from_the_model_equal_the_configurations_for_every_studys_tiny_variants():
    """`param_counts` builds the model (meta device) and counts it: for every variant of every study at `tiny`, the
    same total as the configuration formula it replaced, and the same trainable count wherever that formula applies
    (Q/K frozen alone); a model that freezes another part has exactly its frozen tensors fewer trainable."""
    from oelm_nb.lab.study import studies
    from oelm_nb.lab.spec import resolve_spec
    from oelm_nb.model.gpt import shape_model
    from oelm_nb.model.freeze import named_tensors
    seen = 0
    for name, st in studies().items():
        for v in st.variants('tiny', 1000, {}):
            cfg = resolve_spec(st, v, 'tiny').model
            (total, trainable), got = shape_counts(cfg), param_counts(cfg)
            frozen = [(n, t.numel()) for n, t, tr in named_tensors(shape_model(cfg)) if not tr]
            assert got[0] == total, (name, v)
            if all('q_proj' in n or 'k_proj' in n for n, _ in frozen): assert got[1] == trainable, (name, v)
            else: assert got[1] == total - sum(k for _, k in frozen), (name, v, frozen)
            seen += 1
    assert seen >= 8
