"""The CVFP fixed-point page (nbs/reports/cvfp_fixed_point.ipynb) executed as papermill would (in-process) on a tiny batch that holds the
`embed` run: its tables are there and hold numbers computed from the batch, and the command-line tool gives the same."""
from __future__ import annotations
import contextlib, io, json, re, sys
from pathlib import Path

import pytest
from shared_runs import inline_batch, execute_inline_notebook

pytestmark = pytest.mark.slow  # an embed run of 20 steps, the page, the tool: about 15 s (more on a loaded machine)

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / 'nbs' / 'reports' / 'cvfp_fixed_point.ipynb'
PARAMS = {'samples': 2, 'val_tokens': 300, 'iterations': 6, 'algorithms': ['MCDL'], 'curve_rows': ['default', 'settled'],
          'study_rows': ['default'], 'phase2_epochs': 1}


def html_tables(nb: dict) -> list[str]:
    "The HTML tables the executed page displays, in order."
    return [''.join(o['data']['text/html']) for c in nb['cells'] if c['cell_type'] == 'code'
            for o in c.get('outputs', []) if '<table' in ''.join(o.get('data', {}).get('text/html', ''))]


def test_page_computes_its_tables_from_the_batch(tmp_path):
    batch = inline_batch(tmp_path / 'cvfp-fp', 'cvfp', variants=['embed'], steps=20)
    assert (batch / 'embed-s0' / 'embedding.safetensors').is_file()
    out = tmp_path / 'page.ipynb'
    # executed as papermill executes it, in a fork of this process (the page's content is the subject, not the kernel)
    error = execute_inline_notebook(PAGE, out, tmp_path, {'run_dir': str(batch), **PARAMS})
    assert error is None, error
    nb = json.loads(out.read_text())
    text = json.dumps(nb)
    tables = html_tables(nb)
    curves = next(t for t in tables if 'lowest mean cos' in t)
    study = next(t for t in tables if 'val PPL before' in t)
    for row in PARAMS['curve_rows']: assert f'>{row}<' in curves
    numbers = lambda t: [float(x) for x in re.findall(r'>\s*(-?\d+\.\d+)\s*<', t)]
    assert len(numbers(curves)) >= 2 * 8 and all(-1.0001 <= x <= 1.0001 for x in numbers(curves)[:2])  # mean, min cos
    assert re.search(r'\d+\.\d{2} → \d+\.\d{2}', study), 'the validation PPL before and now'
    assert re.search(r'\d+\.\d{4} → 1\.0000', study), "the cache now is the sequential pass: it agrees with it"
    assert f'{PARAMS["samples"]} training stories' in text and 'curves end at the fixed point' in text
    assert str(batch.resolve()) in text  # the batch it read is named
    # the tool runs the same computation: its last curve record is the page's last iteration (its main, in-process: the
    # computation is the subject, not the interpreter it starts in)
    sys.path.insert(0, str(ROOT / 'tools'))
    try: import cvfp_fixed_point as tool
    finally: sys.path.remove(str(ROOT / 'tools'))
    out = io.StringIO()
    with contextlib.redirect_stdout(out): tool.main(['curves', str(batch), '--samples', '2', '--iterations', '6'])
    last = json.loads(out.getvalue().splitlines()[-1])
    assert last['iteration'] == 5 and f"{last['cos_mean']:.4f}" in curves
