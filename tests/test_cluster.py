"""Batches beyond one terminal: the SLURM backend end to end through submitit's local executor (`--backend
submitit-local`: the same submission, waiting, cancelling and failure handling, with jobs as processes here), the
sbatch file submitit writes for `--backend slurm` (built without a cluster), and `--detach`."""
from __future__ import annotations
import json, os, re, signal, subprocess, sys, time
from pathlib import Path

import pytest

from oelm_nb.lab.cluster import ClusterConfig, sbatch_script, slurm_parameters, time_minutes
from oelm_nb.base.core import ConfigError
from oelm_nb.base.rundir import read_holder, is_alive
from cli_helpers import oelm_main, run_oelm, oelm_cmd, read_json, tiny_args

pytestmark = pytest.mark.slow  # batches and processes end to end: `make test` runs them, `make test-fast` does not

TINY = tiny_args(4)
LOCAL = ['--backend', 'submitit-local', '--time', '00:10:00']


def wait_for(cond, timeout: float = 240, what: str = 'condition'):
    t0 = time.time()
    while not cond():
        if time.time() - t0 > timeout: raise AssertionError(f'timed out after {timeout}s waiting for {what}')
        time.sleep(0.3)


# ====================================================================== the sbatch file, without a cluster
def test_sbatch_script_of_a_two_gpu_run(tmp_path):
    "The file submitit would hand to sbatch: partition, GPUs, CPUs, time, extra options, and the command that started the batch."
    cfg = ClusterConfig(partition='gpu-a100', gpus_per_run=2, cpus_per_run=16, time='1-06:00:00', options={'account': 'lab', 'qos': 'high'})
    s = sbatch_script(cfg, tmp_path / 'jobs' / 'gpt-s0', 'oelm-qk-freeze-gpt-s0', "oelm run qk-freeze --backend slurm --gpus-per-run 2")
    for line in ('#SBATCH --partition=gpu-a100', '#SBATCH --gpus-per-node=2', '#SBATCH --cpus-per-task=16', '#SBATCH --time=1800',
                 '#SBATCH --nodes=1', '#SBATCH --ntasks-per-node=1', '#SBATCH --account=lab', '#SBATCH --qos=high',
                 '#SBATCH --job-name=oelm-qk-freeze-gpt-s0'):
        assert line in s.splitlines(), f'{line!r} missing from\n{s}'
    assert "export OELM_COMMAND='oelm run qk-freeze --backend slurm --gpus-per-run 2'" in s  # runs name the batch's command
    srun = [l for l in s.splitlines() if l.startswith('srun ')]
    assert len(srun) == 1 and srun[0].endswith(f'-u -m submitit.core._submit {tmp_path / "jobs" / "gpt-s0"}')
    assert str(tmp_path / 'jobs' / 'gpt-s0') in s.split('#SBATCH --output=')[1].splitlines()[0]  # logs next to the job's pickles
    # one task: torchrun inside the job starts a process per GPU
    assert slurm_parameters(cfg, 'x')['ntasks_per_node'] == 1 and 'gpus_per_node' not in slurm_parameters(ClusterConfig(), 'x')


def test_cluster_flags_are_checked_before_anything_runs(tmp_path, capsys):
    from oelm_nb.app.cli import main
    out = tmp_path / 'b'
    for args, msg in ((['--partition', 'gpu'], 'only with --backend slurm'),
                      (['--backend', 'slurm', '--time', '4h'], 'HH:MM:SS'),
                      (['--backend', 'slurm', '--gpus', '0,1'], '--gpus-per-run'),
                      (['--backend', 'slurm', '--slurm-option', 'time=1:00:00'], 'set by oelm itself'),
                      (['--backend', 'slurm', '--slurm-option', 'account'], 'KEY=VALUE'),
                      (['--backend', 'slurm'], 'srun')):  # no SLURM on this machine: said plainly, before any run
        rc = main(['run', 'qk-freeze', '--variants', 'gpt', '--seeds', '0', '--out', str(out), *TINY, *args])
        err = capsys.readouterr().err
        assert rc == 2 and msg in err and err.startswith('oelm run: error:'), (args, err)
    assert not out.exists(), 'nothing may be written'
    with pytest.raises(ConfigError, match='cluster'): ClusterConfig(cluster='pbs')
    assert time_minutes('00:59:01') == 60


# ====================================================================== end to end on the local executor
def test_pca_batch_on_the_local_executor_upstream_failure_status_and_rerun(tmp_path):
    """PCA runs need their baseline: the baseline fails (its checkpoint is cut off mid-write), so pca-k8-s1 is blocked and
    never submitted; `oelm status` shows it; the same command again trains the baseline afresh and submits its dependent
    run only once the baseline's job completed. (Skipping completed runs is the runner's rule: test_runner, test_rundir.)"""
    out = tmp_path / 'pca'
    bad = out / 'baseline-s1' / 'checkpoints' / 'step_0000001'
    bad.mkdir(parents=True)
    (bad / 'meta.json').write_text('{"step": 1, "tokens": ')
    args = ('run', 'pca', '--ks', '8', '--variants', 'pca-k8', '--seeds', '1', '--jobs', '2', '--out', str(out), '--no-report', *TINY, *LOCAL)
    res = oelm_main(*args)  # the driver in-process: the jobs, submitit's local processes, are the subject
    assert res.returncode == 1, res.stdout + res.stderr
    assert 'FAILED runs: baseline-s1, pca-k8-s1' in res.stderr
    st = {d: read_json(out / d / 'summary.json') for d in ('baseline-s1', 'pca-k8-s1')}
    assert st['baseline-s1']['status'] == 'failed' and 'CheckpointError' in st['baseline-s1']['error']
    assert st['pca-k8-s1']['status'] == 'failed' and 'upstream run(s) baseline-s1' in st['pca-k8-s1']['error']
    jobs = read_json(out / 'batch.json')['jobs']
    assert set(jobs) == {'baseline-s1'}, jobs  # the blocked run was never submitted

    status = oelm_main('status', str(out))  # what `oelm status` reads (in-process: not a process boundary)
    assert status.returncode == 0, status.stderr
    lines = {l.split()[0]: l.split() for l in status.stdout.splitlines()[2:]}
    assert lines['baseline-s1'][1:3] == ['failed', jobs['baseline-s1']] and lines['pca-k8-s1'][1:3] == ['blocked', '-']
    print(status.stdout)

    again = oelm_main(*args)  # the corrupt run is set aside and trained afresh; its dependent run now
    assert again.returncode == 0, again.stdout + again.stderr
    assert all(read_json(out / d / 'summary.json')['status'] == 'completed' for d in ('baseline-s1', 'pca-k8-s1'))
    jobs = read_json(out / 'batch.json')['jobs']
    assert set(jobs) == {'baseline-s1', 'pca-k8-s1'}, jobs
    for name, jid in jobs.items():
        rec = read_json(out / name / 'job.json')
        assert rec['job_id'] == jid and rec['backend'] == 'local' and Path(rec['stdout']).exists()
        assert re.search(rf'{name}: submitted as local job {jid}\b', again.stdout)
    # the dependent run's job was submitted only after its upstream run had completed
    assert again.stdout.index('baseline-s1: local job') < again.stdout.index('pca-k8-s1: submitted as')
    assert (out / 'pca-k8-s1' / 'pca.ipynb').exists(), 'the job executed the experiment notebook, as a local batch does'


def test_a_cancelled_job_fails_its_run_with_its_state(tmp_path):
    "Cancel a job while it trains (what submitit's LocalJob.cancel sends); its run is recorded as failed, with the job's state and log."
    out = tmp_path / 'qk'
    args = ('run', 'qk-freeze', '--variants', 'gpt', '--seeds', '0', '--out', str(out), '--no-report',
            *tiny_args(5000), '--set', 'train.log_every=1', *LOCAL)
    # a shell's background job (`make test &`, some CI runners) starts with SIGINT ignored, and so would the job: give it a terminal's default
    p = subprocess.Popen(oelm_cmd(*args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    wait_for(lambda: (out / 'gpt-s0' / 'job.json').exists() and (out / 'gpt-s0' / 'metrics.jsonl').exists(), what='gpt-s0 to train')
    job_id = read_json(out / 'gpt-s0' / 'job.json')['job_id']
    os.kill(int(job_id), signal.SIGINT)  # a local job's id is its process id
    try: stdout, stderr = p.communicate(timeout=300)
    finally: p.kill()
    assert p.returncode == 1, stdout + stderr
    s = read_json(out / 'gpt-s0' / 'summary.json')
    assert s['status'] == 'failed' and s['job_id'] == job_id and s['job_state'] in ('INTERRUPTED', 'CANCELLED', 'FAILED'), s
    assert f'local job {job_id} ended without finishing' in stdout and s['error'].endswith('_log.err')
    assert 'FAILED runs: gpt-s0' in stderr


def test_a_rerun_after_the_driver_died_waits_for_the_job_instead_of_submitting_another(tmp_path, monkeypatch):
    """The `oelm run` that submitted a job is killed; the job goes on; the same command again re-attaches to it through the run's lock.
    The job asks for 2 GPUs: it trains through torchrun inside the job (here on the CPU, with gloo, as the local GPU-set test does).
    The job is paused (SIGSTOP to its processes) from the moment it holds the run's lock until the rerun has seen it: the rerun
    then finds it training however loaded the machine is, so the run can be short."""
    import psutil
    from oelm_nb.lab.cluster import ClusterBackend
    monkeypatch.setenv('OELM_GPU_SETS_ON_CPU', '1')
    out = tmp_path / 're'
    args = ('run', 'qk-freeze', '--variants', 'gpt', '--seeds', '0', '--out', str(out), '--no-report', *tiny_args(20), '--set', 'train.log_every=1',
            *LOCAL, '--gpus-per-run', '2')
    driver = subprocess.Popen(oelm_cmd(*args), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for(lambda: (out / 'gpt-s0' / 'job.json').exists() and (h := read_holder(out / 'gpt-s0')) is not None and is_alive(h),
             what='the job of gpt-s0 to hold its run')
    job_id = read_json(out / 'gpt-s0' / 'job.json')['job_id']
    job = psutil.Process(int(job_id))  # a local job's id is its process id
    paused = [job, *job.children(recursive=True)]
    for p in paused: p.send_signal(signal.SIGSTOP)
    def resume():
        for p in paused:
            try: p.send_signal(signal.SIGCONT)
            except psutil.NoSuchProcess: pass
    try:
        driver.kill(); driver.wait()
        assert not (out / 'gpt-s0' / 'summary.json').exists() and is_alive(read_holder(out / 'gpt-s0')), 'the job outlives its driver'
        seen = ClusterBackend.earlier_job
        def earlier_job_then_resume(self, j):  # the rerun has asked whether a job trains the run: let the job go on
            try: return seen(self, j)
            finally: resume()
        monkeypatch.setattr(ClusterBackend, 'earlier_job', earlier_job_then_resume)
        again = oelm_main(*args)  # the killed driver was the process boundary; the rerun's decision is in-process
    finally: resume()
    assert again.returncode == 0, again.stdout + again.stderr
    assert f'gpt-s0: job {job_id} from an earlier `oelm run` still trains it' in again.stdout
    assert f'gpt-s0: job {job_id} completed it' in again.stdout and 'submitted as' not in again.stdout
    assert read_json(out / 'gpt-s0' / 'job.json')['job_id'] == job_id and read_json(out / 'batch.json')['jobs'] == {'gpt-s0': job_id}
    steps = [json.loads(l)['step'] for l in (out / 'gpt-s0' / 'metrics.jsonl').read_text().splitlines() if l.strip()]
    assert steps == sorted(set(steps)) and steps[-1] == 20, 'one job wrote the run, once'
    assert read_json(out / 'gpt-s0' / 'summary.json')['world_size'] == 2 and (out / 'gpt-s0' / 'torchrun.log').exists()
    # two processes of batch_size each (test_runner's GPU-set test: `--gpus 0,1` reaches the same execute_run with both devices)
    s, cfg = read_json(out / 'gpt-s0' / 'summary.json'), read_json(out / 'gpt-s0' / 'config.json')
    assert s['tokens'] == 2 * s['steps'] * cfg['train']['batch_size'] * cfg['train']['grad_accum'] * cfg['model']['block_size']


# ====================================================================== --detach
def test_detached_batch_survives_its_terminal_and_a_second_run_attaches(tmp_path, monkeypatch):
    """The detached batch is a process in its own session (the subject); the attaching `oelm run` is the same command in
    this process. The detached batch is paused (SIGSTOP) from the moment it holds the batch's lock until the attaching
    run has found it and said so: the attaching run then finds it training however fast the machine is."""
    import psutil
    from oelm_nb.lab import cluster
    out = tmp_path / 'det'
    # no report (rendering one is not what detaching is about: test_runner renders it)
    args = ('run', 'qk-freeze', '--variants', 'gpt', '--seeds', '0', '--no-report', '--out', str(out), *tiny_args(8))
    term = subprocess.Popen(oelm_cmd(*args, '--detach'), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    stdout, stderr = term.communicate(timeout=120)
    assert term.returncode == 0, stdout + stderr
    assert 'goes on in the background' in stdout and f'oelm status {out}' in stdout
    try: os.killpg(term.pid, signal.SIGHUP)  # the terminal closes: its session gets a hangup
    except ProcessLookupError: pass
    wait_for(lambda: (h := read_holder(out)) is not None and h.get('detached'), 60, 'the detached batch to take its lock')
    holder = read_holder(out)
    assert is_alive(holder) and holder['pid'] != term.pid
    batch = psutil.Process(holder['pid'])
    paused = [batch, *batch.children(recursive=True)]
    for p in paused: p.suspend()
    def resume():
        for p in paused:
            try: p.resume()
            except psutil.NoSuchProcess: pass
    seen = cluster.follow
    def follow_then_resume(batch_dir, interval=5.0, out=print):  # the attaching run found the batch: let it go on
        def said(line): out(line); resume()
        return seen(batch_dir, 0.5, said)
    monkeypatch.setattr(cluster, 'follow', follow_then_resume)
    try: attached = oelm_main(*args)  # the same command, attached: follows the batch, then reports as usual
    finally: resume()
    assert attached.returncode == 0, attached.stdout + attached.stderr
    assert 'is being run in the background by' in attached.stdout
    assert 'gpt-s0: already completed, skipped' in attached.stdout
    assert '1/1 runs completed' in attached.stdout
    assert 'gpt-s0: completed' in (out / 'batch.log').read_text()
    wait_for(lambda: not is_alive(holder), 60, 'the detached batch to exit once its runs are done')
