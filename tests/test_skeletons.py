"""The shared skeletons of issue 39: every experiment notebook is parameters, `run_in_notebook`, `plot_run`; every
report notebook opens with `open_report` and ends with `provenance_footer`; every study draws a run through its
`Study.plot` hook. A study without a report notebook or a plot (both optional) is skipped or draws nothing."""
from __future__ import annotations
import json, re
from pathlib import Path

import matplotlib
matplotlib.use('Agg')
import matplotlib.pyplot as plt
import pandas as pd
import pytest

from oelm_nb.lab.study import get_study, study_names
from oelm_nb.lab.spec import resolve_spec
from oelm_nb.lab.run import plot_run
from oelm_nb.report.tables import completed, fmt, mean_of, people_number

ROOT = Path(__file__).resolve().parent.parent
STUDIES = study_names()  # every registered study (entry points; tests/toy_study among them)


def code_cells(nb: Path) -> list[dict]:
    return [c for c in json.loads(nb.read_text())['cells'] if c['cell_type'] == 'code']


def src(c: dict) -> str: return ''.join(c['source'])


@pytest.mark.parametrize('study', STUDIES)
def test_experiment_notebook_is_the_skeleton(study):
    cells = code_cells(ROOT / 'nbs' / get_study(study).notebook)
    assert 'parameters' in cells[0]['metadata'].get('tags', [])
    for name in ('config', 'nproc', 'progress'):  # the names the runner passes
        assert f'\n{name} = ' in '\n' + src(cells[0]), name
    rest = [src(c) for c in cells[1:]]
    assert len(rest) == 3 and 'import run_in_notebook, plot_run' in rest[0], rest
    assert rest[1].startswith('spec, summary = run_in_notebook(config, example=')
    # its example names the study, or (a notebook several studies share: `Study.notebook`'s default) one that uses it
    example = re.search(r"study='([\w-]+)'", rest[1])[1]
    assert example == study or get_study(example).notebook == get_study(study).notebook, (study, example)
    assert rest[2].startswith('plot_run(spec, summary)')


@pytest.mark.parametrize('study', STUDIES)
def test_report_notebook_opens_and_closes_the_same_way(study):
    if get_study(study).report is None: pytest.skip(f'{study} has no report notebook (optional: `oelm run` prints its answers)')
    text = '\n'.join(src(c) for c in code_cells(ROOT / 'nbs' / get_study(study).report))
    assert text.count('open_report(run_dir, ') == 1 and text.count('provenance_footer(run_dir, ') == 1
    assert 'find_batch_dir' not in text and "status == 'completed'" not in text and 'filterwarnings' not in text
    assert '**Batch**' not in text  # the batch line is written once, in report.page.batch_line


def write_metrics(d: Path, recs: list[dict]):
    d.mkdir(parents=True, exist_ok=True)
    (d / 'metrics.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in recs))


@pytest.mark.parametrize('study', STUDIES)
def test_every_study_draws_a_run(tmp_path, study):
    variant = get_study(study).planned('tiny', 20)[0]  # the first run its batch would train
    spec = resolve_spec(study, variant, 'tiny', 0, 20, str(tmp_path / 'run'))
    recs = [{'step': s, 'train_loss': 3.0 - s / 10, 'ce_loss': 3.0, 'kv_cos': 0.5, 'kv_cos_centered': 0.4} for s in (1, 2)]
    recs[-1].update(val_loss=2.9, val_ppl=18.2, recall_acc=0.2, val_kv_cos=0.6, val_kv_cos_centered=0.45)
    write_metrics(tmp_path / 'run', recs)
    summary = {'trained': True, 'k': 4, 'recall_chance': 0.1, 'final_kv_cos': 0.6, 'final_kv_cos_centered': 0.45}
    before = len(plt.get_fignums())
    plot_run(spec, summary)  # draws (and shows, a no-op on Agg) without error; nothing for a study without `plot`
    assert len(plt.get_fignums()) >= before
    plt.close('all')


def test_one_filter_formatter_and_mean():
    runs = pd.DataFrame({'variant': ['a', 'b', 'b'], 'seed': [0, 0, 1], 'status': ['completed', 'failed', 'completed']})
    assert completed(runs).index.tolist() == [0, 2] and completed(runs, ['b']).seed.tolist() == [1]
    assert (fmt(None), fmt(float('nan'), '.2f', missing=''), fmt(0.5, '.1%')) == ('n/a', '', '50.0%')
    assert people_number(float('nan'), 'val_ppl') == '' and people_number(3.14159, 'val_ppl') == '3.142'
    assert mean_of([1.0, None, float('nan'), 2.0]) == 1.5 and mean_of([]) is None
    for mod in ('oelm_nb.studies.cvfp.guidelines', 'oelm_nb.studies.mercator.report', 'oelm_nb.studies.cvfp.report'):
        m = __import__(mod, fromlist=['x'])
        assert not hasattr(m, '_mean'), mod  # one mean: report.tables.mean_of
        assert getattr(m, 'fmt', fmt) is fmt  # the one formatter, where a module uses it
