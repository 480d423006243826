"""H3 times the models the runs trained: a fresh qk-freeze batch whose model takes the data's vocabulary (no
`model.vocab_size` override, as `make run`'s `--set data.vocab_size=512`) writes timing.json with the runs' trainable
counts. Trained in this process (`runner.execute_inline`, 4 steps on the 300-story corpus), 10 timing rounds."""
from __future__ import annotations
import functools, json

from oelm_nb.lab import runner
from oelm_nb.lab.study import SMALL_CORPUS, studies
from oelm_nb.studies.qk_freeze.study import interleaved_timing, h3_answer, load_timing


def test_timing_json_has_the_runs_trainable_counts(tmp_path, monkeypatch):
    monkeypatch.setattr(studies()['qk-freeze'], 'after_batch', functools.partial(interleaved_timing, steps=10, warmup=1))
    corpus = {k: v for k, v in SMALL_CORPUS.items() if k != 'model.vocab_size'}  # the model takes the data's vocabulary
    lines = []
    res = runner.run_study('qk-freeze', variants=['oelm', 'oelm-freeze'], seeds=[0], steps=4, overrides=corpus,
                           out_dir=tmp_path / 'b', execute=runner.execute_inline, report=False, log=lines.append)
    assert not res.failed, lines
    runs = {v: json.loads((tmp_path / 'b' / f'{v}-s0' / 'summary.json').read_text())['params']['trainable']
            for v in ('oelm', 'oelm-freeze')}
    vocab = json.loads((tmp_path / 'b' / 'data' / 'meta.json').read_text())['vocab_size']
    assert vocab != 2048  # the tiny preset's: the runs' models differ from the preset's
    t = load_timing(tmp_path / 'b')
    assert t.trainable_params.to_dict() == runs and t.runs_trainable_params.to_dict() == runs, (t, runs)
    assert (t.vocab_size == vocab).all() and (t.rounds == 10).all() and len(t.loc['oelm-freeze', 'ratios']) == 10
    a = h3_answer(t)
    assert f"oelm {runs['oelm']:,} and oelm-freeze {runs['oelm-freeze']:,} trainable, as the runs" in a.method, a.method
    assert a.low <= a.value <= a.high and a.n == 10
