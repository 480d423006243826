"""The data chapter from outside: story corpus, splits, recall alignment, token files, sources and caching."""
from __future__ import annotations
import importlib.util
import json, os, re, shutil, time
from pathlib import Path

import numpy as np
import pytest
import torch

from oelm_nb.base.core import DataConfig
from oelm_nb.data.corpus import (DataError, TokenData, batch, generate_stories, load_split, prepare_data, read_documents,
                          read_meta, recall_positions, synthetic_splits, token_dtype)
from oelm_nb.data.tokenizer import EOT, BPETokenizer, gpt2_tokenizer, load_tokenizer

SMALL = DataConfig(vocab_size=700, n_train_stories=1500, n_val_stories=150, seed=3)


@pytest.fixture(scope='module')
def stories_dir(tmp_path_factory) -> Path:
    "A small prepared story corpus shared by the read-only tests."
    return prepare_data(SMALL, tmp_path_factory.mktemp('data') / 'stories', progress=False)


def copy_of(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / 'copy'
    shutil.copytree(src, dst)
    return dst


# ------------------------------------------------------------------ generator and splits
def test_generator_is_deterministic():
    a, b = generate_stories(40, seed=11), generate_stories(40, seed=11)
    assert [s.text for s in a] == [s.text for s in b]
    assert [s.recall_spans for s in a] == [s.recall_spans for s in b]
    assert [s.antecedent for s in a] == [s.antecedent for s in b]
    assert [s.text for s in generate_stories(5, seed=11)] == [s.text for s in a[:5]]  # prefix-stable
    assert generate_stories(1, seed=12)[0].text != a[0].text


def test_stories_shape_and_spans():
    for s in generate_stories(300, seed=4):
        assert 50 <= len(s.text.split()) <= 120
        assert s.recall_spans and len(s.recall_spans) == len(s.antecedent) == len(s.kinds)
        assert set(s.kinds) == {'name', 'object'}
        for (a, b), ant in zip(s.recall_spans, s.antecedent):
            word = re.match(r'\w+', s.text[ant:]).group()
            assert ant < a and s.text[a:b] == word
            assert s.text[a - 1] == ' ' and s.text[ant - 1] == ' '  # same BPE pre-token at both mentions


def test_splits_are_disjoint():
    train, val = synthetic_splits(3000, 300, seed=1234)
    assert len(train) == 3000 and len(val) == 300
    assert not {s.text for s in train} & {s.text for s in val}
    assert len({s.text for s in val}) == 300


# ------------------------------------------------------------------ recall alignment
def test_recall_positions_point_to_the_antecedent_token():
    stories = generate_stories(200, seed=9)
    tok = BPETokenizer.train([s.text for s in stories], 500)
    for s, (ids, locate) in zip(stories, tok.encode_with_locator([s.text for s in stories])):
        pos = recall_positions(s, locate)
        assert len(pos) == len(s.recall_spans)
        for t, d in pos:
            assert d > 0 and ids[t] == ids[t - d]


def test_recall_files_align_with_tokens(stories_dir):
    meta = read_meta(stories_dir)
    for split in ('train', 'val'):
        data = load_split(stories_dir, split)
        assert data.recall is not None and len(data.recall) == len(data.tokens)
        pos = np.nonzero(data.recall)[0]
        assert len(pos) == meta['recall'][split]['positions'] > 0
        ante = pos - data.recall[pos].astype(np.int64)
        assert (ante >= 0).all()
        np.testing.assert_array_equal(data.tokens[pos], data.tokens[ante])
        # the antecedent lies in the same document: no <|endoftext|> in between
        eot = np.cumsum(np.asarray(data.tokens) == meta['eot_id'])
        np.testing.assert_array_equal(eot[pos], eot[ante])
    r = meta['recall']
    assert 0 < r['chance_level'] < 0.5 and r['val']['max_distance'] < 400


def test_meta_records_baselines(stories_dir):
    meta = read_meta(stories_dir)
    assert meta['config'] == SMALL.to_dict()
    assert meta['vocab_size'] <= SMALL.vocab_size and meta['dtype'] == 'uint16'
    assert 1 < meta['unigram_ppl'] < meta['vocab_size']
    tok = load_tokenizer(stories_dir)
    assert tok.vocab_size == meta['vocab_size'] and tok.decode([tok.eot_id]) == EOT
    text = synthetic_splits(1, 1, seed=SMALL.seed)[0][0].text
    assert tok.decode(tok.encode(text)) == text
    first = load_split(stories_dir, 'train').tokens[:len(tok.encode(text)) + 1]
    assert tok.decode(first) == text + EOT


# ------------------------------------------------------------------ token files
def write_dir(d: Path, tokens: np.ndarray, vocab_size: int, **meta) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    for split in ('train', 'val'): tokens.tofile(d / f'{split}.bin')
    (d / 'meta.json').write_text(json.dumps(dict(vocab_size=vocab_size, **meta)))
    return d


@pytest.mark.parametrize('vocab_size,dtype', [(1000, np.uint16), (65_535, np.uint16), (70_000, np.uint32)])
def test_bin_round_trip_and_dtype_choice(tmp_path, vocab_size, dtype):
    assert token_dtype(vocab_size) == dtype
    toks = np.random.default_rng(0).integers(0, vocab_size, 5000).astype(dtype)
    toks[-1] = vocab_size - 1
    d = write_dir(tmp_path / 'd', toks, vocab_size)  # no dtype in meta.json: chosen from vocab_size
    data = load_split(d, 'val')
    assert isinstance(data, TokenData) and data.tokens.dtype == dtype and data.recall is None
    np.testing.assert_array_equal(data.tokens, toks)
    assert (d / 'val.bin').stat().st_size == toks.size * np.dtype(dtype).itemsize


def test_prepared_file_sizes(stories_dir):
    meta = read_meta(stories_dir)
    for split in ('train', 'val'):
        assert (stories_dir / f'{split}.bin').stat().st_size == 2 * meta['n_tokens'][split]
        assert (stories_dir / f'{split}_recall.bin').stat().st_size == 2 * meta['n_tokens'][split]


def test_batch(stories_dir):
    data = load_split(stories_dir, 'val')
    starts = np.array([0, 7, len(data) - 33])
    x, y, rec = batch(data, starts, 32)
    assert x.shape == y.shape == rec.shape == (3, 32)
    assert x.dtype == y.dtype == rec.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    toks = torch.from_numpy(np.asarray(data.tokens, dtype=np.int64))
    for b, s in enumerate(starts):
        assert torch.equal(y[b], toks[s + 1:s + 33])
        for t in torch.nonzero(rec[b])[:, 0].tolist():
            assert y[b, t] == toks[s + t + 1 - rec[b, t]]
    assert rec.sum() > 0
    with pytest.raises(DataError, match='window starts'): batch(data, np.array([len(data) - 10]), 32)


# ------------------------------------------------------------------ corrupt inputs
def test_missing_meta(stories_dir, tmp_path):
    d = copy_of(stories_dir, tmp_path); (d / 'meta.json').unlink()
    with pytest.raises(DataError, match=r'meta\.json is missing'): load_split(d, 'train')


def test_empty_file(stories_dir, tmp_path):
    d = copy_of(stories_dir, tmp_path); (d / 'train.bin').write_bytes(b'')
    with pytest.raises(DataError, match=r'train\.bin is empty'): load_split(d, 'train')


def test_odd_byte_count(stories_dir, tmp_path):
    d = copy_of(stories_dir, tmp_path)
    with open(d / 'val.bin', 'ab') as f: f.write(b'\x01')
    with pytest.raises(DataError, match=r'val\.bin has \d+ bytes, not a multiple of 2'): load_split(d, 'val')


def test_token_id_out_of_vocab(stories_dir, tmp_path):
    d = copy_of(stories_dir, tmp_path)
    V = read_meta(d)['vocab_size']
    t = np.fromfile(d / 'val.bin', dtype=np.uint16); t[17] = V; t.tofile(d / 'val.bin')
    with pytest.raises(DataError, match=rf'val\.bin holds token id {V} \(first bad id at position 17\).*vocab_size={V}'):
        load_split(d, 'val')


def test_recall_length_mismatch(stories_dir, tmp_path):
    d = copy_of(stories_dir, tmp_path)
    with open(d / 'train_recall.bin', 'ab') as f: f.write(b'\x00\x00')
    with pytest.raises(DataError, match=r'train_recall\.bin has \d+ entries but .*train\.bin has \d+ tokens'):
        load_split(d, 'train')


@pytest.mark.parametrize('lines,problem', [('{"text": "a"}\n{"text": "b"\n', 'not valid JSON'),
                                           ('{"text": "a"}\n{"story": "b"}\n', 'no "text" string field'),
                                           ('{"text": "a"}\n["b"]\n', 'no "text" string field')])
def test_bad_jsonl_line(tmp_path, lines, problem):
    f = tmp_path / 'corpus.jsonl'; f.write_text(lines)
    with pytest.raises(DataError, match=rf'corpus\.jsonl, line 2: {re.escape(problem)}'):
        prepare_data(DataConfig(source=str(f), vocab_size=300), tmp_path / 'out', progress=False)


def test_unknown_source(tmp_path):
    with pytest.raises(DataError, match='neither'): prepare_data(DataConfig(source=str(tmp_path / 'nope.txt')), tmp_path / 'o')


# ------------------------------------------------------------------ sources
def test_text_and_jsonl_sources(tmp_path):
    texts = [s.text for s in generate_stories(120, seed=2)]
    (tmp_path / 'a.txt').write_text('\n\n'.join(texts[:60]) + '\n')
    (tmp_path / 'b.jsonl').write_text(''.join(json.dumps({'text': t}) + '\n' for t in texts[60:]))
    assert read_documents(tmp_path / 'a.txt') == texts[:60]
    d = prepare_data(DataConfig(source=str(tmp_path), vocab_size=400, val_fraction=0.1), tmp_path / 'out', progress=False)
    meta = read_meta(d)
    assert meta['n_docs'] == {'train': 108, 'val': 12} and meta['recall'] is None
    assert load_split(d, 'train').recall is None
    assert not (d / 'train_recall.bin').exists()


def test_prepared_directory_is_used_as_is(stories_dir, tmp_path):
    assert prepare_data(DataConfig(source=str(stories_dir)), tmp_path / 'unused', progress=False) == stories_dir
    assert not (tmp_path / 'unused').exists()


@pytest.mark.skipif(importlib.util.find_spec("datasets") is None, reason="HF datasets not installed (the hf extra)")
def test_tinystories_offline_fails_fast(monkeypatch, tmp_path):
    monkeypatch.setenv('HF_DATASETS_OFFLINE', '1'); monkeypatch.setenv('HF_HUB_OFFLINE', '1')
    monkeypatch.setenv('HF_HOME', str(tmp_path / 'hf'))  # an empty cache
    t0 = time.time()
    with pytest.raises(DataError) as e:
        prepare_data(DataConfig(source='tinystories'), tmp_path / 'out', progress=False)
    assert time.time() - t0 < 20
    msg = str(e.value)
    assert 'TinyStories' in msg and '.txt' in msg and '.jsonl' in msg and 'source=' in msg


@pytest.mark.skipif(importlib.util.find_spec("datasets") is None, reason="HF datasets not installed (the hf extra)")
def test_tinystories_unreachable_hub_fails_fast(monkeypatch, tmp_path):
    "Without offline variables, an unreachable Hub is detected by a short probe instead of datasets' retries."
    import oelm_nb.data.corpus as D
    for k in ('HF_DATASETS_OFFLINE', 'HF_HUB_OFFLINE', 'TRANSFORMERS_OFFLINE'): monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv('HF_HOME', str(tmp_path / 'hf'))
    monkeypatch.setattr(D, 'reachable', lambda *a, **k: False)
    t0 = time.time()
    with pytest.raises(DataError, match='local files'): D.load_tinystories()
    assert time.time() - t0 < 20


def test_gpt2_tokenizer_offline_fails_fast(monkeypatch, tmp_path):
    import oelm_nb.data.tokenizer as T
    pytest.importorskip('tiktoken')
    monkeypatch.setenv('TIKTOKEN_CACHE_DIR', str(tmp_path / 'empty-cache'))
    monkeypatch.setattr(T, 'reachable', lambda *a, **k: False)
    t0 = time.time()
    with pytest.raises(DataError, match='TIKTOKEN_CACHE_DIR'): gpt2_tokenizer()
    assert time.time() - t0 < 5


# ------------------------------------------------------------------ caching
def test_prepare_data_caches(tmp_path):
    cfg = DataConfig(vocab_size=400, n_train_stories=300, n_val_stories=30, seed=5)
    d = prepare_data(cfg, tmp_path / 'd', progress=False)
    stamp = {p.name: p.stat().st_mtime_ns for p in d.iterdir()}
    t0 = time.time()
    assert prepare_data(cfg, tmp_path / 'd', progress=False) == d
    assert time.time() - t0 < 0.5
    assert {p.name: p.stat().st_mtime_ns for p in d.iterdir()} == stamp  # nothing rewritten
    assert not [p for p in d.iterdir() if p.name.endswith('.tmp')]
    # another config, or an incomplete directory, is prepared again
    prepare_data(cfg.replace(seed=6), d, progress=False)
    assert read_meta(d)['config']['seed'] == 6
    (d / 'val.bin').unlink()
    prepare_data(cfg.replace(seed=6), d, progress=False)
    assert load_split(d, 'val').meta['config']['seed'] == 6


# ------------------------------------------------------------------ the tiktoken path, with a local toy encoding
def toy_tiktoken():
    "A byte-level tiktoken encoding built here (bytes plus ' '+letter merges): no download needed."
    tiktoken = pytest.importorskip('tiktoken')
    from oelm_nb.data.tokenizer import TiktokenTokenizer
    ranks = {bytes([i]): i for i in range(256)}
    for c in 'ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz': ranks[b' ' + c.encode()] = len(ranks)
    pat = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
    return TiktokenTokenizer(tiktoken.Encoding('toy-bytes', pat_str=pat, mergeable_ranks=ranks,
                                               special_tokens={EOT: len(ranks)}))


def test_tiktoken_tokenizer_locates_recall_tokens():
    tok = toy_tiktoken()
    stories = generate_stories(50, seed=8)
    for s, (ids, locate) in zip(stories, tok.encode_with_locator([s.text for s in stories])):
        assert tok.decode(ids) == s.text
        for t, d in recall_positions(s, locate):
            assert ids[t] == ids[t - d] and tok.decode([ids[t]]).startswith(' ')


def test_prepare_with_gpt2_tokenizer_path(monkeypatch, tmp_path):
    import oelm_nb.data.corpus as D, oelm_nb.data.tokenizer as T
    tok = toy_tiktoken()
    monkeypatch.setattr(D, 'gpt2_tokenizer', lambda *a, **k: tok)
    monkeypatch.setattr(T, 'gpt2_tokenizer', lambda *a, **k: tok)  # load_tokenizer, of chapter tokenizer
    cfg = DataConfig(tokenizer='gpt2', n_train_stories=100, n_val_stories=20)
    d = prepare_data(cfg, tmp_path / 'g', progress=True)  # also exercises the progress bars
    meta = read_meta(d)
    assert meta['vocab_size'] == tok.vocab_size and meta['eot_id'] == tok.eot_id and meta['tokenizer'] == 'gpt2'
    assert load_tokenizer(d) is tok
    data = load_split(d, 'val')
    pos = np.nonzero(data.recall)[0]
    assert len(pos) > 0
    np.testing.assert_array_equal(data.tokens[pos], data.tokens[pos - data.recall[pos].astype(np.int64)])


def test_literal_end_of_text_only_ever_separates_documents(tmp_path):
    "A literal <|endoftext|> inside a JSONL text ends the document: the prepared streams hold the id exactly once per document."
    import json as _json
    import numpy as _np
    from oelm_nb.base.core import DataConfig
    from oelm_nb.data.corpus import prepare_data, load_split, read_documents
    from oelm_nb.data.tokenizer import EOT
    texts = [f'story {i} begins. {EOT} story {i} part two ends.' if i % 3 == 0 else f'plain story number {i} here.' for i in range(30)]
    src = tmp_path / 'docs.jsonl'
    src.write_text(''.join(_json.dumps({'text': t}) + '\n' for t in texts))
    docs = read_documents(src)
    assert len(docs) == 30 + 10 and not any(EOT in d for d in docs)
    out = prepare_data(DataConfig(source=str(src), vocab_size=300, val_fraction=0.1), tmp_path / 'prep', progress=False)
    n_eot = 0
    for split in ('train', 'val'):
        d = load_split(out, split)
        eot = int(_json.loads((out / 'meta.json').read_text())['eot_id'])
        toks = _np.asarray(d.tokens)
        n_eot += int((toks == eot).sum())
        assert toks[-1] == eot  # every document, the last one included, ends with the id
    assert n_eot == len(docs)
