"""A report a reader can defend and trace (issue 14): provenance of every run, the convergence rule, the tables that
link a report back to its runs, and figures with fixed colours and words on their axes.

Batches are written by hand (`fake_runs`), so each check chooses its numbers; the one check that trains goes
through `prepare_run` on a few hundred stories.
"""
from __future__ import annotations
import json, math, os, platform, re, subprocess, sys, urllib.parse
from datetime import datetime, timezone
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

import oelm_nb
from oelm_nb.data.corpus import TokenData
from oelm_nb.lab.spec import resolve_spec
from oelm_nb.lab.provenance import COMMAND_ENV, provenance, record_provenance, write_summary
from oelm_nb.lab.sample import SAMPLE_PROMPTS, sample_prompts
from oelm_nb.lab.run import prepare_run
from oelm_nb.base.rundir import read_json
from oelm_nb.base.rundir import RunMismatch
from oelm_nb.report.tables import (load_runs, load_curves, convergence, convergence_note, convergence_caveat, provenance_table,
                            hyperparameter_table, run_links, variant_colors, plot_curves, NOT_RECORDED)

from fake_runs import fake_batch, fake_run, failed

REPO = Path(__file__).resolve().parents[1]


# ====================================================================== provenance of a run
def test_provenance_names_the_checkout_and_versions(monkeypatch):
    monkeypatch.delenv(COMMAND_ENV, raising=False)
    p = provenance()
    head = subprocess.run(['git', '-C', str(REPO), 'rev-parse', 'HEAD'], capture_output=True, text=True).stdout.strip()
    assert re.fullmatch(r'[0-9a-f]{40}', p['commit']) and p['commit'] == head
    assert isinstance(p['dirty'], bool)
    status = subprocess.run(['git', '-C', str(REPO), 'status', '--porcelain', '--untracked-files=no'], capture_output=True, text=True).stdout
    assert p['dirty'] == bool(status.strip())
    assert (p['oelm_nb'], p['torch'], p['cuda'], p['python'], p['numpy']) == (
        oelm_nb.__version__, torch.__version__, torch.version.cuda, platform.python_version(), np.__version__)
    assert p['command'] == ' '.join(sys.argv) and p['host']
    started = datetime.fromisoformat(p['started'])
    assert started.utcoffset().total_seconds() == 0 and abs((datetime.now(timezone.utc) - started).total_seconds()) < 3600
    monkeypatch.setenv(COMMAND_ENV, 'oelm run qk-freeze --seeds 0 1')
    assert provenance()['command'] == 'oelm run qk-freeze --seeds 0 1'


def test_a_copy_of_the_package_outside_a_checkout_has_no_commit(tmp_path):
    "An installed wheel (here: the package copied out of the checkout) reports commit None, not some checkout's commit."
    import shutil
    shutil.copytree(REPO / 'oelm_nb', tmp_path / 'oelm_nb', ignore=shutil.ignore_patterns('__pycache__'))
    code = 'import json, oelm_nb, oelm_nb.lab.provenance as e; print(json.dumps([oelm_nb.__file__, e.provenance()]))'
    res = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, cwd=tmp_path,
                         env={**os.environ, 'PYTHONPATH': str(tmp_path)})
    assert res.returncode == 0, res.stderr
    where, p = json.loads(res.stdout.strip().splitlines()[-1])
    assert Path(where).resolve().is_relative_to(tmp_path.resolve())  # the copy was imported, not the checkout
    assert p['commit'] is None and p['dirty'] is None and p['oelm_nb'] == oelm_nb.__version__


def test_summary_carries_the_start_recorded_and_the_end(tmp_path):
    spec = resolve_spec('qk-freeze', 'gpt', out_dir=str(tmp_path))
    s = write_summary(spec, {'status': 'completed'})  # a study that recorded no start
    assert s['provenance']['started'] is None and s['provenance']['commit'] == provenance()['commit']
    first = record_provenance(tmp_path)
    again = record_provenance(tmp_path)  # resumed: the earlier start is kept
    assert again['earlier'] == [first]
    s = write_summary(spec, {'status': 'completed', 'runtime': {'device': 'cpu'}, 'world_size': 1})
    assert s == read_json(tmp_path / 'summary.json')
    assert {k: v for k, v in s['provenance'].items() if k != 'finished'} == again
    assert s['provenance']['finished'] >= again['started'] and s['runtime'] == {'device': 'cpu'} and s['world_size'] == 1


def test_prepare_run_records_provenance_after_the_configuration_check(tmp_path, monkeypatch):
    monkeypatch.setenv(COMMAND_ENV, 'oelm run qk-freeze --steps 20')
    small = {'data.n_train_stories': 400, 'data.n_val_stories': 50, 'data.vocab_size': 512, 'model.vocab_size': 512}
    spec = resolve_spec('qk-freeze', 'gpt', steps=20, out_dir=str(tmp_path / 'run'), data_dir=str(tmp_path / 'data'), overrides=small)
    prepare_run(spec)
    p = read_json(tmp_path / 'run' / 'provenance.json')
    assert p['command'] == 'oelm run qk-freeze --steps 20' and p['commit'] == provenance()['commit']
    other = resolve_spec('qk-freeze', 'gpt', steps=20, out_dir=str(tmp_path / 'run'), data_dir=str(tmp_path / 'data'),
                         overrides={**small, 'train.lr': 1e-3})
    with pytest.raises(RunMismatch): prepare_run(other)
    assert read_json(tmp_path / 'run' / 'provenance.json') == p  # a refused run records nothing


# ====================================================================== sample prompts
class WordTok:
    "One id per word; id 0 ends a document."
    eot_id, words = 0, ['<eot>', 'the', 'cat', 'sat', 'a', 'dog', 'ran', 'far', 'away']
    def decode(self, ids): return ' '.join(self.words[i] for i in ids)


def test_sample_prompts_open_evenly_spaced_validation_documents():
    toks = np.array([1, 2, 3, 0, 0, 4, 5, 6, 7, 8, 0, 1, 5, 0, 4, 2])  # docs: the cat sat | (empty) | a dog ran far away | the dog | unfinished
    val = TokenData(tokens=toks, recall=None, vocab_size=9, meta={})
    assert sample_prompts(val, WordTok(), n=2, n_tokens=2) == ['the cat', 'the dog']
    assert sample_prompts(val, WordTok(), n=3, n_tokens=3) == ['the cat sat', 'a dog ran', 'the dog']
    assert sample_prompts(val, WordTok(), n=3) == sample_prompts(val, WordTok(), n=3)  # deterministic
    assert sample_prompts(TokenData(np.array([1, 2, 3]), None, 9, {}), WordTok()) == SAMPLE_PROMPTS  # no boundary: the fallback


# ====================================================================== convergence
def synthetic(shapes: dict, steps=range(50, 501, 50)):
    runs = pd.DataFrame([{'variant': v, 'seed': s, 'status': 'completed', 'run_dir': ''} for v, s in shapes])
    curves = pd.DataFrame([{'variant': v, 'seed': s, 'step': k, 'val_loss': f(k)} for (v, s), f in shapes.items() for k in steps])
    return runs, curves


def test_convergence_reads_the_run_directories(tmp_path):
    "The schedule comes from each run's config.json (validated): without one, no forecast is attempted."
    recs = lambda base: [{'step': k, 'val_loss': base + 10 / k} for k in range(50, 501, 50)]
    root = fake_batch(tmp_path / 'b', 'qk-freeze', {'gpt': lambda s: {'status': 'completed'}}, seeds=(0, 1))
    for s in (0, 1): fake_run(root, 'gpt', s, {'status': 'completed'}, recs(1.0 + s / 100))
    (root / 'gpt-s0' / 'config.json').write_text(json.dumps({'train': {'lr': 1e-2, 'min_lr': 1e-4, 'warmup_steps': 20,
                                                                      'max_steps': 500}}))
    conv = convergence(load_runs(root))
    assert conv.index.tolist() == ['gpt-s0', 'gpt-s1']
    assert conv.loc['gpt-s0', 'flag'] in ('still improving', 'plateau', 'no forecast', 'no fit')
    assert conv.loc['gpt-s0', 'fit_points'] == 10 and math.isfinite(conv.loc['gpt-s0', 'backtest_error'])
    assert conv.loc['gpt-s1', ['flag', 'why']].tolist() == ['unknown', 'no schedule in config.json: nothing to forecast with']
    runs, curves = synthetic({('flat', 0): lambda k: 1.0, ('flat', 1): lambda k: 1.0})
    runs.loc[1, 'status'] = 'failed'
    assert convergence(runs, curves).loc['flat-s1', 'why'] == 'run failed: not judged'


# ====================================================================== provenance table
PROV = {'commit': 'a' * 40, 'dirty': False, 'oelm_nb': '0.1.0', 'torch': '2.5.0', 'cuda': '12.4', 'python': '3.11.7', 'numpy': '2.1.0',
        'host': 'gpu-1', 'command': 'oelm run qk-freeze', 'started': '2025-01-01T10:00:00+00:00', 'finished': '2025-01-01T10:05:00+00:00'}


def summary(prov=None, device='NVIDIA H100', world_size=1):
    s = {'status': 'completed', 'best_val_ppl': 3.0, 'runtime': {'device': 'cuda:0', 'device_name': device, 'dtype': 'bfloat16'},
         'world_size': world_size}
    return {**s, 'provenance': prov} if prov is not None else s


def test_provenance_table_groups_runs_by_what_they_ran_on(tmp_path):
    root = fake_batch(tmp_path / 'b', 'qk-freeze', {
        'gpt': lambda s: summary({**PROV, 'started': f'2025-01-01T0{8 + s}:00:00+00:00'}),
        'oelm': lambda s: summary({**PROV, 'dirty': True}) if s == 0 else summary(None),    # s1: an older run
        'oelm-freeze': lambda s: summary({**PROV, 'commit': None, 'dirty': None}, world_size=2) if s == 0 else failed()},
        seeds=(0, 1))
    runs = load_runs(root)
    assert runs.loc[0, 'provenance_commit'] == 'a' * 40 and runs.loc[0, 'provenance_started'] == '2025-01-01T08:00:00+00:00'
    t = provenance_table(runs)
    assert t.runs.tolist() == ['gpt-s0, gpt-s1', 'oelm-s0', 'oelm-s1', 'oelm-freeze-s0', 'oelm-freeze-s1']
    assert t.loc[0, ['n_runs', 'commit', 'dirty', 'cuda', 'device', 'dtype', 'world_size', 'command', 'started', 'finished']].tolist() == [
        2, 'a' * 40, 'no', '12.4', 'NVIDIA H100', 'bfloat16', '1', 'oelm run qk-freeze', '2025-01-01T08:00:00+00:00', '2025-01-01T10:05:00+00:00']
    assert t.loc[1, 'dirty'] == 'yes: uncommitted changes'
    assert t.loc[2, 'commit'] == NOT_RECORDED and t.loc[2, 'started'] == NOT_RECORDED and t.loc[2, 'device'] == 'NVIDIA H100'
    assert (t.loc[3, 'commit'], t.loc[3, 'world_size']) == ('not a git checkout', '2')
    assert set(t.loc[4, ['commit', 'torch', 'device', 'command']]) == {NOT_RECORDED}  # failed before writing a summary of its own


# ====================================================================== hyperparameters
def write_config(run_dir: Path, model: dict, train: dict, settings: dict | None = None):
    (run_dir / 'config.json').write_text(json.dumps({'model': model, 'train': train, 'data': {'source': 'synthetic'},
                                                     'settings': settings or {}, 'out_dir': str(run_dir), 'study': 'x'}))


def test_hyperparameter_table_puts_differing_fields_first_and_marks_them(tmp_path):
    root = fake_batch(tmp_path / 'b', 'qk-freeze', {v: (lambda s: {'status': 'completed'}) for v in ('gpt', 'oelm-freeze', 'lost')}, seeds=(0, 1))
    for v in ('gpt', 'oelm-freeze'):
        for s in (0, 1):
            write_config(root / f'{v}-s{s}', {'n_layer': 2, 'variant': v, 'unfreeze_at': [100, 200]},
                         {'lr': 5e-3, 'seed': s, 'max_steps': 500 if v == 'gpt' else 600}, {'rank': 4} if v == 'gpt' else {})
    t = hyperparameter_table(root, style=False)
    assert t.index.tolist() == ['model.variant', 'train.max_steps', 'settings.rank',   # differing first, in config order
                                'model.n_layer', 'model.unfreeze_at', 'train.lr', 'data.source']
    assert t.differs.tolist() == [True, True, True, False, False, False, False]
    assert 'train.seed' not in t.index  # differs between seeds, not variants
    assert t.loc['settings.rank'].tolist()[:3] == ['4', 'absent', NOT_RECORDED]
    assert t.loc['model.unfreeze_at', 'gpt'] == '[100, 200]' and all(isinstance(v, str) for v in t.drop(columns='differs').values.ravel())
    html = hyperparameter_table(root).to_html()
    selectors = ' '.join(re.findall(r'([^{}]+)\{\s*background-color: #fde9a9', html))
    assert sorted(set(map(int, re.findall(r'_row(\d+)_col\d+', selectors)))) == [0, 1, 2]  # the three differing rows are highlighted


# ====================================================================== links
class Tags(HTMLParser):
    def __init__(self, text):
        super().__init__(); self.tags = []; self.feed(text); self.close()
    def handle_starttag(self, tag, attrs): self.tags.append((tag, dict(attrs)))


def test_run_links_are_relative_escaped_and_resolve(tmp_path):
    bad = 'v"><script>alert("pwned")'  # a crafted folder name (no slash can be in one)
    root = fake_batch(tmp_path / 'b', 'qk-freeze', {'gpt': lambda s: {'status': 'completed'}, bad: lambda s: {'status': 'completed'},
                                                    'never': lambda s: False})
    for v in ('gpt', bad): fake_run(root, v, 0, {'status': 'completed'}, [{'step': 1, 'val_loss': 2.0}])
    (root / f'{bad}-s0' / 'train_lm.ipynb').write_text('{}')
    page = run_links(root).data
    tags = Tags(page).tags
    assert 'script' not in [t for t, _ in tags] and all(not k.startswith('on') for _, a in tags for k in a)
    assert '&lt;script&gt;' in page
    hrefs = [a['href'] for t, a in tags if t == 'a']
    assert len(hrefs) == 5  # two folders, one notebook, two metrics files; nothing for the run that never ran
    for h in hrefs:
        assert not h.startswith('/') and ':' not in h and '"' not in h and '<' not in h
        assert (root / urllib.parse.unquote(h)).exists(), h
    assert any(urllib.parse.unquote(h) == f'{bad}-s0/train_lm.ipynb' for h in hrefs)
    # the batch named by a relative path from elsewhere: the same links, relative to the batch
    cwd = os.getcwd(); os.chdir(tmp_path)
    try: assert run_links(Path('b')).data == page
    finally: os.chdir(cwd)


# ====================================================================== figures
def test_variant_colors_are_fixed_per_variant_and_used_by_plots(tmp_path):
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    order = ['gpt', 'oelm', 'oelm-freeze', 'gauss']
    c = variant_colors(order)
    assert c == variant_colors(order) and c == variant_colors(order + ['gpt']) and len(set(c.values())) == 4
    assert c['gpt'] == variant_colors(['gpt'])['gpt']
    recs = lambda v, s: [{'step': k, 'tokens': 1000 * k, 'val_loss': 2 + 1 / k + s / 10, 'val_ppl': math.exp(2 + 1 / k)} for k in (1, 2, 4)]
    curves = pd.concat([pd.DataFrame(recs(v, s)).assign(variant=v, seed=s) for v in order for s in (0, 1)])
    fig, (a, b) = plt.subplots(1, 2)
    try:
        plot_curves(curves, 'val_loss', ax=a)
        assert (a.get_xlabel(), a.get_ylabel(), a.get_yscale()) == ('training step', 'validation loss (nats/token)', 'linear')
        legend = {t.get_text(): matplotlib.colors.to_hex(h.get_color()) for t, h in zip(a.get_legend().get_texts(), a.get_legend().legend_handles)}
        assert legend == c
        plot_curves(curves, 'val_ppl', x='tokens', ax=b, variants=['oelm-freeze'], colors=c, logy=True)
        assert (b.get_xlabel(), b.get_yscale()) == ('tokens seen', 'log')
        assert matplotlib.colors.to_hex(b.get_legend().legend_handles[0].get_color()) == c['oelm-freeze']
        lo, hi = math.exp(2.25), math.exp(3)
        assert all(lo * .95 <= t <= hi * 1.05 for t in b.get_yticks()) and len(b.get_yticks()) >= 3
    finally:
        plt.close(fig)
