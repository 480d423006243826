"""A study of one's own: one folder (a package with a `Study`) plus one registration (an entry point in group
`oelm_nb.studies`), run end to end by `oelm run`, its flags generated from a dataclass. Nothing in oelm_nb changes.

The study is tests/toy_study, registered by tests/toy_study-0.1.dist-info (the suites run with tests/ on sys.path).
Here `oelm` runs in this process (`oelm_main`, `oelm_inline`): what is under test is that the registry, the flags, the
runner and the report take a study they have never seen. A fresh process finding the entry point on its own path is
checked once, by `oelm run toy --help` in a subprocess."""
from __future__ import annotations
import json, os, subprocess, sys
from pathlib import Path

import pytest
from cli_helpers import oelm_cmd, oelm_main, oelm_inline

HERE = Path(__file__).parent


def test_it_is_registered_by_its_entry_point_alone():
    from importlib import metadata
    from oelm_nb.lab.study import study_names, get_study
    eps = {ep.name: ep.value for ep in metadata.entry_points(group='oelm_nb.studies')}
    assert eps.get('toy') == 'toy_study:TOY' and 'toy' in study_names()
    assert get_study('toy').report == str(HERE / 'toy_study' / 'report.ipynb')
    # another process sees it where its path holds the folder and the registration, as after `pip install`
    env = {**os.environ, 'PYTHONPATH': os.pathsep.join([str(HERE), os.environ.get('PYTHONPATH', '')]).rstrip(os.pathsep)}
    r = subprocess.run(oelm_cmd('run', 'toy', '--help'), capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0 and get_study('toy').description in ' '.join(r.stdout.split()), r.stdout + r.stderr


def test_its_flags_are_generated_from_its_dataclass(tmp_path):
    h = oelm_main('run', 'toy', '--help')
    assert h.returncode == 0, h.stderr
    assert '--depths' in h.stdout and 'model depths to compare, the first the reference' in h.stdout
    assert '--seeds' in h.stdout and '--set' in h.stdout  # the flags every study shares
    assert 'toy' in oelm_main('run', '--help').stdout
    bad = oelm_main('run', 'toy', '--depths', '[1, "x"]', '--out', str(tmp_path / 'never'))
    assert bad.returncode == 2 and 'depths' in bad.stderr and not (tmp_path / 'never').exists()
    typo = oelm_main('run', 'toy', '--depht', '[1]', '--out', str(tmp_path / 'never'))
    assert typo.returncode == 2 and 'depht' in typo.stderr


@pytest.mark.slow  # trains 4 tiny runs (in-process) and renders a report with papermill
def test_a_new_study_is_one_folder_and_one_registration(tmp_path):
    out = tmp_path / 'runs'
    r = oelm_inline('run', 'toy', '--depths', '[1, 2]', '--out', str(out))
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
