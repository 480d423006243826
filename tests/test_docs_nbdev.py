"""nbdev's own docs path: what `nbdev_docs` runs before Quarto renders (nbdev's exec_show_docs: the exported cells, every
cell with an import and the show_doc cells, alone in a fresh shell) passes on every chapter.

`make nbtest` (tools/build_docs.py --check-only) runs it on every chapter, after nbdev's test_nb, in the same fresh process
(build_docs.exec_show_docs_check), so a chapter that would break `nbdev_docs` fails `make test` there, naming the cell. Here:
that the check is in the processing every chapter goes through, and a negative control: a chapter with an import mixed into
a code cell fails it, as it fails nbdev's own processors, and passes both once the import has a cell of its own."""
from __future__ import annotations
import json, subprocess, sys, textwrap
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / 'tools'))
import build_docs as bd  # noqa: E402


def chapter(path: Path, mixed: bool) -> Path:
    "A chapter that exports a function and tests it; `mixed`: the test's import shares the cell with the test."
    test = ['from fastcore.test import test_close\ntest_close(area(r), 4 * math.pi)'] if mixed else \
           ['from fastcore.test import test_close', 'test_close(area(r), 4 * math.pi)']
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_markdown_cell('# Circles\n\n> A chapter for the docs check'),
        nbformat.v4.new_code_cell('#| export\nimport math'),
        nbformat.v4.new_code_cell('#| export\ndef area(r):\n    "The area of a circle of radius `r`."\n    return math.pi * r * r'),
        nbformat.v4.new_code_cell('r = 2.0'),
        *map(nbformat.v4.new_code_cell, test)])
    nb.metadata['kernelspec'] = {'name': 'python3', 'display_name': 'Python 3', 'language': 'python'}
    path.write_text(nbformat.writes(nb))
    return path


PROBE = textwrap.dedent('''
    import json, sys
    sys.path.insert(0, 'tools')
    import build_docs as bd
    from execnb.nbio import read_nb
    from fastcore.xtras import working_directory
    from nbdev.process import NBProcessor
    from nbdev.processors import FilterDefaults
    out = {}
    for src in sys.argv[1:]:
        try: bd.process_notebook(src, src + '.proc', execute=True); ours = 'ok'
        except bd.DocsBuildError as e: ours = str(e)
        try:  # nbdev's own processors, exec_show_docs included, as nbdev_proc_nbs (nbdev_docs) runs them
            with working_directory('nbs'): NBProcessor(nb=read_nb(src), procs=FilterDefaults().procs()).process()
            nbdev = 'ok'
        except Exception as e: nbdev = f'{e} <- {e.__cause__!r}'
        out[src] = {'check': ours, 'nbdev': nbdev}
    print(json.dumps(out))
''')


def test_the_notebook_check_runs_nbdevs_exec_show_docs():
    "Every chapter `make nbtest` processes goes through nbdev's exec_show_docs as nbdev_docs runs it, then show_doc."
    procs = bd.docs_procs(shell=object())
    assert bd.exec_show_docs_check in procs and issubclass(bd.exec_show_docs_check, bd.exec_show_docs)
    assert procs.index(bd.exec_show_docs_check) + 1 == procs.index(next(p for p in procs if p.__name__ == 'show_docs_in_test_shell'))
    assert bd.exec_show_docs not in procs and bd.exec_show_docs in bd.docs_procs()  # a notebook not run: nbdev's own


def test_a_chapter_mixing_an_import_with_code_fails_the_docs_check(tmp_path):
    "Negative control: nbdev's exec_show_docs runs the mixed cell without `r = 2.0` (no import there): NameError."
    mixed, split = chapter(tmp_path / 'mixed.ipynb', True), chapter(tmp_path / 'split.ipynb', False)
    r = subprocess.run([sys.executable, '-c', PROBE, str(mixed), str(split)], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    bad, good = res[str(mixed)], res[str(split)]
    assert good == {'check': 'ok', 'nbdev': 'ok'}, good
    assert 'NameError' in bad['nbdev'] and "name 'r' is not defined" in bad['nbdev'], bad['nbdev']  # nbdev_docs fails
    assert '`nbdev_docs` would fail' in bad['check'] and "NameError: name 'r' is not defined" in bad['check'], bad['check']
    assert bd.MIXED_HINT in bad['check'] and 'test_close(area(r), 4 * math.pi)' in bad['check']
    assert (tmp_path / 'split.ipynb.proc').exists() and not (tmp_path / 'mixed.ipynb.proc').exists()
