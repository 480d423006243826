"""The answer first (issue 29, item 6): every study's report opens with its questions and answers.

Each report is rendered as `oelm run` renders it (papermill, then nbconvert --no-input) on a small batch: the
Q/K freeze, Mercator and CVFP reports on batches written by hand with three seeds (`fake_runs`, and the CVFP
verdict tests' `make_batch`), the PCA report on the session's shared PCA batch (`shared_runs.pca_batch`, which
renders its report anyway). The page is parsed into its `<h2>` sections with the standard library's HTML parser,
and the checks are the issues' acceptance (29, 38): the first section is "Questions and answers", one table of the
study's answers (`Study.answers`, the evidence kit), each row with its verdict and, where it has one, its interval,
then one line under the table with the budget (once) and the caveats (each once); provenance and configuration
come last, the full configuration folded in a `<details>` element; a section without data is one line with the
command that gets it.
"""
from __future__ import annotations
import json, math, re
from html.parser import HTMLParser
from pathlib import Path

import pytest

from fake_runs import fake_batch, fake_run
from shared_runs import pca_batch, completed
from test_cvfp_verdicts import make_batch as cvfp_fake_batch

pytestmark = pytest.mark.slow  # each test renders a report through papermill: seconds of kernel start-up

SEEDS = (0, 1, 2)


# ---------------------------------------------------------------- the page, as sections
class Sections(HTMLParser):
    "The page as a list of sections (the text before the first <h2>, then one per <h2>): title, text, list items, tables."
    def __init__(self, page: str):
        super().__init__(convert_charrefs=True)
        self.sections = [self._new('')]
        self._skip = self._heading = None
        self._items, self._tables, self._details = [], [], 0
        self.feed(page); self.close()

    @staticmethod
    def _new(title): return {'title': title, 'text': [], 'items': [], 'tables': []}
    _row = _cell = None

    def handle_starttag(self, tag, attrs):
        if tag in ('style', 'script'): self._skip = tag
        elif tag == 'h2': self._heading = []
        elif tag == 'li': self._items.append([])
        elif tag == 'details': self._details += 1
        elif tag == 'table': self._tables.append({'headers': [], 'rows': [], 'folded': self._details > 0, '_th': None})
        if tag == 'th' and self._tables: self._tables[-1]['_th'] = []
        if tag == 'tr' and self._tables: self._row = []
        if tag in ('td', 'th') and self._row is not None: self._cell = []

    def handle_endtag(self, tag):
        if tag == self._skip: self._skip = None
        elif tag == 'h2' and self._heading is not None:
            self.sections.append(self._new(''.join(self._heading).replace('\u00b6', '').strip()))
            self._heading = None
        elif tag == 'li' and self._items:
            self.sections[-1]['items'].append(' '.join(''.join(self._items.pop()).split()))
        elif tag == 'details': self._details -= 1
        elif tag == 'th' and self._tables and self._tables[-1]['_th'] is not None:
            self._tables[-1]['headers'].append(''.join(self._tables[-1]['_th']).strip()); self._tables[-1]['_th'] = None
        if tag in ('td', 'th') and self._cell is not None and self._row is not None:
            self._row.append(' '.join(''.join(self._cell).split())); self._cell = None
        if tag == 'tr' and self._row is not None and self._tables:
            self._tables[-1]['rows'].append(self._row); self._row = None
        elif tag == 'table' and self._tables:
            t = self._tables.pop(); t.pop('_th'); self.sections[-1]['tables'].append(t)

    def handle_data(self, data):
        if self._skip: return
        if self._heading is not None: self._heading.append(data); return
        for item in self._items: item.append(data)
        if self._tables and self._tables[-1]['_th'] is not None: self._tables[-1]['_th'].append(data)
        if self._cell is not None: self._cell.append(data)
        self.sections[-1]['text'].append(data)

    def section(self, title: str) -> dict:  # 'Questions and answers' also finds '... at the longest budget'
        return next(s for s in self.sections if s['title'] == title or s['title'].startswith(title + ' '))

    def text(self, title: str) -> str:
        return ' '.join(''.join(self.section(title)['text']).split())


INTERVAL = re.compile(r'95% CI .+\.\. |exact count|quartiles of \d+ interleaved rounds')
NO_INTERVAL = ('no data', 'neither formed it', 'earlier', 'later', 'more often', 'undecidable', 'no resolvable difference',
               'open', 'inconclusive (needs')


def answer_rows(page: 'Sections') -> dict:
    "question id -> the cells of its row in the one answers table of 'Questions and answers'."
    tables = [t for t in page.section('Questions and answers')['tables'] if 'answer' in t['headers']]
    assert len(tables) == 1, page.section('Questions and answers')['tables']
    return {r[0]: r for r in tables[0]['rows'] if len(r) >= 4 and r[0]}  # the header row has no id


def answers_first(html_file: Path, expected: dict, intervals: bool = True) -> Sections:
    """The order checks every report passes; `expected`: question id -> its verdict (from the study's answers, 'no
    data' for one without data). Returns the parsed page for the report's own checks."""
    page = Sections(html_file.read_text(encoding='utf-8'))
    titles = [s['title'] for s in page.sections]
    first = 2 if titles[1] == 'Does the gap close with tokens?' else 1  # the Q/K report opens with its gaps per budget
    assert titles[first].startswith('Questions and answers'), titles  # the first section after the title and introduction
    assert titles[-1] == 'Where the numbers come from', titles
    assert page.sections[0]['tables'] == []
    rows = answer_rows(page)
    for q, verdict in expected.items():
        assert q in rows, (q, list(rows))
        row = ' | '.join(rows[q])
        assert verdict in rows[q][2], (q, verdict, row)  # the answer column
        if not intervals or any(w in verdict for w in NO_INTERVAL): continue
        assert INTERVAL.search(row), f'{q} states no interval: {row}'
    text = page.text('Questions and answers')
    assert re.search(r"(All answers hold at the runs' budget: [^\[]*?\d[^\[]*? per run\.|Budgets: )", text), text
    # provenance and the configuration: in the last section only, the full configuration folded
    where = [i for i, s in enumerate(page.sections) for t in s['tables'] if {'commit', 'differs'} & set(t['headers'])]
    assert where and set(where) == {len(titles) - 1}, [titles[i] for i in where]
    last = page.sections[-1]['tables']
    assert any('commit' in t['headers'] and not t['folded'] for t in last)
    assert any('differs' in t['headers'] and t['folded'] for t in last)
    assert not any('differs' in t['headers'] and not t['folded'] for t in last)  # shown: only the fields that differ
    return page


def render(root: Path) -> Path:
    from oelm_nb.lab.render import render_report
    return render_report(root, log=lambda *a: None)


def write_config(root: Path, variant: str, seed: int, model: dict):
    (root / f'{variant}-s{seed}' / 'config.json').write_text(json.dumps({'model': model, 'train': {'lr': 0.01, 'seed': seed}}))


# ---------------------------------------------------------------- Q/K freeze: three variants, three seeds, no controls
QK_PPL = {'gpt': 10.0, 'oelm': 11.0, 'oelm-freeze': 11.1}
QK_TRAINABLE = {'gpt': 1000, 'oelm': 1000, 'oelm-freeze': 930}
STEPS, BLOCK = 40, 512


def qk_ppl(v: str, seed: int) -> float: return QK_PPL[v] * (1 + (0.012 if v == 'oelm-freeze' else 0.01) * seed)


def qk_metrics(ppl: float) -> list[dict]:
    return [{'step': k, 'tokens': k * BLOCK, 'elapsed_s': 0.1 * k, 'train_loss': math.log(ppl) + 1 / k, 'val_loss': math.log(ppl) + 1e-4 / k,
             'val_ppl': ppl * math.exp(1e-4 / k), 'recall_acc': 0.5} for k in (10, 20, 30, 40)]


@pytest.fixture(scope='module')
def qk_report(tmp_path_factory):
    root = tmp_path_factory.mktemp('qk-order') / 'batch'
    summary = lambda v: lambda s: {'status': 'completed', 'steps': STEPS, 'tokens': STEPS * BLOCK, 'best_val_ppl': qk_ppl(v, s),
                                   'final_val_ppl': qk_ppl(v, s), 'recall_acc': 0.5, 'tokens_per_s': 1000.0, 'wall_time_s': 4.0,
                                   'params': {'total': 1000, 'trainable': QK_TRAINABLE[v], 'frozen': 1000 - QK_TRAINABLE[v]}}
    fake_batch(root, 'qk-freeze', {v: summary(v) for v in QK_PPL}, seeds=SEEDS, plan={v: {'model.variant': v} for v in QK_PPL})
    for v in QK_PPL:
        for s in SEEDS:
            fake_run(root, v, s, summary(v)(s), qk_metrics(qk_ppl(v, s)))
            write_config(root, v, s, {'n_layer': 2, 'variant': v})
    return root, render(root)


def test_qk_freeze_report_answers_first(qk_report):
    from oelm_nb.report.tables import load_runs
    from oelm_nb.studies.qk_freeze.answers import qk_answers
    root, html_file = qk_report
    answers = qk_answers(load_runs(root))
    verdicts = {a.qid: a.verdict for a in answers}
    # the batch decides something: H1 7% fewer, H2 +1%, H4 +11%; nothing formed the recall circuit at recall 0.5 with
    # no chance level recorded
    assert [verdicts[q] for q in ('H1', 'H2', 'H3', 'H4')] == ['rejected', 'supported', 'no data', 'rejected']
    page = answers_first(html_file, verdicts)
    rows = answer_rows(page)
    assert list(rows) == ['H1', 'H2', 'H3', 'H4', 'R1', 'R2', 'H2-trend', 'H4-trend']
    text = page.text('Questions and answers')
    budget = f'{STEPS} steps, {STEPS * BLOCK / 1e3:.3g}k tokens per run'
    assert text.count('tokens per run') == 1 and f"All answers hold at the runs' budget: {budget}." in text  # once
    assert text.count('rests on the normal assumption') <= 2  # each caveat once: H2's and H4's p-values differ at most
    assert 'oelm bench --variants oelm,oelm-freeze' in ' '.join(rows['H3'])  # the question without data says how
    # a section without data is one line with the command that trains it, not a table of 'no data' rows
    controls = page.section('Controls: orthogonality, initial scale, freezing')
    assert controls['tables'] == [] and re.search(r'No controls in this batch: oelm run qk-freeze (--\S+ \S+ )*--variants gauss,gauss-freeze '
                                                  r'--seeds \d', page.text(controls['title']))  # with the batch's own settings
    # the configuration shows what differs: model.variant, one column per variant
    before_fold = page.text('Where the numbers come from').split('The full configuration')[0]
    assert 'model.variant' in before_fold and 'model.n_layer' not in before_fold


# ---------------------------------------------------------------- Mercator: students against no-distill and MSE, three seeds
MERC_PPL = {'no-distill': 32.0, 'mse': 31.0, 'mercator-b0.01': 30.0, 'mercator-b0.1': 33.0}


@pytest.fixture(scope='module')
def mercator_report(tmp_path_factory):
    root = tmp_path_factory.mktemp('mercator-order') / 'batch'
    student = lambda v: lambda s: {'status': 'completed', 'role': 'student', 'best_val_ppl': MERC_PPL[v] + 0.2 * s * (v == 'mse'),
                                   'steps': 30, 'tokens': 30 * 256, 'wall_time_s': 3.0, 'final_kv_cos': 0.6, 'final_kv_cos_centered': 0.55,
                                   'kv_cos_centered_layers': [0.5, 0.6], 'task': 'recall', 'task_acc': 0.3 + 0.01 * s + 0.05 * (v == 'mercator-b0.01')}
    runs = {'teacher': lambda s: {'status': 'completed', 'role': 'teacher', 'best_val_ppl': 10.0, 'steps': 60, 'wall_time_s': 3.0},
            **{v: student(v) for v in MERC_PPL}}
    fake_batch(root, 'mercator', runs, seeds=SEEDS, plan={v: {'settings.beta': v} for v in runs})
    for v in runs:
        for s in SEEDS: write_config(root, v, s, {'n_layer': 2 if v != 'teacher' else 4})
    return root, render(root)


def test_mercator_report_answers_first(mercator_report):
    from oelm_nb.report.tables import load_runs
    from oelm_nb.studies.mercator.report import mercator_answers, headline, mercator_runs
    root, html_file = mercator_report
    answer = headline(mercator_runs(root))
    assert answer.startswith('**Does any distillation variant beat `no-distill`?** On validation PPL, yes: 2 of 3')
    answers = mercator_answers(load_runs(root))
    page = answers_first(html_file, {a.qid: a.verdict for a in answers})
    # the students' budget, not the teacher's
    assert "All answers hold at the runs' budget: 30 steps, 7,680 tokens per run." in page.text('Questions and answers')


# ---------------------------------------------------------------- CVFP: two algorithms at three sample sizes, speed runs, three seeds
@pytest.fixture(scope='module')
def cvfp_report(tmp_path_factory):
    root = cvfp_fake_batch(tmp_path_factory.mktemp('cvfp-order') / 'batch', seeds=SEEDS)
    for d in root.iterdir():  # seeds that differ: ODCM above MCDL by 4-6 points, a speed-up of 20-22x
        s = json.loads((d / 'summary.json').read_text()) if (d / 'summary.json').exists() else None
        if not s: continue
        seed = int(d.name.rsplit('-s', 1)[1])
        if s.get('algorithm') == 'ODCM' and 'samples' in s: s['val_er_percent'] += 4 + seed
        if 'speedup' in s: s['parallel_s'] = s['sequential_s'] / (20 + seed); s['speedup'] = 20 + seed
        (d / 'summary.json').write_text(json.dumps(s))
        (d / 'config.json').write_text(json.dumps({'settings': {'diversity': s.get('algorithm', 'none'), 'samples': s.get('samples', 0)}}))
    return root, render(root)


def test_cvfp_report_answers_first(cvfp_report):
    from oelm_nb.studies.cvfp.report import cvfp_answers
    root, html_file = cvfp_report
    answers = {a.qid: a for a in cvfp_answers(root)}
    assert [answers[q].verdict for q in ('Q1', 'Q2', 'Q3', 'Q4')] == ['supported', 'supported', 'rejected', 'rejected']
    page = answers_first(html_file, {q: a.verdict for q, a in answers.items()}, intervals=False)
    rows = answer_rows(page)
    assert '95% CI' in ' '.join(rows['Q1']) and '95% CI' in ' '.join(rows['Q2'])
    emb = page.section('Frozen vs trained embedding')
    assert emb['tables'] == [] and re.search(r'No --train-embedding runs in this batch: oelm run cvfp .*--out \S+ .*--train-embedding',
                                             page.text(emb['title']))  # the batch's own settings, and the flag


# ---------------------------------------------------------------- PCA: the shared batch (seeds 0 and 1, ks 16 and 64) renders its report
def test_pca_report_answers_first(tmp_path_factory):
    from oelm_nb.report.tables import load_runs
    from oelm_nb.studies.pca.study import pca_answers
    out = completed(pca_batch(tmp_path_factory))
    answers = pca_answers(load_runs(out))
    assert len(answers) >= 1  # an answer for each k and reference (4-step runs: at least k=16 vs baseline)
    page = answers_first(out / 'report.html', {a.qid: a.verdict for a in answers}, intervals=False)
    assert all('2 paired seeds' in ' '.join(r) for q, r in answer_rows(page).items() if q.startswith('k='))
