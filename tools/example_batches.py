#!/usr/bin/env python
"""Example batches for the docs site: each study's report executed on seconds-long runs.

The report pages of the site would otherwise show code without a single output. At docs time this
script runs one small batch per study (the tiny preset, a 300-story corpus with a 300-token
vocabulary, seeds 0 and 1 (`SEEDS`), a few dozen steps) in one process per study, each run called in-process
(`oelm_nb.lab.execute.execute_inline`, no notebook per run), and renders the study's report on it with
papermill, as `oelm run` does. The numbers on those pages show what the report computes; runs this
short answer nothing, and each page says so.

`report_page` runs a study's batch in a fresh process and turns its executed report into the page the docs show, cached.

Usage: python tools/example_batches.py STUDY OUT_DIR   (one batch; tools/build_docs.py calls it through report_page)
"""
from __future__ import annotations

import hashlib
import html
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SEEDS = (0, 1)  # the seeds of every example batch


def examples() -> dict[str, dict]:
    "study -> its example batch: the study's own smoke batch (`Study.smoke`, run_study keyword arguments on SMALL_CORPUS)."
    from oelm_nb.lab.study import studies
    return {name: st.smoke for name, st in studies().items() if st.smoke and st.report}


def describe(study: str) -> str:
    "One sentence for the page: what the example batch ran."
    ex = examples()[study]
    opts = ''.join(f", --{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}" for k, v in ex.get('options', {}).items())
    seeds = ' and '.join(map(str, SEEDS))
    if ex.get('variants'): opts += f", variants {', '.join(ex['variants'])}"
    return (f"the tiny preset, {ex['steps']} optimizer steps per run, seed{'s' if len(SEEDS) > 1 else ''} {seeds}{opts}, on a "
            f"300-story corpus with a 300-token vocabulary")


def run_example(study: str, out: Path, log=print):
    "Run the example batch of `study` into `out` (runs in this process) and render its report; returns the BatchResult."
    from oelm_nb.lab.runner import run_study
    from oelm_nb.lab.execute import execute_inline
    from oelm_nb.lab.study import SMALL_CORPUS
    ex = examples()[study]
    res = run_study(study, seeds=list(SEEDS), steps=ex['steps'], out_dir=out, options=ex.get('options'),
                    variants=ex.get('variants'),  # as tools/same_numbers.py reads `Study.smoke` (None: the study's own)
                    overrides={**SMALL_CORPUS, **ex.get('overrides', {})}, execute=execute_inline, report=True, log=log)
    if res.failed: raise RuntimeError(f"example batch {study}: run(s) {', '.join(res.failed)} did not complete; see {out}")
    return res


def report_studies() -> dict[str, str]:
    "Report notebook (relative to nbs/) -> its study."
    from oelm_nb.lab.study import studies
    return {st.report: name for name, st in studies().items() if st.report}


NOTE = ('<div class="admonition example"><p class="admonition-title">Executed on an example batch</p><p>This page is the '
        'report notebook executed when the site was built, on runs that take seconds: {what}. Every number is computed from '
        'those runs, so the page shows what the report computes; runs this short answer none of its questions. Run the study '
        '(<code>oelm run</code>, or <code>make run</code> for the Q/K freeze study) for a report that does. The code is in '
        "the notebook (<code>nbs/reports/</code>); here, as in a batch's <code>report.html</code>, only its output is shown.</p></div>")
_re_relative_anchor = re.compile(r'<a href="(?![a-z][a-z0-9+.-]*:|/|#)[^"]*">(.*?)</a>', re.S | re.I)


def run_batch(study: str, ex_dir: Path) -> subprocess.CompletedProcess:
    "This script on `study`'s example batch, in a fresh process in ex_dir (tests/test_docs.py runs it in a fork instead)."
    return subprocess.run([sys.executable, __file__, study, f'runs/{study}'], cwd=ex_dir, capture_output=True, text=True,
                          env={**os.environ, 'PYTHONHASHSEED': '0'})


def main(study: str, out: Path) -> str:
    "Run the example batch of `study` into `out` and render its report; returns the line to print."
    t0 = time.time()
    res = run_example(study, out, log=lambda s: None)
    return f'[docs] example batch {study}: {len(res.statuses)} runs and the report in {time.time() - t0:.0f}s'


def report_page(study: str, report_nb: Path, ex_dir: Path, use_cache: bool = True, log=print) -> Path:
    """The report of `study` executed on its example batch, as a page for the docs: the batch runs in a fresh process into
    ex_dir/runs/<study> (cached, keyed by the report, the library, settings.ini and this file); the page shows, under a
    note saying what ran, only the outputs (Quarto cell options, which the docs apply), as a batch's report.html does;
    paths read as the batch's own (`runs/<study>`), links to run files (not on the site) keep only their names."""
    batch, page, keyf = ex_dir / 'runs' / study, ex_dir / 'pages' / report_nb.name, ex_dir / f'{study}.key'
    h = hashlib.sha256()
    for p in [report_nb, ROOT / 'settings.ini', Path(__file__), *sorted((ROOT / 'oelm_nb').glob('**/*.py'))]: h.update(p.name.encode() + p.read_bytes())
    if use_cache and page.exists() and keyf.exists() and keyf.read_text() == h.hexdigest(): return page
    shutil.rmtree(batch, ignore_errors=True); keyf.unlink(missing_ok=True)
    batch.parent.mkdir(parents=True, exist_ok=True)
    log(f'example batch for {report_nb.name}: {describe(study)}')
    r = run_batch(study, ex_dir)
    if r.returncode: raise RuntimeError(f"the example batch of {study} failed (see {batch}):\n{r.stderr[-3000:]}")
    log('  ' + (r.stdout.strip().splitlines() or [''])[-1].removeprefix('[docs] '))
    nb = json.loads((batch / 'report.ipynb').read_text().replace(str(ex_dir.resolve()) + '/', ''))
    for o in (o for c in nb['cells'] for o in c.get('outputs', []) if 'text/html' in o.get('data', {})):
        o['data']['text/html'] = _re_relative_anchor.sub(r'\1', ''.join(o['data']['text/html']))
    for c in (c for c in nb['cells'] if c['cell_type'] == 'code'):
        c['source'] = ('#| echo: false\n' if c.get('outputs') else '#| include: false\n') + ''.join(c['source'])
    nb['cells'].insert(1, {'cell_type': 'markdown', 'id': 'example-note', 'metadata': {}, 'source': NOTE.format(what=html.escape(describe(study)))})
    page.parent.mkdir(parents=True, exist_ok=True); page.write_text(json.dumps(nb, indent=1)); keyf.write_text(h.hexdigest())
    return page


if __name__ == '__main__':
    if len(sys.argv) != 3 or sys.argv[1] not in examples():
        sys.exit(f"usage: python tools/example_batches.py STUDY OUT_DIR, STUDY one of {', '.join(examples())}")
    from oelm_nb.lab.execute import skip_slow_imports
    skip_slow_imports()  # the report page is written here (nbconvert), as `oelm run` writes it
    print(main(sys.argv[1], Path(sys.argv[2])))
