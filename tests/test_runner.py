"""The papermill batch runner and the report, from outside: `oelm run`, `oelm report`, `RunExplorer`.

Every batch here is tiny (4 optimizer steps on a 300-story corpus with a 300-token vocabulary) because each
papermill execution costs seconds of kernel start-up. One batch (2 variants, seed 0, 2 runs at a time) is built once per
pytest session (shared between xdist workers through a file lock) and only read by the tests that use it;
tests that change a batch work on a copy.

Checks compare against independent sources: parameter counts from arithmetic on the config fields, perplexity
as exp(loss), the run's own metrics log, the parameters the runner was given.
"""
from __future__ import annotations
import dataclasses, fcntl, json, math, os, re, shutil, signal, subprocess, time
from pathlib import Path

import pytest
from shared_runs import SMALL_CORPUS
from cli_helpers import TIMEOUT, oelm_cmd as oelm, oelm_main, oelm_inline, run_oelm, read_json, html_text, tiny_args

pytestmark = pytest.mark.slow  # batches and processes end to end: `make test` runs them, `make test-fast` does not

TINY = tiny_args(4)
OVERRIDES = SMALL_CORPUS  # what tiny_args sets on the command line
VARIANTS, SEEDS = ('gpt', 'oelm-freeze'), (0,)  # two runs at a time: the papermill batch every other test reads


def expected_total(V: int, T: int, L: int, d: int, ff: int | None = None, bias: bool = True, attn_bias: bool = False) -> int:
    "Parameters of this package's GPT from its config fields (tied embeddings counted once, no factorization)."
    ff, b, ab = ff or 4 * d, int(bias), int(attn_bias)
    ln = d + b * d
    return V * d + T * d + L * (2 * ln + 4 * (d * d + ab * d) + (d * ff + b * ff) + (ff * d + b * d)) + ln


def total_from_config(m: dict) -> int:
    "`expected_total` of a ModelConfig dict (config.json's `model`)."
    assert m.get('n_embd_wte') in (None, m['n_embd'])
    return expected_total(m['vocab_size'], m['block_size'], m['n_layer'], m['n_embd'], m['d_ff'], m['bias'], m['attn_bias'])


def copy_batch(src: Path, dst: Path) -> Path:
    "A copy of a batch directory without the checkpoints (nothing here reads them)."
    shutil.copytree(src, dst, symlinks=True, ignore=shutil.ignore_patterns('checkpoints'))
    return dst


# ====================================================================== the shared batch
@pytest.fixture(scope='module')
def batch(tmp_path_factory):
    """`oelm run qk-freeze --variants gpt,oelm-freeze --seeds 0 --jobs 2` on tiny data: (batch dir, exit code, stdout, stderr).
    The Q/K study's one papermill batch end to end (tests/shared_runs.py says which batch is each study's)."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get('PYTEST_XDIST_WORKER'): root = root.parent  # shared by the workers of this session
    out, done = root / 'oelm-runner-batch', root / 'oelm-runner-batch.result.json'
    with open(root / 'oelm-runner-batch.lock', 'w') as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            res = run_oelm('run', 'qk-freeze', '--variants', ','.join(VARIANTS), '--seeds', *map(str, SEEDS), '--jobs', '2', '--out', str(out), *TINY)
            done.write_text(json.dumps({'rc': res.returncode, 'stdout': res.stdout, 'stderr': res.stderr}))
        r = read_json(done)
    return out, r['rc'], r['stdout'], r['stderr']


def test_batch_completes_with_complete_run_directories(batch):
    out, rc, stdout, stderr = batch
    assert rc == 0, f'oelm run failed ({rc}):\n{stdout}\n{stderr}'
    assert f'{len(VARIANTS) * len(SEEDS)}/{len(VARIANTS) * len(SEEDS)} runs completed in {out}' in stdout
    totals = set()
    for v in VARIANTS:
        for s in SEEDS:
            d = out / f'{v}-s{s}'
            for name in ('train_lm.ipynb', 'config.json', 'metrics.jsonl', 'summary.json'): assert (d / name).is_file(), f'{d}/{name}'
            assert (d / 'checkpoints').is_dir()

            # the executed notebook: every code cell ran, no errors, and the injected parameters are this run's
            nb = read_json(d / 'train_lm.ipynb')
            code = [c for c in nb['cells'] if c['cell_type'] == 'code']
            assert all(isinstance(c.get('execution_count'), int) for c in code), f'{d}: not every code cell was executed'
            assert not [o for c in code for o in c.get('outputs', []) if o.get('output_type') == 'error']
            tags = [c['metadata'].get('tags', []) for c in nb['cells']]
            i_par = next(i for i, t in enumerate(tags) if 'parameters' in t)
            assert 'injected-parameters' in tags[i_par + 1], 'the injected parameters must follow the parameters cell'
            ns: dict = {}
            exec(''.join(nb['cells'][i_par + 1]['source']), ns)
            # one parameter describes the run: its config.json, resolved once by the runner (no JSON inside JSON)
            assert set(ns) - {'__builtins__'} == {'config', 'nproc', 'progress'} and ns['nproc'] == 1
            assert Path(ns['config']) == (d / 'config.json').resolve()
            assert nb['metadata']['papermill']['parameters']['config'] == ns['config']

            # config.json: the resolved spec of this run with the overrides applied
            cfg = read_json(d / 'config.json')
            n_layer, n_embd = cfg['model']['n_layer'], cfg['model']['n_embd']
            assert cfg['model']['variant'] == v and cfg['model']['vocab_size'] == 300
            assert (cfg['train']['seed'], cfg['train']['max_steps'], cfg['train']['eval_batches']) == (s, 4, 2)
            assert (cfg['data']['vocab_size'], cfg['data']['n_train_stories'], cfg['data']['n_val_stories']) == (300, 300, 40)

            recs = [json.loads(l) for l in (d / 'metrics.jsonl').read_text().splitlines() if l.strip()]
            assert [r['step'] for r in recs] == [1, 2, 3, 4]
            evals = [r for r in recs if 'val_loss' in r]
            final_ckpt = (d / 'checkpoints' / 'final').resolve()
            assert final_ckpt.name == 'step_0000004' and (final_ckpt / 'model.safetensors').is_file()

            sm = read_json(d / 'summary.json')
            assert sm['status'] == 'completed' and (sm['variant'], sm['seed'], sm['steps']) == (v, s, 4)
            assert sm['final_val_loss'] == pytest.approx(evals[-1]['val_loss'])
            assert sm['best_val_loss'] == pytest.approx(min(r['val_loss'] for r in evals))
            assert sm['best_val_ppl'] == pytest.approx(math.exp(sm['best_val_loss']), rel=1e-6)
            assert sm['final_val_ppl'] == pytest.approx(math.exp(sm['final_val_loss']), rel=1e-6)
            assert isinstance(sm['recall_acc'], (int, float)) and 0.0 <= sm['recall_acc'] <= 1.0
            assert sm['tokens_per_s'] > 0 and sm['wall_time_s'] > 0
            assert sm['runtime']['threads'] == max(1, (os.cpu_count() or 1) // 2)  # each of the 2 concurrent runs got its share of the cores
            p = sm['params']
            assert p['total'] == p['trainable'] + p['frozen']
            assert p['total'] == total_from_config(cfg['model'])
            assert p['frozen'] == (n_layer * 2 * n_embd ** 2 if v == 'oelm-freeze' else 0)
            totals.add(p['total'])
    assert len(totals) == 1

    report = out / 'report.html'
    assert report.is_file()
    raw = report.read_text(encoding='utf-8', errors='replace')
    for h in ('H1', 'H2', 'H3', 'H4'): assert f'>{h}<' in raw, f'hypothesis row {h} missing from the report'
    text = html_text(report)
    for v in VARIANTS:
        for s in SEEDS: assert re.search(rf'(^| ){re.escape(v)} {s} completed ', text), f'run {v}-s{s} missing from the runs table'


def test_report_preset_accounting_matches_the_models(batch):
    "The report's second parameter table is the tiny preset's own configuration, counted by building the models."
    from oelm_nb.lab.spec import resolve_spec
    from oelm_nb.model.freeze import param_report
    from oelm_nb.model.gpt import GPT
    out, rc, stdout, stderr = batch
    assert rc == 0, stderr
    text = html_text(out / 'report.html')
    for v in VARIANTS:
        spec = resolve_spec('qk-freeze', v, 'tiny', 0, 4, str(out), 'synthetic')
        rep = param_report(GPT(spec.model, init_seed=0))
        assert spec.model.vocab_size != 300  # the preset's own vocabulary, not the batch's override
        assert rep.total == total_from_config(spec.model.to_dict())
        assert rep.frozen == (spec.model.n_layer * 2 * spec.model.n_embd ** 2 if v == 'oelm-freeze' else 0)
        assert f'{v} {rep.total:,} {rep.trainable:,} {rep.frozen:,} {rep.frozen_fraction:.2%}' in text


# ====================================================================== medium512 accounting, as the report does it
def test_medium512_preset_accounting_as_the_report_computes_it(tmp_path):
    from oelm_nb.lab.spec import resolve_spec
    from oelm_nb.model.freeze import param_report
    from oelm_nb.model.gpt import GPT
    total = expected_total(50257, 512, 6, 512, 2048)
    assert total == 44_896_768
    want = {'gpt': (total, total, 0), 'oelm-freeze': (total, 41_751_040, 3_145_728)}
    for v, (tot, tr, fr) in want.items():
        spec = resolve_spec('qk-freeze', v, 'medium512', 0, None, str(tmp_path), 'synthetic')  # the report notebook's call
        rep = param_report(GPT(spec.model, init_seed=0))
        assert (rep.total, rep.trainable, rep.frozen) == (tot, tr, fr), v
    assert fr == 6 * 2 * 512 * 512  # Q and K of every layer


# ====================================================================== kill and resume a batch
def _procs_in(d: Path) -> list[int]:
    "Processes whose working directory is inside `d` (papermill and kernels run in the run directories)."
    d, pids = str(d.resolve()), []
    for p in Path('/proc').iterdir():
        if not p.name.isdigit(): continue
        try: cwd = os.readlink(p / 'cwd')
        except OSError: continue
        if cwd == d or cwd.startswith(d + os.sep): pids.append(int(p.name))
    return pids


@pytest.mark.skipif(not Path('/proc/self/cwd').exists(), reason='needs /proc to find orphaned kernels')
def test_killed_batch_resumes_and_skips_completed_runs(tmp_path):
    out = tmp_path / 'killed'
    args = ('run', 'qk-freeze', '--variants', 'oelm-freeze', '--seeds', '0', '1', '--no-report', '--out', str(out), *TINY)
    first, second = out / 'oelm-freeze-s0', out / 'oelm-freeze-s1'
    with open(tmp_path / 'first.log', 'w') as log:
        proc = subprocess.Popen(oelm(*args), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.time() + TIMEOUT
            while True:
                try: st = read_json(first / 'summary.json').get('status')
                except (FileNotFoundError, json.JSONDecodeError): st = None
                if st == 'completed' and not (first / '.running').exists(): break  # trained, and its notebook finished
                assert proc.poll() is None, f'oelm run ended before its first run completed:\n{(tmp_path / "first.log").read_text()}'
                assert time.time() < deadline, 'the first run did not complete in time'
                time.sleep(0.2)
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    # the kernels run in sessions of their own; they must notice their parent is gone and stop (ipykernel's parent poller)
    deadline = time.time() + 30
    while _procs_in(out) and time.time() < deadline: time.sleep(0.5)
    assert not _procs_in(out), f'processes still running in {out} after the batch was killed: {_procs_in(out)}'
    s0 = first / 'summary.json'
    mtime, content = s0.stat().st_mtime_ns, s0.read_text()
    assert not (second / 'summary.json').exists(), 'the batch was not killed mid-way (the second run already finished)'

    res = oelm_inline(*args)  # the kill was the process boundary; what the rerun skips is the runner's rule, in-process
    assert res.returncode == 0, res.stdout + res.stderr
    assert '[oelm run] oelm-freeze-s0: already completed, skipped' in res.stdout
    assert 'oelm-freeze-s0: started' not in res.stdout
    assert 'oelm-freeze-s1: started' in res.stdout and 'oelm-freeze-s1: already completed' not in res.stdout
    assert '2/2 runs completed' in res.stdout
    assert s0.stat().st_mtime_ns == mtime and s0.read_text() == content
    for d in (first, second):
        sm = read_json(d / 'summary.json')
        assert sm['status'] == 'completed' and sm['steps'] == 4
        steps = [json.loads(l)['step'] for l in (d / 'metrics.jsonl').read_text().splitlines() if l.strip()]
        assert steps == [1, 2, 3, 4], f'{d.name}: metrics after resume: {steps}'


@pytest.mark.skipif(not Path('/proc/self/cwd').exists(), reason='needs /proc to find the kernel')
def test_ctrl_c_stops_in_one_line_and_the_rerun_resumes_with_the_uninterrupted_numbers(tmp_path):
    "Ctrl-C (SIGINT to the process group, as a terminal sends it) while a run trains: no traceback, no failed run."
    import psutil
    sets = ['--set', 'train.ckpt_every=5', '--set', 'train.eval_every=5', '--set', 'train.dtype=float32']
    out, args = tmp_path / 'ctrl-c', ['run', 'qk-freeze', '--variants', 'gpt', '--seeds', '0', '--no-report', *tiny_args(30), *sets]
    ckpts = out / 'gpt-s0' / 'checkpoints'
    # --jobs 2: one thread per run, as the in-process runs below train (the same numbers, not merely close ones)
    # a shell's background job (`make test &`, some CI runners) starts with SIGINT ignored, and so would oelm: give it a
    # terminal's default, as test_cluster's cancelled job does (on a fresh clone run so, the Ctrl-C was ignored)
    proc = subprocess.Popen(oelm(*args, '--out', str(out), '--jobs', '2'), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.time() + TIMEOUT
        while not (ckpts.is_dir() and any(p.name.startswith('step_') for p in ckpts.iterdir())):
            assert proc.poll() is None, f'oelm run ended before its first checkpoint:\n{proc.communicate()}'
            assert time.time() < deadline, 'no checkpoint in time'
            time.sleep(0.05)
        kernels = [k for k in psutil.Process(proc.pid).children(recursive=True) if os.getsid(k.pid) != proc.pid]  # own session
        kernels = [k for k in kernels if _signal(k, 'suspend')]  # the run cannot finish before the Ctrl-C reaches it
        os.killpg(proc.pid, signal.SIGINT)  # oelm and papermill; papermill interrupts the kernel (its own session)
        wait_until = time.time() + 60
        while time.time() < wait_until and not all(sigint_pending(k.pid) for k in kernels): time.sleep(0.05)
        for k in kernels: _signal(k, 'resume')
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None: os.killpg(proc.pid, signal.SIGKILL); proc.wait()
    assert kernels and proc.returncode == 130, stdout + stderr
    assert 'Traceback' not in stdout + stderr and 'KeyboardInterrupt' not in stdout + stderr, stderr
    line = stderr.strip().splitlines()[-1]
    kept = int(re.search(r'gpt-s0 keeps its checkpoint of step (\d+);', line).group(1))
    assert line.startswith('oelm run: interrupted (Ctrl-C)') and 'run the same command again to resume' in line, stderr
    assert not (out / 'gpt-s0' / 'summary.json').exists()  # as after kill -9: not failed
    deadline = time.time() + 30
    while _procs_in(out) and time.time() < deadline: time.sleep(0.5)

    res = oelm_inline(*args, '--out', str(out))  # the rerun's rule, in-process
    assert res.returncode == 0 and f'gpt-s0: resumed from step {kept}' in res.stdout, res.stdout + res.stderr
    assert 'failed before' not in res.stdout and not list(tmp_path.glob('ctrl-c/gpt-s0.*'))
    ref = oelm_inline(*args, '--out', str(tmp_path / 'ref'))
    assert ref.returncode == 0, ref.stdout + ref.stderr
    got, want = (read_jsonl_rows(d / 'gpt-s0' / 'metrics.jsonl') for d in (out, tmp_path / 'ref'))
    assert [r[0] for r in got] == list(range(1, 31)) and got == want
    assert read_json(out / 'gpt-s0' / 'summary.json')['best_val_ppl'] == read_json(tmp_path / 'ref' / 'gpt-s0' / 'summary.json')['best_val_ppl']


def _signal(proc, how: str) -> bool:
    "proc.suspend() or proc.resume(); False where the process has ended meanwhile (a child listed a moment ago may have)."
    import psutil
    try: getattr(proc, how)(); return True
    except (psutil.NoSuchProcess, ProcessLookupError): return False


def sigint_pending(pid: int) -> bool:
    "Whether process `pid` has a SIGINT waiting (it is stopped: it takes the signal when it continues)."
    try: status = Path(f'/proc/{pid}/status').read_text()
    except OSError: return True  # gone
    return any(int(v, 16) & (1 << (signal.SIGINT - 1)) for k, v in re.findall(r'^(SigPnd|ShdPnd):\s*([0-9a-f]+)', status, re.M))


def read_jsonl_rows(p) -> list[tuple]:
    "(step, train loss, val loss) of each line of a metrics.jsonl: the numbers, not the times."
    return [(r['step'], r['train_loss'], r.get('val_loss')) for r in map(json.loads, Path(p).read_text().splitlines())]


# ====================================================================== one failing run
def test_one_failed_run_is_recorded_and_reported(tmp_path):
    "gpt-s0 holds a corrupt checkpoint, so its resume fails; oelm-freeze-s0, which runs after it, still completes."
    out = tmp_path / 'fail'
    bad = out / 'gpt-s0' / 'checkpoints' / 'step_0000001'
    bad.mkdir(parents=True)
    (bad / 'meta.json').write_text('{"step": 1, "tokens": ')  # cut off mid-write
    res = oelm_inline('run', 'qk-freeze', '--variants', ','.join(VARIANTS), '--seeds', '0', '--out', str(out), *TINY)  # runs in-process, the report by papermill
    assert res.returncode == 1, res.stdout + res.stderr
    assert 'Traceback' not in res.stderr
    assert re.search(r'FAILED runs: gpt-s0\b', res.stderr), res.stderr
    assert 'oelm-freeze-s0' not in res.stderr
    sm = read_json(out / 'gpt-s0' / 'summary.json')
    assert sm['status'] == 'failed' and (sm['variant'], sm['seed']) == ('gpt', 0)
    assert 'CheckpointError' in sm['error'] and 'step_0000001' in sm['error']
    ok = read_json(out / 'oelm-freeze-s0' / 'summary.json')
    assert ok['status'] == 'completed' and ok['steps'] == 4
    assert '1/2 runs completed' in res.stdout
    text = html_text(out / 'report.html')
    assert re.search(r'(^| )gpt 0 failed ', text), 'the failed run must stay in the runs table'
    assert re.search(r'(^| )oelm-freeze 0 completed ', text)
    assert '1 run(s) did not complete' in text and 'gpt-s0 (failed: CheckpointError' in text


def test_failed_run_is_retried_from_scratch(batch, tmp_path):
    out, rc, stdout, stderr = batch
    assert rc == 0, stderr
    d = copy_batch(out, tmp_path / 'copy')  # every run completed; now gpt-s0 is left as a failed resume leaves it
    bad = d / 'gpt-s0' / 'checkpoints' / 'step_0000099'
    bad.mkdir(parents=True)
    (bad / 'meta.json').write_text('{"step": 99, "tokens": ')
    (d / 'gpt-s0' / 'summary.json').write_text(json.dumps(
        {'status': 'failed', 'variant': 'gpt', 'seed': 0, 'error': f'CheckpointError: {bad}/meta.json is corrupt'}))
    from oelm_nb.lab.runner import run_study  # the runner's decision is under test: the run itself goes in-process
    from oelm_nb.lab.execute import execute_inline
    lines = []
    res = run_study('qk-freeze', variants=list(VARIANTS), seeds=list(SEEDS), steps=4, out_dir=d, overrides=OVERRIDES, report=False,
                    execute=execute_inline, log=lines.append)
    log = '\n'.join(lines)
    assert 'gpt-s0: started' in log and log.count('already completed, skipped') == 1, log
    sm = read_json(d / 'gpt-s0' / 'summary.json')
    assert not res.failed and sm['status'] == 'completed', sm.get('error')
    assert [json.loads(l)['step'] for l in (d / 'gpt-s0' / 'metrics.jsonl').read_text().splitlines() if l.strip()] == [1, 2, 3, 4]
    aside = d / 'gpt-s0.failed-1'  # the failed attempt is kept for inspection, not deleted
    assert (aside / 'checkpoints' / 'step_0000099' / 'meta.json').exists()
    assert read_json(aside / 'summary.json')['status'] == 'failed'


# ====================================================================== oelm report
def test_oelm_report_rerenders_from_the_run_directories(batch, tmp_path):
    out, rc, stdout, stderr = batch
    assert rc == 0, stderr
    d = copy_batch(out, tmp_path / 'copy')
    sm = read_json(d / 'gpt-s0' / 'summary.json')
    sm['best_val_ppl'] = 777.125  # a value no run produces: the new report must read the directory again
    (d / 'gpt-s0' / 'summary.json').write_text(json.dumps(sm))
    (d / 'report.html').write_text('stale')
    res = oelm_main('report', str(d))
    assert res.returncode == 0, res.stdout + res.stderr
    text = html_text(d / 'report.html')
    assert 'stale' != text.strip() and '777.125' in text
    assert all(f'>{h}<' in (d / 'report.html').read_text(encoding='utf-8', errors='replace') for h in ('H1', 'H2', 'H3', 'H4'))


def test_oelm_report_on_a_non_batch_directory_exits_2(tmp_path):
    (tmp_path / 'not-a-batch').mkdir()
    res = oelm_main('report', str(tmp_path / 'not-a-batch'))
    assert res.returncode == 2, res.stdout + res.stderr
    assert 'Traceback' not in res.stderr
    assert 'not a batch directory' in res.stderr and 'batch.json' in res.stderr and 'not-a-batch' in res.stderr
    assert not (tmp_path / 'not-a-batch' / 'report.html').exists()


# ====================================================================== RunExplorer
def test_run_explorer_follows_its_widgets(batch, tmp_path):
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    from oelm_nb.report.explorer import RunExplorer
    out, rc, stdout, stderr = batch
    assert rc == 0, stderr
    d = copy_batch(out, tmp_path / 'copy')
    try:
        ex = RunExplorer(d)
        ax = lambda: ex.fig.axes[0]
        assert ex.plotted_variants() == list(VARIANTS)
        assert (ax().get_xlabel(), ax().get_ylabel(), ax().get_yscale()) == ('training step', 'validation perplexity', 'linear')

        ex.variants.value = ('oelm-freeze',)
        assert ex.plotted_variants() == ['oelm-freeze']
        ex.metric.value = 'val_loss'
        assert (ax().get_ylabel(), ax().get_yscale()) == ('validation loss (nats/token)', 'linear')
        assert max(max(l.get_xdata()) for l in ax().lines if len(l.get_xdata())) == 4  # steps
        ex.xaxis.value = 'tokens'
        assert ax().get_xlabel() == 'tokens seen' and ex.plotted_variants() == ['oelm-freeze']
        cfg = read_json(d / 'oelm-freeze-s0' / 'config.json')
        tokens = 4 * cfg['train']['batch_size'] * cfg['model']['block_size']
        assert max(max(l.get_xdata()) for l in ax().lines if len(l.get_xdata())) == tokens

        # a run appears in the directory; reload picks it up and selects every variant again
        shutil.copytree(d / 'gpt-s0', d / 'oelm-s0')
        assert 'oelm' not in ex.variants.options
        ex.reload_button.click()
        assert list(ex.variants.options) == ['gpt', 'oelm-freeze', 'oelm']
        assert ex.plotted_variants() == ['gpt', 'oelm-freeze', 'oelm']
        assert (ax().get_xlabel(), ax().get_ylabel()) == ('tokens seen', 'validation loss (nats/token)')  # the other choices are kept
        assert '>oelm<' in ex.table.value
    finally:
        plt.close('all')


def test_run_interrupted_after_training_is_reexecuted_not_skipped(batch, tmp_path):
    "A run whose notebook was cut off after summary.json was written (the .running marker remains) is executed again."
    out, rc, stdout, stderr = batch
    assert rc == 0, stderr
    d = copy_batch(out, tmp_path / 'copy')
    (d / 'oelm-freeze-s0' / '.running').write_text('12345')
    res = oelm_inline('run', 'qk-freeze', '--variants', ','.join(VARIANTS), '--seeds', *map(str, SEEDS), '--out', str(d),
                      '--no-report', *TINY)  # the runner's decision is under test: the run itself goes in-process
    assert res.returncode == 0, res.stdout + res.stderr
    assert 'oelm-freeze-s0: started' in res.stdout and res.stdout.count('already completed, skipped') == 1, res.stdout
    assert not (d / 'oelm-freeze-s0' / '.running').exists()
    steps = [json.loads(l)['step'] for l in (d / 'oelm-freeze-s0' / 'metrics.jsonl').read_text().splitlines() if l.strip()]
    assert steps == sorted(set(steps)) and steps[-1] == 4  # resumed from the final checkpoint: nothing trained twice
    assert read_json(d / 'oelm-freeze-s0' / 'summary.json')['tokens_per_s'] > 0


def test_gpu_set_of_two_is_one_job_on_both_devices(tmp_path, monkeypatch):
    """`--gpus 0,1` is one GPU set of two devices: its run gets both (execute_run trains it through torchrun, one process
    per device: test_cluster's driver-died job trains so, world size 2 and its tokens); on a CPU-only machine with
    OELM_GPU_SETS_ON_CPU=1 the runner says that the set trains on the CPU."""
    from unittest import mock
    from oelm_nb.lab import runner
    monkeypatch.setenv('OELM_GPU_SETS_ON_CPU', '1')
    calls = []
    def record(job, batch, gpu_set=None, threads=None, log=print):
        calls.append((job.name, gpu_set, threads)); return 'completed'
    with mock.patch.object(runner, 'execute_run', record):
        res = oelm_main('run', 'qk-freeze', '--variants', 'gpt', '--seeds', '0', '--gpus', '0,1', '--out', str(tmp_path / 'set'),
                        '--no-report', *TINY)
    assert res.returncode == 0, res.stdout + res.stderr
    assert 'each GPU set trains on the CPU' in res.stdout  # said, not silent
    assert calls == [('gpt-s0', ['0', '1'], None)]  # one run on the set's two devices; threads left to torchrun


# ====================================================================== runs that start from other runs
def test_upstream_runs_go_first_and_a_failed_upstream_blocks_its_dependents(tmp_path, monkeypatch):
    "The runner adds missing upstream variants, starts dependents only after them, and records blocked runs as failed."
    from oelm_nb.lab import runner
    from oelm_nb.base.rundir import write_json
    from oelm_nb.lab.study import Study, Variant, NoSettings
    from oelm_nb.lab.study import STUDIES
    variants = lambda preset, steps, opts: {'base': Variant({'model.variant': 'gpt'}), 'child-1': Variant({'model.variant': 'oelm'}, ('base',))}
    monkeypatch.setitem(STUDIES, 'chain-test', Study('chain-test', 'a chain', NoSettings, variants, run=lambda spec, progress=None: {},
                                                     train={}, data={}, default_variants=('child-1',), report=None))
    started = []
    def fake_execute(job, *a, **k):
        started.append(job.name); job.run_dir.mkdir(parents=True, exist_ok=True)
        ok = not (job.variant == 'base' and job.seed == 1)
        write_json(job.run_dir / 'summary.json', {'status': 'completed' if ok else 'failed'})
        return 'completed' if ok else 'failed'
    monkeypatch.setattr(runner, 'execute_run', fake_execute)
    res = runner.run_study('chain-test', seeds=[0, 1], out_dir=tmp_path, jobs=2, overrides=OVERRIDES, report=False, log=lambda s: None)
    assert list(res.statuses) == ['base-s0', 'base-s1', 'child-1-s0', 'child-1-s1']  # 'base' was added in front
    assert res.statuses == {'base-s0': 'completed', 'base-s1': 'failed', 'child-1-s0': 'completed', 'child-1-s1': 'failed'}
    assert started.index('child-1-s0') > started.index('base-s0') and 'child-1-s1' not in started
    blocked = read_json(tmp_path / 'child-1-s1' / 'summary.json')
    assert blocked['status'] == 'failed' and 'base-s1' in blocked['error']
    assert read_json(tmp_path / 'batch.json')['variants'] == ['base', 'child-1']


def test_every_study_has_its_own_run_command(capsys):
    "`oelm run --help` lists the studies; each has its notebooks and its own flags (in-process; the console script's help: test_cli)."
    from oelm_nb.app.cli import main
    from oelm_nb.lab.study import studies as _studies; studies = _studies()
    from oelm_nb.lab.execute import notebook_path
    def help_of(*args) -> tuple[int, str]:
        try: rc = main([*args, '--help'])
        except SystemExit as e: rc = e.code
        return rc, capsys.readouterr().out
    rc, out = help_of('run')
    assert rc == 0
    for name, st in studies.items():
        assert name in out
        assert notebook_path(st.notebook).is_file() and (st.report is None or notebook_path(st.report).is_file())
        rc, sub = help_of('run', name)
        flags = ['--' + f.name.replace('_', '-') for f in dataclasses.fields(st.options)] if st.options else []
        assert rc == 0 and all(f in sub for f in flags)  # one flag per field of the study's options
