"""JupyterLab as a researcher meets it: `make lab`'s server starts (as root too), saving a notebook without an edit
leaves its file unchanged (the project's save hook), and a report notebook runs from its own folder, as Lab runs it,
finding the batch under the project root."""
from __future__ import annotations
import json, os, shutil, socket, subprocess, sys, time, urllib.request
from pathlib import Path

import pytest
from shared_runs import copy_batch, execute_inline_notebook, qk_freeze_batch

pytestmark = pytest.mark.slow  # batches and processes end to end: `make test` runs them, `make test-fast` does not

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def _free_port() -> int:
    with socket.socket() as s: s.bind(('127.0.0.1', 0)); return s.getsockname()[1]


def _api(port, token, path, method='GET', body=None):
    req = urllib.request.Request(f'http://127.0.0.1:{port}/api/{path}', method=method, data=None if body is None else json.dumps(body).encode(),
                                 headers={'Authorization': f'token {token}', 'Content-Type': 'application/json'})
    with urllib.request.urlopen(req, timeout=30) as r: return r.status, json.loads(r.read() or b'null')


def _makefile_lab_flags() -> list[str]:
    "The flags `make lab` gives `jupyter lab`, read from the Makefile (so the test checks what users run)."
    line = next(l for l in (REPO / 'Makefile').read_text().splitlines() if 'jupyter lab ' in l)
    flags = line.split('jupyter lab ', 1)[1].split(' $$(')[0].split()
    allow_root = '--allow-root' in line and 'id -u' in line
    return [f.replace('tools/', f'{REPO}/tools/') for f in flags if not f.startswith('--notebook-dir')], allow_root


@pytest.fixture
def project(tmp_path):
    "A copy of the project's settings, two notebooks and a report in a temporary project root."
    root = tmp_path / 'proj'
    (root / 'nbs' / 'reports').mkdir(parents=True)
    shutil.copy(REPO / 'settings.ini', root / 'settings.ini')
    shutil.copy(REPO / 'nbs' / 'model' / '22_freeze.ipynb', root / 'nbs' / '02_freeze.ipynb')
    shutil.copy(REPO / 'nbs' / 'reports' / 'qk_freeze.ipynb', root / 'nbs' / 'reports' / 'qk_freeze.ipynb')
    return root


def test_lab_server_starts_and_saving_without_an_edit_changes_nothing(project):
    flags, allow_root = _makefile_lab_flags()
    assert allow_root, "make lab must pass --allow-root when run as root"
    port, token = _free_port(), 'oelm-test-token'
    cmd = [str(BIN / 'jupyter'), 'lab', '--no-browser', f'--port={port}', f'--ServerApp.token={token}', f'--notebook-dir={project / "nbs"}', *flags]
    if os.geteuid() == 0: cmd.append('--allow-root')
    proc = subprocess.Popen(cmd, cwd=project, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for _ in range(120):
            try:
                if _api(port, token, 'status')[0] == 200: break
            except OSError: time.sleep(0.5)
        else: pytest.fail('JupyterLab did not answer within 60 s')
        before = (project / 'nbs' / '02_freeze.ipynb').read_bytes()
        status, model = _api(port, token, 'contents/02_freeze.ipynb?content=1')
        assert status == 200 and model['type'] == 'notebook'
        nb = model['content']
        nb['metadata']['kernelspec']['display_name'] = 'Python 3 (ipykernel)'  # what Lab writes on save
        nb['metadata']['language_info'] = {'name': 'python', 'version': '3.11.7'}
        cell = next(c for c in nb['cells'] if c['cell_type'] == 'code')
        cell['execution_count'] = 7
        status, _ = _api(port, token, 'contents/02_freeze.ipynb', 'PUT', {'type': 'notebook', 'format': 'json', 'content': nb})
        assert status == 200
        after = (project / 'nbs' / '02_freeze.ipynb').read_bytes()
        assert after == before, 'saving through JupyterLab changed the notebook file'
        assert _api(port, token, 'contents/reports/qk_freeze.ipynb?content=0')[0] == 200  # the report opens too
        # a new notebook, as Lab's launcher makes one (Untitled.ipynb), then its first save: cleaned, no error in the log
        status, new = _api(port, token, 'contents', 'POST', {'type': 'notebook'})
        assert status == 201 and new['name'].startswith('Untitled'), new
        nb = {'nbformat': 4, 'nbformat_minor': 5, 'metadata': {'kernelspec': {'display_name': 'Python 3 (ipykernel)', 'language': 'python', 'name': 'python3'}},
              'cells': [{'cell_type': 'code', 'id': 'abc', 'metadata': {'collapsed': False}, 'execution_count': 3, 'source': '1 + 1',
                         'outputs': [{'output_type': 'execute_result', 'execution_count': 3, 'data': {'text/plain': '2'}, 'metadata': {}}]}]}
        (project / 'nbs' / new['path']).unlink()  # saved as a file that is not there yet (a rename, a save-as)
        assert _api(port, token, f"contents/{new['path']}", 'PUT', {'type': 'notebook', 'format': 'json', 'content': nb})[0] in (200, 201)
        saved = json.loads((project / 'nbs' / new['path']).read_text())
        assert saved['cells'][0]['execution_count'] is None and saved['metadata']['kernelspec']['display_name'] == 'python3', saved
    finally:
        proc.terminate()
        try: proc.wait(timeout=20)
        except subprocess.TimeoutExpired: proc.kill()
    log = proc.stdout.read()
    assert 'Traceback' not in log and 'Pre-save hook' not in log and 'Overriding existing pre_save_hook' not in log, log[-3000:]


def test_make_lab_opens_at_the_project_root_trusts_every_notebook_and_takes_lab_args():
    r = subprocess.run(['make', '-n', 'lab', 'LAB_ARGS=--port=8999 --ip=0.0.0.0 --no-browser'], cwd=REPO, capture_output=True, text=True)
    lines = r.stdout.splitlines()
    trust = next(l for l in lines if 'jupyter trust' in l)
    lab = next(l for l in lines if 'jupyter lab ' in l)
    assert 'find nbs -name' in trust and '*.ipynb' in trust  # every folder of nbs/, not a list of some
    assert '--notebook-dir=. ' in lab and lab.rstrip().endswith('--port=8999 --ip=0.0.0.0 --no-browser'), lab  # the root: runs/ visible


def test_report_notebook_runs_from_its_own_folder(project, tmp_path, tmp_path_factory, monkeypatch):
    """The report's opening (`open_report`, its first call) from the working directory JupyterLab uses (the notebook's
    folder) with the notebook's own run_dir, in-process; the batch is a copy of the session's shared Q/K freeze batch
    (tests/shared_runs.py) where `make run` puts its batch. Then papermill in that folder without a batch: the clear message."""
    from oelm_nb.report.page import open_report
    copy_batch(qk_freeze_batch(tmp_path_factory), project / 'runs' / 'qk-freeze', 'checkpoints')
    reports = project / 'nbs' / 'reports'
    nb = json.loads((reports / 'qk_freeze.ipynb').read_text())
    run_dir = next(''.join(c['source']) for c in nb['cells'] if 'parameters' in c['metadata'].get('tags', []))
    ns: dict = {}; exec(run_dir, ns)  # the notebook's own default, `runs/qk-freeze`
    monkeypatch.delenv('OELM_PROJECT', raising=False)
    monkeypatch.chdir(reports)
    found, batch, runs = open_report(ns['run_dir'], 'qk-freeze', 'run')
    assert found == (project / 'runs' / 'qk-freeze').resolve() and batch['study'] == 'qk-freeze'  # found under the project root
    assert set(runs.variant) == {'gpt', 'oelm-freeze'} and (runs.status == 'completed').all()
    # without a batch: the whole notebook, executed in that folder as papermill would (in a fork of this process: the
    # notebook's first cells are the subject, not a kernel's start), stops with a clear message saying what to run
    shutil.rmtree(project / 'runs')
    error = execute_inline_notebook(reports / 'qk_freeze.ipynb', tmp_path / 'out2.ipynb', reports, {})
    assert error is not None and 'Run `make run` (or `oelm run qk-freeze`) first' in error, error
