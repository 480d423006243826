"""A nanoGPT data folder as its prepare.py leaves it (train.bin, val.bin, meta.pkl) trains without conversion, its
samples decode to characters, and a meta.pkl that refers to code is refused before anything is executed."""
from __future__ import annotations
import json, os, pickle
from pathlib import Path
import numpy as np
import pytest
from cli_helpers import oelm_main, oelm_inline, read_json

TEXT = ('First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n\n'
        'First Citizen:\nYou are all resolved rather to die than to famish?\n\n') * 60


def char_folder(root: Path) -> Path:
    "What nanoGPT's data/shakespeare_char/prepare.py writes, for a short text."
    chars = sorted(set(TEXT)); stoi = {c: i for i, c in enumerate(chars)}
    ids = np.array([stoi[c] for c in TEXT], dtype=np.uint16); n = int(0.9 * len(ids))
    root.mkdir(parents=True); ids[:n].tofile(root / 'train.bin'); ids[n:].tofile(root / 'val.bin')
    with open(root / 'meta.pkl', 'wb') as f: pickle.dump({'vocab_size': len(chars), 'itos': dict(enumerate(chars)), 'stoi': stoi}, f)
    return root


def test_a_character_level_folder_trains_and_samples_characters(tmp_path):
    data = char_folder(tmp_path / 'shakespeare_char')
    out = tmp_path / 'batch'
    res = oelm_inline('run', 'qk-freeze', '--data', str(data), '--variants', 'gpt', '--seeds', '0', '--steps', '8', '--no-report',
                   '--out', str(out), '--set', 'model.block_size=64', '--set', 'train.eval_batches=2', '--set', 'train.eval_every=4')
    assert res.returncode == 0, res.stderr[-2000:]
    s = read_json(out / 'gpt-s0' / 'summary.json')
    assert s['status'] == 'completed' and s['samples'] and 'samples_note' not in s
    assert all(set(t) <= set(TEXT) for t in s['samples'] + s['sample_prompts'])  # characters of the data set, not ids
    assert read_json(out / 'gpt-s0' / 'config.json')['model']['vocab_size'] >= len(set(TEXT))
    res = oelm_main('sample', str(out / 'gpt-s0'), '--prompt', 'First Citizen:', '--max-new-tokens', '20', '--json')
    assert res.returncode == 0, res.stderr
    assert all(t['text'].startswith('First Citizen:') and set(t['text']) <= set(TEXT) for t in json.loads(res.stdout))


class Marker:
    "Unpickling this would create a file: a stand-in for any code a hostile pickle runs."
    def __init__(self, path): self.path = path
    def __reduce__(self): return (os.mkdir, (self.path,))


def test_a_meta_pkl_that_refers_to_code_is_refused_and_nothing_runs(tmp_path):
    data = char_folder(tmp_path / 'evil')
    marker = tmp_path / 'pwned'
    with open(data / 'meta.pkl', 'wb') as f: pickle.dump({'vocab_size': 40, 'hook': Marker(str(marker))}, f)
    res = oelm_main('run', 'qk-freeze', '--data', str(data), '--variants', 'gpt', '--seeds', '0', '--steps', '2', '--no-report',
                   '--out', str(tmp_path / 'batch'))
    assert res.returncode == 2, res.stderr
    assert 'meta.pkl was not read' in res.stderr and 'refers to posix.mkdir' in res.stderr, res.stderr
    assert not marker.exists() and not (tmp_path / 'batch').exists()
