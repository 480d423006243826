"""The documentation site (tools/build_docs.py, mkdocs.yml), its notebook check and the Quarto configuration nbdev_docs reads.

The site is built once per test session, as `make docs` builds it, into a temporary folder shared
by the pytest-xdist workers. Notebooks that `make nbtest` / `make docs` / `make readme` ran and processed
(_mkdocs/proc) are reused when they are still valid (their key covers the notebook, the library and
settings.ini), so `make test` runs each notebook once and a fresh clone runs them here.
"""
from __future__ import annotations

import concurrent.futures as cf
import fcntl
import functools
import json
import multiprocessing as mp
import os
import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest
import yaml
from oelm_nb.lab.study import studies

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / 'tools'))
import build_docs as bd  # noqa: E402
import example_batches as eb  # noqa: E402
from check_links import check_site, relative_404, relink  # noqa: E402
from mkdocs_jupyter.utils import slugify  # noqa: E402

DOCS = bd.discover()
LIB_NBS = [d for d in DOCS if d.library]
# the site's report pages run an example batch each (`make docs`: every study, about 2 minutes); here one study's, to
# keep `make test` short: the machinery is the same for all, and each study's report is tested on real batches by its own suite
EXAMPLE_STUDIES = ('qk-freeze',)
# ...on a smaller batch than `make docs` runs (the study's smoke batch at 10 steps, seed 0 alone, the two variants of its
# main comparison, 5 timing rounds): the page is built the same way, and what it shows of such runs is no answer either way
EXAMPLE_STEPS, EXAMPLE_SEEDS, EXAMPLE_TIMING_ROUNDS = 10, (0,), 5


def example_variants(study: str) -> list[str]:
    "The two variants of the study's main comparison (the answers that rest on them have data), else its first two."
    st = studies()[study]
    return [st.main[2], st.main[1]] if isinstance(st.main, tuple) else list(st.variants('tiny', EXAMPLE_STEPS, {}))[:2]
BASE_PATH = '/' + bd.nbdev_config().get('doc_baseurl', '').strip('/')
BASE_URL = bd.nbdev_config().doc_host + bd.nbdev_config().doc_baseurl


# ------------------------------------------------------------------------------ the built site
@pytest.fixture(scope='session')
def site(tmp_path_factory, request) -> Path:
    "Build the site once for the whole session (xdist workers share it through a lock file)."
    base = tmp_path_factory.getbasetemp()
    if getattr(request.config, 'workerinput', None) is not None: base = base.parent
    out = base / 'docs-site'
    with open(base / 'docs-site.lock', 'w') as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        ok, failed = out / 'BUILT', out / 'FAILED'
        if not ok.exists() and not failed.exists():
            out.mkdir(parents=True, exist_ok=True)
            cache = ROOT / '_mkdocs' / 'proc'
            if cache.is_dir(): shutil.copytree(cache, out / 'build' / 'proc')
            examples = ROOT / '_mkdocs' / 'examples'  # the example batches of the report pages, when `make docs` ran them
            if examples.is_dir(): shutil.copytree(examples, out / 'build' / 'examples', ignore=shutil.ignore_patterns('.lock*'))
            try:
                with pytest.MonkeyPatch.context() as mp_:
                    mp_.setattr(eb, 'run_batch', example_batch_in_a_fork)
                    mp_.setattr(eb, 'SEEDS', EXAMPLE_SEEDS)
                    smoke = eb.examples
                    mp_.setattr(eb, 'examples', lambda: {k: {**v, 'steps': min(v['steps'], EXAMPLE_STEPS),
                                                             'variants': v.get('variants') or example_variants(k)}
                                                         for k, v in smoke().items()})
                    qk = studies()['qk-freeze']
                    mp_.setattr(qk, 'after_batch', functools.partial(qk.after_batch, steps=EXAMPLE_TIMING_ROUNDS, warmup=1))
                    bd.build(site_dir=out / 'site', build_dir=out / 'build', jobs=2, use_cache=True, check_links=False,
                             examples=EXAMPLE_STUDIES)
                ok.write_text('ok')
            except bd.DocsBuildError as e:
                failed.write_text(str(e))
        if failed.exists(): pytest.fail(f'the docs build failed:\n{failed.read_text()}', pytrace=False)
    return out / 'site'


def example_batch_in_a_fork(study: str, ex_dir: Path) -> subprocess.CompletedProcess:
    """`example_batches.run_batch` in a child forked from this test process: the libraries are imported already, and the
    report is executed in-process as the conftest arranges (`make docs` runs the script in a fresh process)."""
    res = ex_dir / f'{study}.result'
    child = mp.get_context('fork').Process(target=_example_child, args=(study, ex_dir, res))
    child.start(); child.join()
    text = res.read_text() if res.exists() else f'the example batch process ended with exit code {child.exitcode}'
    return subprocess.CompletedProcess([study], int(child.exitcode != 0), text if child.exitcode == 0 else '', text)


def _example_child(study: str, ex_dir: Path, res: Path):
    ok = False
    try:
        os.chdir(ex_dir)
        res.write_text(eb.main(study, Path('runs') / study)); ok = True
    except BaseException as e:
        res.write_text(f'{type(e).__name__}: {e}')
    finally:
        os._exit(0 if ok else 1)


class _Page(HTMLParser):
    def __init__(self, text):
        super().__init__()
        self.ids, self.nav, self.h1 = set(), [], []
        self._in_h1 = False
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if 'id' in a: self.ids.add(a['id'])
        if tag == 'a' and 'md-nav__link' in (a.get('class') or '') and a.get('href', '').endswith('.html'):
            self.nav.append(a['href'])
        if tag == 'h1': self._in_h1 = True

    def handle_endtag(self, tag):
        if tag == 'h1': self._in_h1 = False

    def handle_data(self, data):
        if self._in_h1 and data.strip() not in ('', '¶'): self.h1.append(data.strip())


@functools.lru_cache(maxsize=None)  # the site is built once a session; each page is parsed once (the tests only read it)
def page(site: Path, html: str) -> tuple[str, _Page]:
    text = (site / html).read_text(encoding='utf-8')
    return text, _Page(text)


def default_exp(d: bd.DocNb) -> str | None:
    """The module a chapter exports (its code cells' `#| default_exp`); None for a guide, a chapter with no exported
    cell (it may show a default_exp line in its prose)."""
    cells = [''.join(c['source']) for c in json.loads(d.src.read_text())['cells'] if c['cell_type'] == 'code']
    mods = [m[1] for s in cells if (m := re.match(r'#\|\s*default_exp\s+([\w.]+)', s))]
    exports = any(re.match(r'#\|\s*export', s) for s in cells)
    assert mods or not exports, f'{d.src}: exported cells but no default_exp'
    return mods[0] if mods else None


def test_notebooks_are_discovered():
    """The notebooks nbdev_test runs are the library chapters (index first, then in reading order, one folder per package);
    nbs/experiments and nbs/reports hold a .notest file."""
    names = [d.src.name for d in LIB_NBS]
    assert names[0] == 'index.ipynb', 'index.ipynb is the home page'
    numbers = [bd.chapter_number(d.src) for d in LIB_NBS[1:]]
    assert len(numbers) >= 2 and numbers == sorted(numbers) and len(set(numbers)) == len(numbers), 'one number per chapter'
    folders = bd.sections(LIB_NBS[1:], ROOT / 'nbs')  # raises for a chapter outside the package folders
    assert list(folders)[:2] == ['base', 'data'] and list(folders)[-1] == 'app', folders  # in reading order
    for d in LIB_NBS[1:]:
        folder, mod = d.src.parent.relative_to(ROOT / 'nbs').as_posix(), default_exp(d)
        if mod is None: continue  # a guide: no module
        assert mod.rsplit('.', 1)[0].replace('.', '/') == folder, f'{d.src}: exports {mod}, not a module of {folder}'
    assert {d.html for d in LIB_NBS} >= {'index.html', 'model/gpt.html'}, 'pages named as nbdev names them (23_gpt -> gpt)'
    for folder in ('experiments', 'reports'):
        assert (ROOT / 'nbs' / folder / '.notest').exists(), f'nbdev_test must skip nbs/{folder} (papermill notebooks)'
        assert {d.dest for d in DOCS if d.src.parent.name == folder and not d.library} == \
               {f'{folder}/{p.name}' for p in (ROOT / 'nbs' / folder).glob('*.ipynb')}


def test_chapter_numbers_follow_dependencies():
    "Reading order: a chapter's exported code imports only modules of chapters numbered before it."
    number = {f'oelm_nb.{default_exp(d)}': bd.chapter_number(d.src) for d in LIB_NBS[1:] if default_exp(d)}
    late = []
    for d in LIB_NBS[1:]:
        me = bd.chapter_number(d.src)
        for c in json.loads(d.src.read_text())['cells']:
            s = ''.join(c['source'])
            if c['cell_type'] != 'code' or not re.match(r'#\|\s*export', s): continue
            for m in re.findall(r'from (oelm_nb(?:\.\w+)+) import', s):
                if number.get(m, -1) > me: late.append(f'{d.src.name} imports {m} (chapter {number[m]})')
    assert not late, late


def test_nav_is_made_from_the_notebooks_and_site_settings_match():
    """The nav (tools/build_docs.py `nav`, not mkdocs.yml) lists every notebook once, in reading order and by package, under
    its title; a study's section is headed by its registered title; mkdocs.yml's site settings are settings.ini's."""
    from mkdocs.utils import yaml_load
    from oelm_nb.lab.study import studies
    conf = yaml_load((ROOT / 'mkdocs.yml').read_text())
    assert 'nav' not in conf, 'mkdocs.yml has no nav: tools/build_docs.py makes it from the notebooks'
    entry = lambda d: {'Home' if d.dest == 'index.ipynb' else bd.title(d): d.dest}
    expected = [entry(LIB_NBS[0])]
    for folder, heading in bd.sections(LIB_NBS[1:], ROOT / 'nbs').items():
        expected.append({heading: [entry(d) for d in LIB_NBS[1:] if d.src.parent.relative_to(ROOT / 'nbs').as_posix() == folder]})
    for section in dict.fromkeys(d.dest.split('/')[0] for d in DOCS if not d.library):
        expected.append({section.title(): [entry(d) for d in DOCS if not d.library and d.dest.split('/')[0] == section]})
    got = bd.nav(DOCS)
    assert got == expected
    pages = [p for sec in got for v in sec.values() for p in ([v] if isinstance(v, str) else [q for e in v for q in e.values()])]
    assert sorted(pages) == sorted(d.dest for d in DOCS) and len(pages) == len(set(pages))  # every notebook, once
    headings = [h for sec in got for h in sec]
    for name, st in studies().items():
        if st.title and st.report: assert f'Study: {st.title}' in headings, (name, headings)  # the registry's title
    assert 'Study: Q/K freeze' in headings and 'Study: qk_freeze' not in headings
    cfg = bd.nbdev_config()
    assert (conf['site_name'], conf['site_description'], conf['repo_url']) == (cfg.title, cfg.description, cfg.git_url)
    assert conf['site_url'] == BASE_URL + '/' and conf['site_dir'] == cfg.doc_path.name
    assert conf['use_directory_urls'] is False and conf['theme']['font'] is False and conf['strict'] is True

@pytest.mark.slow  # reads the site built once per session (about 35 s): `make test` runs it, `make test-fast` does not
@pytest.mark.parametrize('nb', LIB_NBS, ids=[d.src.name for d in LIB_NBS])
def test_every_library_notebook_has_a_page(site, nb):
    assert (site / nb.html).exists(), f'{nb.src.name} has no page {nb.html}'
    text, p = page(site, nb.html)
    assert 'jupyter-wrapper' in text, f'{nb.html} holds no rendered notebook'
    src = json.loads(nb.src.read_text())
    first = ''.join(src['cells'][0]['source']) if src['cells'] else ''
    m = re.match(r'#\s+(.+)', first.strip())
    if m: assert m.group(1).strip() in ' '.join(p.h1), f'{nb.html}: the title "{m.group(1)}" is missing'


@pytest.mark.slow  # reads the site built once per session (about 35 s): `make test` runs it, `make test-fast` does not
def test_navigation_lists_every_chapter_in_order(site):
    _, p = page(site, 'index.html')
    order = list(dict.fromkeys(h for h in p.nav if h in {d.html for d in LIB_NBS}))
    assert order == [d.html for d in LIB_NBS]


@pytest.mark.slow  # reads the site built once per session (about 35 s): `make test` runs it, `make test-fast` does not
def test_no_broken_internal_links(site):
    broken = check_site(site, BASE_PATH)
    assert not broken, f'{len(broken)} broken internal link(s):\n' + '\n'.join(map(str, broken[:40]))


@pytest.mark.slow  # reads the site built once per session (about 35 s): `make test` runs it, `make test-fast` does not
def test_api_reference_is_rendered_html(site):
    "Each public exported function/class has a show_doc entry: an anchored heading and a highlighted signature."
    import importlib
    modidx = importlib.import_module(f"{bd.nbdev_config().lib_name}._modidx").d
    checked, missing, pages = 0, [], {}
    for mod, syms in modidx['syms'].items():
        for name, (link, _) in syms.items():
            short = name[len(mod) + 1:]
            if '.' in short or short.startswith('_'): continue
            html, anchor = link.split('#')
            if not (site / html).exists(): continue
            if html not in pages: pages[html] = page(site, html)[1].ids
            if slugify(anchor) not in pages[html]: missing.append(f'{html}#{anchor} ({name})')
            checked += 1
    assert checked > 0
    assert not missing, 'exported symbols without an API entry on their page:\n' + '\n'.join(missing)
    for nb in LIB_NBS:
        text, _ = page(site, nb.html)
        assert '{target="_blank"' not in text and '```' not in text, f'{nb.html}: show_doc markdown left raw'
        if bd.SHOWDOC_MARKER in text: assert 'class="highlight' in text, f'{nb.html}: signatures not highlighted'


@pytest.mark.slow  # reads the site built once per session (about 35 s): `make test` runs it, `make test-fast` does not
@pytest.mark.parametrize('study', EXAMPLE_STUDIES)
def test_report_page_is_executed_on_an_example_batch(site, study):
    "A study's report page shows the report computed from real (seconds-long) runs, says so, and links no run file."
    report = {v: k for k, v in eb.report_studies().items()}[study]
    page_html = site / report.replace('.ipynb', '.html')
    text = page_html.read_text()
    assert 'Executed on an example batch' in text and 'answer none of its questions' in text
    assert text.count('<img') >= 1, 'the report draws figures'
    assert f'runs/{study}' in text and str(ROOT / '_mkdocs') not in text and '/build/examples' not in text  # paths read as the batch's own
    assert 'summary.json">' not in text and 'metrics.jsonl">' not in text  # the run files are not on the site
    batch = site.parent / 'build' / 'examples' / 'runs' / study
    summaries = [json.loads(p.read_text()) for p in batch.glob('*-s[0-9]*/summary.json')]
    assert len(summaries) == 2 and all(s['status'] == 'completed' for s in summaries)
    variants = ', '.join(example_variants(study))
    assert {s['seed'] for s in summaries} == set(EXAMPLE_SEEDS) and f"seed {EXAMPLE_SEEDS[0]}, variants {variants}, on a" in text  # the note says which
    # the site shows the reports under nbs/ (a study registered from elsewhere, like tests/toy_study, has its own)
    others = [r for r, st in eb.report_studies().items() if st not in EXAMPLE_STUDIES and not Path(r).is_absolute()]
    for r in others: assert 'Not executed for this site' in (site / r.replace('.ipynb', '.html')).read_text()  # shown as saved


@pytest.mark.slow  # reads the site built once per session (about 35 s): `make test` runs it, `make test-fast` does not
def test_site_is_self_contained_for_offline_viewing(site):
    "No font CDN; plain .html pages (use_directory_urls: false); nbdev's links to the docs host lead inside the site."
    text, _ = page(site, 'index.html')
    assert 'fonts.googleapis' not in text
    assert not (site / 'base' / 'core').is_dir()
    hosted = [p.name for p in site.rglob('*.html') if f'href="{BASE_URL}/' in p.read_text(encoding='utf-8')]
    assert not hosted, f'links to {BASE_URL} left on {hosted}'
    assert 'href="../model/gpt.html#gpt"' in page(site, 'train/memory.html')[0], 'a link to an API entry leads to its anchor'
    assert 'href="../model/gpt.html#gpt"' in page(site, 'lab/export.html')[0]


@pytest.mark.slow  # reads the site built once per session (about 35 s): `make test` runs it, `make test-fast` does not
def test_site_is_polished(site):
    """Figures are described by their section, every image has alt text and every cell's input and output take the keyboard
    focus (nbconvert's accessibility pass, done by regex in tools/build_docs.py), 404.html works at any depth, the search
    index has no copy-button text."""
    pages = {p: p.read_text(encoding='utf-8') for p in site.rglob('*.html')}
    assert not [p.name for p, t in pages.items() if bd.NO_ALT in t]
    assert any('alt="Figure: ' in t for t in pages.values())
    assert not [m[0] for t in pages.values() for m in re.finditer(r'alt="[^"]*(?:¶|&#182;)[^"]*"', t)], 'a heading\'s permalink sign in alt text'
    assert not [p.name for p, t in pages.items() if re.search(r'<img(?![^>]*\salt=)', t)], 'an image without alt text'
    cells = re.compile(r'<div\b[^>]*class="[^"]*\b(?:jp-Cell-inputWrapper|jp-OutputArea-output)\b[^>]*>')
    tags = [m[0] for t in pages.values() for m in cells.finditer(t)]
    assert len(tags) > 500 and all('tabindex="0"' in m for m in tags), [m for m in tags if 'tabindex' not in m][:3]
    assert f'"{BASE_PATH}/assets' not in pages[site / '404.html'] and f'<base href="{BASE_PATH}/">' in pages[site / '404.html']
    assert 'Copied!' not in (site / 'search' / 'search_index.json').read_text()


@pytest.mark.slow  # a process of its own: `make test` runs it, `make test-fast` does not
def test_a_page_missing_from_the_nav_fails_the_build(site, tmp_path):
    "mkdocs.yml's validation (strict): a notebook page that the nav does not list stops the build, naming it."
    built = site.parent / 'build' / 'docs'  # two of the pages are enough (the nav's other entries are then reported missing too)
    shutil.copytree(built / 'stylesheets', tmp_path / 'docs' / 'stylesheets')
    for name in ('index.ipynb', 'base/core.ipynb'):
        (tmp_path / 'docs' / name).parent.mkdir(parents=True, exist_ok=True); shutil.copy(built / name, tmp_path / 'docs' / name)
    shutil.copy(built / 'base' / 'core.ipynb', tmp_path / 'docs' / 'new_chapter.ipynb')
    with pytest.raises(bd.DocsBuildError, match=r'(?s)nav.*new_chapter\.ipynb'):
        bd.run_mkdocs(tmp_path / 'docs', tmp_path / 'site', [{'Home': 'index.ipynb'}, {'Core': 'base/core.ipynb'}])


# ------------------------------------------------------------------------------ one notebook: nbdev's test_nb, then its docs processors
def _nb(*cells) -> dict:
    def cell(src):
        if src.startswith('md:'): return {'cell_type': 'markdown', 'metadata': {}, 'source': src[3:]}
        return {'cell_type': 'code', 'execution_count': None, 'metadata': {}, 'outputs': [], 'source': src}
    return {'cells': [cell(c) for c in cells], 'metadata': {'kernelspec': {'name': 'python3', 'language': 'python',
            'display_name': 'Python 3'}}, 'nbformat': 4, 'nbformat_minor': 4}


def _process(tmp_path, nb: dict, name: str) -> tuple[bool, object, Path]:
    src, dst = tmp_path / 'nbs' / name, tmp_path / 'out' / name
    src.parent.mkdir(parents=True, exist_ok=True)
    src.write_text(json.dumps(nb))
    # in a fresh process, as the build does (IPython takes over the process it runs in)
    with cf.ProcessPoolExecutor(1, mp_context=mp.get_context('spawn')) as ex:
        ok, res = ex.submit(bd._worker, str(src), str(dst), True).result()
    return ok, res, dst


def test_executed_notebook_keeps_outputs_figures_and_api_docs(tmp_path):
    nb = _nb('md:# Tiny chapter\n\n> A synthetic notebook.',
             '#| export\ndef add(a:int, # the first number\n        b:int=1)->int:\n    "Add two numbers."\n    return a + b',
             'print(add(2))',
             'import matplotlib.pyplot as plt\nplt.figure(figsize=(2, 1)); plt.plot([1, 3, 2]);',
             '#| hide\nsecret = 42',
             '#| slow\nraise RuntimeError("flagged slow: never runs")',
             '#| eval: false\nraise RuntimeError("eval: false: never runs")')
    ok, res, dst = _process(tmp_path, nb, '01_tiny.ipynb')
    assert ok, res
    cells = bd.adapt_notebook(json.loads(dst.read_text()))['cells']
    sources = [''.join(c['source']) for c in cells]
    assert sources[0].startswith('# Tiny chapter\n\n> A synthetic notebook.'), 'the title and description come first'
    assert any(bd.SHOWDOC_MARKER in s and '### add' in s and 'the first number' in s for s in sources), 'show_doc entry missing'
    assert not any('secret' in s for s in sources), '#| hide cell shown'
    assert not any('#|' in s for s in sources), 'cell options left in the code'
    outs = [o for c in cells for o in c.get('outputs', [])]
    assert any(o.get('name') == 'stdout' and ''.join(o['text']).strip() == '3' for o in outs)
    assert any('image/png' in o.get('data', {}) for o in outs), 'matplotlib figure missing'


def test_a_failing_cell_fails_with_notebook_cell_and_error(tmp_path):
    ok, msg, _ = _process(tmp_path, _nb('x = 1', 'y = x / 0'), '02_broken.ipynb')
    assert not ok
    assert '02_broken.ipynb' in msg and 'y = x / 0' in msg and 'ZeroDivisionError' in msg


@pytest.mark.slow  # a process of its own: `make test` runs it, `make test-fast` does not
def test_notebook_check_fails_on_a_broken_notebook(tmp_path):
    """Negative control of `make nbtest`: `build_docs.py --check-only` on a small nbdev project exits with status 1, naming
    the broken notebook, its cell and the error; cells flagged `slow` or `#| eval: false` are skipped (nbdev's rules)."""
    (tmp_path / 'tools').mkdir(); (tmp_path / 'nbs').mkdir(); (tmp_path / 'oelm_nb').mkdir()
    shutil.copy(ROOT / 'tools' / 'build_docs.py', tmp_path / 'tools')
    shutil.copy(ROOT / 'settings.ini', tmp_path)  # tst_flags = slow cuda
    (tmp_path / 'nbs' / '00_fine.ipynb').write_text(json.dumps(_nb(
        'md:# Fine', 'x = 1', '#| slow\nraise RuntimeError("flagged slow: skipped")',
        '#| eval: false\nraise RuntimeError("eval: false: skipped")', 'assert x == 1')))
    (tmp_path / 'nbs' / '01_broken.ipynb').write_text(json.dumps(_nb('md:# Broken', 'x = 1', 'y = x / 0', 'print("never")')))
    r = subprocess.run([sys.executable, 'tools/build_docs.py', '--check-only', '--jobs', '2'], cwd=tmp_path,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 1, r.stdout + r.stderr
    assert 'nbs/00_fine.ipynb -> fine.html' in r.stdout, 'the notebook with skipped failing cells passes'
    assert '1 notebook(s) failed' in r.stderr and 'nbs/01_broken.ipynb: cell 3 raised ZeroDivisionError' in r.stderr
    assert 'y = x / 0' in r.stderr and 'Traceback' in r.stderr
    assert 'skipped' not in r.stderr and (tmp_path / '_mkdocs' / 'proc' / 'fine.key').exists()
    assert not (tmp_path / '_mkdocs' / 'proc' / 'broken.key').exists(), 'a failed notebook is not cached'


def test_page_is_what_quarto_would_show():
    "adapt_notebook: frontmatter as title, show_doc markdown as text, Quarto cell options applied, widgets as a note."
    md = ('---\n\n[source](https://x/y.py#LNone){target="_blank" style="float:right"}\n\n### __init__\n\n'
          '```python\ndef f(a, # see [`g`](https://host/m.html#g)\n):\n```\n')
    out = lambda data: {'output_type': 'display_data', 'metadata': {}, 'data': data}
    nb = {'cells': [{'cell_type': 'raw', 'metadata': {}, 'source': '---\ntitle: T\ndescription: D\n---'},
                    {'cell_type': 'code', 'metadata': {}, 'outputs': [out({'text/markdown': md})],
                     'source': '#| output: asis\n#| echo: false\nshow_doc(f)'},
                    {'cell_type': 'code', 'metadata': {}, 'outputs': [out({bd.WIDGET_MIME: {}, 'text/plain': 'w'})], 'source': 'w'},
                    {'cell_type': 'code', 'metadata': {}, 'outputs': [out({'text/plain': '1'})], 'source': '#| echo: false\n1'},
                    {'cell_type': 'code', 'metadata': {}, 'outputs': [out({'text/plain': '2'})], 'source': '#| output: false\n2'},
                    {'cell_type': 'code', 'metadata': {}, 'outputs': [], 'source': '#| include: false\n3'}],
          'metadata': {'widgets': {'state': {}}}}
    title, doc, widget, echo, output = bd.adapt_notebook(nb)['cells']
    assert title['source'] == '# T\n\n> D\n' and 'widgets' not in bd.adapt_notebook(nb)['metadata']
    assert doc['cell_type'] == 'markdown' and bd.SHOWDOC_MARKER in doc['source'] and '### \\_\\_init\\_\\_' in doc['source']
    assert '<a href="https://x/y.py" class="nbdev-source" target="_blank"' in doc['source'] and '---' not in doc['source']
    assert '# see `g`' in doc['source'], 'no markdown links inside the signature'
    assert widget['outputs'][0]['data'] == {'text/html': bd.WIDGET_NOTE}
    assert echo['metadata']['tags'] == [bd.HIDE_INPUT] and echo['source'] == '1' and echo['outputs']
    assert output['source'] == '2' and output['outputs'] == []


# ------------------------------------------------------------------------------ Quarto / nbdev configuration
def test_quarto_config_is_one_valid_nbdev_file():
    top, nbs = ROOT / '_quarto.yml', ROOT / 'nbs' / '_quarto.yml'
    assert top.exists() and nbs.exists()
    assert nbs.resolve() == top.resolve() or nbs.read_text() == top.read_text(), \
        'nbs/_quarto.yml must be the top-level _quarto.yml (a link to it)'
    q = yaml.safe_load(top.read_text())
    assert q['project']['type'] == 'website'
    assert set(q['metadata-files']) >= {'nbdev.yml', 'sidebar.yml'}
    assert 'html' in q['format']
    css = q['format']['html'].get('css')
    if css: assert (ROOT / 'nbs' / css).exists(), f'{css} referenced by _quarto.yml is missing from nbs/'


def test_nbdev_yml_matches_settings():
    "nbs/nbdev.yml is what nbdev's refresh_quarto_yml writes from settings.ini (nbdev_docs rewrites it)."
    from nbdev.quarto import _nbdev_yml
    cfg = bd.nbdev_config()
    vals = {k: cfg[k] for k in ['title', 'description', 'branch', 'git_url', 'doc_host', 'doc_baseurl']}
    vals['doc_path'] = cfg.doc_path.name
    assert (ROOT / 'nbs' / 'nbdev.yml').read_text() == _nbdev_yml.format(**vals), \
        'nbs/nbdev.yml is out of date: run `.venv/bin/python -c "from nbdev.quarto import refresh_quarto_yml; refresh_quarto_yml()"`'
    assert yaml.safe_load((ROOT / 'nbs' / 'nbdev.yml').read_text())['project']['output-dir'] == cfg.doc_path.name


# ------------------------------------------------------------------------------ the link checker itself
def test_link_checker_reports_what_is_broken(tmp_path):
    (tmp_path / 'sub').mkdir()
    (tmp_path / 'img.png').write_bytes(b'')
    (tmp_path / 'b.html').write_text('<h2 id="there">x</h2><a name="named"></a>')
    (tmp_path / 'sub' / 'c.html').write_text('<a href="../b.html#there">ok</a><a href="../b.html#gone">bad</a>')
    (tmp_path / 'a.html').write_text(
        '<a href="b.html#there">ok</a> <a href="b.html#named">ok</a> <a href="#self">ok</a> <p id="self"></p>'
        '<img src="img.png"> <a href="https://example.org/x.html#y">external</a> <a href="/site/b.html">ok</a>'
        '<a href="missing.html">bad</a> <a href="b.html#nope">bad</a> <img src="gone.png"> <a href="#nowhere">bad</a>')
    broken = {(b.page, b.link) for b in check_site(tmp_path, '/site/')}
    assert broken == {('a.html', 'missing.html'), ('a.html', 'b.html#nope'), ('a.html', 'gone.png'),
                      ('a.html', '#nowhere'), ('sub/c.html', '../b.html#gone')}


def test_polish_site_describes_figures_and_cleans_search(tmp_path):
    "After mkdocs: figures described by their section and page, no 'Copied!' (the copy button) in the search index."
    site = tmp_path / 'site'; (site / 'search').mkdir(parents=True); (site / 'reports').mkdir()
    (site / 'reports' / 'x.html').write_text('<html><head><title>Reports x - oelm_nb</title></head><body><h2>Curves &amp; more</h2>'
                                             f'<img src="a.png" alt="{bd.NO_ALT}"><h3>entry</h3><img alt="{bd.NO_ALT}"></body></html>')
    (site / 'search' / 'search_index.json').write_text(json.dumps({'docs': [{'location': 'a.html', 'text': 'Copied! x = 1'}]}))
    assert bd.polish_site(site) == {'alt': 2, 'copied': 1}
    x = (site / 'reports' / 'x.html').read_text()
    assert x.count('alt="Figure: Curves &amp; more (Reports x)"') == 2 and bd.NO_ALT not in x
    assert json.loads((site / 'search' / 'search_index.json').read_text())['docs'][0]['text'] == 'x = 1'


def test_site_links_made_internal(tmp_path):
    "Links to the site's public address become relative (a missing anchor: the page); 404.html works from any depth."
    (tmp_path / 'sub').mkdir()
    (tmp_path / 'model.html').write_text('<h3 id="gptforward">GPT.forward</h3>')
    (tmp_path / 'index.html').write_text('home')
    (tmp_path / 'sub' / 'a.html').write_text('<a href="https://h.io/site/model.html#gpt.forward">x</a> <a href="https://h.io/site/model.html#_private">y</a>'
                                             ' <a href="https://h.io/site/gone.html">z</a> <a href="https://h.io/site/">home</a>')
    (tmp_path / '404.html').write_text('<html><head><link href="/site/assets/main.css"></head><body><a href="/site/">home</a></body></html>')
    assert relink(tmp_path, 'https://h.io/site', slugify) == 3
    a = (tmp_path / 'sub' / 'a.html').read_text()
    assert 'href="../model.html#gptforward"' in a and 'href="../model.html"' in a and 'href="../index.html"' in a
    assert 'href="https://h.io/site/gone.html"' in a, 'a page this site lacks: the link stays as nbdev wrote it'
    assert relative_404(tmp_path, '/site/') == 2
    p404 = (tmp_path / '404.html').read_text()
    assert 'href="./assets/main.css"' in p404 and '"/site/assets' not in p404 and '<base href="/site/">' in p404


def test_a_new_study_folder_gets_its_docs_section(tmp_path):
    """A study's chapters in nbs/studies/NAME/ are a section of the docs without editing tools/build_docs.py or mkdocs.yml:
    headed by its registered title, or by its folder's name before it is registered."""
    nbs = tmp_path / 'nbs'
    chapter = lambda rel: bd.DocNb(nbs / rel, rel, True)
    chapters = [chapter('app/91_cli.ipynb'), chapter('base/00_core.ipynb'), chapter('studies/toy/95_study.ipynb')]
    got = bd.sections(chapters, nbs, studies={})
    assert got == {'base': bd.SECTIONS['base'], 'app': 'Application', 'studies/toy': 'Study: toy'}  # by chapter number
    assert bd.sections(chapters, nbs, studies={'studies/toy': 'Study: A toy'})['studies/toy'] == 'Study: A toy'
    assert bd.study_sections()['studies/qk_freeze'] == 'Study: Q/K freeze'  # from the entry points and Study.title
    with pytest.raises(KeyError, match='package folder'):
        bd.sections([chapter('misc/99_notes.ipynb')], nbs)


def test_the_search_index_holds_prose_not_code_or_tables():
    "A search finds chapters by their prose: code blocks (and the copy button's repeat of them), output tables and the permalink sign are left out."
    ix = {'docs': [{'location': 'a.html#s', 'title': 'Freezing Q/K\u00b6',
                    'text': '<p>Why we freeze.</p> <pre>test_eq(freeze(m),\n  1)</pre> test_eq(freeze(m),\n1) '
                            '<table><tr><td>oelm-freeze</td></tr></table> <p>Then &lt;more&gt; prose.</p>'}]}
    d = bd.search_prose(ix)['docs'][0]
    assert d['title'] == 'Freezing Q/K'
    assert d['text'] == '<p>Why we freeze.</p> <p>Then &lt;more&gt; prose.</p>', d['text']
    assert bd.search_prose({'docs': [{'title': 't', 'text': '<pre>a</pre> b'}]})['docs'][0]['text'] == 'b'  # not a repeat: kept
