#!/usr/bin/env python
"""Build the documentation site without Quarto (`nbdev_docs` needs it): nbdev's own checks and processors, then mkdocs.

1. Each notebook that `nbdev_test` tests (not in folders holding a `.notest` file) runs through nbdev's `nbdev.test.test_nb`
   (nbdev's rules: `tst_flags`, `#| eval: false`, `skip_exec`; a cell that raises fails the check, naming the notebook, the
   cell and the traceback), keeping its outputs; then every notebook goes through nbdev's docs processors (FilterDefaults,
   as `nbdev_proc_nbs`), nbdev's exec_show_docs included as `nbdev_docs` runs it (exports and imports alone in a fresh
   shell): a notebook that would break `nbdev_docs` fails here. One fresh process per notebook (Python 3.10 too),
   `--jobs` at a time, cached in _mkdocs/proc by its inputs.
   `--check-only` (`make nbtest`) stops here.
2. A study's report page is the report executed on an example batch (tools/example_batches.py, cached).
3. For mkdocs-jupyter, what Quarto would do: frontmatter as title, show_doc's markdown as text, cell options applied.
4. `mkdocs build` (mkdocs.yml, the nav made from the notebooks); nbdev's links to the docs host made internal,
   404 page, figure alt text and search index fixed, internal links checked (tools/check_links.py).
Usage: python tools/build_docs.py [--check-only] [--jobs N] [--no-cache] [--no-examples] [--no-check-links]
                                  [--site-dir DIR] [--build-dir DIR]
"""
from __future__ import annotations

import argparse, hashlib, html, inspect, json, os, re, shutil, subprocess, sys, time, traceback
import concurrent.futures as cf, multiprocessing as mp
from dataclasses import dataclass, replace
from pathlib import Path
from urllib.parse import urlsplit

import execnb, nbdev.test
from execnb.nbio import read_nb, write_nb
from execnb.shell import CaptureShell
from fastcore.basics import ifnone, str2bool
from fastcore.xtras import working_directory
from nbdev.config import get_config
from nbdev.doclinks import _nbpath2html, nbglob
from nbdev.frontmatter import _fm2dict
from nbdev.process import NBProcessor, Processor, _directive, first_code_ln
from nbdev.processors import FilterDefaults, _default_exp, exec_show_docs

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / 'tools'))
os.environ.setdefault('NO_MKDOCS_2_WARNING', '1')  # mkdocs-material's end-of-life banner
HIDE_INPUT = 'nbdev-hide-input'      # mkdocs.yml: mkdocs-jupyter's remove_tag_config hides the code of cells tagged so
SHOWDOC_MARKER = 'nbdev-doc-marker'  # mkdocs-jupyter gives markdown cells no tag classes: the CSS finds API entries by this
WIDGET_MIME = 'application/vnd.jupyter.widget-view+json'
WIDGET_NOTE = ('<p class="nbdev-widget-note"><em>An interactive widget is shown here when the notebook runs in '
               'JupyterLab; a static page cannot run it.</em></p>')
NO_ALT = 'No description has been provided for this image'  # nbconvert's alt text for every figure

class DocsBuildError(RuntimeError): "The docs build failed; the message says where and why."

def log(*a): print('[docs]', *a, flush=True)
def _rel(p: Path) -> str: return str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(p)
def nbdev_config(): return get_config(path=ROOT)

@dataclass
class DocNb:
    src: Path          # the notebook (a report shown on an example batch: that execution of it)
    dest: str          # its page in the docs folder, named as nbdev names it: nbs/model/23_gpt.ipynb -> model/gpt.ipynb (model/gpt.html)
    library: bool      # run by the notebook check (nbdev_test tests it), or shown as saved
    example: str = ''  # a report executed on an example batch: what the batch ran
    @property
    def html(self) -> str: return self.dest.removesuffix('.ipynb') + '.html'

def discover(nbs: Path | None = None) -> list[DocNb]:
    "The notebooks as nbdev finds them (nbglob): first those nbdev_test tests (no `.notest` beside them), index first."
    nbs = Path(nbs or nbdev_config().nbs_path).resolve()
    docs = [DocNb(p, _nbpath2html(p.relative_to(nbs)).with_suffix('.ipynb').as_posix(), bool(nbdev.test._keep_file(p, '.notest')))
            for p in nbglob(nbs, as_path=True)]
    return sorted(docs, key=lambda d: (not d.library, d.src.stem != 'index', chapter_number(d.src), d.src))

def chapter_number(nb: Path) -> float:
    """A chapter's place in reading order: the number its file name starts with, a letter after it a step after that
    number (nbs/lab/54_run.ipynb -> 54, nbs/lab/56a_execute.ipynb -> 56.01)."""
    m = re.match(r'(\d+)([a-z]?)', nb.name)
    if not m: return -1
    return int(m.group(1)) + (ord(m.group(2)) - ord('a') + 1) / 100 if m.group(2) else int(m.group(1))

# the docs' sections (the nav of the site, made by `nav`): one per package folder of nbs/, in reading order; a registered
# study's folder is headed by its title (`study_sections`), an unregistered one 'Study: <folder>'
SECTIONS = {'base': 'Base: configurations, run directories, metrics', 'data': 'Data', 'model': 'Model',
            'report': 'Reports and evidence', 'train': 'Training', 'lab': 'The lab: studies, batches, tools', 'app': 'Application'}

def study_sections() -> dict[str, str]:
    """{folder of nbs/: 'Study: TITLE'} of the studies registered by this package's entry points: the folder its module is
    exported from (oelm_nb.studies.qk_freeze.study -> studies/qk_freeze), its `Study.title` (or name) as the heading."""
    from importlib.metadata import entry_points
    from oelm_nb.lab.study import STUDY_GROUP, studies
    lib, registered, out = nbdev_config().lib_name, studies(), {}
    for ep in entry_points(group=STUDY_GROUP):
        parts = ep.module.split('.')
        if parts[0] == lib and ep.name in registered:  # a study of another package has its own docs
            out['/'.join(parts[1:-1])] = 'Study: ' + (registered[ep.name].title or ep.name)
    return out

def sections(chapters: list[DocNb], nbs: Path, studies: dict[str, str] | None = None) -> dict[str, str]:
    """{folder: heading} of the library chapters' package folders, in reading order (each folder where its first
    chapter's number puts it); `studies`: the study folders' headings (default: `study_sections()`). A folder that is
    neither a package's nor a study's raises."""
    studies, out = study_sections() if studies is None else studies, {}
    for d in sorted(chapters, key=lambda d: chapter_number(d.src)):
        folder = d.src.parent.relative_to(nbs).as_posix()
        if folder in out or folder == '.': continue
        if folder in SECTIONS: out[folder] = SECTIONS[folder]
        elif folder in studies: out[folder] = studies[folder]
        elif folder.startswith('studies/') and folder.count('/') == 1: out[folder] = 'Study: ' + folder.split('/')[1]
        else: raise KeyError(f'{d.src}: a chapter lives in a package folder of nbs/ ({", ".join(SECTIONS)} or studies/NAME)')
    return out

def title(d: DocNb) -> str:
    "The notebook's title as nbdev reads it (its frontmatter, or the '# title' cell)."
    from nbdev.frontmatter import FrontmatterProc
    return NBProcessor(d.src, procs=FrontmatterProc, process=True).nb.frontmatter_['title']

def nav(docs: list[DocNb]) -> list:
    """The site's navigation (mkdocs' `nav`): Home, each package folder's chapters under its section heading, in reading
    order, then the other notebooks (experiments, reports) by folder; each under its title. Made from the notebooks, so
    a new chapter or study folder needs no edit of mkdocs.yml."""
    nbs, lib = nbdev_config().nbs_path.resolve(), [d for d in docs if d.library]
    entry = lambda d: {'Home' if d.dest == 'index.ipynb' else title(d): d.dest}
    out = [entry(d) for d in lib if d.dest == 'index.ipynb']
    chapters = [d for d in lib if d.dest != 'index.ipynb']
    for folder, heading in sections(chapters, nbs).items():
        out.append({heading: [entry(d) for d in chapters if d.src.parent.relative_to(nbs).as_posix() == folder]})
    others = [d for d in docs if not d.library]
    for folder in dict.fromkeys(d.dest.split('/')[0] for d in others):
        out.append({folder.title(): [entry(d) for d in others if d.dest.split('/')[0] == folder]})
    return out

# ---------------------------------------------------------------------------------------------- nbdev, one notebook
# a figure of several panels on a page is one picture per panel (oelm_nb.report.page.panels_html), as in the reports;
# registered without a name in the notebook's namespace, so a notebook still needs its own imports
PANELS = "__import__('oelm_nb.report.page', fromlist=['_']).show_figures_in_panels()"

def run_test_nb(fn: Path):
    """Run `fn` with nbdev's test runner, nbdev.test.test_nb (nbdev's rules for which cells run and what fails), and return
    its shell and the notebook it ran, whose cells hold the outputs (None when it ran nothing: `skip_exec`). A cell that
    raises: DocsBuildError with the notebook, the cell and the traceback."""
    ran = []
    class RecordingShell(CaptureShell):  # test_nb's shell, keeping the notebook it runs
        def run_all(self, nb, *args, **kw):
            ran.append((self, nb))
            self.run_cell(PANELS)  # the page's figures of several panels: one picture per panel, one column on a phone
            return super().run_all(nb, *args, **kw)
    nbdev.test.CaptureShell = RecordingShell
    try: ok, _ = nbdev.test.test_nb(fn, skip_flags=nbdev_config().tst_flags.split(), showerr=False, basepath=ROOT)
    finally: nbdev.test.CaptureShell = CaptureShell
    if ran and not ok:
        (shell, nb), n = ran[0], getattr(ran[0][0], '_cell_idx', 0)
        raise DocsBuildError(f"{_rel(fn)}: cell {n} raised {type(shell.exc).__name__}: {shell.exc}\n----- cell source -----\n"
                             f"{nb.cells[n - 1].source if n else ''}\n----- traceback -----\n{shell.prettytb(fname=_rel(fn))}")
    return ran[0] if ran else None

MIXED_HINT = ("this cell mixes imports with other code: nbdev's exec_show_docs runs it (it has imports) without the cells "
              "it needs (they have none); put its imports in a cell of their own (nbdev's FAQ)")

class exec_show_docs_check(exec_show_docs):
    """nbdev's own exec_show_docs, as `nbdev_docs` runs it before Quarto renders: the exported cells, every cell with an
    import and the show_doc cells, alone in a fresh shell. A notebook that fails here breaks `nbdev_docs` (most often a
    cell mixing imports with code that needs a cell nbdev does not run: NameError). Its outputs are dropped: the pages
    keep test_nb's, and show_doc renders in the test shell (docs_procs)."""
    def begin(self):
        from IPython.core.interactiveshell import InteractiveShell
        self.prev = InteractiveShell._instance  # CaptureShell() makes itself IPython's shell: the test shell is again after
        super().begin()
    def __call__(self, cell):
        import warnings
        outs = cell.get('outputs')
        sd = getattr(cell, 'has_sd', False) and re.fullmatch(r'show_doc\(([\w.]+)\)', cell.source.strip())
        try:
            with warnings.catch_warnings():  # nbdev's FAQ warning on every cell mixing imports and code: fatal only where it fails
                warnings.simplefilter('ignore')
                if not sd: super().__call__(cell)
                elif hasattr(self, 'k') and not str2bool(getattr(self.nb, 'frontmatter_', {}).get('skip_showdoc', False)):
                    self.k.run(f'{sd[1]};')  # nbdev's show_doc(name) of an exported name: what can fail here is the name;
                    if self.k.exc: raise self.k.exc  # show_doc itself renders once, in the test shell (docs_procs)
        except Exception:
            from nbdev.processors import _ast_contains
            import ast
            trees, k = cell.parsed_() or [], self.k
            mixed = _ast_contains(trees, (ast.Import, ast.ImportFrom)) and _ast_contains(trees, (ast.Expr, ast.Assign))
            raise DocsBuildError(f"{_rel(Path(self.nb.path_))}: `nbdev_docs` would fail: nbdev's exec_show_docs (the exported "
                                 f"cells, the cells with imports and the show_doc cells, run alone in a fresh shell) stopped "
                                 f"at the cell below: {type(k.exc).__name__}: {k.exc}" + (f'; {MIXED_HINT}' if mixed else '')
                                 + f"\n----- cell source -----\n{cell.source}\n----- traceback -----\n{k.prettytb(fname=_rel(Path(self.nb.path_)))}") from None
        finally:
            if outs is not None: cell['outputs'] = outs
    def end(self):  # no widget state: a static page has no kernel to run widgets
        from IPython.core.interactiveshell import InteractiveShell
        InteractiveShell._instance = self.prev

def docs_procs(shell=None) -> list:
    """nbdev's docs processors (FilterDefaults, as nbdev_proc_nbs; settings.ini `procs`/`skip_procs` count). After test_nb,
    nbdev's exec_show_docs runs as `nbdev_docs` runs it (exec_show_docs_check: exports and imports alone in a fresh shell,
    where a cell mixing imports and code that needs another cell fails, nbdev's FAQ), then show_doc runs in the test shell
    for the pages: an exported name is documented from its module (a class defined in a cell has no source for its fields'
    comments, and nbdev links a function defined in a cell to the first module with that name)."""
    lib = nbdev_config().lib_name
    class show_docs_in_test_shell(Processor):
        def begin(self): self.mod = _default_exp(self.nb); shell.run_cell('from nbdev.showdoc import show_doc')
        def cell(self, cell):
            if not getattr(cell, 'has_sd', False): return  # the show_doc cells nbdev's add_show_docs added
            source, x = cell.source, re.search(r'^show_doc\((\w+)\)$', cell.source, re.M)
            if x and self.mod: cell.source = source.replace(x[0], f"show_doc(getattr(__import__('{lib}.{self.mod}', fromlist=['_']), "
                                                            f"'{x[1]}', {x[1]}))")
            shell.cell(cell)
            cell.source = source
            if shell.exc: raise DocsBuildError(f'{_rel(Path(self.nb.path_))}: show_doc failed:\n{shell.prettytb()}')
    return [q for p in FilterDefaults().procs()
            for q in ([exec_show_docs_check, show_docs_in_test_shell] if p is exec_show_docs and shell else [p])]

def process_notebook(src: str, dst: str, execute: bool) -> float:
    """One notebook as nbdev treats it, in this (fresh) process: run by nbdev's test runner when `execute`, its outputs
    kept, then nbdev's docs processors. Writes `dst`; returns the seconds it took."""
    t0, src = time.time(), Path(src)
    nb, (shell, ran) = read_nb(src), (execute and run_test_nb(src)) or (None, None)
    code = lambda n: [c for c in n.cells if c.cell_type == 'code'] if n else []  # test_nb's copy has the same code cells
    for cell, done in zip(code(nb), code(ran)): cell.outputs = done.get('outputs', [])
    with working_directory(nbdev_config().nbs_path):  # where nbdev finds settings.ini (its doc links need it)
        NBProcessor(nb=nb, procs=docs_procs(shell)).process()
    Path(dst).parent.mkdir(parents=True, exist_ok=True)
    write_nb(nb, dst)
    return time.time() - t0

# ---------------------------------------------------------------------------------------------- all notebooks, cached
# the example batch the explorer chapter opens on, once the docs build trained it: part of what such a page shows, so part
# of its cache key, and passed to the notebook's process (a fork server keeps the environment it started with)
EXAMPLE_ENV = 'OELM_EXAMPLE_BATCH'

def _worker(src: str, dst: str, execute: bool, env: dict | None = None) -> tuple[bool, float | str]:
    "process_notebook in a pool worker (`env`: set first): (True, seconds) or (False, what failed)."
    os.environ.update(env or {})
    try: return True, process_notebook(src, dst, execute)
    except DocsBuildError as e: return False, str(e)
    except BaseException as e: return False, f'{src}: ' + ''.join(traceback.format_exception(e))

def library_modules() -> list[str]:
    "Every module of the package (its notebooks import them: a server that imported them forks notebooks that need not)."
    import pkgutil
    lib = nbdev_config().lib_name
    return [m.name for m in pkgutil.walk_packages([str(ROOT / nbdev_config().lib_path)], f'{lib}.') if not m.name.endswith('_modidx')]

def _mp_context(n: int):
    """A fresh process per notebook, forked from a server that imported torch, IPython, nbdev and the package's modules
    once (saves ~3 s and ~2 s a notebook): a notebook's own cells still run in its own process, after nothing else.
    From 3 notebooks to execute on, torch._dynamo too: an optimizer's first step imports it (2.7 s; 22 of 50 notebooks
    step one). With none to execute (pages of notebooks that are not run here), nbdev alone: torch would cost ~10 s."""
    if 'forkserver' not in mp.get_all_start_methods(): return mp.get_context('spawn')
    ctx = mp.get_context('forkserver')
    ctx.set_forkserver_preload(['__main__', 'build_docs'] + (n > 0) * [
        'torch', *(['torch._dynamo'] if n >= 3 else []), 'IPython', 'execnb.shell', 'nbdev.processors',
        'matplotlib.pyplot', 'pandas', *library_modules()])
    return ctx

def _in_fresh_process(ctx, *args) -> tuple[bool, float | str]:
    """_worker(*args) in a process that runs nothing else and then ends (what `max_tasks_per_child=1` gives from Python
    3.11, written so that 3.10 has it too): a notebook never sees what an earlier one imported, patched or registered."""
    with cf.ProcessPoolExecutor(1, mp_context=ctx) as ex: return ex.submit(_worker, *args).result()

def _key(d: DocNb) -> str:
    "What a processed notebook depends on: the notebook, the library, settings.ini, this processing, the versions."
    h = hashlib.sha256(f'{d.library} {nbdev.__version__} {execnb.__version__} {sys.version}'.encode())
    for p in [d.src, ROOT / 'settings.ini', *sorted((ROOT / nbdev_config().lib_path).glob('**/*.py'))]:
        h.update(p.name.encode() + p.read_bytes())
    for f in (process_notebook, run_test_nb, docs_procs, exec_show_docs_check): h.update(inspect.getsource(f).encode())
    if EXAMPLE_ENV in d.src.read_text(encoding='utf-8'): h.update(os.environ.get(EXAMPLE_ENV, '').encode())
    return h.hexdigest()

def process_notebooks(docs: list[DocNb], proc_dir: Path, jobs: int = 2, use_cache: bool = True, quiet: bool = False) -> dict[Path, Path]:
    "process_notebook for each of `docs` (library notebooks executed), `jobs` at a time, into proc_dir, cached. {src: processed}"
    out, todo, errors, say = {}, [], [], (lambda *a: None) if quiet else log
    for d in docs:
        out[d.src] = dst = proc_dir / d.dest
        key, keyf = _key(d), dst.with_suffix('.key')
        if not (use_cache and dst.exists() and keyf.exists() and keyf.read_text() == key): todo.append((d, dst, keyf, key))
    say(f"{len(todo)} of {len(docs)} notebook(s) to run ({len(docs) - len(todo)} unchanged since they ran, cached in {_rel(proc_dir)}), "
        f"{jobs} at a time, each in a fresh process: nbdev's test_nb, then nbdev's docs processors")
    os.environ.setdefault('PYTHONHASHSEED', '0')
    for v in ('OMP_NUM_THREADS', 'MKL_NUM_THREADS', 'OPENBLAS_NUM_THREADS'):  # oversubscribed cores: torch's QR ~10x slower
        os.environ.setdefault(v, str(max(1, (os.cpu_count() or 1) // max(1, jobs))))
    ctx = _mp_context(sum(d.library for d, *_ in todo))  # the notebooks it executes
    with cf.ThreadPoolExecutor(max(1, jobs)) as ex:  # `jobs` notebooks at a time, each in a process of its own
        env = {EXAMPLE_ENV: os.environ[EXAMPLE_ENV]} if EXAMPLE_ENV in os.environ else {}
        futs = {ex.submit(_in_fresh_process, ctx, str(d.src), str(dst), d.library, env): (d, keyf, key) for d, dst, keyf, key in todo}
        for f in cf.as_completed(futs):
            d, keyf, key = futs[f]
            try: ok, res = f.result()
            except Exception as e: ok, res = False, f'{_rel(d.src)}: the worker process died: {e!r}'
            keyf.unlink(missing_ok=True)
            if ok: keyf.write_text(key); say(f"  {_rel(d.src)} -> {d.html}: {res:.1f}s{'' if d.library else ' (not run here)'}")
            else: log(f'  {_rel(d.src)}: FAILED'); errors.append(res)
    if errors: raise DocsBuildError(f'{len(errors)} notebook(s) failed:\n\n' + '\n\n'.join(errors))
    return out

def add_examples(docs: list[DocNb], ex_dir: Path, use_cache: bool = True, only: tuple | None = None) -> list[DocNb]:
    "`docs` with each study's report (`only`: these studies') replaced by its execution on an example batch."
    import example_batches as eb
    nbs, studies, out = nbdev_config().nbs_path, eb.report_studies(), []
    for d in docs:
        study = studies.get(d.src.relative_to(nbs).as_posix()) if d.src.is_relative_to(nbs) else None
        if d.library or study not in eb.examples() or (only is not None and study not in only): out.append(d); continue
        try: out.append(replace(d, src=eb.report_page(study, d.src, ex_dir, use_cache, log), example=eb.describe(study)))
        except RuntimeError as e: raise DocsBuildError(str(e)) from None
    return out

# ---------------------------------------------------------------------------------------------- pages for mkdocs-jupyter
def _src(x) -> str: return ''.join(x) if isinstance(x, list) else (x or '')
def _frontmatter(source: str) -> dict | None: return _fm2dict(source) or None  # a raw cell's YAML, as nbdev reads it

def split_quarto_options(source: str) -> tuple[dict, str]:
    "The Quarto cell options nbdev leaves atop a code cell, read by nbdev's parser ({'echo': 'false'}, lower case), and the code."
    lines = source.splitlines(True)
    i = ifnone(first_code_ln(lines), len(lines))
    opts = {k.rstrip(':'): ' '.join(v).strip('"\'').lower() for k, v in filter(None, map(_directive, lines[:i]))}
    return opts, ''.join(lines[i:]).strip('\n')

def clean_stream(o: dict) -> dict | None:
    "A stream output as a terminal shows it: no ANSI escapes, carriage returns (progress bars) overwriting; None when blank."
    if o.get('output_type') != 'stream': return o
    text = re.sub(r'\x1B(?:[@-Z\\-_]|\[[0-?]*[ -/]*[@-~])', '', _src(o.get('text')))
    text = '\n'.join(l.rsplit('\r', 1)[-1] if '\r' in l.rstrip('\r') else l.replace('\r', '') for l in text.split('\n'))
    return {**o, 'text': text} if text.strip() else None

def _md_cell(source: str) -> dict:
    return {'cell_type': 'markdown', 'id': 'nbdev-' + hashlib.sha1(source.encode()).hexdigest()[:8], 'metadata': {}, 'source': source}

def _pandoc_links_to_html(md: str) -> str:
    "`[text](url){target=\"_blank\" style=\"...\"}` (Pandoc attributes, which nbconvert's markdown cannot read) -> <a ...>."
    return re.sub(r'\[([^\]]+)\]\(([^)\s]+)\)\{([^}]*)\}', lambda m: f'<a href="{m[2]}"'
                  + ' class="nbdev-source"' * (m[1] == 'source') + f' {m[3].strip()} rel="noopener">{m[1]}</a>', md)

def showdoc_markdown(md: str) -> str:
    "show_doc's markdown for nbconvert: Pandoc links as HTML, no leading rule (a box), `__init__` not bold, no links in code."
    md = re.sub(r'^\s*---\s*\n', '', _pandoc_links_to_html(re.sub(r'(\.py)#LNone\b', r'\1', md)))
    md = re.sub(r'^(#{1,6}\s+)(.*)$', lambda m: m[1] + re.sub(r'(?<!\\)([_*])', r'\\\1', m[2]), md, flags=re.M)
    md = re.sub(r'```.*?```', lambda m: re.sub(r'\[(`[^`]*`)\]\([^)\s]*\)', r'\1', m[0]), md, flags=re.S)
    return f'<div class="{SHOWDOC_MARKER}"></div>\n\n{md.strip()}\n'

def _static(o: dict) -> list[dict]:
    "An output as a page without a kernel shows it: a widget as a note, with the picture it brings along (RunExplorer's)."
    if WIDGET_MIME not in o.get('data', {}): return [o]
    note = {'output_type': 'display_data', 'metadata': {}, 'data': {'text/html': WIDGET_NOTE}}
    rest = {k: v for k, v in o['data'].items() if k not in (WIDGET_MIME, 'text/plain')}
    return [note] + ([{'output_type': 'display_data', 'metadata': {}, 'data': rest}] if rest else [])

def adapt_notebook(nb: dict) -> dict:
    """A processed notebook as Quarto would show it, for mkdocs-jupyter: the frontmatter as title and description, the
    cell options applied (`include`/`output: false`, `echo: false`), show_doc's `asis` markdown as a markdown cell (a
    heading in the page's table of contents), streams cleaned, a widget (it needs a kernel) as a note."""
    cells = []
    for c in nb['cells']:
        src = _src(c.get('source'))
        if c['cell_type'] == 'raw':  # nbdev's frontmatter; other raw cells mean nothing on a web page
            fm = _frontmatter(src) or {}
            if fm.get('title'): cells.append(_md_cell(f"# {fm['title']}\n" + (f"\n> {fm['description']}\n" if fm.get('description') else '')))
            continue
        if c['cell_type'] == 'markdown':
            if src.strip(): cells.append(c)
            continue
        opts, code = split_quarto_options(src)
        outs = [] if opts.get('output') == 'false' else [o for o in map(clean_stream, c.get('outputs', [])) if o]
        if opts.get('include') == 'false': continue
        if opts.get('output') == 'asis':  # nbdev's show_doc cells
            cells += [_md_cell(showdoc_markdown(_src(o['data']['text/markdown']))) for o in outs if 'text/markdown' in o.get('data', {})]
            continue
        pictured = any('image/png' in o.get('data', {}) and WIDGET_MIME not in o['data'] for o in outs)  # drawn already
        outs = [q for o in outs for q in _static(o)[:1 if pictured else None]]
        tags = c['metadata'].get('tags', []) + [HIDE_INPUT] * (opts.get('echo') == 'false')
        if code.strip() or outs: cells.append({**c, 'source': code, 'outputs': outs, 'metadata': {'tags': tags} if tags else {}})
    meta = {k: v for k, v in nb['metadata'].items() if k != 'widgets'}  # widget state would load the widget JS from a CDN
    return {**nb, 'cells': cells, 'metadata': meta}

def add_note(nb: dict, kind: str, title: str, text: str) -> dict:
    "`nb` with an admonition under its title."
    cells = nb['cells']
    at = int(bool(cells) and cells[0]['cell_type'] == 'markdown' and _src(cells[0]['source']).lstrip().startswith('# '))
    note = _md_cell(f'<div class="admonition {kind}"><p class="admonition-title">{title}</p><p>{text}</p></div>')
    return {**nb, 'cells': cells[:at] + [note] + cells[at:]}

NOT_EXECUTED = ('note', 'Not executed for this site', 'This notebook is shown as saved, without outputs computed by the docs '
                'build. Run it in JupyterLab, or as a batch with papermill (<code>oelm run</code>).')
SAVED_OUTPUTS = ('note', 'Shown as it was last run', 'The outputs on this page were computed when the notebook was last run on '
                 'the runs it names, and saved with it; the docs build shows them and does not run it again. Rerun it '
                 'in JupyterLab, or with papermill, on runs of your own.')

def _has_outputs(nb: dict) -> bool: return any(c.get('outputs') for c in nb['cells'] if c['cell_type'] == 'code')

EXTRA_CSS = """.md-grid { max-width: 1400px; }
/* API reference entries rendered from show_doc */
.jupyter-wrapper .nbdev-doc-marker { display: none; }
.jupyter-wrapper .jp-MarkdownCell:has(.nbdev-doc-marker) { margin: 1.2em 0; padding: .1em 1em .2em; border: 1px solid
  var(--md-default-fg-color--lightest); border-left: 4px solid var(--md-primary-fg-color); border-radius: 4px; }
.jupyter-wrapper .jp-MarkdownCell:has(.nbdev-doc-marker) :is(h3, h4) { margin-top: .5em; font-family: var(--md-code-font-family); font-weight: 600; }
.jupyter-wrapper a.nbdev-source { float: right; font-size: .8em; margin-top: .6em; }
.jupyter-wrapper .jp-MarkdownCell:has(.nbdev-doc-marker) :is(pre, pre code) { white-space: pre-wrap; overflow-wrap: anywhere; }
.jupyter-wrapper .jp-MarkdownCell:has(.nbdev-doc-marker) table { font-size: .85em; }
.jupyter-wrapper .jp-RenderedHTMLCommon :is(pre, pre code) { font-size: var(--jp-code-font-size, 13px); line-height: var(--jp-code-line-height, 1.3077); }
/* tables in markdown cells and outputs (pandas) */
.jupyter-wrapper .jp-RenderedHTMLCommon table { border-collapse: collapse; margin: .8em 0; }
.jupyter-wrapper .jp-RenderedHTMLCommon :is(th, td) { padding: .3em .7em; border: 1px solid var(--md-default-fg-color--lightest); }
.jupyter-wrapper .jp-RenderedHTMLCommon thead tr { background: var(--md-default-fg-color--lightest); }
.jupyter-wrapper .jp-RenderedHTMLCommon tbody tr:nth-child(odd) { background: rgba(0,0,0,.025); }
.jupyter-wrapper .jp-OutputArea-output img { max-width: 100%; height: auto; }
/* the left navigation's sticky site name repeats the header's and covered the section title scrolled under it: shown
   only where the navigation is a drawer (narrow screens), with a background there */
@media screen and (min-width: 76.25em) { .md-nav--primary > .md-nav__title { display: none; } }
.md-nav--primary > .md-nav__title { background-color: var(--md-default-bg-color); z-index: 1; }
"""

# ---------------------------------------------------------------------------------------------- the site
# mkdocs-jupyter converts each page with a new nbconvert exporter, whose Jinja environment compiles the same templates
# again: 880 compilations for 56 pages, a quarter of the build (cProfile). One cache of compiled templates for the process.
SHARED_TEMPLATES = r"""
import jinja2, nbconvert.exporters.templateexporter as _te
class _Compiled(jinja2.BytecodeCache):
    store = {}
    def load_bytecode(self, bucket):
        if bucket.key in self.store: bucket.bytecode_from_string(self.store[bucket.key])
    def dump_bytecode(self, bucket): self.store[bucket.key] = bucket.bytecode_to_string()
_create = _te.TemplateExporter._create_environment
def _environment(self):
    env = _create(self); env.bytecode_cache = _Compiled(); return env
_te.TemplateExporter._create_environment = _environment
# nbconvert's HTMLExporter parses every finished page with BeautifulSoup (html.parser) only to give images without alt
# text a placeholder (polish_site replaces it) and cells tabindex="0", then serialises it again: 37% of the build
# (py-spy). The same two edits as regexes; the pages' text and the tags they edit are unchanged (compared on every page).
import re as _re, nbconvert.exporters.html as _h
_IMG = _re.compile(r'<img\b(?![^>]*\salt=)')
_FOCUS = _re.compile(r'(<div\b[^>]*\sclass="[^"]*\b(?:jp-Cell-inputWrapper|jp-OutputArea-output)\b[^"]*")')
class _Page:
    def __init__(self, page, features=None): self.page = page
    def select(self, css): return []
    def __str__(self):
        return _FOCUS.sub(r'\1 tabindex="0"', _IMG.sub('<img alt="No description has been provided for this image"', self.page))
_h.BeautifulSoup = _Page
"""

def run_mkdocs(docs_dir: Path, site_dir: Path, nav: list) -> None:
    """`mkdocs build` on the pages in docs_dir with mkdocs.yml and `nav` (written beside docs_dir as a mkdocs.yml that
    inherits the project's); strict: a warning fails it, a page in docs_dir that `nav` lacks too."""
    import yaml
    from oelm_nb.lab.execute import module_args  # `python -m mkdocs` without the imports nbformat does not need
    conf = docs_dir.parent / 'mkdocs.yml'
    conf.write_text(yaml.safe_dump({'INHERIT': str(ROOT / 'mkdocs.yml'), 'nav': nav}, sort_keys=False, allow_unicode=True))
    flag, code = module_args('mkdocs')
    r = subprocess.run([sys.executable, flag, SHARED_TEMPLATES + code, 'build', '-f', str(conf), '-d', str(site_dir)],
                       capture_output=True, text=True, env={**os.environ, 'OELM_DOCS_DIR': str(docs_dir)})
    if r.returncode: raise DocsBuildError('mkdocs build failed:\n' + '\n'.join(l for l in r.stderr.splitlines() if 'INFO' not in l))

def _text(fragment: str) -> str: return re.sub(r'\s+', ' ', html.unescape(re.sub(r'<[^>]+>', '', fragment)).replace('¶', '')).strip()

def figure_alt_text(page: str, title: str) -> str:
    "`page` with nbconvert's placeholder alt text replaced by the figure's place: the section it sits in and the page."
    heads = [(m.end(), _text(m[1])) for m in re.finditer(r'<h2[^>]*>(.*?)</h2>', page, re.S)]  # sections, not API entries
    def alt(m):
        under = [h for end, h in heads if end < m.start()]
        return f'alt="Figure: {html.escape(under[-1] if under else title, quote=True)} ({html.escape(title, quote=True)})"'
    return re.sub(f'alt="{NO_ALT}"', alt, page)

def polish_site(site_dir: Path) -> dict:
    "After mkdocs: figure alt text, no 'Copied!' in the search index. Returns the counts."
    counts = {'alt': 0, 'copied': 0}
    for f in site_dir.rglob('*.html'):
        t = f.read_text(encoding='utf-8')
        if NO_ALT not in t: continue
        m = re.search(r'<title>(.*?)</title>', t, re.S)
        counts['alt'] += t.count(NO_ALT)
        f.write_text(figure_alt_text(t, _text(m[1]).split(' - ')[0] if m else f.stem), encoding='utf-8')
    index = site_dir / 'search' / 'search_index.json'  # mkdocs-jupyter's copy button says 'Copied!' on every code cell
    if index.exists():
        text, counts['copied'] = re.subn(r'Copied! ?', '', index.read_text(encoding='utf-8'))
        index.write_text(json.dumps(search_prose(json.loads(text))), encoding='utf-8')
    return counts

def search_prose(index: dict) -> dict:
    """The search index of prose: each entry's text without code blocks and tables (a search for a word found test lines
    and whole output tables before the chapter about it, and their snippets ran past the results panel), its title
    without the heading's permalink sign."""
    def drop(text: str) -> str:
        text = re.sub(r'<table\b.*?</table>', ' ', text, flags=re.S)
        out, at = [], 0
        for m in re.finditer(r'<pre\b[^>]*>(.*?)</pre>\s*', text, re.S):
            out.append(text[at:m.start()]); at = m.end()
            words = m[1].split()  # the copy button's text repeats the block right after it
            repeat = words and re.match(r'\s*'.join(map(re.escape, words)), text[at:])
            if repeat: at += repeat.end()
        return re.sub(r'\s+', ' ', ''.join(out) + text[at:]).strip()
    for d in index.get('docs', []):
        d['title'] = d.get('title', '').replace('\u00b6', '').strip()
        d['text'] = drop(d.get('text', ''))
    return index

def write_pages(docs: list[DocNb], processed: dict[Path, Path], docs_dir: Path) -> None:
    "The pages for mkdocs-jupyter (and the CSS) in docs_dir, from the processed notebooks."
    shutil.rmtree(docs_dir, ignore_errors=True)
    (docs_dir / 'stylesheets').mkdir(parents=True)
    (docs_dir / 'stylesheets' / 'nbdev.css').write_text(EXTRA_CSS)
    for d in docs:
        nb = adapt_notebook(json.loads(processed[d.src].read_text()))
        (docs_dir / d.dest).parent.mkdir(parents=True, exist_ok=True)
        (docs_dir / d.dest).write_text(json.dumps(nb if d.library or d.example else
                                              add_note(nb, *(SAVED_OUTPUTS if _has_outputs(nb) else NOT_EXECUTED)), indent=1))

def build(site_dir: Path | None = None, build_dir: Path | None = None, jobs: int = 2, use_cache: bool = True,
          check_links: bool = True, examples: bool | tuple = True) -> Path:
    "Build the whole site (`examples`: report pages executed on example batches: all, none or these studies'); returns it."
    from check_links import check_site, relative_404, relink
    from mkdocs_jupyter.utils import slugify
    t0, cfg = time.time(), nbdev_config()
    site_dir, build_dir = Path(site_dir or cfg.doc_path).resolve(), Path(build_dir or ROOT / '_mkdocs').resolve()
    docs = discover(cfg.nbs_path)
    site_nav = nav(docs)
    if examples: docs = add_examples(docs, build_dir / 'examples', use_cache, None if examples is True else tuple(examples))
    if (build_dir / 'examples' / 'runs' / 'qk-freeze' / 'batch.json').exists():  # the explorer chapter opens on it
        os.environ[EXAMPLE_ENV] = str(build_dir / 'examples' / 'runs' / 'qk-freeze')
    write_pages(docs, process_notebooks(docs, build_dir / 'proc', jobs, use_cache), build_dir / 'docs')
    log(f'rendering {len(docs)} page(s) with mkdocs-material + mkdocs-jupyter (mkdocs.yml, the nav from the notebooks) into {site_dir}')
    run_mkdocs(build_dir / 'docs', site_dir, site_nav)
    base_url, base_path = cfg.doc_host + cfg.doc_baseurl, urlsplit(cfg.doc_host + cfg.doc_baseurl).path
    n, n404, fixed = relink(site_dir, base_url, slugify), relative_404(site_dir, base_path), polish_site(site_dir)
    log(f"{n} link(s) to {base_url} and {n404} of 404.html made relative, {fixed['alt']} figure(s) given alt text, "
        f"{fixed['copied']} 'Copied!' removed from the search index")
    if check_links and (broken := check_site(site_dir, base_path)):
        raise DocsBuildError(f'{len(broken)} broken internal link(s) in {site_dir}:\n' + '\n'.join(map(str, broken[:50])))
    log(f'done in {time.time() - t0:.0f}s: open {site_dir / "index.html"}')
    return site_dir

def run_stage1(docs, proc_dir, jobs=2, use_cache=True, execute='all', quiet=False):  # the name tools/build_readme.py calls
    return process_notebooks(docs, Path(proc_dir), jobs, use_cache, quiet)

def changed_notebooks(docs: list[DocNb]) -> list[DocNb]:
    "Those of `docs` that git reports as changed since the last commit, or new (`make test-fast`: the chapters being edited)."
    r = subprocess.run(['git', 'status', '--porcelain', '--untracked-files=all', '--', 'nbs'], cwd=ROOT, capture_output=True,
                       text=True)
    if r.returncode: return docs  # not a git checkout: every notebook
    paths = {(ROOT / line[3:].split(' -> ')[-1].strip('"')).resolve() for line in r.stdout.splitlines()}
    return [d for d in docs if d.src.resolve() in paths]

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--check-only', action='store_true', help="only step 1, the notebook check of `make test` (`make nbtest`)")
    ap.add_argument('--jobs', type=int, default=min(2, os.cpu_count() or 1), help='notebooks handled in parallel')
    ap.add_argument('--no-cache', action='store_true', help='run every notebook again')
    ap.add_argument('--changed', action='store_true', help='with --check-only: only the notebooks changed since the last '
                    'commit, or new (git status; `make test-fast`); `make test` checks them all')
    ap.add_argument('--no-examples', action='store_true', help='report pages as saved, not executed on example batches')
    ap.add_argument('--no-check-links', action='store_true', help='skip the internal link check')
    ap.add_argument('--site-dir', help='where the site goes (default: settings.ini doc_path)')
    ap.add_argument('--build-dir', help='work folder: processed notebooks, example batches, pages (default: _mkdocs)')
    a = ap.parse_args(argv)
    try:
        if not a.check_only: build(a.site_dir, a.build_dir, a.jobs, not a.no_cache, not a.no_check_links, not a.no_examples)
        else:
            t0, docs = time.time(), [d for d in discover() if d.library]
            if a.changed:
                docs = changed_notebooks(docs)
                log(f"{len(docs)} notebook(s) changed since the last commit (--changed; `make nbtest` checks every one)")
            process_notebooks(docs, Path(a.build_dir or ROOT / '_mkdocs').resolve() / 'proc', a.jobs, not a.no_cache)
            log(f"{len(docs)} notebook(s) pass nbdev's test_nb ({time.time() - t0:.0f}s)")
    except DocsBuildError as e:
        print(f'\n[docs] FAILED: {e}', file=sys.stderr)
        return 1
    return 0

if __name__ == '__main__':
    sys.exit(main())
