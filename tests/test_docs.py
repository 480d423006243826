"""The documentation site (tools/build_docs.py) and the Quarto configuration nbdev_docs reads.

The site is built once per test session, as `make docs` builds it, into a temporary folder shared
by the pytest-xdist workers. Executed notebooks that `make docs` / `make readme` left in _mkdocs/proc
are reused when they are still valid (their key covers the notebook, the library and settings.ini),
so a fresh clone executes every notebook and a working copy after `make docs` only re-renders.
OELM_DOCS_TEST_EXECUTE=showdoc builds with nbdev's own execution for docs instead (only what show_doc
needs, as nbdev_proc_nbs / nbdev_docs do): a check that nbdev_docs would get through the notebooks.
"""
from __future__ import annotations

import concurrent.futures as cf
import fcntl
import json
import multiprocessing as mp
import os
import re
import shutil
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / 'tools'))
import build_docs as bd  # noqa: E402
from check_links import check_site  # noqa: E402

LIB_NBS = bd.library_notebooks()
# the site's report pages run an example batch each (`make docs`: every study, about 2 minutes); here one study's, to
# keep `make test` short: the machinery is the same for all, and each study's report is tested on real batches by its own suite
EXAMPLE_STUDIES = ('qk-freeze',)
BASE_PATH = '/' + bd.nbdev_config().get('doc_baseurl', '').strip('/')


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
                bd.build(site_dir=out / 'site', build_dir=out / 'build', jobs=2, use_cache=True, check_links=False,
                         execute=os.environ.get('OELM_DOCS_TEST_EXECUTE', 'all'), examples=EXAMPLE_STUDIES)
                ok.write_text('ok')
            except bd.DocsBuildError as e:
                failed.write_text(str(e))
        if failed.exists(): pytest.fail(f'the docs build failed:\n{failed.read_text()}', pytrace=False)
    return out / 'site'


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


def page(site: Path, html: str) -> tuple[str, _Page]:
    text = (site / html).read_text(encoding='utf-8')
    return text, _Page(text)


def test_notebooks_are_discovered():
    names = [d.src.name for d in LIB_NBS]
    assert names[0] == 'index.ipynb', 'index.ipynb is the home page'
    assert len(names) >= 2 and all(d.library for d in LIB_NBS)
    assert [d.src for d in LIB_NBS[1:]] == sorted((d.src for d in LIB_NBS[1:]), key=bd.nb_order), \
        'chapters are ordered by notebook number'
    assert [bd.nb_order(Path(n))[1] for n in ('2_a.ipynb', '10_b.ipynb')] == [2, 10]
    assert {d.html for d in LIB_NBS} >= {'index.html'}
    assert not any(d.src.parent != ROOT / 'nbs' for d in LIB_NBS), 'sub-folders of nbs/ are not library chapters'


@pytest.mark.parametrize('nb', LIB_NBS, ids=[d.src.name for d in LIB_NBS])
def test_every_library_notebook_has_a_page(site, nb):
    assert (site / nb.html).exists(), f'{nb.src.name} has no page {nb.html}'
    text, p = page(site, nb.html)
    assert 'jupyter-wrapper' in text, f'{nb.html} holds no rendered notebook'
    src = json.loads(nb.src.read_text())
    first = ''.join(src['cells'][0]['source']) if src['cells'] else ''
    m = re.match(r'#\s+(.+)', first.strip())
    if m: assert m.group(1).strip() in ' '.join(p.h1), f'{nb.html}: the title "{m.group(1)}" is missing'


def test_navigation_lists_every_chapter_in_order(site):
    _, p = page(site, 'index.html')
    order = list(dict.fromkeys(h for h in p.nav if h in {d.html for d in LIB_NBS}))
    assert order == [d.html for d in LIB_NBS]


def test_no_broken_internal_links(site):
    broken = check_site(site, BASE_PATH)
    assert not broken, f'{len(broken)} broken internal link(s):\n' + '\n'.join(map(str, broken[:40]))


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
            if bd._slugify(anchor) not in pages[html]: missing.append(f'{html}#{anchor} ({name})')
            checked += 1
    assert checked > 0
    assert not missing, 'exported symbols without an API entry on their page:\n' + '\n'.join(missing)
    for nb in LIB_NBS:
        text, _ = page(site, nb.html)
        assert '{target="_blank"' not in text and '```' not in text, f'{nb.html}: show_doc markdown left raw'
        if bd.SHOWDOC_MARKER in text: assert 'class="highlight' in text, f'{nb.html}: signatures not highlighted'


@pytest.mark.parametrize('study', EXAMPLE_STUDIES)
def test_report_page_is_executed_on_an_example_batch(site, study):
    "A study's report page shows the report computed from real (seconds-long) runs, says so, and links no run file."
    report = {v: k for k, v in bd.report_studies().items()}[study]
    page_html = site / report.replace('.ipynb', '.html')
    text = page_html.read_text()
    assert 'Executed on an example batch' in text and 'answer none of its questions' in text
    assert text.count('<img') >= 1, 'the report draws figures'
    assert f'runs/{study}' in text and str(ROOT / '_mkdocs') not in text and '/build/examples' not in text  # paths read as the batch's own
    assert 'summary.json">' not in text and 'metrics.jsonl">' not in text  # the run files are not on the site
    batch = site.parent / 'build' / 'examples' / 'runs' / study
    summaries = [json.loads(p.read_text()) for p in batch.glob('*-s[0-9]*/summary.json')]
    assert len(summaries) >= 4 and all(s['status'] == 'completed' for s in summaries)
    assert {s['seed'] for s in summaries} == {0, 1}
    others = [r for r, st in bd.report_studies().items() if st not in EXAMPLE_STUDIES]
    for r in others: assert 'Not executed for this site' in (site / r.replace('.ipynb', '.html')).read_text()  # shown as saved


def test_site_is_self_contained_for_offline_viewing(site):
    "No page loads fonts from a CDN; pages are plain .html files (use_directory_urls: false)."
    text, _ = page(site, 'index.html')
    assert 'fonts.googleapis' not in text
    assert not (site / 'core').is_dir()


# ------------------------------------------------------------------------------ execution path of `make docs`
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
        ok, res = ex.submit(bd._worker, str(src), str(dst), 'all', ('slow',)).result()
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
    page_nb, title = bd.adapt_notebook(json.loads(dst.read_text()))
    assert title == 'Tiny chapter'
    cells = page_nb['cells']
    sources = [''.join(c['source']) for c in cells]
    assert any(bd.SHOWDOC_MARKER in s and '### add' in s for s in sources), 'show_doc entry missing'
    assert not any('secret' in s for s in sources), '#| hide cell shown'
    outs = [o for c in cells for o in c.get('outputs', [])]
    assert any(o.get('name') == 'stdout' and ''.join(o['text']).strip() == '3' for o in outs)
    assert any('image/png' in o.get('data', {}) for o in outs), 'matplotlib figure missing'


def test_a_failing_cell_fails_with_notebook_cell_and_error(tmp_path):
    ok, msg, _ = _process(tmp_path, _nb('x = 1', 'y = x / 0'), '02_broken.ipynb')
    assert not ok
    assert '02_broken.ipynb' in msg and 'y = x / 0' in msg and 'ZeroDivisionError' in msg


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


def test_polish_site_fixes_404_alt_text_and_search(tmp_path):
    "The site's finishing pass: a 404 page that works from any depth, figures described by their section, no 'Copied!' in search."
    site = tmp_path / 'site'; (site / 'search').mkdir(parents=True); (site / 'reports').mkdir()
    (site / '404.html').write_text('<html><head><link href="/oelm_nb/assets/main.css"></head><body><a href="/oelm_nb/">home</a></body></html>')
    (site / 'reports' / 'x.html').write_text('<html><head><title>Reports x - oelm_nb</title></head><body><h2>Curves &amp; more</h2>'
                                             f'<img src="a.png" alt="{bd.NO_ALT}"><h3>entry</h3><img alt="{bd.NO_ALT}"></body></html>')
    (site / 'search' / 'search_index.json').write_text(json.dumps({'docs': [{'location': 'a.html', 'text': 'Copied! x = 1'}]}))
    counts = bd.polish_site(site, '/oelm_nb/')
    assert counts == {'alt': 2, 'copied': 1, '404': 2}
    p404 = (site / '404.html').read_text()
    assert 'href="./assets/main.css"' in p404 and '"/oelm_nb/assets' not in p404 and '<base href="/oelm_nb/">' in p404
    x = (site / 'reports' / 'x.html').read_text()
    assert x.count('alt="Figure: Curves &amp; more (Reports x)"') == 2 and bd.NO_ALT not in x
    assert json.loads((site / 'search' / 'search_index.json').read_text())['docs'][0]['text'] == 'x = 1'
