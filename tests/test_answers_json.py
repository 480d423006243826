"""answers.json holds numbers as numbers and `oelm report` rewrites it with report.html (issue 46): a Q/K freeze batch
written by hand, its report rendered with the notebook execution stubbed (the page is not what is tested here)."""
from __future__ import annotations
import json, math

import numpy as np

from fake_runs import fake_batch, fake_run

STEPS = np.arange(300, 1801, 300)  # 6 evaluations: too few to backtest, so no slow fits


def qk_batch(root):
    "4 seeds of gpt, oelm and oelm-freeze; gpt and oelm form the recall circuit, oelm-freeze never does."
    ppl = {'gpt': [10.0, 10.1, 10.2, 10.3], 'oelm': [10.4, 10.3, 10.6, 10.5], 'oelm-freeze': [11.0, 10.9, 11.4, 11.2]}
    root = fake_batch(root, 'qk-freeze', {v: (lambda s: False) for v in ppl}, seeds=range(4))
    for v, ps in ppl.items():
        for s, p in enumerate(ps):
            rec = 0.05 + (0.0 if v == 'oelm-freeze' else 0.75) * (STEPS >= 300 + 300 * s)
            recs = [{'step': int(k), 'tokens': int(k) * 1024, 'val_loss': math.log(p) + 2 * math.exp(-k / 300),
                     'recall_acc': float(r)} for k, r in zip(STEPS, rec)]
            fake_run(root, v, s, {'status': 'completed', 'steps': 1800, 'tokens': 1800 * 1024, 'best_val_ppl': p,
                                  'recall_chance': 0.05, 'recall_acc': float(rec[-1]),
                                  'params_trainable': 930 if v == 'oelm-freeze' else 1000}, recs)
    return root


def test_oelm_report_rewrites_answers_json_with_numbers(tmp_path, monkeypatch):
    from oelm_nb.lab import render
    root = qk_batch(tmp_path / 'b')
    (root / 'answers.json').write_text(json.dumps({'study': 'qk-freeze', 'answers': [{'qid': 'H2', 'estimate': '+9%'}]}))
    monkeypatch.setattr(render, 'execute_report', lambda nb_in, nb_out, batch_dir: None)  # the notebook's step: not the subject
    monkeypatch.setattr(render, 'report_html', lambda nb: '<html><head></head><body></body></html>')
    render.render_report(root, log=lambda *a: None)
    stored = json.loads((root / 'answers.json').read_text())
    got = {a['qid']: a for a in stored['answers']}
    assert stored['study'] == 'qk-freeze' and list(got) == ['H1', 'H2', 'H3', 'H4', 'R1', 'R2', 'H2-trend', 'H4-trend']  # the stale one is gone
    h2 = got['H2']
    assert all(isinstance(h2[k], float) for k in ('estimate', 'low', 'high', 'p')) and h2['n'] == 4
    assert h2['estimate_text'] == f"{h2['estimate']:+.1%}" and h2['low'] < h2['estimate'] < h2['high']
    # all 4 seeds above 5%: the claim is 'rejected' (the gap is above its margin), and p is that claim's t-test; it
    # reaches 5% alone (doubled: 0.04) but not after Holm over the family, so the answer claims nothing
    assert (h2['side'], h2['test']) == ('greater', 't-test (paired)') and 2 * h2['p'] <= 0.05 < h2['p_holm']
    assert h2['verdict'] == 'inconclusive' and any("'rejected' alone" in c for c in h2['caveats'])
    assert h2['sides'] == 'one-sided, non-inferiority with margin 5%'
    assert got['R2']['sides'].startswith('one-sided, later') and got['R2']['p_holm'] >= got['R2']['p']
    assert got['H1']['p'] == 0.0 and got['H1']['test'].startswith('exact count')  # a count: no sampling
    r2 = got['R2']  # oelm formed it in 4 of 4 seeds, oelm-freeze in none: within seed, one-sided p = 1/16
    assert (r2['estimate'], r2['p'], r2['n']) == (None, 0.0625, 8)
    assert r2['verdict'] == 'undecidable with 4 seeds: oelm-freeze later in 4, earlier in 0 of 4'
    # every oelm run formed it: the estimate is oelm-freeze's delay, its censored runs bounds (1,800 minus 300..1,200)
    assert r2['estimate_text'].startswith('delay of oelm-freeze behind oelm: at least +1,050 steps (median over 4 seeds')
    assert (r2['low'], r2['high']) == (600.0, None) and r2['interval'].startswith('at least 87.5% interval +600 .. no upper end')
    assert 'formed within 1,800 steps: oelm-freeze 0 of 4 vs oelm 4 of 4' in r2['caveats']
