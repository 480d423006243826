"""The CVFP study from outside: `oelm run cvfp` end to end on tiny data, its flags and plan, embeddings from a path.

One batch (the embedding GPT, the Phase 1 speed run, MCDL on 2 and 4 stories with sequential Phase 1, and a run asking
for more stories than the corpus has) is built once per pytest session (shared between xdist workers through a file
lock) and only read. Expected values come from independent sources: token counts from the prepared token file, the
embedding from the GPT checkpoint's tensors, perplexity as exp(loss) from the metrics log, the power-law fit from
np.polyfit on the summaries, the checks' verdicts from their stated rules.
"""
from __future__ import annotations
import fcntl, json, math, os, re, subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from cli_helpers import oelm_inline, read_json, read_jsonl, html_text, tiny_args

pytestmark = pytest.mark.slow  # batches and processes end to end: `make test` runs them, `make test-fast` does not

TINY = tiny_args(4)
SMALL_CVFP = ['--set', 'settings.val_tokens=600', '--set', 'settings.check_tokens=200', '--set', 'settings.phase1_max_iterations=3',
              '--set', 'settings.phase1_min_iterations=2', '--set', 'settings.speed_iterations=3',
              '--set', 'settings.phase2_epochs=2', '--set', 'settings.tokens=400']
SAMPLES = (2, 4)
TOO_MANY = 1000  # stories: the tiny corpus has 300, so this run fails


# ====================================================================== the shared batch
@pytest.fixture(scope='module')
def batch(tmp_path_factory):
    "`oelm run cvfp --algorithms MCDL --samples 2 4 1000 --phase1 sequential --seeds 0 --jobs 2` on tiny data: (dir, rc, stdout, stderr)."
    root = tmp_path_factory.getbasetemp()
    if os.environ.get('PYTEST_XDIST_WORKER'): root = root.parent
    out, done = root / 'oelm-cvfp-batch', root / 'oelm-cvfp-batch.result.json'
    with open(root / 'oelm-cvfp-batch.lock', 'w') as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            # the runs in-process (the study's flags, plan, runs and report are under test; the papermill batch: test_runner)
            res = oelm_inline('run', 'cvfp', '--algorithms', 'MCDL', '--samples', *map(str, (*SAMPLES, TOO_MANY)), '--phase1', 'sequential',
                              '--seeds', '0', '--out', str(out), *TINY, *SMALL_CVFP)
            done.write_text(json.dumps({'rc': res.returncode, 'stdout': res.stdout, 'stderr': res.stderr}))
        r = read_json(done)
    return out, r['rc'], r['stdout'], r['stderr']


def coverage(data_dir: Path, n_train: int, n_val: int) -> dict:
    "Independently of select_val_tokens: the validation stories all of whose tokens occur in the first n_train training stories, and the unseen share of the first n_val validation tokens."
    meta = read_json(data_dir / 'meta.json')
    dt, eot = np.dtype(meta['dtype']), meta['eot_id']
    tr, va = np.fromfile(data_dir / 'train.bin', dtype=dt), np.fromfile(data_dir / 'val.bin', dtype=dt)
    seen = set(tr[:story_tokens(data_dir, n_train)].tolist())
    stories, cur = [], []
    for t in va.tolist():
        cur.append(t)
        if t == eot: stories.append(cur); cur = []
    if cur: stories.append(cur)
    covered = [st for st in stories if all(t in seen for t in st)]
    first = va[:n_val].tolist()
    return {'stories': len(stories), 'covered': len(covered), 'covered_tokens': sum(map(len, covered)),
            'first_unseen_percent': 100 * sum(t not in seen for t in first) / len(first), 'seen': seen}


def story_tokens(data_dir: Path, n: int) -> int:
    "Tokens in the first n stories of the prepared training split, counted from the token file."
    meta = read_json(data_dir / 'meta.json')
    toks = np.fromfile(data_dir / 'train.bin', dtype=np.dtype(meta['dtype']))
    return int(np.flatnonzero(toks == meta['eot_id'])[n - 1] + 1)


def test_batch_runs_and_failure(batch):
    out, rc, stdout, stderr = batch
    assert rc == 1, f'exactly the oversized run must fail:\n{stdout}\n{stderr}'
    assert f'MCDL-n{TOO_MANY}-s0' in stderr and 'FAILED' in stderr
    names = ['embed-s0', 'phase1-speed-s0', *[f'MCDL-n{n}-s0' for n in (*SAMPLES, TOO_MANY)]]
    for name in names: assert (out / name / 'summary.json').is_file(), name
    b = read_json(out / 'batch.json')
    assert b['study'] == 'cvfp' and sorted(b['variants']) == sorted(n[:-3] for n in names) and b['seeds'] == [0]
    assert b['options']['phase1'] == 'sequential' and b['options']['algorithms'] == ['MCDL']
    assert all(b['plan'][v]['overrides']['settings.parallel'] is False for v in b['variants'])
    bad = read_json(out / f'MCDL-n{TOO_MANY}-s0' / 'summary.json')
    assert bad['status'] == 'failed' and f'{TOO_MANY} stories asked for, the split has 300' in bad['error']


def test_embedding_is_the_gpt_token_table(batch):
    from safetensors.torch import load_file
    out = batch[0]
    s = read_json(out / 'embed-s0' / 'summary.json')
    assert s['status'] == 'completed' and s['trained'] is True and s['steps'] == 4
    emb = load_file(str(out / 'embed-s0' / 'embedding.safetensors'))['embedding']
    ck = load_file(str(out / 'embed-s0' / 'checkpoints' / 'best' / 'model.safetensors'))
    table = ck.get('transformer.tok.wte.weight', ck.get('lm_head.weight'))  # tied: saved once
    assert torch.equal(emb, table) and (s['embedding_rows'], s['embedding_dim']) == tuple(table.shape) == (300, 64)


def test_cvfp_run_summaries(batch):
    out = batch[0]
    data_dir = out / 'data'
    for n in SAMPLES:
        d = out / f'MCDL-n{n}-s0'
        s = read_json(d / 'summary.json')
        assert s['status'] == 'completed' and (s['algorithm'], s['samples']) == ('MCDL', n)
        assert s['parallel'] is False  # --phase1 sequential reached the run
        assert read_json(d / 'config.json')['settings']['parallel'] is False
        assert s['train_tokens'] == story_tokens(data_dir, n)
        assert (s['val_tokens'], s['check_tokens']) == (600, 200)
        # the coverage rule: the numbers select_val_tokens recorded, against an independent count on the token files
        cov = coverage(data_dir, n, 600)
        assert (s['val_selection'], s['val_stories_split'], s['val_covered_stories'], s['val_covered_tokens']) == ('covered', cov['stories'], cov['covered'], cov['covered_tokens'])
        assert s['first_unseen_percent'] == pytest.approx(cov['first_unseen_percent'])
        assert s['val_coverage_rule'] == (s['val_unseen_tokens'] == 0) and s['val_unseen_percent'] == pytest.approx(100 * s['val_unseen_tokens'] / 600)
        assert s['val_coverage_rule'] == (cov['covered_tokens'] >= 600)  # covered stories first: the rule holds exactly when they suffice
        assert s['val_unseen_percent'] <= s['first_unseen_percent'] + 1e-9  # the choice never covers worse than the split's first tokens
        # the common set: the split's first tokens, the final model's PPL
        assert s['common_val_tokens'] == 600 and 1 < s['common_val_ppl'] < 1000 and 0 <= s['common_val_acc'] <= 1
        assert (s['phase2_train_embedding'], s['val_patience'], s['restore_best']) == (False, 0, True)
        for part in ('train', 'val'):
            tot = s['train_tokens'] if part == 'train' else s['check_tokens']
            assert 0 <= s[f'{part}_converged_tokens'] <= tot
            assert s[f'{part}_convergence_rate'] == pytest.approx(100 * s[f'{part}_converged_tokens'] / tot)
            assert s[f'{part}_er_dim'] == 64 and 1 <= s[f'{part}_er'] <= 64
            assert s[f'{part}_er_percent'] == pytest.approx(100 * s[f'{part}_er'] / 64)
        assert 2 <= s['iterations'] <= s['max_iterations'] == 3
        hist = read_jsonl(d / 'phase1.jsonl')
        assert [h['iteration'] for h in hist] == list(range(s['iterations']))
        kept = hist[s['best_iteration']] if s['best_iteration'] is not None else hist[-1]  # the iteration whose weights were kept
        assert s['cvfp_loss'] == pytest.approx(kept['cvfp']) and s['cvfp_loss'] >= 0
        assert all('val_effective_rank' in h for h in hist[1:])
        # the checks follow their stated rules
        assert s['num_layers'] == 1 and (s['min_iterations'], s['phase1_lr']) == (2, 0.002)
        assert s['best_iteration'] is None or 1 <= s['best_iteration'] < s['iterations']
        c = s['checks']
        i = c['identity']
        assert i['passed'] == (i['zero_diff'] > 0.1 and (i['token_similarity'] is None or i['token_similarity'] < 0.95))
        assert [k['value'] for k in i['criteria']] == [i['zero_diff'], i['token_similarity']]
        v = c['convergence']
        assert v['final_diff'] == s['final_diff'] == v['losses'][-1] and len(v['losses']) == 9  # 10 passes, the first the baseline
        assert v['passed'] == (v['final_diff'] < 1e-3 and v['verdict'] in ('CONVERGED', 'CONVERGING'))
        slope, std = np.polyfit(np.arange(9), v['losses'], 1)[0], np.std(v['losses'])
        expected = ('CONVERGING' if slope < -1e-3 else 'CONVERGED' if abs(slope) < 1e-3 and std < 1e-2 else 'DIVERGING' if slope > 1e-3 else 'UNSTABLE')
        assert v['verdict'] == expected and v['slope'] == pytest.approx(slope)
        assert v['reduction_percent'] == pytest.approx(100 * (v['losses'][-1] - v['losses'][0]) / v['losses'][0])
        assert v['final_grade'] == ('GOOD' if v['final_diff'] < 1e-3 else 'FAIL' if v['final_diff'] > 1e-2 else 'MARGINAL')
        # the fixed point: the kept iteration's contexts against a sequential pass, regime by its stated rule
        a = c['agreement']
        assert (a['cos_mean'], a['cos_min'], a['mse'], a['verdict']) == (
            s['agreement_cos_mean'], s['agreement_cos_min'], s['agreement_mse'], s['agreement_regime'])
        assert a['verdict'] == ('fixed point' if a['cos_mean'] >= 0.99 else 'near' if a['cos_mean'] >= 0.9 else 'off')
        assert a['passed'] == (a['cos_mean'] >= 0.99) and -1 <= a['cos_min'] <= a['cos_mean'] <= 1 and a['mse'] >= 0
        assert a['tokens'] == s['train_tokens'] - 1 and s['settle_sweeps'] == 0
        e = c['effective_rank']
        low = min(s['train_er_percent'], s['val_er_percent'])
        assert e['verdict'] == ('FAIL' if low < 30 or e['spread'] < 0.1 else 'PASS' if s['train_er_percent'] >= 88 and s['val_er_percent'] >= 81 else 'BELOW BAND')
        assert e['passed'] == (e['verdict'] == 'PASS') and (e['train_er_percent'], e['val_er_percent']) == (s['train_er_percent'], s['val_er_percent'])
        # Phase 2: one evaluation per epoch; PPL = exp(loss); the best is the lowest
        recs = read_jsonl(d / 'metrics.jsonl')
        ev = [r for r in recs if 'val_ppl' in r]
        assert len(ev) == 2 and len(recs) == s['phase2_steps'] == 2 * math.ceil((s['train_tokens'] - 1) / s['phase2_batch_size'])
        assert all(r['val_ppl'] == pytest.approx(math.exp(r['val_loss'])) for r in ev)
        assert s['best_val_ppl'] == pytest.approx(min(r['val_ppl'] for r in ev)) and s['final_val_ppl'] == pytest.approx(ev[-1]['val_ppl'])
        assert 1 < s['best_val_ppl'] < 1000 and 0 <= s['val_acc'] <= 1
        for k in ('phase1_s', 'phase1_train_s', 'checks_s', 'phase2_s', 'wall_time_s'): assert s[k] > 0
        assert (d / 'model.safetensors').is_file()


def test_speed_run(batch):
    out = batch[0]
    s = read_json(out / 'phase1-speed-s0' / 'summary.json')
    assert s['status'] == 'completed' and s['tokens'] == 400
    assert s['sequential_iterations'] == s['parallel_iterations'] == s['iterations'] == 3
    assert s['speedup'] == pytest.approx(s['sequential_s'] / s['parallel_s'])
    for v in ('sequential', 'parallel'):
        assert 1 <= s[f'{v}_train_er'] <= s['er_dim'] and 1 <= s[f'{v}_val_er'] <= s['er_dim']
        assert s[f'{v}_val_er_percent'] == pytest.approx(100 * s[f'{v}_val_er'] / s['er_dim'])
        assert len(read_jsonl(out / 'phase1-speed-s0' / f'phase1_{v}.jsonl')) == 3
    assert -1 <= s['par_seq_cosine_min'] <= s['par_seq_cosine_mean'] <= 1 and s['par_seq_mse'] >= 0 and s['num_layers'] == 1
    assert s['par_seq_regime'] == ('fixed point' if s['par_seq_cosine_mean'] >= 0.99 else 'near' if s['par_seq_cosine_mean'] >= 0.9 else 'off')


def test_alpha_progression_from_the_runs(batch):
    out = batch[0]
    a = read_json(out / 'alpha_progression.json')
    assert list(a['algorithms']) == ['MCDL']
    m = a['algorithms']['MCDL']
    sums = [read_json(out / f'MCDL-n{n}-s0' / 'summary.json') for n in SAMPLES]
    assert [p['samples'] for p in m['points']] == list(SAMPLES)  # the failed run is left out
    toks, ppl = np.log([s['train_tokens'] for s in sums]), np.log([s['final_val_ppl'] for s in sums])  # the final epoch, never the best
    slope, icpt = np.polyfit(toks, ppl, 1)
    assert m['overall']['alpha'] == pytest.approx(slope, rel=1e-9) and m['overall']['A'] == pytest.approx(math.exp(icpt), rel=1e-9)
    assert m['overall']['r2'] == pytest.approx(1.0)  # two points lie on their line
    assert m['progression']['window'] == 2 and len(m['progression']['windows']) == 1
    assert a['ppl'] == 'final_val_ppl' and m['seed_alpha']['n'] == 1 and m['seeds']['0']['alpha'] == pytest.approx(slope, rel=1e-9)
    best = np.polyfit(toks, np.log([s['best_val_ppl'] for s in sums]), 1)[0]
    assert a['protocols']['best_val_ppl']['MCDL']['overall']['alpha'] == pytest.approx(best, rel=1e-9)


def test_report_states_the_numbers(batch):
    out = batch[0]
    t = html_text(out / 'report.html')
    assert f'MCDL-n{TOO_MANY}' in t and 'did not complete' in t and 'failed' in t
    sp = read_json(out / 'phase1-speed-s0' / 'summary.json')
    assert f"parallel Phase 1 is {sp['speedup']:.1f}x faster" in t
    d = sp['er_dim']
    for v in ('sequential', 'parallel'):
        assert f"{sp[f'{v}_train_er']:.2f}/{d} ({sp[f'{v}_train_er_percent']:.1f}%)" in t
        assert f"{sp[f'{v}_val_er']:.2f}/{d} ({sp[f'{v}_val_er_percent']:.1f}%)" in t
    for n in SAMPLES:
        s = read_json(out / f'MCDL-n{n}-s0' / 'summary.json')
        assert f"{s['train_convergence_rate']:.1f}% ({s['train_converged_tokens']:,}/{s['train_tokens']:,} tokens)" in t
        assert f"{s['val_convergence_rate']:.1f}% ({s['val_converged_tokens']:,}/{s['check_tokens']:,} tokens)" in t
        assert f"{s['train_er']:.2f}/64 ({s['train_er_percent']:.1f}%)" in t and f"{s['val_er']:.2f}/64 ({s['val_er_percent']:.1f}%)" in t
        assert f"{s['best_val_ppl']:.2f}" in t and f"{s['final_val_ppl']:.2f}" in t and f"{s['iterations']}/3" in t
    a = read_json(out / 'alpha_progression.json')['algorithms']['MCDL']['overall']
    assert f"alpha {a['alpha']:.5f} (R^2 {a['r2']:.4f})" in t
    assert 'PASS' in t or 'FAIL' in t
    assert re.search(r'Check 2: identity mapping passed in \d+ of 2 runs', t)
    assert "All 3 CVFP and speed runs follow the New-LLM guidelines' one-layer rule (num_layers = 1)." in t
    assert 'maximum iterations 3 (guidelines 40)' in t and 'validation tokens 600 (guidelines 10,000)' in t
    assert 'Stopping rule: no early stopping, every run runs all its iterations' in t
    assert "The New-LLM guidelines' coverage rule (every validation token occurs in the training tokens) holds in" in t
    assert 'No run trained the embedding' in t and 'fit on the seed means' in t
    assert 'PASS >= 81 (guidelines band 81-82), FAIL < 30' in t and 'No sample size has both MCDL and ODCM runs' in t
    assert f"cosine {sp['par_seq_cosine_mean']:.4f} mean" in t
    assert re.search(r'Fixed point: parallel vs sequential passed in \d+ of 2 runs', t)
    assert re.search(r'Phase 1 ended at its fixed point in \d+ of 2 runs', t) and 'on 56,602 tokens' in t


# ====================================================================== flags and plan (no training)
def parse(*argv):
    from oelm_nb.app.cli import build_parser
    return build_parser().parse_args(['run', 'cvfp', *argv])


def test_flags_reach_the_plan_and_the_runs():
    from oelm_nb.app.cli import run_flags
    from oelm_nb.lab.spec import resolve_spec
    from oelm_nb.lab.study import get_study
    st = get_study('cvfp')
    a = parse('--phase1', 'sequential', '--concurrent', '--jobs', '2', '--algorithms', 'ODCM', '--samples', '8', '3', '--dist-reg-weight', '0.5')
    assert a.phase1 == 'sequential' and a.concurrent is True  # Phase 1's version and the runner's concurrency: two flags
    variants, over, opts = run_flags(st, a)
    assert variants is None and over == {} and st.planned('tiny', 400, opts) == ['embed', 'phase1-speed', 'ODCM-n8', 'ODCM-n3']
    spec = resolve_spec('cvfp', 'ODCM-n3', 'tiny', 0, None, '/tmp/x/ODCM-n3-s0', 'synthetic', None, over, options=opts)
    cfg = spec.settings.config(spec.train.seed)
    assert (cfg.parallel, cfg.dist_reg_weight, cfg.diversity, spec.settings.samples) == (False, 0.5, 'ODCM', 3)
    b = parse('--phase1', 'parallel')
    assert b.phase1 == 'parallel' and b.concurrent is False
    assert st.variant('embed', options=run_flags(st, b)[2]).overrides['settings.parallel'] is True
    assert 'settings.parallel' not in st.variant('embed', options=run_flags(st, parse())[2]).overrides  # no --phase1: parallel
    # defaults: both algorithms over init * 2^i, i < window + windows - 1
    v = st.planned('tiny', 400, run_flags(st, parse())[2])
    assert sorted(v[2:]) == sorted(f'{alg}-n{n}' for alg in ('MCDL', 'ODCM') for n in (20, 40, 80, 160, 320))
    opts = run_flags(st, parse('--init-samples', '5', '--multiplier', '3', '--window-size', '2', '--num-windows', '1', '--algorithms', 'MCDL'))[2]
    assert st.planned('tiny', 400, opts)[2:] == ['MCDL-n15', 'MCDL-n5']
    assert st.default_seeds == (0, 1)  # two seeds by default: the report shows the spread of alpha over seeds
    te = run_flags(st, parse('--train-embedding', '--samples', '3', '--algorithms', 'ODCM'))[2]
    assert te['train_embedding'] is True and st.planned('tiny', 400, te)[2:] == ['ODCM-n3', 'ODCM-n3-train-emb']
    spec = resolve_spec('cvfp', 'ODCM-n3-train-emb', 'tiny', 0, None, '/tmp/x/ODCM-n3-train-emb-s0', 'synthetic', None, {}, options=te)
    assert spec.settings.config(0).phase2_train_embedding is True and spec.settings.samples == 3


@pytest.mark.parametrize('argv,message', [
    (['--algorithms', 'WMSE'], "unknown ['WMSE']"),
    (['--samples', '0', '4'], 'must be positive'),
    (['--samples', '4', '--init-samples', '2'], 'drop --init-samples'),
    (['--dist-reg-weight', '1.5'], 'must be in [0, 1]'),
    (['--embeddings', '/nonexistent/model'], 'no such file or directory'),
    (['--variants', 'MCDL-n7'], "no variant 'MCDL-n7'"),  # names are labels of the planned runs, not parsed
    (['--variants', 'VICReg-n10'], "no variant 'VICReg-n10'"),
])
def test_bad_flags_are_clear_errors(argv, message, tmp_path, capsys):
    from oelm_nb.app.cli import main
    rc = main(['run', 'cvfp', '--out', str(tmp_path / 'b'), *argv])
    err = capsys.readouterr().err
    assert rc == 2 and 'oelm run: error:' in err and message in err, err
    assert not (tmp_path / 'b' / 'batch.json').exists()  # nothing ran


def test_phase1_takes_a_version(tmp_path, capsys):
    "--phase1 parallel|sequential picks Phase 1's version; anything else is refused by the parser, naming the choices."
    from oelm_nb.app.cli import main
    with pytest.raises(SystemExit) as e: main(['run', 'cvfp', '--out', str(tmp_path / 'b'), '--phase1', 'both'])
    err = capsys.readouterr().err
    assert e.value.code == 2 and '--phase1 both: expected one of parallel, sequential' in err, err
    assert not (tmp_path / 'b').exists()


# ====================================================================== embeddings from a path
@pytest.fixture(scope='module')
def tiny_data(tmp_path_factory):
    from oelm_nb.base.core import DataConfig
    from oelm_nb.data.corpus import prepare_data
    return prepare_data(DataConfig(source='synthetic', vocab_size=300, n_train_stories=60, n_val_stories=10),
                        tmp_path_factory.mktemp('cvfp-data'), progress=False)


def test_first_stories_matches_the_token_file(tiny_data):
    from oelm_nb.base.core import ConfigError
    from oelm_nb.studies.cvfp.study import first_stories
    from oelm_nb.data.corpus import load_split
    tr = load_split(tiny_data, 'train')
    for n in (1, 7, 60):
        ids = first_stories(tr.tokens, tr.meta['eot_id'], n)
        assert len(ids) == story_tokens(Path(tiny_data), n) and int(ids[-1]) == tr.meta['eot_id']
        assert int((ids == tr.meta['eot_id']).sum()) == n
    with pytest.raises(ConfigError, match='61 stories asked for, the split has 60'): first_stories(tr.tokens, tr.meta['eot_id'], 61)


def test_embed_run_takes_a_hf_style_directory(tiny_data, tmp_path):
    from safetensors.torch import save_file, load_file
    from oelm_nb.base.core import ConfigError
    from oelm_nb.studies.cvfp.study import run_cvfp, load_embedding
    from oelm_nb.lab.spec import resolve_spec
    hf = tmp_path / 'hf-model'; hf.mkdir()
    w = torch.randn(300, 24)
    save_file({'transformer.h.0.attn.c_attn.weight': torch.randn(24, 72), 'transformer.wte.weight': w, 'lm_head.weight': torch.zeros(300, 24)},
              str(hf / 'model.safetensors'))
    (hf / 'config.json').write_text('{"model_type": "gpt2"}')
    spec = resolve_spec('cvfp', 'embed', 'tiny', 0, None, str(tmp_path / 'b' / 'embed-s0'), str(tiny_data), None, {'settings.embeddings': str(hf)})
    s = run_cvfp(spec)
    assert s['status'] == 'completed' and s['trained'] is False and 'transformer.wte.weight' in s['embedding_source']
    assert torch.equal(load_file(str(tmp_path / 'b' / 'embed-s0' / 'embedding.safetensors'))['embedding'], w)
    assert not (tmp_path / 'b' / 'embed-s0' / 'checkpoints').exists()  # nothing was trained
    # a single .safetensors file works too; too few rows for the data's vocabulary is a clear error
    save_file({'model.embed_tokens.weight': torch.randn(100, 8)}, str(tmp_path / 'small.safetensors'))
    assert load_embedding(tmp_path / 'small.safetensors')[0].shape == (100, 8)
    small = resolve_spec('cvfp', 'embed', 'tiny', 0, None, str(tmp_path / 'c' / 'embed-s0'), str(tiny_data), None,
                         {'settings.embeddings': str(tmp_path / 'small.safetensors')})
    with pytest.raises(ConfigError, match=r'shape \(100, 8\).*one row per token of the data \(300\)'): run_cvfp(small)
    with pytest.raises(ConfigError, match='does not exist'): load_embedding(tmp_path / 'missing')
    save_file({'w': torch.randn(3, 3)}, str(tmp_path / 'noemb.safetensors'))
    with pytest.raises(ConfigError, match='no token-embedding tensor'): load_embedding(tmp_path / 'noemb.safetensors')


def test_train_embedding_twin(tiny_data, tmp_path):
    "--train-embedding: same Phase 1 as the frozen run, Phase 2 trains the tied embedding; the frozen run's embedding is the upstream one."
    from safetensors.torch import save_file, load_file
    from oelm_nb.studies.cvfp.study import run_cvfp
    from oelm_nb.lab.spec import resolve_spec
    src = tmp_path / 'emb.safetensors'
    save_file({'model.embed_tokens.weight': torch.randn(300, 16, generator=torch.Generator().manual_seed(0))}, str(src))
    b = tmp_path / 'b'
    small = {'settings.val_tokens': 300, 'settings.check_tokens': 100, 'settings.phase1_max_iterations': 4, 'settings.phase1_min_iterations': 3,
             'settings.phase2_epochs': 2, 'settings.context_dim': 16}
    run_cvfp(resolve_spec('cvfp', 'embed', 'tiny', 0, None, str(b / 'embed-s0'), str(tiny_data), None, {'settings.embeddings': str(src)}))
    opts = {'samples': [3], 'algorithms': ['MCDL'], 'train_embedding': True}
    sums = {v: run_cvfp(resolve_spec('cvfp', v, 'tiny', 0, None, str(b / f'{v}-s0'), str(tiny_data), None, small, options=opts))
            for v in ('MCDL-n3', 'MCDL-n3-train-emb')}
    f, t = sums['MCDL-n3'], sums['MCDL-n3-train-emb']
    assert (f['phase2_train_embedding'], t['phase2_train_embedding']) == (False, True)
    strip = lambda p: [{k: v for k, v in h.items() if k != 'seconds'} for h in read_jsonl(p)]
    assert strip(b / 'MCDL-n3-s0' / 'phase1.jsonl') == strip(b / 'MCDL-n3-train-emb-s0' / 'phase1.jsonl')  # the same Phase 1
    assert (f['val_er'], f['train_er'], f['best_iteration']) == (t['val_er'], t['train_er'], t['best_iteration'])
    up = load_file(str(b / 'embed-s0' / 'embedding.safetensors'))['embedding']
    mf, mt = load_file(str(b / 'MCDL-n3-s0' / 'model.safetensors')), load_file(str(b / 'MCDL-n3-train-emb-s0' / 'model.safetensors'))
    emb = lambda m: m['embedding.weight'] if 'embedding.weight' in m else m['head.weight']  # tied: saved once
    assert torch.equal(emb(mf), up) and not torch.equal(emb(mt), up)
    n_emb = up.numel()
    assert t['phase2_trainable_params'] == f['phase2_trainable_params'] + n_emb == t['params_trainable_phase2'] + n_emb
    assert f['final_val_ppl'] != t['final_val_ppl']


def test_cvfp_run_needs_its_embed_run_and_valid_settings(tiny_data, tmp_path):
    from oelm_nb.base.core import ConfigError
    from oelm_nb.studies.cvfp.study import run_cvfp
    from oelm_nb.lab.spec import resolve_spec
    spec = resolve_spec('cvfp', 'MCDL-n2', 'tiny', 0, None, str(tmp_path / 'MCDL-n2-s0'), str(tiny_data), None, options={'samples': [2]})
    with pytest.raises(ConfigError, match="'embed' run of seed 0 must complete first"): run_cvfp(spec)
    with pytest.raises(ConfigError, match=r"study 'cvfp', settings: CVFPSettings has no field\(s\) \['contxt_dim'\]"):
        resolve_spec('cvfp', 'MCDL-n2', 'tiny', 0, None, str(tmp_path / 'MCDL-n2-s0'), str(tiny_data), None, {'settings.contxt_dim': 8}, options={'samples': [2]})
    with pytest.raises(ConfigError, match='CVFPSettings.check_tokens=12000 is invalid'):
        resolve_spec('cvfp', 'MCDL-n2', 'tiny', 0, None, str(tmp_path / 'x'), str(tiny_data), None, {'settings.check_tokens': 12000}, options={'samples': [2]})
