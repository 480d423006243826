"""A study of one's own: one folder (a package with a `Study`) plus one registration (an entry point in group
`oelm_nb.studies`), run end to end by `oelm run`, its flags generated from a dataclass. Nothing in oelm_nb changes."""
from __future__ import annotations
import json, os, subprocess, sys, textwrap
from pathlib import Path

import nbformat
import pytest

TOY = '''
"""A toy study: does a second layer help on a tiny story corpus?"""
from dataclasses import dataclass
from pathlib import Path
from oelm_nb.lab.experiment import Study, Variant, NoSettings, train_run
from oelm_nb.report.evidence import Answer
from oelm_nb.report.tables import compare

@dataclass
class ToyOptions:
    """The toy study's flags."""
    depths: list[int] | None = None
    """model depths to compare, the first the reference (default: [1, 2])"""

def variants(preset: str, steps: int, options: dict) -> dict:
    return {f'depth-{n}': Variant({'model.n_layer': n}) for n in options.get('depths') or [1, 2]}

def answers(runs) -> list:
    names = sorted(runs.variant.unique())
    if len(names) < 2: return [Answer('T1', 'does depth change val PPL?', 'no data')]
    c = compare(runs, names[-1], names[0], 'best_val_ppl')
    return [Answer('T1', f'{names[-1]} vs {names[0]}: val PPL', 'inconclusive', f'{c.mean:+.2%}', seeds=f'{c.n} seeds')]

STUDY = Study('toy', 'Does a second layer help on a tiny story corpus?', NoSettings, variants, run=train_run,
              train={'tiny': dict(max_steps=12, batch_size=4, lr=5e-3, min_lr=5e-4, warmup_steps=2, eval_every=6,
                                  eval_batches=2, log_every=3)},
              data={'tiny': dict(vocab_size=300, n_train_stories=150, n_val_stories=20)},
              options=ToyOptions, default_seeds=(0, 1), report=str(Path(__file__).with_name('report.ipynb')),
              answers=answers)
'''

REPORT = [('run_dir = "runs/toy"', ['parameters']),
          ('from oelm_nb.report.tables import load_runs, variant_table, safe_table\n'
           'from oelm_nb.report.evidence import answers_frame\n'
           'from oelm_nb.lab.experiment import get_study\n'
           'runs = load_runs(run_dir)\n'
           "display(safe_table(answers_frame(get_study('toy').answers(runs))))\n"
           'display(safe_table(variant_table(runs)))', [])]


def make_toy(root: Path) -> dict:
    "The folder and the registration, as a lab would write them; returns the environment that sees them."
    pkg = root / 'toy_study'
    pkg.mkdir()
    (pkg / '__init__.py').write_text(TOY)
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell('# The toy study')] +
                                  [nbformat.v4.new_code_cell(src, metadata={'tags': tags}) for src, tags in REPORT])
    nb.metadata['kernelspec'] = {'name': 'python3', 'display_name': 'Python 3', 'language': 'python'}
    nbformat.write(nb, pkg / 'report.ipynb')
    # the registration: what `pip install` of a package declaring the entry point writes
    dist = root / 'toy_study-0.1.dist-info'
    dist.mkdir()
    (dist / 'METADATA').write_text('Metadata-Version: 2.1\nName: toy-study\nVersion: 0.1\n')
    (dist / 'entry_points.txt').write_text('[oelm_nb.studies]\ntoy = toy_study:STUDY\n')
    return {**os.environ, 'PYTHONPATH': os.pathsep.join([str(root), os.environ.get('PYTHONPATH', '')]).rstrip(os.pathsep)}


def oelm(*args, env):
    return subprocess.run([str(Path(sys.executable).with_name('oelm')), *args], capture_output=True, text=True, env=env,
                          timeout=600)


def test_its_flags_are_generated_from_its_dataclass(tmp_path):
    env = make_toy(tmp_path)
    h = oelm('run', 'toy', '--help', env=env)
    assert h.returncode == 0, h.stderr
    assert '--depths' in h.stdout and 'model depths to compare, the first the reference' in h.stdout
    assert '--seeds' in h.stdout and '--set' in h.stdout  # the flags every study shares
    assert 'toy' in oelm('run', '--help', env=env).stdout
    bad = oelm('run', 'toy', '--depths', '[1, "x"]', '--out', str(tmp_path / 'never'), env=env)
    assert bad.returncode == 2 and 'depths' in bad.stderr and not (tmp_path / 'never').exists()
    typo = oelm('run', 'toy', '--depht', '[1]', '--out', str(tmp_path / 'never'), env=env)
    assert typo.returncode == 2 and 'depht' in typo.stderr


@pytest.mark.slow  # trains 4 tiny runs and renders a report (~1 min on 2 cores)
def test_a_new_study_is_one_folder_and_one_registration(tmp_path):
    env = make_toy(tmp_path)
    out = tmp_path / 'runs'
    r = oelm('run', 'toy', '--depths', '[1, 2]', '--out', str(out), '--jobs', '2', env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    statuses = {d.name: json.loads((d / 'summary.json').read_text())['status'] for d in out.glob('depth-*')}
    assert statuses == {'depth-1-s0': 'completed', 'depth-1-s1': 'completed', 'depth-2-s0': 'completed',
                        'depth-2-s1': 'completed'}
    cfg = json.loads((out / 'depth-2-s0' / 'config.json').read_text())
    assert cfg['model']['n_layer'] == 2 and cfg['origins']['model.n_layer'] == 'variant'
    assert cfg['origins']['train.max_steps'] == 'study'
    assert 'T1 ' in r.stdout and 'depth-2 vs depth-1: val PPL' in r.stdout  # the console's answers
    html = (out / 'report.html').read_text()
    assert 'depth-2 vs depth-1: val PPL' in html and 'depth-1' in html
