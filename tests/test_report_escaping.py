"""Strings from a run directory reach report.html as text, never as markup.

A batch directory is input the report does not control: run-folder names (the `variant` column), a failed run's
`error`, the `samples` a model generated, string summary fields and batch.json fields. The batches here are written
by hand (no training) with script tags, event-handler attributes, `javascript:` links and a backtick that would end a
Markdown code span; `oelm report` renders them, and report.html is parsed with the standard library's HTML parser.
Every payload carries the marker `pwned`, which nbconvert's own page (its MathJax and require.js scripts) never
contains, so the checks tell the template's scripts from injected ones. Each payload must also be on the page as
visible text, so a check cannot pass because the text was dropped.
"""
from __future__ import annotations
import json, re
from html.parser import HTMLParser
from pathlib import Path

import pandas as pd
import pytest

from cli_helpers import oelm_main
from fake_runs import failed, fake_batch, fake_run

pytestmark = pytest.mark.slow  # batches and processes end to end: `make test` runs them, `make test-fast` does not

MARK = 'pwned'

# ---------------------------------------------------------------- the page, parsed
class Page(HTMLParser):
    "The elements of an HTML page: every attribute, the text of each script, the visible text."
    def __init__(self, html: str):
        super().__init__(convert_charrefs=True)
        self.attrs, self.scripts, self.text, self._in = [], [], [], None
        self.feed(html); self.close()

    def handle_starttag(self, tag, attrs):
        self.attrs += [(tag, k, v or '') for k, v in attrs]
        if tag == 'script': self.scripts.append(' '.join(f'{k}={v}' for k, v in attrs))
        if tag in ('script', 'style'): self._in = tag

    def handle_endtag(self, tag):
        if tag == self._in: self._in = None

    def handle_data(self, data):
        if self._in == 'script': self.scripts[-1] += data
        elif self._in is None: self.text.append(data)


def injected(page: Page) -> list:
    "What a run directory's strings made into markup: marked scripts, event handlers, script URLs, marked attributes."
    url = lambda v: re.sub(r'[\s\x00-\x20]', '', v).lower().startswith(('javascript:', 'vbscript:'))
    quoted_path = lambda k, v: k == 'href' and re.fullmatch(r'[A-Za-z0-9%._~/-]*', v) is not None  # a percent-encoded relative link: data, no scheme
    return ([('script', s[:80]) for s in page.scripts if MARK in s]
            + [(t, k, v[:80]) for t, k, v in page.attrs if k.startswith('on') or url(v) or (MARK in v and not quoted_path(k, v))])


def missing_text(page: Page, payloads) -> list[str]:
    "The payloads that are not on the page as visible text."
    text = ''.join(page.text)
    return [p for p in payloads if p not in text]


def assert_escaped(html_file: Path, payloads):
    page = Page(html_file.read_text(encoding='utf-8'))
    assert injected(page) == []
    assert missing_text(page, payloads) == []


# ---------------------------------------------------------------- the checks see what they look for
BAD_ERROR = '<script>alert("pwned-error")</script> [details](javascript:alert("pwned-link"))'
BAD_NAME = 'run`<img src=x onerror=alert("pwned-name")>'  # a backtick ends the Markdown code span the name is put in


def test_the_checks_find_markup_the_unescaped_path_makes():
    "Negative control: a Styler and IPython's Markdown (as nbconvert renders it) leave live elements; the helpers do not."
    from nbconvert.filters import markdown2html
    from oelm_nb.report.tables import safe_markdown, safe_table
    table = pd.DataFrame({'variant': [BAD_NAME], 'error': [BAD_ERROR]})
    sentence = f"**1 run(s) did not complete:** `{BAD_NAME}-s0` (failed: {BAD_ERROR})"
    unsafe = Page(table.style.to_html() + markdown2html(sentence))
    found = injected(unsafe)
    assert ('script', 'alert("pwned-error")') in found and any(k == 'onerror' for _, k, *_ in found)
    assert any(k == 'href' for _, k, *_ in found)  # the javascript: link
    safe = Page(safe_table(table.style).to_html() + safe_markdown(sentence).data)
    assert injected(safe) == []
    assert missing_text(safe, [BAD_NAME, BAD_ERROR]) == []


# ---------------------------------------------------------------- a Q/K freeze batch
QK = {'name': '<img src=x onerror=alert("pwned-dir")>',           # folder of a failed run
      'tick': BAD_NAME,                                          # folder of another failed run
      'variant': '<b onmouseover=alert("pwned-variant")>v',      # folder of a completed run: tables, samples heading, pairs
      'error': BAD_ERROR,
      'sample': '<script>alert("pwned-sample")</script>',
      'sample2': 'a <img src=x onerror=alert("pwned-sample2")> b',
      'dtype': "<iframe src=\"javascript:alert('pwned-dtype')\"></iframe>",  # a string summary field (runtime.dtype)
      'data': '<script>alert("pwned-data")</script>'}             # a batch.json field


def qk_summary(samples: list[str], dtype: str = 'float32'):
    return lambda s: {'status': 'completed', 'steps': 4, 'best_val_ppl': 50.0 + s, 'final_val_ppl': 51.0, 'recall_acc': 0.1,
                      'tokens_per_s': 1000.0, 'wall_time_s': 3.0, 'params': {'total': 100, 'trainable': 90, 'frozen': 10},
                      'runtime': {'dtype': dtype, 'threads': 1}, 'samples': samples}


@pytest.fixture(scope='module')
def qk_report(tmp_path_factory):
    root = fake_batch(tmp_path_factory.mktemp('qk') / 'batch', 'qk-freeze',
                      {'gpt': qk_summary([QK['sample'], QK['sample2']], QK['dtype'])}, plan={'gpt': {'model.variant': 'gpt'}})
    b = json.loads((root / 'batch.json').read_text()); b['data'] = QK['data']
    (root / 'batch.json').write_text(json.dumps(b))
    fake_run(root, QK['variant'], 0, qk_summary(['once upon a time'])(0))
    fake_run(root, QK['name'], 0, failed(QK['error']))
    fake_run(root, QK['tick'], 0, failed('RuntimeError: boom'))
    res = oelm_main('report', str(root))
    assert res.returncode == 0, res.stdout + res.stderr
    return root / 'report.html'


def test_qk_freeze_report_shows_run_strings_as_text(qk_report):
    assert_escaped(qk_report, QK.values())
    # and behind the escaping, the page forbids every script (a Content-Security-Policy in its head)
    from oelm_nb.lab.render import NO_SCRIPTS
    head = qk_report.read_text(encoding='utf-8').split('</head>')[0]
    assert NO_SCRIPTS in head and "script-src 'none'" in NO_SCRIPTS


# ---------------------------------------------------------------- a Mercator batch: names in batch.json and in verdict sentences
MERC = {'student': 'mercator-<img src=x onerror=alert("pwned-student")>',   # a completed distilled student
        'tick': 'mercator-`<svg onload=alert("pwned-tick")>',              # another, with a backtick
        'error': '<script>alert("pwned-merror")</script>',
        'teacher': '<script>alert("pwned-teacher")</script>'}              # batch.json options


def student(ppl: float, cos: float = 0.6):
    return lambda s: {'status': 'completed', 'best_val_ppl': ppl, 'steps': 30, 'wall_time_s': 3.0, 'final_kv_cos': cos,
                      'final_kv_cos_centered': cos - 0.05, 'kv_cos_centered_layers': [cos - 0.1, cos]}


@pytest.fixture(scope='module')
def mercator_report(tmp_path_factory):
    runs = {'teacher': lambda s: {'status': 'completed', 'best_val_ppl': 10.0, 'steps': 30, 'wall_time_s': 3.0},
            'no-distill': student(32.0, 0.3), 'mse': student(31.0, 0.5), MERC['student']: student(30.0, 0.9),
            MERC['tick']: student(33.0, 0.7), 'mercator-b0.1': lambda s: failed(MERC['error'])}
    root = fake_batch(tmp_path_factory.mktemp('mercator') / 'batch', 'mercator', runs, plan={v: {'settings.beta': v} for v in runs})
    b = json.loads((root / 'batch.json').read_text()); b['options'] = {'teacher': MERC['teacher'], 'student': 'gpt2'}
    (root / 'batch.json').write_text(json.dumps(b))
    res = oelm_main('report', str(root))
    assert res.returncode == 0, res.stdout + res.stderr
    return root / 'report.html'


def test_mercator_report_shows_run_strings_as_text(mercator_report):
    assert_escaped(mercator_report, MERC.values())
