"""A real browser's look at pages, as a reader opens them: headless Chromium driven by Playwright's Python package.

Debian's `chromium` (or any Chromium/Chrome: `OELM_CHROMIUM=/path/to/binary`) is launched through Playwright's
`executable_path`, so Playwright's own browser download (which needs the internet) is never used. Each page is served
over http from a folder (`serve`), loaded at every viewport (`VIEWPORTS`, a desktop and a phone), its `<details>`
opened, and checked for what a reader trips on (`check_pages`):

- the page wider than the viewport (a reader must scroll the whole page sideways);
- a table cut: wider than the space it has, with no scroll box (an ancestor with `overflow-x: auto/scroll`) around it;
- a figure shrunk below `SHRUNK` of the width it was drawn for (its `width` attribute, else its pixels) (its labels, drawn at 8-10 pt, then read at under 4 pt: a figure
  of several panels 16 inches wide on a phone);
- a broken link (an internal link to a missing file or anchor: `tools/check_links.check_page`) or image (not loaded),
  or a request of the page answered with an error;
- a console error or an uncaught exception from the page's own code (requests outside the served folder are blocked:
  there is no network; the errors they cause are not the page's; nor are the scripts a page's Content Security Policy
  refuses to run, as report.html's does).

Usage: python tests/browser_check.py FOLDER PAGE.html ... (exit status 1 and a list of problems; `--hint`: the one line
saying what to install when no browser is found)
"""
from __future__ import annotations

import functools
import http.server
import os
import shutil
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / 'tools'))
from check_links import check_page  # noqa: E402  (one link checker for the site and for this check)

VIEWPORTS = {'desktop': (1440, 900), 'phone': (390, 844)}
CHROMIUM_ENV = 'OELM_CHROMIUM'  # a Chromium or Chrome binary to use instead of the one found on PATH
REQUIRE_ENV = 'OELM_REQUIRE_BROWSER'  # set (CI: .ci/run): a missing browser fails the check instead of skipping it
SHRUNK = 0.4  # an image shown at less than this share of its natural width is too small to read
CHROMIUM_NAMES = ('chromium', 'chromium-browser', 'google-chrome', 'google-chrome-stable')


def chromium_path() -> str | None:
    "The Chromium binary to drive: $OELM_CHROMIUM, else the first of `CHROMIUM_NAMES` on PATH; None when there is none."
    if (p := os.environ.get(CHROMIUM_ENV)): return p if Path(p).is_file() else None
    return next((w for n in CHROMIUM_NAMES if (w := shutil.which(n))), None)


def missing() -> str | None:
    "None when the check can run, else one line saying what to install."
    try: import playwright  # noqa: F401
    except ModuleNotFoundError: return "the browser check needs Playwright's Python package: make setup installs it (pip install playwright)"
    if chromium_path(): return None
    how = 'apt-get install -y chromium' if shutil.which('apt-get') else 'install Chromium or Google Chrome'
    return (f'the browser check needs Chromium: {how} (or set {CHROMIUM_ENV} to a Chromium/Chrome binary); '
            "Playwright's own browser download is not used")


@dataclass(frozen=True)
class Problem:
    page: str      # the page, relative to the served folder
    viewport: str  # 'desktop', 'phone' (VIEWPORTS) or 'any' (the same at every size)
    kind: str      # 'page wider than the viewport', 'table cut', 'figure too small', 'broken link', 'broken image', 'console error'
    detail: str

    def __str__(self): return f'{self.page} [{self.viewport}]: {self.kind}: {self.detail}'


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *a): pass


class serve:
    "`with serve(folder) as url:` the folder over http on 127.0.0.1 (a free port) while the block runs."
    def __init__(self, folder): self.folder = Path(folder).resolve()

    def __enter__(self) -> str:
        handler = functools.partial(_Quiet, directory=str(self.folder))
        self.httpd = http.server.ThreadingHTTPServer(('127.0.0.1', 0), handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return f'http://127.0.0.1:{self.httpd.server_address[1]}/'

    def __exit__(self, *exc): self.httpd.shutdown(); self.httpd.server_close()


# what the page measures of itself, after opening every <details>: the page's width, what sticks out of it, the tables that
# are wider than their space with no scroll box, the images that did not load, those shown too small to read
MEASURE = r"""(shrunk) => {
  document.querySelectorAll('details').forEach(d => { d.open = true; });
  const vw = document.documentElement.clientWidth;
  const name = e => e.tagName.toLowerCase() + (e.id ? '#' + e.id : '') +
    (typeof e.className === 'string' && e.className.trim() ? '.' + e.className.trim().split(/\s+/).slice(0, 2).join('.') : '');
  const label = t => { const h = t.querySelector('th'); return name(t) + (h ? ' (first header "' + h.textContent.trim().slice(0, 40) + '")' : ''); };
  const ox = e => getComputedStyle(e).overflowX;
  const scrollBox = t => { for (let e = t; e && e !== document.body; e = e.parentElement)
    if (['auto', 'scroll'].includes(ox(e))) return e; return null; };
  const out = {width: document.documentElement.scrollWidth, vw, sticking: [], cut: [], images: [], small: []};
  if (out.width > vw + 1) {
    for (const e of document.body.querySelectorAll('*')) {
      const r = e.getBoundingClientRect(), p = e.parentElement.getBoundingClientRect();
      if (r.width && r.right > vw + 1 && p.right <= vw + 1 && !scrollBox(e.parentElement)) out.sticking.push(name(e) + ' to ' + Math.round(r.right) + 'px');
      if (out.sticking.length >= 3) break;
    }
  }
  for (const t of document.querySelectorAll('table')) {
    const r = t.getBoundingClientRect();
    if (!r.width) continue;  // not shown
    const box = scrollBox(t);
    if (box) {  // scrolls: fine when a scroll box around it (its own or one outside it) ends within the screen
      let fits = null;
      for (let e = box; e && e !== document.body && !fits; e = scrollBox(e.parentElement))
        if (e.getBoundingClientRect().right <= vw + 1) fits = e;
      if (!fits) out.cut.push(label(t) + ': its scroll box ' + name(box) + ' reaches ' + Math.round(box.getBoundingClientRect().right) + 'px');
      continue;
    }
    let limit = Math.min(vw, t.parentElement.getBoundingClientRect().right);
    for (let e = t.parentElement; e && e !== document.body; e = e.parentElement)
      if (['hidden', 'clip'].includes(ox(e))) limit = Math.min(limit, e.getBoundingClientRect().right);
    if (r.right > limit + 1) out.cut.push(label(t) + ': ' + Math.round(r.width) + 'px wide, ' + Math.max(0, Math.round(limit - r.left)) + 'px of it in view, no scroll box');
  }
  for (const img of document.images) {
    if (img.getAttribute('src') && (!img.complete || img.naturalWidth === 0)) { out.images.push(img.getAttribute('src').slice(0, 80)); continue; }
    // drawn for this width: its width attribute where it has one (a retina figure: half its pixels), else its pixels
    const w = img.getBoundingClientRect().width, drawn = parseFloat(img.getAttribute('width')) || img.naturalWidth;
    if (w && w < shrunk * drawn)
      out.small.push((img.getAttribute('alt') || img.getAttribute('src').slice(0, 40)) + ': ' + Math.round(w) + 'px of ' + Math.round(drawn) + 'px');
  }
  return out;
}"""


def _policy(text: str) -> bool:
    "A console message that the page's Content Security Policy blocked a script: the policy at work, no code that failed."
    return 'violates the following Content Security Policy' in text


def launch(playwright):
    "Headless Chromium from `chromium_path()` (one browser for every page of a check)."
    return playwright.chromium.launch(executable_path=chromium_path(), headless=True,
                                      args=['--no-sandbox', '--disable-gpu', '--disable-dev-shm-usage'])


def check_pages(browser, folder, pages, viewports=VIEWPORTS, screenshots=None) -> list[Problem]:
    """Every problem a reader would meet on `pages` (paths relative to `folder`, which is served over http) at each of
    `viewports` ({name: (width, height)}), with `browser` (`launch`); `screenshots`: a folder for a picture of each."""
    folder, problems = Path(folder).resolve(), []
    for p in pages:  # links: read from the file, once (the same at every size); a folder opens as a listing from a file
        problems += [Problem(p, 'any', 'broken link', f'{b.link} ({b.reason})') for b in check_page(folder / p, folder)
                     if not (b.reason == 'no such file' and (folder / p).parent.joinpath(unquote(urlsplit(b.link).path)).is_dir())]
    with serve(folder) as root:
        for vname, (w, h) in viewports.items():
            ctx = browser.new_context(viewport={'width': w, 'height': h}, device_scale_factor=1)
            ctx.route('**/*', lambda route: route.continue_() if route.request.url.startswith(root) or
                      route.request.url.startswith('data:') else route.abort())  # no network: only the served folder
            page, now = ctx.new_page(), {}
            page.on('console', lambda m: m.type == 'error' and (m.location or {}).get('url', '').startswith(root) and
                    not _policy(m.text) and
                    now['errors'].append(f"{m.text[:200]} ({m.location.get('url', '').removeprefix(root)}:{m.location.get('lineNumber')})"))
            page.on('pageerror', lambda e: now['errors'].append(f'uncaught {e.name}: {e.message[:200]}'))
            page.on('response', lambda r: r.status >= 400 and r.url.startswith(root) and
                    now['failed'].append(f'{r.url.removeprefix(root)} (HTTP {r.status})'))
            for p in pages:
                now.update(errors=[], failed=[])
                page.goto(root + Path(p).as_posix(), wait_until='load')
                m = page.evaluate(MEASURE, SHRUNK)
                if m['width'] > m['vw'] + 1:
                    problems.append(Problem(p, vname, 'page wider than the viewport',
                                            f"{m['width']}px at {m['vw']}px: " + ', '.join(m['sticking'] or ['?'])))
                problems += [Problem(p, vname, 'table cut', c) for c in m['cut']]
                problems += [Problem(p, vname, 'broken image', i) for i in m['images']]
                problems += [Problem(p, vname, 'figure too small', s) for s in m['small']]
                problems += [Problem(p, vname, 'broken link', f) for f in dict.fromkeys(now['failed'])]
                problems += [Problem(p, vname, 'console error', e) for e in dict.fromkeys(now['errors'])]
                if screenshots is not None:
                    Path(screenshots).mkdir(parents=True, exist_ok=True)
                    page.screenshot(path=str(Path(screenshots) / f"{Path(p).as_posix().replace('/', '_')}-{w}x{h}.png"), full_page=True)
            ctx.close()
    return problems


def main(argv=None) -> int:
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('folder', nargs='?'); ap.add_argument('pages', nargs='*')
    ap.add_argument('--hint', action='store_true', help='print what to install when the check cannot run, and exit')
    ap.add_argument('--screenshots', help='a folder for a full-page picture of each page at each size')
    a = ap.parse_args(argv)
    if a.hint or (why := missing()):
        if (why := missing()): print(f'[setup] {why}' if a.hint else why)
        return 0 if a.hint else 1
    from playwright.sync_api import sync_playwright
    with sync_playwright() as pw:
        browser = launch(pw)
        problems = check_pages(browser, a.folder, a.pages, screenshots=a.screenshots)
        browser.close()
    for p in problems: print(p)
    print(f'[browser] {len(a.pages)} page(s) at {len(VIEWPORTS)} sizes: {len(problems)} problem(s)')
    return 1 if problems else 0


if __name__ == '__main__':
    sys.exit(main())
