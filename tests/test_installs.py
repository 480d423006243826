"""Installs as users have them: torch's version with a local label (PyTorch's wheels: `2.13.0+cu130`, `2.13.0+cpu`) or
without one (PyPI's metadata), a CUDA build on a machine without a GPU, the torch build chosen in the Makefile, and the
Pythons the package promises.

Every place the package checks a version, each fed the three forms of one release:
- `same_release` (oelm_nb.app.doctor): two versions of one release, whatever their labels;
- `torch_build`: the build a version names (cpu, cuda 13.0), from its label or torch.version.cuda;
- `check_packages`: each requirement's range (packaging's SpecifierSet, local labels allowed) and the torch imported
  being the torch installed (PyPI's metadata says 2.13.0 of the torch whose __version__ is 2.13.0+cu130);
- `check_torch`: the build named, and a CUDA build without a GPU warned about (`build_mismatch`);
- `_environment_problems` and `torch_install_command`: the fixes, which pin the release without its label.
(The tools compare no versions: tools/build_docs.py hashes nbdev's, execnb's and Python's into its cache key.)"""
from __future__ import annotations
import configparser, json, re, subprocess, sys
from pathlib import Path

import pytest
import torch

import oelm_nb.app.doctor as D
from oelm_nb.app.cli import main

ROOT = Path(__file__).resolve().parent.parent
VERSIONS = {'2.13.0+cu130': ('13.0', 'cuda 13.0'), '2.13.0+cpu': (None, 'cpu'), '2.13.0': (None, 'cpu')}
CPU = D.Machine(torch.device('cpu'), ROOT)


@pytest.fixture
def installed(monkeypatch):
    "Make the installed torch look like `version` (torch.__version__, torch.version.cuda, the distribution's metadata)."
    def fake(version: str, cuda: str | None, dist: str | None = None, driver: bool = False, devs=()):
        monkeypatch.setattr(torch, '__version__', version)
        monkeypatch.setattr(torch.version, 'cuda', cuda)
        real = D._version
        monkeypatch.setattr(D, '_version', lambda n: (dist or version) if n == 'torch' else real(n))
        monkeypatch.setattr(D.shutil, 'which', lambda cmd, *a, **k: '/usr/bin/nvidia-smi' if driver and cmd == 'nvidia-smi' else None)
        monkeypatch.setattr(D, 'devices', lambda: list(devs))
        monkeypatch.setattr(D, 'cuda_build_bytes', lambda dist='torch': int(4.3 * D.GiB))
    return fake


@pytest.mark.parametrize('version', VERSIONS)
def test_version_checks_understand_local_labels(version):
    cuda, build = VERSIONS[version]
    assert D.same_release(version, '2.13.0') and D.same_release('2.13.0', version) and D.same_release(version, '2.13.0+cpu')
    assert not D.same_release(version, '2.12.0') and not D.same_release(version, '2.13.1+cu130')
    assert D.torch_build(version, cuda) == build
    assert D.torch_build(version, '13.0') == ('cpu' if version.endswith('+cpu') else 'cuda 13.0')  # the label decides
    assert D.torch_install_command(D.CPU_INDEX, version).endswith(f'TORCH_INDEX={D.CPU_INDEX}') or \
        D.torch_install_command(D.CPU_INDEX, version).endswith(f'torch==2.13.0 --index-url {D.CPU_INDEX}')


@pytest.mark.parametrize('version', VERSIONS)
def test_the_fixes_pin_the_release_without_its_label(version, monkeypatch):
    monkeypatch.setattr(D.sys, 'prefix', '/opt/some-env')  # not this checkout's .venv: the pip form
    cmd = D.torch_install_command(D.CPU_INDEX, version)
    assert cmd == f'pip install --force-reinstall torch==2.13.0 --index-url {D.CPU_INDEX}', cmd


@pytest.mark.parametrize('dist', ['same', '2.13.0'], ids=['metadata-with-label', 'metadata-without-label'])
@pytest.mark.parametrize('version', VERSIONS)
def test_packages_check_passes_and_names_the_build(version, dist, installed):
    cuda, build = VERSIONS[version]
    installed(version, cuda, dist=version if dist == 'same' else dist)
    summary, figs = D.check_packages(CPU)
    assert figs['torch_build'] == build and f'torch {version} ({build} build)' in summary, summary


@pytest.mark.parametrize('version', VERSIONS)
def test_packages_check_fails_when_the_torch_imported_is_another_release(version, installed):
    installed(version, VERSIONS[version][0], dist='2.12.0')
    c = D.run_check('packages', D.check_packages, CPU)
    assert c.status == 'failed' and f'the torch imported ({version}' in c.error and 'is not the torch installed (2.12.0)' in c.error


@pytest.mark.parametrize('version', VERSIONS)
def test_torch_check_names_the_build_and_warns_on_a_cuda_build_without_a_gpu(version, installed):
    cuda, build = VERSIONS[version]
    installed(version, cuda)
    c = D.run_check('torch', D.check_torch, CPU)
    assert c.status == 'ok' and f'torch {version} ({build} build)' in c.summary and c.figures['build'] == build
    if build == 'cpu': assert not c.warning and not c.fix and 'cuda_build_gib' not in c.figures
    else:
        assert f'torch {version} is a cuda 13.0 build, 4.3 GiB on disk' in c.warning and 'without an NVIDIA GPU' in c.warning
        assert c.fix.endswith(f'TORCH_INDEX={D.CPU_INDEX}') or c.fix.endswith(f'--index-url {D.CPU_INDEX}')
        assert c.figures['cuda_build_gib'] == 4.3


@pytest.mark.parametrize('version', VERSIONS)
def test_a_build_that_fits_the_machine_is_not_warned_about(version, installed):
    cuda = VERSIONS[version][0] or '13.0'  # the CUDA build of each form (PyPI's 2.13.0 says its CUDA in torch.version)
    installed(version.replace('+cpu', '+cu130'), cuda, devs=[{'index': 0, 'name': 'GPU', 'memory_gib': 80.0, 'capability': '9.0'}])
    c = D.run_check('torch', D.check_torch, CPU)
    assert c.status == 'ok' and not c.warning, c


@pytest.mark.parametrize('version', ['2.13.0+cpu', '2.13.0'])
def test_a_cpu_build_on_a_machine_with_a_gpu_fails_with_the_fix(version, installed):
    installed(version, None, driver=True)
    c = D.run_check('torch', D.check_torch, CPU)
    assert c.status == 'failed' and f'torch {version} is a cpu build: every run trains on the CPU' in c.error
    assert D.CUDA_INDEX in c.fix


def test_doctor_reports_a_cuda_build_without_a_gpu_with_its_fix(installed, tmp_path, capsys):
    "The console table and --json: the check passes, with the warning, its size and the one-line fix; exit status 0."
    installed('2.13.0+cu130', '13.0', dist='2.13.0')
    out = tmp_path / 'doctor.json'
    assert main(['doctor', '--check', 'packages', '--check', 'torch', '--device', 'cpu', '--json', str(out)]) == 0
    text = capsys.readouterr().out
    assert 'torch 2.13.0+cu130 (cuda 13.0 build)' in text and 'warning: torch 2.13.0+cu130 is a cuda 13.0 build, 4.3 GiB' in text
    assert re.search(r'fix: .*download\.pytorch\.org/whl/cpu', ' '.join(text.split()))
    assert '2 ok, 0 failed, 0 skipped, 1 warning(s) (torch)' in text
    rep = json.loads(out.read_text())
    assert rep['warnings'] == ['torch'] and rep['checks'][1]['warning'].startswith('torch 2.13.0+cu130 is a cuda 13.0 build')


def _make_n(*args) -> str:
    "The commands `make setup` would run (make -n -B: printed, not run)."
    return subprocess.run(['make', '-n', '-B', '.venv/.oelm-installed', *args], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout


def test_make_setup_installs_torch_from_the_index_chosen():
    cpu = _make_n('TORCH_INDEX=https://download.pytorch.org/whl/cpu')
    assert 'install --no-compile "torch==2.13.0" --index-url "https://download.pytorch.org/whl/cpu"' in cpu
    pinned = _make_n('TORCH_PIN=torch==2.13.0+cu130', 'TORCH_INDEX=https://download.pytorch.org/whl/cu130')
    assert 'install --no-compile "torch==2.13.0+cu130" --index-url "https://download.pytorch.org/whl/cu130"' in pinned
    assert '--index-url' not in _make_n()  # pip's own index, as before


def test_the_python_promise_is_one_and_test_pythons_covers_it():
    "settings.ini min_python, pyproject's requires-python, setup.py's classifiers and the Pythons make test-pythons tries agree."
    cfg = configparser.ConfigParser(); cfg.read(ROOT / 'settings.ini')
    min_python = cfg['DEFAULT']['min_python']
    assert f'requires-python=">={min_python}"' in (ROOT / 'pyproject.toml').read_text()
    assert sys.version_info[:2] >= tuple(map(int, min_python.split('.')))
    r = subprocess.run(['make', 'test-pythons', 'PYTHONS=2.1'], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and re.search(r'2\.1\s+not found', r.stdout), r.stdout + r.stderr
    script = (ROOT / 'tools' / 'test_pythons.sh').read_text()
    assert 'all="3.10 3.11 3.12 3.13"' in script and "'3.10 3.11 3.12 3.13'" in (ROOT / 'setup.py').read_text()
