"""Pages as a reader sees them, in a real browser (issue 63): headless Chromium (tests/browser_check.py) loads the report of
the docs test's example batch (its `report.html`, beside the batch, as `oelm run` writes it) and the docs site that
tests/test_docs.py builds, at 1440x900 and 390x844, and fails on a page wider than the screen, a table cut without a
scroll box, a broken link or image, or a console error from the page's own code. The check itself is tested on planted
faults first. One browser for the session; the pages are those the docs test builds anyway.

Without Chromium (or Playwright) the tests skip with one line saying what to install; with OELM_REQUIRE_BROWSER set
(.ci/run sets it) they fail instead.
"""
from __future__ import annotations
import os
from pathlib import Path

import pytest

import browser_check as bc
from test_docs import site  # noqa: F401  (the docs site fixture: built once per session, shared with test_docs)

pytestmark = pytest.mark.slow  # the docs site and its example batch: `make test` runs them, `make test-fast` does not


@pytest.fixture(scope='session')
def browser():
    "One headless Chromium for every page of the session."
    if (why := bc.missing()):
        if os.environ.get(bc.REQUIRE_ENV): pytest.fail(f'{bc.REQUIRE_ENV} is set and {why}', pytrace=False)
        pytest.skip(why)
    from playwright.sync_api import sync_playwright
    with sync_playwright() as pw:
        b = bc.launch(pw)
        yield b
        b.close()


PAGE = '''<!doctype html><html><head><meta name="viewport" content="width=device-width, initial-scale=1">
<style>body {{ margin: 8px; font: 16px sans-serif; }} .box {{ overflow-x: auto; }}</style></head>
<body><h1>A page</h1><p>Text that fits.</p>{body}</body></html>'''
WIDE_TABLE = '<table><tr>' + ''.join(f'<th>column_{i}_with_a_long_name</th>' for i in range(12)) + '</tr></table>'


def planted(tmp_path: Path, **bodies) -> Path:
    "A folder of pages named after the keywords, each a small page with that body."
    (tmp_path / 'fig.png').write_bytes(bytes.fromhex('89504e470d0a1a0a0000000d4948445200000001000000010806000000'
                                                     '1f15c4890000000d49444154789c63f8cfc0f01f0005000201a2d6ea1a0000000049454e44ae426082'))
    from PIL import Image
    Image.new('RGB', (1600, 60), 'white').save(tmp_path / 'wide.png')  # a figure of several panels drawn 16 inches wide
    for name, body in bodies.items(): (tmp_path / f'{name}.html').write_text(PAGE.format(body=body))
    return tmp_path


def kinds(problems) -> dict[str, set[str]]:
    "page -> the kinds of problem found on it."
    out = {}
    for p in problems: out.setdefault(Path(p.page).stem, set()).add(p.kind)
    return out


def test_the_check_fails_on_a_planted_overflow(browser, tmp_path):
    folder = planted(tmp_path, ok=f'<div class="box">{WIDE_TABLE}</div><img src="fig.png" alt="a figure"><a href="ok.html#x">self</a><i id="x"></i>',
                     wide=f'<div style="width: 2000px">a block wider than any screen</div>',
                     cut=f'<div style="overflow: hidden">{WIDE_TABLE}</div>',
                     spill=WIDE_TABLE,
                     small='<img src="wide.png" alt="three panels" style="max-width: 100%">')
    problems = bc.check_pages(browser, folder, ['ok.html', 'wide.html', 'cut.html', 'spill.html', 'small.html'])
    found = kinds(problems)
    assert 'ok' not in found, found  # a wide table in a scroll box, an image that loads, a link to an anchor that exists
    assert found['wide'] == {'page wider than the viewport'}, found
    assert found['cut'] == {'table cut'}, found  # clipped: the page fits, the table does not
    assert found['spill'] >= {'table cut', 'page wider than the viewport'}, found
    # shrunk to fit: on a wide screen 1,408 of 1,600 px, readable; on a phone under a quarter, not
    assert [(p.viewport, p.kind) for p in problems if p.page == 'small.html'] == [('phone', 'figure too small')], problems


def test_the_check_fails_on_a_planted_dead_link_image_and_error(browser, tmp_path):
    folder = planted(tmp_path, link='<a href="../report/convergence.html">the convergence chapter</a>',
                     anchor='<a href="#nowhere">a section</a>',
                     image='<img src="missing.png" alt="a figure">',
                     error='<script>console.error("the page failed"); undefined_function();</script>',
                     offline='<img src="https://example.org/x.png" alt="external"><a href="https://oelm-nb.github.io/oelm_nb/">site</a>')
    problems = bc.check_pages(browser, folder, ['link.html', 'anchor.html', 'image.html', 'error.html', 'offline.html'],
                              viewports={'phone': bc.VIEWPORTS['phone']})
    found = kinds(problems)
    assert found['link'] == {'broken link'} and found['anchor'] == {'broken link'}, found
    assert 'broken image' in found['image'], found
    assert found['error'] == {'console error'} and len([p for p in problems if p.page == 'error.html']) == 2, problems
    # an external image is blocked (no network), so it shows as not loaded; an external link is not followed
    assert found.get('offline') == {'broken image'}, found


def test_the_report_of_a_batch_fits_the_screen(browser, site, tmp_path):  # noqa: F811
    "report.html beside the docs test's example batch, where `oelm run` writes it, opened from the batch folder."
    report = site.parent / 'build' / 'examples' / 'runs' / 'qk-freeze' / 'report.html'
    assert report.exists(), f'the docs build wrote no report beside its example batch: {report}'
    problems = bc.check_pages(browser, report.parent.parent, ['qk-freeze/report.html'],
                              screenshots=os.environ.get('OELM_SCREENSHOTS'))
    assert not problems, '\n'.join(map(str, problems))


# the pages a reader meets first and those with the widest tables and figures: every page at two sizes cost 3 minutes
PAGES = ('index.html', 'reports/qk_freeze.html', 'reports/qk_budget_check.html', 'report/explorer.html', 'report/budgets.html')


def test_the_docs_site_fits_the_screen(browser, site):  # noqa: F811
    pages = [p for p in PAGES if (site / p).exists()]
    assert len(pages) >= 4, sorted(p.relative_to(site).as_posix() for p in site.rglob('*.html'))[:80]
    problems = bc.check_pages(browser, site, pages, screenshots=os.environ.get('OELM_SCREENSHOTS'))
    assert not problems, f'{len(problems)} problem(s):\n' + '\n'.join(map(str, problems[:40]))
