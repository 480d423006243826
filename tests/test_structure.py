"""The package's design, checked: the import contract (.importlinter) holds, and it can fail.

`make test` runs `lint-imports` on the package itself; these tests show that each kind of contract in it catches the
break it is there for, on a copy of the package with one bad import added."""
from __future__ import annotations
import shutil, subprocess, sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LINT = Path(sys.executable).with_name('lint-imports')


def lint(tmp_path: Path, bad_module: str | None = None, code: str = '') -> subprocess.CompletedProcess:
    "lint-imports with the project's contract on a copy of oelm_nb, `code` written into `bad_module` (a dotted name)."
    pkg = tmp_path / 'oelm_nb'
    shutil.copytree(ROOT / 'oelm_nb', pkg, ignore=shutil.ignore_patterns('__pycache__'))
    shutil.copy(ROOT / '.importlinter', tmp_path / '.importlinter')
    if bad_module:
        f = tmp_path / (bad_module.replace('.', '/') + '.py')
        f.write_text(code)
    return subprocess.run([str(LINT), '--no-cache', '--no-logo'], cwd=tmp_path, capture_output=True, text=True,
                          env={'PYTHONPATH': str(tmp_path), 'PATH': str(Path(sys.executable).parent)})


def test_the_contract_holds_and_states_the_design(tmp_path):
    r = lint(tmp_path)
    assert r.returncode == 0, r.stdout[-3000:]
    for name in ('The package layers', 'Each study knows no other study', 'Reports and the base layer run without torch'):
        assert name in r.stdout
    layers = (ROOT / '.importlinter').read_text().split('[importlinter:contract:layers]')[1].split('\n\n')[0]
    rows = [l for l in layers.splitlines() if l.startswith('    oelm_nb.')]
    assert len(rows) <= 8, rows


@pytest.mark.parametrize('module, code, broken', [
    ('oelm_nb.base.heavy', 'import torch\n', 'Reports and the base layer run without torch'),
    ('oelm_nb.report.heavy', 'from oelm_nb.train import memory\n', 'The package layers'),  # siblings
    ('oelm_nb.lab.knows_a_study', 'from oelm_nb.studies.qk_freeze import study\n', 'The package layers'),
    ('oelm_nb.studies.pca.peek', 'from oelm_nb.studies.cvfp import method\n', 'Each study knows no other study'),
    # a new study is in the contract without editing it (`oelm_nb.studies.*`)
    ('oelm_nb.studies.toy', 'from oelm_nb.studies.pca import study\n', 'Each study knows no other study'),
    ('oelm_nb.studies.cvfp.upward', 'pass\n', None),
])
def test_each_contract_catches_its_break(tmp_path, module, code, broken):
    "torch in base, a report importing training, the framework importing a study, a study importing another."
    r = lint(tmp_path, module, code)
    if broken is None:
        assert r.returncode == 0, r.stdout[-3000:]  # the control: an innocent module breaks nothing
    else:
        assert r.returncode != 0 and f'{broken}' in r.stdout.split('Broken contracts')[-1], r.stdout[-3000:]
