#!/usr/bin/env python
"""Check the internal links of a static HTML site.

Every `href`/`src` (and `srcset`) of every .html file that points inside the site (no scheme, no
`//host`) must name an existing file; `page.html#anchor` and `#anchor` must name an `id` (or a
named `<a>`) on the target page. External links are not fetched (there is no network here).
Root-relative links (`/oelm_nb/model.html`, as mkdocs writes in 404.html) are resolved against the
site's base path (`--base /oelm_nb/`, the path of the site's URL).

`relink` and `relative_404` make the links of a freshly built site internal: links to the site's own public address
(nbdev writes them) and the root-relative links of 404.html.

Usage: python tools/check_links.py SITE_DIR [--base /PATH/]   (exit status 1 and a list when links are broken)
"""
from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from functools import lru_cache
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

LINK_ATTRS = {'href', 'src', 'srcset', 'poster', 'data'}
# anchors that themes handle in JavaScript, not through an element id
IGNORED_FRAGMENTS = {'', 'top', '__search', '__drawer', '__toc'}


@dataclass(frozen=True)
class BrokenLink:
    page: str     # the page holding the link, relative to the site
    link: str     # the link as written
    reason: str

    def __str__(self): return f'{self.page}: {self.link} ({self.reason})'


class _Parser(HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.ids, self.links = set(), []

    def handle_starttag(self, tag, attrs):
        for k, v in attrs:
            if v is None: continue
            if k == 'id' or (k == 'name' and tag == 'a'): self.ids.add(v)
            elif k in LINK_ATTRS and not (tag in ('link',) and k == 'href' and dict(attrs).get('rel') in ('preconnect', 'dns-prefetch')):
                if k == 'srcset': self.links += [s.strip().split()[0] for s in v.split(',') if s.strip()]
                elif k == 'data' and tag != 'object': continue
                else: self.links.append(v)

    handle_startendtag = handle_starttag


@lru_cache(maxsize=None)
def _parse(path: Path) -> _Parser:
    p = _Parser()
    p.feed(path.read_text(encoding='utf-8', errors='replace'))
    return p


def is_internal(link: str) -> bool:
    s = urlsplit(link.strip())
    return not (s.scheme or s.netloc or link.strip().startswith('//'))


def check_page(page: Path, site: Path, base_path: str = '/') -> list[BrokenLink]:
    site = site.resolve()
    base_path = '/' + base_path.strip('/') + '/' if base_path.strip('/') else '/'
    rel = page.resolve().relative_to(site).as_posix()
    broken = []
    for link in _parse(page.resolve()).links:
        link = link.strip()
        if not is_internal(link): continue
        s = urlsplit(link)
        path, frag = unquote(s.path), unquote(s.fragment)
        if not path and not s.fragment and not s.query:
            broken.append(BrokenLink(rel, link, 'empty link')); continue
        if path.startswith('/'):
            if not (path + '/').startswith(base_path) and path != base_path.rstrip('/'):
                broken.append(BrokenLink(rel, link, f'root-relative link outside the base path {base_path}')); continue
            target = (site / path[len(base_path):]).resolve()
        else: target = (page.parent / path).resolve() if path else page.resolve()
        try: target.relative_to(site)
        except ValueError:
            broken.append(BrokenLink(rel, link, 'points outside the site')); continue
        if target.is_dir(): target = target / 'index.html'
        if not target.exists():
            broken.append(BrokenLink(rel, link, 'no such file')); continue
        if frag in IGNORED_FRAGMENTS or target.suffix not in ('.html', '.htm'): continue
        if frag not in _parse(target).ids:
            broken.append(BrokenLink(rel, link, f'no id "{frag}" on {target.relative_to(site).as_posix()}'))
    return broken


def check_site(site: Path | str, base_path: str = '/') -> list[BrokenLink]:
    "All broken internal links of the .html files under `site`, served under the URL path `base_path`."
    site = Path(site).resolve()
    _parse.cache_clear()
    if not site.is_dir(): return [BrokenLink(str(site), '', 'site folder does not exist')]
    res = []
    for page in sorted(site.rglob('*.html')): res += check_page(page, site, base_path)
    return res


def relink(site: Path, base_url: str, slug=lambda anchor: anchor) -> int:
    """Links to the site's public address (`base_url`, e.g. https://host/oelm_nb: nbdev links `model.html#gpt` there) ->
    links inside `site`; `slug` turns the link's anchor into the page's id for it, and an anchor the page lacks (nbdev also
    links private names, which get no entry) is dropped: the link goes to the page. Returns the number of links rewritten."""
    site = Path(site).resolve()
    _parse.cache_clear()
    pages, n = {p.relative_to(site).as_posix(): p for p in site.rglob('*.html')}, 0
    pattern = re.compile('href="' + re.escape(base_url.rstrip('/') + '/') + r'([^"#]*)#?([^"]*)"')
    def sub(m, page):
        nonlocal n
        target, anchor = m[1] or 'index.html', slug(unquote(m[2]))
        if target not in pages: return m[0]
        n, anchor = n + 1, '#' + anchor if anchor and anchor in _parse(pages[target]).ids else ''
        return f'href="{os.path.relpath(target, os.path.dirname(page) or ".")}{anchor}"'
    for page, path in pages.items():
        text = path.read_text(encoding='utf-8')
        if (new := pattern.sub(lambda m: sub(m, page), text)) != text: path.write_text(new, encoding='utf-8')
    return n


def relative_404(site: Path, base_path: str) -> int:
    """mkdocs writes 404.html with root-relative links (`/oelm_nb/assets/...`), as it is served for a missing URL at any
    depth: make them relative (for file://) and, over http(s), resolve them against the site's root with a <base>."""
    page, prefix = Path(site) / '404.html', '/' + base_path.strip('/') + '/'
    if not page.exists() or prefix == '//': return 0
    t = page.read_text(encoding='utf-8')
    n = t.count(f'"{prefix}')
    t = t.replace(f'"{prefix}', '"./').replace(f'"{prefix.rstrip("/")}"', '"."')
    base = f'<script>if (location.protocol !== "file:") document.write(\'<base href="{prefix}">\');</script>'
    page.write_text(t.replace('<head>', '<head>\n' + base, 1), encoding='utf-8')
    return n


def main(argv=None):
    import argparse
    ap = argparse.ArgumentParser(description='Check the internal links of a static HTML site.')
    ap.add_argument('site'); ap.add_argument('--base', default='/', help='URL path the site is served under')
    a = ap.parse_args(argv)
    broken = check_site(a.site, a.base)
    for b in broken: print(b)
    n = len(list(Path(a.site).rglob('*.html')))
    print(f'[check_links] {n} page(s), {len(broken)} broken internal link(s)')
    return 1 if broken else 0


if __name__ == '__main__':
    sys.exit(main())
