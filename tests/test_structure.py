"""The package's structure, checked: the layer contract (import-linter), a torch-free report layer, module sizes."""
from __future__ import annotations
import subprocess, sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize('module', ['oelm_nb.core', 'oelm_nb.rundir', 'oelm_nb.metrics', 'oelm_nb.report'])
def test_the_report_layer_imports_no_torch(module):
    "A report reads run directories on a machine without a GPU stack: these modules import no torch, directly or not."
    code = f"import sys, {module}; bad = [m for m in ('torch',) if m in sys.modules]; assert not bad, bad"
    r = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]


def test_a_torch_import_would_be_caught(tmp_path):
    "The check above can fail: a module that imports torch is reported."
    (tmp_path / 'heavy.py').write_text('import torch\n')
    code = "import sys, heavy; assert 'torch' not in sys.modules"
    r = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode != 0
