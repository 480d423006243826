"""The model takes the data's vocabulary before any run starts: `oelm run --data DIR` on data prepared with a larger
vocabulary than the preset's works without flags (and says so once); a --set that fixes the model's vocabulary
below the data's is refused up front, before anything trains."""
from __future__ import annotations
import json
from pathlib import Path
import pytest
from cli_helpers import oelm_main, oelm_inline, read_json



@pytest.fixture(scope='module')
def wide_data(tmp_path_factory) -> Path:
    "A prepared story folder with a 2,600-token vocabulary (the tiny preset's model has 2,048)."
    d = tmp_path_factory.mktemp('vocab') / 'data'
    res = oelm_main('data', 'prepare', '--source', 'synthetic', '--out', str(d), '--set', 'data.vocab_size=2600',
                   '--set', 'data.n_train_stories=600', '--set', 'data.n_val_stories=40', '--quiet')
    assert res.returncode == 0, res.stderr
    assert read_json(d / 'meta.json')['vocab_size'] == 2600
    return d


def test_a_wider_data_vocabulary_is_taken_by_the_model(wide_data, tmp_path):
    out = tmp_path / 'batch'
    res = oelm_inline('run', 'qk-freeze', '--data', str(wide_data), '--variants', 'gpt', '--seeds', '0', '--steps', '3', '--no-report',
                   '--out', str(out), '--set', 'train.eval_batches=2')
    assert res.returncode == 0, res.stderr[-2000:]
    assert "the data's vocabulary is 2,600: model.vocab_size 2,048 -> 2,600" in res.stdout
    assert read_json(out / 'gpt-s0' / 'config.json')['model']['vocab_size'] == 2600
    assert read_json(out / 'gpt-s0' / 'summary.json')['status'] == 'completed'


def test_a_vocabulary_fixed_below_the_datas_is_refused_before_anything_runs(wide_data, tmp_path):
    out = tmp_path / 'batch'
    res = oelm_main('run', 'qk-freeze', '--data', str(wide_data), '--variants', 'gpt,oelm', '--seeds', '0', '1', '--steps', '3',
                   '--no-report', '--out', str(out), '--set', 'model.vocab_size=2048')
    assert res.returncode == 2
    assert ('--set model.vocab_size=2048 is smaller than the vocabulary of the data' in res.stderr
            and 'model.vocab_size >= 2600' in res.stderr), res.stderr
    assert res.stderr.count('smaller than the vocabulary') == 1 and 'started' not in res.stdout  # once, and no run started
    assert not out.exists()  # nothing was left behind
