#!/usr/bin/env python
"""Build the documentation site from the notebooks without Quarto.

`nbdev_docs` needs Quarto, which cannot be installed everywhere (see settings.ini and
_quarto.yml: that configuration stays valid for people who have Quarto). This script builds an
equivalent static site with mkdocs-material + mkdocs-jupyter:

1. every library notebook (`nbs/*.ipynb`, `index.ipynb` is the home page) is executed and
   processed in one pass with nbdev's own notebook processors (`nbdev.processors.FilterDefaults`,
   what `nbdev_proc_nbs` applies): `show_doc` cells are added after exported definitions and
   rendered, `#| hide` / `#| export` cells lose their source, and so on. Every code cell runs, as
   under `nbdev_test` (cells with `#| eval: false` or a flag from settings.ini `tst_flags` are
   skipped), so figures and printed output appear on the page. A failing cell stops the build
   with the notebook, the cell and the traceback. Notebooks in sub-folders of nbs/ are not executed
   here: experiment notebooks are shown as saved; each study's report notebook is shown executed
   on an example batch of seconds-long runs that tools/example_batches.py runs first (stage 0,
   cached; `--no-examples` shows them as saved).
   (`nbdev_proc_nbs` itself is not called: without Quarto it tries to download and install it.)
2. the processed notebooks are adapted for mkdocs-jupyter: Quarto frontmatter becomes a title and
   a description, `show_doc` output becomes a markdown cell (so the API reference renders as
   headings, highlighted signatures and tables and shows up in the table of contents), Quarto
   cell options (`#| echo: false`, ...) are applied and removed, and links to the configured docs
   host (`doc_host` + `doc_baseurl`, as nbdev writes them) become relative links into this site.
   Pages are named as nbdev/Quarto names them (`03_model.ipynb` -> `model.html`).
3. `mkdocs build --strict` writes the site (default `_docs/`, settings.ini `doc_path`), and the
   internal links of the result are checked (tools/check_links.py).

Each notebook runs in a fresh process (forked from a server that has imported torch, IPython and
nbdev once), two at a time by default, with one BLAS thread each. Executed notebooks are cached in
the build folder (default `_mkdocs/`), keyed by the notebook, the library sources, settings.ini and
the processing code, so a second `make docs` only re-renders. `--execute showdoc` runs only what
nbdev itself runs for docs (a check that `nbdev_docs` would get through the notebooks).

Usage: python tools/build_docs.py [--site-dir DIR] [--build-dir DIR] [--jobs N] [--no-cache]
                                  [--execute all|showdoc|none] [--no-check-links] [--no-examples]
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import hashlib
import html
import json
import multiprocessing as mp
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOOLS = Path(__file__).resolve().parent
if str(TOOLS) not in sys.path: sys.path.insert(0, str(TOOLS))

MATHJAX_URL = "https://cdnjs.cloudflare.com/ajax/libs/mathjax/2.7.7/latest.js?config=TeX-AMS_CHTML-full,Safe"
SECTION_TITLES = {'experiments': 'Experiments', 'reports': 'Reports'}


class DocsBuildError(RuntimeError):
    "The docs build failed; the message says where and why."


def log(*a):
    print('[docs]', *a, flush=True)


# ---------------------------------------------------------------------------------------------
# configuration and discovery

def nbdev_config():
    from nbdev.config import get_config
    return get_config(path=ROOT)


def split_flags(s: str) -> set[str]:
    "settings.ini `tst_flags`; accept both 'slow cuda' (nbdev) and 'slow|cuda'."
    return {f for f in re.split(r'[\s|,]+', s or '') if f}


def page_slug(stem: str) -> str:
    "nbdev/Quarto page name of a notebook (nbdev.doclinks._nbpath2html): 03_model -> model, lower case."
    return re.sub(r'^\d+[a-zA-Z0-9]*_', '', stem.lower())


def nb_order(p: Path):
    "index first, then by notebook number (2_x before 10_y), then by name."
    m = re.match(r'^(\d+)', p.stem)
    return (p.stem != 'index', int(m.group(1)) if m else float('inf'), p.name)


@dataclass
class DocNb:
    src: Path          # the notebook in nbs/ (for a report with an example: the executed example)
    dest: str          # path of the page notebook inside the mkdocs docs folder, e.g. 'model.ipynb'
    library: bool      # a top-level library chapter (executed) or an extra notebook (not executed)
    section: str = ''  # nav section of extra notebooks
    example: str = ''  # a report executed on an example batch: what that batch ran

    @property
    def html(self) -> str: return self.dest[:-len('.ipynb')] + '.html'


def _visible(p: Path, base: Path) -> bool:
    return not any(part.startswith(('.', '_')) for part in p.relative_to(base).parts)


def discover(nbs: Path | None = None) -> list[DocNb]:
    "Library notebooks (top level of nbs/, index first, then by name) and extra notebooks in sub-folders."
    nbs = nbs or nbdev_config().nbs_path
    lib = sorted((p for p in nbs.glob('*.ipynb') if _visible(p, nbs)), key=nb_order)
    res = [DocNb(p, page_slug(p.stem) + '.ipynb', True) for p in lib]
    extra = sorted(p for p in nbs.glob('*/**/*.ipynb') if _visible(p, nbs) and '.ipynb_checkpoints' not in p.parts)
    for p in extra:
        rel = p.relative_to(nbs)
        dest = '/'.join([*rel.parts[:-1], page_slug(p.stem) + '.ipynb'])
        res.append(DocNb(p, dest, False, rel.parts[0]))
    seen = {}
    for d in res:
        if d.dest in seen: raise DocsBuildError(f"{d.src} and {seen[d.dest]} would both become the page {d.html}: rename one")
        seen[d.dest] = d.src
    return res


def library_notebooks(nbs: Path | None = None) -> list[DocNb]:
    return [d for d in discover(nbs) if d.library]


def _rel(p: Path) -> str: return str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(p)


# ---------------------------------------------------------------------------------------------
# stage 0: the report pages, executed on example batches (tools/example_batches.py)

def report_studies() -> dict[str, str]:
    "Report notebook (relative to nbs/) -> its study."
    from oelm_nb.studies import STUDIES
    return {st.report: name for name, st in STUDIES.items() if st.report}


def _example_key(report_nb: Path, lib_files: list[Path]) -> str:
    h = hashlib.sha256()
    for p in [report_nb, ROOT / 'settings.ini', TOOLS / 'example_batches.py', *lib_files]:
        h.update(str(p.name).encode()); h.update(p.read_bytes())
    return h.hexdigest()


_re_relative_anchor = re.compile(r'<a href="(?![a-z][a-z0-9+.-]*:|/|#)[^"]*">(.*?)</a>', re.S | re.I)


def unlink_run_files(nb: dict) -> dict:
    "A report links its run directories' files (summary.json, metrics.jsonl); on the site they are not there: keep the names, drop the links."
    for c in nb['cells']:
        for o in c.get('outputs', []):
            data = o.get('data', {})
            if 'text/html' in data: data['text/html'] = _re_relative_anchor.sub(r'\1', _src(data['text/html']))
    return nb


def build_examples(docs: list[DocNb], ex_dir: Path, use_cache: bool = True, only: tuple | None = None) -> list[DocNb]:
    """Run each study's example batch (cached; `only`: these studies alone) and point its report page at the executed report;
    returns `docs` updated. Paths on the page read as the batch's own (`runs/<study>`), not the build folder's."""
    import example_batches as eb
    cfg = nbdev_config()
    studies, lib_files = report_studies(), sorted(Path(cfg.lib_path).glob('**/*.py'))
    out = []
    for d in docs:
        rel = d.src.relative_to(cfg.nbs_path).as_posix() if d.src.is_relative_to(cfg.nbs_path) else ''
        study = studies.get(rel)
        if d.library or study not in eb.EXAMPLES or (only is not None and study not in only): out.append(d); continue
        batch, page, keyf = ex_dir / 'runs' / study, ex_dir / 'pages' / d.src.name, ex_dir / f'{study}.key'
        key = _example_key(d.src, lib_files)
        if not (use_cache and page.exists() and keyf.exists() and keyf.read_text() == key):
            shutil.rmtree(batch, ignore_errors=True); keyf.unlink(missing_ok=True)
            batch.parent.mkdir(parents=True, exist_ok=True)
            log(f'example batch for {d.html}: {eb.describe(study)}')
            res = subprocess.run([sys.executable, str(TOOLS / 'example_batches.py'), study, f'runs/{study}'], cwd=ex_dir,
                                 capture_output=True, text=True, env={**os.environ, 'PYTHONHASHSEED': '0'})
            if res.returncode != 0:
                raise DocsBuildError(f"the example batch of {study} for {d.html} failed (see {batch}):\n{res.stderr[-3000:]}")
            log('  ' + (res.stdout.strip().splitlines() or [''])[-1].removeprefix('[docs] '))
            nb = json.loads((batch / 'report.ipynb').read_text().replace(str(ex_dir.resolve()) + '/', ''))
            page.parent.mkdir(parents=True, exist_ok=True); page.write_text(json.dumps(unlink_run_files(nb), indent=1)); keyf.write_text(key)
        out.append(replace(d, src=page, example=eb.describe(study)))
    return out


# ---------------------------------------------------------------------------------------------
# stage 1: execute + process with nbdev's processors (runs in a worker process)

def _make_exec_proc(skip_flags: set[str], fname: str):
    from nbdev.processors import exec_show_docs, cell_lang

    class exec_all(exec_show_docs):
        "Like nbdev's exec_show_docs, but runs every code cell (as nbdev_test does), keeping outputs."
        def _module(self) -> str | None:
            "The package module this notebook exports to (`#| default_exp`), or None."
            if not hasattr(self, '_mod'):
                m = next((re.search(r'^#\|\s*default_exp\s+(\S+)', c.source, re.M) for c in self.nb.cells
                          if c.cell_type == 'code' and 'default_exp' in c.source), None)
                self._mod = f"{nbdev_config().lib_name}.{m.group(1)}" if m else None
            return self._mod

        def __call__(self, cell):
            if not hasattr(self, 'k'): return
            if cell.cell_type != 'code' or not cell.source or cell_lang(cell) != 'python': return
            if 'nbdev_export' + '(' in cell.source: return
            direc = getattr(cell, 'directives_', None) or {}
            if direc.get('eval:', [''])[0].lower() == 'false': return
            if skip_flags & set(direc): return
            source = cell.source
            if (m := re.search(r'^show_doc\((\w+)\)\s*$', source, re.M)) and (mod := self._module()):
                # a class defined in a notebook cell has no source file, so show_doc cannot read its fields' comments;
                # the same class from the exported module has one (the sync check keeps both identical)
                cell.source = source.replace(m.group(0), f"show_doc(getattr(__import__('importlib').import_module({mod!r}), {m.group(1)!r}, {m.group(1)}))")
            try: self.k.cell(cell)
            finally: cell.source = source
            if self.k.exc:
                import traceback
                exc = self.k.exc
                tb = ''.join(traceback.format_exception(exc))
                cid = f" (cell id {cell['id']})" if cell.get('id') else ''
                raise DocsBuildError(f"{fname}: a cell{cid} raised {type(exc).__name__}: {exc}\n"
                                     f"----- cell source -----\n{cell.source}\n----- traceback -----\n{tb}")
    return exec_all


EXECUTE_MODES = ('all', 'showdoc', 'none')


def process_notebook(src: str, dst: str, execute: str = 'all', skip_flags: tuple = ()) -> float:
    """Run nbdev's docs processors on `src` and write `dst`. `execute`: 'all' runs every code cell (outputs and
    figures appear); 'showdoc' runs only what `show_doc` needs (exported cells and imports), exactly as
    `nbdev_proc_nbs` does; 'none' runs nothing (notebooks shown with their saved outputs).
    Returns the seconds it took. Raises DocsBuildError naming the notebook and cell on failure."""
    if execute not in EXECUTE_MODES: raise ValueError(f'execute must be one of {EXECUTE_MODES}, not {execute!r}')
    from execnb.nbio import read_nb, write_nb
    from fastcore.xtras import working_directory
    from nbdev.processors import FilterDefaults, exec_show_docs, add_show_docs
    t0 = time.time()
    src, dst = Path(src), Path(dst)
    fname = str(src.relative_to(ROOT)) if src.is_relative_to(ROOT) else str(src)
    if str(ROOT) not in sys.path: sys.path.insert(0, str(ROOT))
    os.environ['IN_TEST'] = '1'
    fd = FilterDefaults()
    procs = list(fd.procs())
    if execute == 'all': procs = [_make_exec_proc(set(skip_flags), fname) if p is exec_show_docs else p for p in procs]
    elif execute == 'none': procs = [p for p in procs if p not in (exec_show_docs, add_show_docs)]
    from nbdev.process import NBProcessor
    nb = read_nb(src)
    with working_directory(src.parent):
        try: NBProcessor(nb=nb, procs=procs).process()
        except DocsBuildError: raise
        except Exception as e:
            msg = f"{fname}: nbdev's processing failed: {type(e).__name__}: {e}"
            cause = e.__cause__
            if cause is not None:
                import traceback
                tb = ''.join(traceback.format_exception(cause)[-3:])
                msg += f"\n----- caused by -----\n{tb}"
                if execute == 'showdoc':
                    msg += ("\nTo render show_doc, nbdev (nbdev_proc_nbs / nbdev_docs) runs the exported cells and every "
                            "cell that contains an import, in a fresh shell without the other cells: keep imports in "
                            "cells of their own (nbdev FAQ: 'Found cells containing imports and other code').")
            raise DocsBuildError(msg) from None
    dst.parent.mkdir(parents=True, exist_ok=True)
    write_nb(nb, dst)
    return time.time() - t0


def _worker(src: str, dst: str, execute: str, skip_flags: tuple) -> tuple[bool, float | str]:
    "process_notebook in a pool worker: returns (True, seconds) or (False, message); nothing to unpickle."
    try: return True, process_notebook(src, dst, execute, skip_flags)
    except DocsBuildError as e: return False, str(e)
    except BaseException as e:
        import traceback
        return False, f'{src}: {type(e).__name__}: {e}\n{traceback.format_exc()}'


PRELOAD = ['torch', 'IPython', 'execnb.shell', 'nbdev.processors', 'matplotlib.pyplot', 'pandas']


def _mp_context():
    """Fresh processes for the notebooks. Where there is a fork server, it imports torch, IPython and nbdev
    once and forks a clean child per notebook (saves ~3 s a notebook); elsewhere each child is spawned."""
    if 'forkserver' not in mp.get_all_start_methods(): return mp.get_context('spawn')
    ctx = mp.get_context('forkserver')
    ctx.set_forkserver_preload(['__main__', 'build_docs', *PRELOAD])
    return ctx


def _hash_inputs(nb: Path, lib_files: list[Path]) -> str:
    h = hashlib.sha256()
    for p in [nb, ROOT / 'settings.ini', *lib_files]:
        h.update(str(p.name).encode()); h.update(p.read_bytes())
    import inspect, nbdev, execnb
    for f in (process_notebook, _make_exec_proc, split_flags): h.update(inspect.getsource(f).encode())
    h.update(f'{nbdev.__version__} {execnb.__version__} {sys.version}'.encode())
    return h.hexdigest()


def run_stage1(docs: list[DocNb], proc_dir: Path, jobs: int, use_cache: bool, execute: str = 'all',
               quiet: bool = False) -> dict[Path, Path]:
    "Execute/process every notebook into proc_dir (in parallel, cached). Returns {src: processed path}."
    cfg = nbdev_config()
    flags = tuple(sorted(split_flags(cfg.get('tst_flags', ''))))
    lib_files = sorted(Path(cfg.lib_path).glob('**/*.py'))
    out, todo = {}, []
    for d in docs:
        dst = proc_dir / d.dest
        mode = execute if d.library else 'none'
        key = _hash_inputs(d.src, lib_files) + mode
        keyf = dst.with_suffix('.key')
        out[d.src] = dst
        if use_cache and dst.exists() and keyf.exists() and keyf.read_text() == key: continue
        todo.append((d, dst, keyf, key, mode))
    say = (lambda *a: None) if quiet else log
    if not todo:
        say(f'all notebooks unchanged since the last build (cached in {proc_dir})')
        return out
    say(f"processing {len(todo)} notebook(s) with {jobs} worker(s), executing {'every cell' if execute == 'all' else execute}"
        + (f" (skipping cells flagged {', '.join(flags)})" if flags else ''))
    os.environ.setdefault('PYTHONHASHSEED', '0')
    # BLAS/OpenMP threads per worker: oversubscribing the cores makes torch's QR ~10x slower
    for v in ('OMP_NUM_THREADS', 'MKL_NUM_THREADS', 'OPENBLAS_NUM_THREADS'):
        os.environ.setdefault(v, str(max(1, (os.cpu_count() or 1) // max(1, jobs))))
    errors = []
    # one fresh interpreter per notebook: notebooks do not share state, and IPython's shell (which
    # replaces __main__) never sees a second task
    with cf.ProcessPoolExecutor(max_workers=max(1, jobs), mp_context=_mp_context(), max_tasks_per_child=1) as ex:
        futs = {ex.submit(_worker, str(d.src), str(dst), mode, flags): (d, dst, keyf, key)
                for d, dst, keyf, key, mode in todo}
        for f in cf.as_completed(futs):
            d, dst, keyf, key = futs[f]
            try: ok, res = f.result()
            except Exception as e: ok, res = False, f'{d.src}: the worker process died: {e!r}'
            if ok:
                keyf.write_text(key)
                say(f"  {_rel(d.src)} -> {d.html}: {res:.1f}s" + ('' if d.library else ' (example report)' if d.example else ' (not executed)'))
            else:
                keyf.unlink(missing_ok=True)
                log(f"  {_rel(d.src)}: FAILED")
                errors.append(res)
    if errors:
        raise DocsBuildError(f"{len(errors)} notebook(s) failed:\n\n" + '\n\n'.join(errors))
    return out


# ---------------------------------------------------------------------------------------------
# stage 2: adapt the processed notebooks for mkdocs-jupyter

SHOWDOC_MARKER = 'nbdev-doc-marker'  # mkdocs-jupyter gives markdown cells no tag classes: CSS finds entries by this
_re_dir = re.compile(r'^\s*#\|\s*([\w-]+)\s*:\s*(.*?)\s*$')
_re_pandoc_link = re.compile(r'\[([^\]]+)\]\(([^)\s]+)\)\{([^}]*)\}')


def _src(x) -> str: return ''.join(x) if isinstance(x, list) else (x or '')


def split_quarto_options(source: str) -> tuple[dict, str]:
    "Leading `#| key: value` lines (Quarto cell options left by nbdev) and the code without them."
    opts, lines = {}, source.splitlines()
    i = 0
    while i < len(lines):
        m = _re_dir.match(lines[i])
        if not m: break
        opts[m.group(1)] = m.group(2).strip('"\'')
        i += 1
    return opts, '\n'.join(lines[i:]).strip('\n')


def _slugify(s: str) -> str:
    from mkdocs_jupyter.utils import slugify
    return slugify(s)


class LinkRewriter:
    """Turn nbdev's absolute doc links (doc_host + doc_baseurl + '/model.html#gpt') into links inside this
    site. `pages` maps each page to the anchors it has; a link to an anchor the page lacks (nbdev links
    private names, which get no show_doc entry) goes to the page itself."""
    def __init__(self, base_url: str, pages: dict[str, set[str]]):
        self.base = base_url.rstrip('/') + '/'
        self.pages = pages
        self.re = re.compile(re.escape(self.base) + r'([^\s)"\'#<>]*)(#[^\s)"\'<>]*)?')

    def __call__(self, text: str, page: str) -> str:
        def sub(m):
            target, anchor = m.group(1) or 'index.html', _slugify((m.group(2) or '')[1:])
            if target not in self.pages: return m.group(0)
            rel = os.path.relpath(target, os.path.dirname(page) or '.')
            return rel + ('#' + anchor if anchor and anchor in self.pages[target] else '')
        return self.re.sub(sub, text)


def heading_ids(nb: dict) -> set[str]:
    "The ids mkdocs-jupyter gives the headings of the markdown cells of `nb` (slug of the heading's text)."
    ids = set()
    for c in nb['cells']:
        if c['cell_type'] != 'markdown': continue
        for m in re.finditer(r'^#{1,6}\s+(.+?)\s*#*\s*$', _src(c['source']), re.M):
            t = re.sub(r'\[([^\]]*)\]\([^)]*\)', r'\1', m.group(1))  # [text](url) -> text
            ids.add(_slugify(re.sub(r'\\(.)|[`*]', r'\1', t)))
    return ids


def rewrite_links(nb: dict, page: str, rewrite: LinkRewriter) -> dict:
    "Apply `rewrite` to the markdown cells and markdown outputs of `nb` (in place)."
    for c in nb['cells']:
        if c['cell_type'] == 'markdown': c['source'] = rewrite(_src(c['source']), page)
        for o in c.get('outputs', []):
            d = o.get('data', {})
            if 'text/markdown' in d: d['text/markdown'] = rewrite(_src(d['text/markdown']), page)
    return nb


def _pandoc_links_to_html(md: str) -> str:
    "`[text](url){target=\"_blank\" style=\"...\"}` (Pandoc attributes, which mkdocs cannot read) -> <a ...>."
    def sub(m):
        attrs = m.group(3).strip()
        cls = ' class="nbdev-source"' if m.group(1) == 'source' else ''
        return f'<a href="{m.group(2)}"{cls} {attrs} rel="noopener">{m.group(1)}</a>'
    return _re_pandoc_link.sub(sub, md)


def _escape_heading(line: str) -> str:
    "Keep `### __init__` from turning into bold text: escape markdown emphasis in show_doc headings."
    m = re.match(r'^(#{1,6}\s+)(.*)$', line)
    return m.group(1) + re.sub(r'(?<!\\)([_*])', r'\\\1', m.group(2)) if m else line


def showdoc_markdown(md: str) -> str:
    "show_doc's markdown output, made readable by mkdocs-jupyter's markdown renderer."
    md = re.sub(r'(\.py)#LNone\b', r'\1', md)  # a class from the module: nbdev finds no line, link the file
    md = _pandoc_links_to_html(md)
    md = re.sub(r'^\s*---\s*\n', '', md)  # the leading rule: each entry gets a styled box instead
    md = '\n'.join(_escape_heading(l) if l.startswith('#') else l for l in md.split('\n')).strip()
    return f'<div class="{SHOWDOC_MARKER}"></div>\n\n{md}\n'


def _md_cell(source: str, tags=None) -> dict:
    cid = hashlib.sha1(source.encode()).hexdigest()[:8]  # nbformat 4.5 cells need an id; keep it stable
    c = {'cell_type': 'markdown', 'id': f'nbdev-{cid}', 'metadata': {}, 'source': source}
    if tags: c['metadata']['tags'] = list(tags)
    return c


WIDGET_MIME = 'application/vnd.jupyter.widget-view+json'
WIDGET_NOTE = ('<p class="nbdev-widget-note"><em>An interactive widget is shown here when the notebook runs in '
               'JupyterLab; a static page cannot run it.</em></p>')


_re_ansi = re.compile(r'\x1B(?:[@-Z\\-_]|\[[0-?]*[ -/]*[@-~])')


def clean_stream(o: dict) -> dict | None:
    """Stream output as a terminal would show it: ANSI escapes removed, carriage returns (progress bars)
    overwriting their line. None when nothing visible is left."""
    if o.get('output_type') != 'stream': return o
    text = _re_ansi.sub('', _src(o.get('text')))
    lines = [l.rsplit('\r', 1)[-1] if '\r' in l.rstrip('\r') else l.replace('\r', '') for l in text.split('\n')]
    text = '\n'.join(lines)
    return {**o, 'text': text} if text.strip() else None


def _widget_note(o: dict) -> dict:
    "A widget view (which needs a live kernel) -> a short note saying so."
    return {'output_type': 'display_data', 'metadata': {}, 'data': {'text/html': WIDGET_NOTE}}


def not_executed_note(nb: dict) -> dict:
    "Put a note under the title of a notebook that the docs build shows without running it."
    note = _md_cell('<div class="admonition note"><p class="admonition-title">Not executed for this site</p>'
                    '<p>This notebook is shown as saved, without outputs computed by the docs build. Run it in '
                    'JupyterLab, or as a batch with papermill (<code>oelm run</code>).</p></div>')
    cells = nb['cells']
    at = 1 if cells and cells[0]['cell_type'] == 'markdown' and _src(cells[0]['source']).lstrip().startswith('# ') else 0
    return {**nb, 'cells': cells[:at] + [note] + cells[at:]}


def example_note(nb: dict, what: str) -> dict:
    "Put a note under the title of a report page executed on an example batch: what ran, and that it answers nothing."
    note = _md_cell('<div class="admonition example"><p class="admonition-title">Executed on an example batch</p>'
                    f'<p>This page is the report notebook executed when the site was built, on runs that take seconds: {html.escape(what)}. '
                    'Every number is computed from those runs, so the page shows what the report computes; runs this short answer '
                    'none of its questions. Run the study (<code>oelm run</code>, or <code>make run</code> for the Q/K freeze study) '
                    'for a report that does. The code is in the notebook (<code>nbs/reports/</code>); here, as in a batch\'s '
                    '<code>report.html</code>, only its output is shown.</p></div>')
    cells = [c if c['cell_type'] != 'code' else {**c, 'metadata': {**c['metadata'], 'tags': [*c['metadata'].get('tags', []), 'nbdev-hide-input']}}
             for c in nb['cells'] if c['cell_type'] != 'code' or c.get('outputs')]  # as report.html shows it: outputs, no code
    at = 1 if cells and cells[0]['cell_type'] == 'markdown' and _src(cells[0]['source']).lstrip().startswith('# ') else 0
    return {**nb, 'cells': cells[:at] + [note] + cells[at:]}


def _frontmatter(source: str) -> dict | None:
    import yaml
    s = source.strip()
    if not (s.startswith('---') and s.rstrip().endswith('---')): return None
    try: return yaml.safe_load(s.strip('-').strip()) or {}
    except Exception: return None


def adapt_notebook(nb: dict) -> tuple[dict, str | None]:
    "Processed notebook (nbformat dict) -> notebook that mkdocs-jupyter renders well, and its title."
    cells, title = [], None
    for c in nb['cells']:
        ct, src = c['cell_type'], _src(c.get('source'))
        if ct == 'raw':
            fm = _frontmatter(src)
            if fm is not None:
                title = fm.get('title') or title
                md = f"# {fm['title']}\n" if fm.get('title') else ''
                if fm.get('description'): md += f"\n> {fm['description']}\n"
                if md: cells.append(_md_cell(md, ['nbdev-title']))
            continue  # other raw cells have no meaning on a web page
        if ct == 'markdown':
            if src.strip(): cells.append({**c, 'source': src})
            continue
        opts, code = split_quarto_options(src)
        if opts.get('include', '').lower() == 'false': continue
        outputs = c.get('outputs', [])
        if re.match(r'^\s*show_doc\(', code) and opts.get('output', '').lower() == 'asis':
            for o in outputs:
                md = o.get('data', {}).get('text/markdown')
                if md is not None: cells.append(_md_cell(showdoc_markdown(_src(md)), ['nbdev-doc']))
            continue
        tags = list(c.get('metadata', {}).get('tags', []))
        if opts.get('echo', '').lower() == 'false': tags.append('nbdev-hide-input')
        if opts.get('output', '').lower() == 'false': outputs = []
        outputs = [_widget_note(o) if WIDGET_MIME in o.get('data', {}) else o for o in outputs]
        outputs = [o for o in map(clean_stream, outputs) if o is not None]
        if not code.strip() and not outputs: continue
        md_ = {k: v for k, v in c.get('metadata', {}).items() if k in ('tags',)}
        if tags: md_['tags'] = tags
        cells.append({**c, 'source': code, 'outputs': outputs, 'metadata': md_})
    meta = dict(nb.get('metadata', {}))
    meta.pop('widgets', None)  # widget state would pull the widget JS from a CDN; the views are replaced above
    meta.setdefault('kernelspec', {'display_name': 'Python 3', 'language': 'python', 'name': 'python3'})
    meta.setdefault('language_info', {'name': 'python'})
    return {**nb, 'cells': cells, 'metadata': meta, 'nbformat': 4, 'nbformat_minor': max(4, nb.get('nbformat_minor', 4))}, title


# ---------------------------------------------------------------------------------------------
# stage 3: mkdocs

EXTRA_CSS = r"""
/* written by tools/build_docs.py */
.md-grid { max-width: 1400px; }
/* API reference entries rendered from show_doc */
.jupyter-wrapper .nbdev-doc-marker { display: none; }
.jupyter-wrapper .jp-MarkdownCell:has(.nbdev-doc-marker) { margin: 1.2em 0; padding: .1em 1em .2em;
  border: 1px solid var(--md-default-fg-color--lightest); border-left: 4px solid var(--md-primary-fg-color);
  border-radius: 4px; }
.jupyter-wrapper .jp-MarkdownCell:has(.nbdev-doc-marker) h3,
.jupyter-wrapper .jp-MarkdownCell:has(.nbdev-doc-marker) h4 { margin-top: .5em; font-family: var(--md-code-font-family); font-weight: 600; }
.jupyter-wrapper a.nbdev-source { float: right; font-size: .8em; margin-top: .6em; }
.jupyter-wrapper .jp-MarkdownCell:has(.nbdev-doc-marker) pre,
.jupyter-wrapper .jp-MarkdownCell:has(.nbdev-doc-marker) pre code { white-space: pre-wrap; overflow-wrap: anywhere; }  /* signatures stay in their box */
.jupyter-wrapper .jp-MarkdownCell:has(.nbdev-doc-marker) table { font-size: .85em; }
.jupyter-wrapper .jp-RenderedHTMLCommon pre, .jupyter-wrapper .jp-RenderedHTMLCommon pre code {
  font-size: var(--jp-code-font-size, 13px); line-height: var(--jp-code-line-height, 1.3077); }
/* tables in markdown cells and outputs (pandas) */
.jupyter-wrapper .jp-RenderedHTMLCommon table { border-collapse: collapse; margin: .8em 0; }
.jupyter-wrapper .jp-RenderedHTMLCommon th, .jupyter-wrapper .jp-RenderedHTMLCommon td { padding: .3em .7em;
  border: 1px solid var(--md-default-fg-color--lightest); }
.jupyter-wrapper .jp-RenderedHTMLCommon thead tr { background: var(--md-default-fg-color--lightest); }
.jupyter-wrapper .jp-RenderedHTMLCommon tbody tr:nth-child(odd) { background: rgba(0,0,0,.025); }
.jupyter-wrapper .jp-OutputArea-output img { max-width: 100%; height: auto; }
"""


def _yaml_str(s: str) -> str: return json.dumps(str(s))


def write_mkdocs_config(build_dir: Path, docs_dir: Path, site_dir: Path, nav: list, cfg) -> Path:
    "mkdocs.yml for the generated docs folder (kept in the build folder: it is an output, like the pages)."
    def nav_yaml(items, indent=2):
        out = []
        for title, v in items:
            if isinstance(v, list): out.append(' ' * indent + f'- {_yaml_str(title)}:'); out += nav_yaml(v, indent + 4)
            else: out.append(' ' * indent + f'- {_yaml_str(title)}: {_yaml_str(v)}')
        return out
    repo = cfg.get('git_url', '')
    lines = [
        '# generated by tools/build_docs.py: edit that script, not this file',
        f"site_name: {_yaml_str(cfg.get('title', cfg.lib_name))}",
        f"site_description: {_yaml_str(cfg.get('description', ''))}",
        f"site_url: {_yaml_str(cfg.get('doc_host', '') + cfg.get('doc_baseurl', '') + '/')}",
        *( [f"repo_url: {_yaml_str(repo)}", f"edit_uri: {_yaml_str('blob/' + cfg.get('branch', 'main') + '/nbs/')}"] if repo else []),
        f"copyright: {_yaml_str('Copyright ' + cfg.get('copyright', ''))}",
        f"docs_dir: {_yaml_str(docs_dir)}",
        f"site_dir: {_yaml_str(site_dir)}",
        'use_directory_urls: false   # model.html as nbdev/Quarto names pages; also browsable from file://',
        'strict: true',
        'theme:',
        '  name: material',
        '  font: false               # system fonts: no requests to a font CDN',
        '  features: [navigation.top, navigation.sections, navigation.indexes, toc.follow, search.highlight, content.code.copy]',
        '  palette:',
        '    primary: indigo',
        '    accent: indigo',
        'plugins:',
        '  - search',
        '  - mkdocs-jupyter:',
        '      include: ["*.ipynb"]',
        '      execute: false        # tools/build_docs.py has executed the library notebooks already',
        '      include_source: false',
        '      cache: false',
        '      toc_depth: 3',
        '      ignore_h1_titles: true   # nav titles come from the notebooks\' frontmatter ("Home" for index)',
        '      no_prompt: true       # no In [ ]: / Out[ ]: prompts, as on an nbdev/Quarto site',
        '      remove_tag_config: {remove_input_tags: [nbdev-hide-input]}   # Quarto echo: false',
        f'      custom_mathjax_url: {_yaml_str(MATHJAX_URL)}',
        'markdown_extensions: [attr_list, tables, admonition, {toc: {permalink: true}}]',
        'extra_css: [stylesheets/nbdev.css]',
        'nav:',
        *nav_yaml(nav),
    ]
    p = build_dir / 'mkdocs.yml'
    p.write_text('\n'.join(lines) + '\n')
    return p


NO_ALT = 'No description has been provided for this image'

def _text(html_fragment: str) -> str: return html.unescape(re.sub(r'\s+', ' ', re.sub(r'<[^>]+>|¶', '', html_fragment))).strip()

def figure_alt_text(page: str, title: str) -> str:
    "`page` with nbconvert's placeholder alt text replaced by the figure's place: the heading it sits under and the page."
    heads = [(m.end(), _text(m.group(1))) for m in re.finditer(r'<h2[^>]*>(.*?)</h2>', page, re.S)]  # sections, not API entries
    def alt(m):
        under = [h for end, h in heads if end < m.start()]
        return f'alt="Figure: {html.escape(under[-1] if under else title, quote=True)} ({html.escape(title, quote=True)})"'
    return re.sub(f'alt="{NO_ALT}"', alt, page)

def polish_site(site_dir: Path, base_path: str) -> dict:
    "After mkdocs: a 404 page with relative links (it is served from any depth), figure alt text, no 'Copied!' in search. Returns counts."
    counts = {'alt': 0, 'copied': 0, '404': 0}
    page404 = site_dir / '404.html'
    if page404.exists() and base_path.strip('/'):
        t = page404.read_text(encoding='utf-8'); prefix = '/' + base_path.strip('/') + '/'
        counts['404'] = t.count(f'"{prefix}')
        t = t.replace(f'"{prefix}', '"./').replace(f'"{prefix.rstrip("/")}"', '"."')
        # served for a missing URL at any depth: over http(s) its relative links resolve against the site's root
        base = f'<script>if (location.protocol !== "file:") document.write(\'<base href="{prefix}">\');</script>'
        page404.write_text(t.replace('<head>', '<head>\n' + base, 1), encoding='utf-8')
    for f in site_dir.rglob('*.html'):
        t = f.read_text(encoding='utf-8')
        if NO_ALT not in t: continue
        m = re.search(r'<title>(.*?)</title>', t, re.S)
        title = _text(m.group(1)).split(' - ')[0] if m else f.stem
        counts['alt'] += t.count(NO_ALT); f.write_text(figure_alt_text(t, title), encoding='utf-8')
    index = site_dir / 'search' / 'search_index.json'
    if index.exists():
        d = json.loads(index.read_text(encoding='utf-8'))
        for doc in d.get('docs', []):
            counts['copied'] += doc.get('text', '').count('Copied!')
            doc['text'] = doc.get('text', '').replace('Copied! ', '').replace('Copied!', '')
        index.write_text(json.dumps(d), encoding='utf-8')
    return counts


def run_mkdocs(config: Path) -> None:
    cmd = [sys.executable, '-m', 'mkdocs', 'build', '--clean', '-f', str(config)]
    env = {**os.environ, 'NO_MKDOCS_2_WARNING': '1'}  # mkdocs-material's end-of-life banner
    r = subprocess.run(cmd, cwd=config.parent, capture_output=True, text=True, env=env)
    noise = ('INFO', 'Cleaning site', 'Building documentation', 'Documentation built')
    msgs = [l for l in (r.stdout + r.stderr).splitlines() if l.strip() and not l.lstrip().startswith(noise)]
    if r.returncode != 0:
        raise DocsBuildError('mkdocs build failed:\n' + '\n'.join(msgs or (r.stdout + r.stderr).splitlines()[-40:]))
    for l in msgs: log('mkdocs:', l)


# ---------------------------------------------------------------------------------------------

def build(site_dir: Path | None = None, build_dir: Path | None = None, jobs: int = 2,
          use_cache: bool = True, check_links: bool = True, execute: str = 'all',
          examples: bool | tuple = True) -> Path:  # report pages executed on example batches: all, none, or these studies'
    "Build the whole site; returns the site folder. Raises DocsBuildError with a readable message."
    t0 = time.time()
    cfg = nbdev_config()
    site_dir = Path(site_dir or cfg.doc_path).resolve()
    build_dir = Path(build_dir or ROOT / '_mkdocs').resolve()
    docs = discover(cfg.nbs_path)
    if not any(d.library for d in docs): raise DocsBuildError(f'no notebooks found in {cfg.nbs_path}')
    if examples: docs = build_examples(docs, build_dir / 'examples', use_cache, None if examples is True else tuple(examples))
    processed = run_stage1(docs, build_dir / 'proc', jobs, use_cache, execute)

    docs_dir = build_dir / 'docs'
    shutil.rmtree(docs_dir, ignore_errors=True)
    (docs_dir / 'stylesheets').mkdir(parents=True)
    (docs_dir / 'stylesheets' / 'nbdev.css').write_text(EXTRA_CSS)
    adapted = {d.dest: adapt_notebook(json.loads(processed[d.src].read_text())) for d in docs}
    rewrite = LinkRewriter(cfg.get('doc_host', '') + cfg.get('doc_baseurl', ''),
                           {d.html: heading_ids(adapted[d.dest][0]) for d in docs})
    nav, sections = [], {}
    for d in docs:
        nb, title = adapted[d.dest]
        if not d.library: nb = example_note(nb, d.example) if d.example else not_executed_note(nb)
        out = docs_dir / d.dest
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(rewrite_links(nb, d.html, rewrite), indent=1))
        title = 'Home' if d.dest == 'index.ipynb' else (title or page_slug(d.src.stem).replace('_', ' '))
        if d.library: nav.append((title, d.dest))
        else: sections.setdefault(d.section, []).append((title, d.dest))
    for s, items in sections.items(): nav.append((SECTION_TITLES.get(s, s.replace('_', ' ').title()), items))

    config = write_mkdocs_config(build_dir, docs_dir, site_dir, nav, cfg)
    log(f'rendering {len(docs)} page(s) with mkdocs-material + mkdocs-jupyter into {site_dir}')
    run_mkdocs(config)
    from urllib.parse import urlsplit
    fixed = polish_site(site_dir, urlsplit(cfg.get('doc_host', '') + cfg.get('doc_baseurl', '')).path)
    log(f"polished: {fixed['alt']} figure(s) given alt text, {fixed['404']} absolute link(s) of 404.html made relative, "
        f"{fixed['copied']} 'Copied!' removed from the search index")
    missing = [d.html for d in docs if not (site_dir / d.html).exists()]
    if missing: raise DocsBuildError(f'pages missing from the site: {missing}')
    if check_links:
        from check_links import check_site
        from urllib.parse import urlsplit
        broken = check_site(site_dir, base_path=urlsplit(cfg.get('doc_host', '') + cfg.get('doc_baseurl', '')).path)
        if broken: raise DocsBuildError(f'{len(broken)} broken internal link(s) in {site_dir}:\n' + '\n'.join(map(str, broken[:50])))
    log(f'done in {time.time() - t0:.1f}s: open {site_dir / "index.html"}')
    return site_dir


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--site-dir', help='where the HTML site goes (default: settings.ini doc_path, _docs)')
    ap.add_argument('--build-dir', help='work folder: processed notebooks, mkdocs.yml (default: _mkdocs)')
    ap.add_argument('--jobs', type=int, default=min(2, os.cpu_count() or 1), help='notebooks executed in parallel')
    ap.add_argument('--no-cache', action='store_true', help='execute every notebook again')
    ap.add_argument('--no-check-links', action='store_true', help='skip the internal link check')
    ap.add_argument('--no-examples', action='store_true',
                    help="show the report pages unexecuted instead of running each study's example batch (about 2 minutes on 2 cores, cached)")
    ap.add_argument('--execute', choices=EXECUTE_MODES, default='all',
                    help="library notebooks: run every cell (default), only what show_doc needs, or nothing")
    ap.add_argument('--check-only', action='store_true',
                    help="only execute the library notebooks (nbdev_test's rules: cells flagged with settings.ini tst_flags or "
                         "'#| eval: false' skipped) into the build folder's cache, failing on the first cell that raises; "
                         "`make test` runs this as its notebook checks, and the docs build then reuses the executed notebooks")
    a = ap.parse_args(argv)
    try:
        if a.check_only:
            t0, cfg = time.time(), nbdev_config()
            build_dir = Path(a.build_dir or ROOT / '_mkdocs').resolve()
            docs = [d for d in discover(cfg.nbs_path) if d.library]
            run_stage1(docs, build_dir / 'proc', a.jobs, not a.no_cache, 'all')
            log(f'{len(docs)} library notebook(s) ran without an error in {time.time() - t0:.0f}s')
            return 0
        build(a.site_dir, a.build_dir, a.jobs, not a.no_cache, not a.no_check_links, a.execute, not a.no_examples)
    except DocsBuildError as e:
        print(f'\n[docs] FAILED: {e}', file=sys.stderr)
        return 1
    return 0


if __name__ == '__main__':
    sys.exit(main())
