"""The trainer from outside (SPEC section 1, training): exact resume, crash-safe checkpoints,
DDP equivalence, divergence handling, checkpoint layout, CLI config errors, safe
deserialization, optional loggers and the metrics log.

Everything runs on CPU with tiny models. Each comparison is against an independent run
(a straight run vs an interrupted-and-resumed one, one process vs two) and the tests that
could pass vacuously carry a negative control (e.g. a resume with the wrong RNG state must
*not* reproduce the straight run).
"""
from __future__ import annotations
import importlib.util, json, math, os, re, shutil, signal, subprocess, sys, textwrap, time
from pathlib import Path

import pytest
from cli_helpers import oelm_main
import torch
from safetensors.torch import load_file, save_file

import oelm_nb
import oelm_nb.train.trainer as T
from oelm_nb.train.checkpoint import CheckpointError, list_checkpoints, load_weights, read_checkpoint_meta
from oelm_nb.base.core import ConfigError, DataConfig, ModelConfig, TrainConfig
from oelm_nb.data.corpus import TokenData, load_split, prepare_data
from oelm_nb.lab.spec import resolve_spec
from oelm_nb.lab.run import train_run
from oelm_nb.base.rundir import read_json
from oelm_nb.model.gpt import GPT, model_config
from oelm_nb.base.metrics import read_metrics
from oelm_nb.train.trainer import Trainer, lm_loss, lr_at
from oelm_nb.train.trainer import TrainingDiverged
from oelm_nb.train.trainer import copy_task_data  # the train chapter's copying task (its examples use it too)

PKG = Path(oelm_nb.__file__).resolve().parent
SUB_ENV = {**os.environ, 'OMP_NUM_THREADS': '1', 'MKL_NUM_THREADS': '1', 'CUDA_VISIBLE_DEVICES': '', 'PYTHONUNBUFFERED': '1'}

TINY = dict(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
RECORD_KEYS = {'step', 'tokens', 'lr', 'train_loss', 'tokens_per_s', 'elapsed_s'}


# ====================================================================== helpers
def mcfg(**kw) -> ModelConfig: return ModelConfig(**{**TINY, 'dropout': 0.0, **kw})

def tcfg(**kw) -> TrainConfig:
    base = dict(max_steps=8, batch_size=4, lr=1e-2, min_lr=1e-3, warmup_steps=2, eval_every=2, eval_batches=2,
                log_every=1, device='cpu', progress=False)
    return TrainConfig(**{**base, **kw})

def copy_data():
    "Train/val copy-task data (with recall positions), rebuilt identically in subprocesses."
    return copy_task_data(n_seqs=128, half=8, vocab=64, seed=0), copy_task_data(n_seqs=32, half=8, vocab=64, seed=1)

def losses(run_dir) -> list[float]: return [r['train_loss'] for r in read_metrics(run_dir)]

def steps(run_dir) -> list[int]: return [r['step'] for r in read_metrics(run_dir)]

def tensors_of(ckpt: Path, key: str = 'model') -> dict: return load_file(str(Path(ckpt) / f'{key}.safetensors'))

def assert_same_tensors(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k in a: assert torch.equal(a[k], b[k]), k

def step_dirs(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith('step_') and not p.is_symlink())


@pytest.fixture(scope='module')
def stories(tmp_path_factory) -> Path:
    "A small real story corpus (BPE vocab 320, recall positions) shared read-only by several tests."
    return prepare_data(DataConfig(vocab_size=320, n_train_stories=200, n_val_stories=40),
                        tmp_path_factory.mktemp('stories') / 'data', progress=False)


# ====================================================================== 1. exact resume
RESUME_CASES = {
    # dropout > 0 (so the torch RNG must be restored) and gradient accumulation
    'gpt-dropout-accum-until4': (dict(variant='gpt', dropout=0.2), 4),
    # progressive unfreezing at step 3: resume after the release (the released layer's Q/K must come back
    # as a trainable parameter with its own optimizer state) and before it (the release happens after resume)
    'freeze-unfreeze3-until4': (dict(variant='oelm-freeze', unfreeze_at=(3,), dropout=0.2), 4),
    'freeze-unfreeze3-until2': (dict(variant='oelm-freeze', unfreeze_at=(3,), dropout=0.2), 2),
}

# ====================================================================== precision
def test_bf16_runs_are_bitwise_reproducible_with_fp32_weights_state_and_loss(tmp_path):
    train, val = copy_data()
    trainers = [Trainer(GPT(mcfg(dropout=0.1), init_seed=0), tcfg(dtype='bfloat16'), train, val, out_dir=tmp_path / f'bf16-{i}')
                for i in range(2)]
    sums = [t.fit() for t in trainers]
    assert len(losses(tmp_path / 'bf16-0')) == 8 and losses(tmp_path / 'bf16-0') == losses(tmp_path / 'bf16-1')
    assert_same_tensors(tensors_of(tmp_path / 'bf16-0/checkpoints/final'), tensors_of(tmp_path / 'bf16-1/checkpoints/final'))
    t = trainers[0]  # autocast computes in bf16; what is kept stays fp32
    assert all(p.dtype == torch.float32 for p in t.raw.parameters())
    assert all(v.dtype == torch.float32 for st in t.opt.state.values() for k, v in st.items() if k in ('exp_avg', 'exp_avg_sq'))
    x = torch.zeros(2, 16, dtype=torch.long)
    with T.autocast(t.device, t.amp): assert t.raw(x, x)[1].dtype == torch.float32
    assert sums[0]['runtime']['dtype'] == 'bfloat16' and sums[0]['runtime']['dtype_config'] == 'bfloat16'
    # negative control: the same run in plain fp32 gives other losses, so bf16 was really in use above
    f32 = Trainer(GPT(mcfg(dropout=0.1), init_seed=0), tcfg(dtype='float32'), train, val, out_dir=tmp_path / 'fp32').fit()
    assert f32['runtime']['dtype'] == 'float32' and losses(tmp_path / 'fp32') != losses(tmp_path / 'bf16-0')


@pytest.mark.parametrize('caps, speedup, native', [
    ({'architecture': 'x86_64', 'avx512_bf16': True, 'amx_bf16': False}, 0.1, True),    # torch's report decides on x86
    ({'architecture': 'x86_64', 'avx512_bf16': False, 'amx_bf16': True}, 0.1, True),
    ({'architecture': 'x86_64', 'avx512_bf16': False, 'amx_bf16': False}, 9.0, False),  # emulated bf16
    ({'architecture': 'aarch64'}, 2.5, True),                                          # no report: the timing probe
    ({'architecture': 'aarch64'}, 0.8, False),
])
def test_native_bf16_is_detected_but_auto_stays_fp32_on_cpu(monkeypatch, caps, speedup, native):
    import oelm_nb.model.device as core
    monkeypatch.setattr(torch._C._cpu, '_get_cpu_capability', lambda: caps)
    monkeypatch.setattr(torch.ops.mkldnn, '_is_mkldnn_bf16_supported', lambda: True)  # oneDNN's own bf16 support: whatever this CPU has
    monkeypatch.setattr(core, 'bf16_matmul_speedup', lambda *a, **k: speedup)
    core.cpu_has_native_bf16.cache_clear()
    try:
        cpu = torch.device('cpu')
        assert core.cpu_has_native_bf16() is native
        # the numerics check moved oelm-freeze beyond the fp32 seed spread under bf16: 'auto' on a CPU is fp32
        assert core.autocast_dtype(cpu, 'auto') is None and core.autocast_dtype(cpu, 'bfloat16') == torch.bfloat16
        note = core.precision_note(cpu)
        assert note.startswith('float32') and (("dtype='bfloat16' is about 2x faster" in note) is native)
    finally:
        core.cpu_has_native_bf16.cache_clear()


@pytest.mark.parametrize('case', list(RESUME_CASES))
def test_exact_resume(tmp_path, case):
    mkw, until = RESUME_CASES[case]
    mc, tc = mcfg(**mkw), tcfg(grad_accum=2)
    train, val = copy_data()
    straight = Trainer(GPT(mc, init_seed=0), tc, train, val, out_dir=tmp_path / 'straight').fit()
    assert straight['status'] == 'completed' and straight['steps'] == 8

    first = Trainer(GPT(mc, init_seed=0), tc, train, val, out_dir=tmp_path / 'resumed').fit(until=until)
    assert first['status'] == 'interrupted' and first['steps'] == until
    assert steps(tmp_path / 'resumed') == list(range(1, until + 1))
    # a NEW model with another init: everything that matters must come from the checkpoint
    second = Trainer(GPT(mc, init_seed=12345), tc, train, val, out_dir=tmp_path / 'resumed').fit()
    assert second['status'] == 'completed' and second['steps'] == 8

    a, b = losses(tmp_path / 'straight'), losses(tmp_path / 'resumed')
    assert len(a) == 8 and a == b  # exact equality, not approximate
    assert steps(tmp_path / 'resumed') == list(range(1, 9))  # no duplicated steps after the resume
    assert [r.get('val_loss') for r in read_metrics(tmp_path / 'straight')] == [r.get('val_loss') for r in read_metrics(tmp_path / 'resumed')]
    # the final weights are bitwise the same too
    assert_same_tensors(tensors_of(tmp_path / 'straight/checkpoints/final'), tensors_of(tmp_path / 'resumed/checkpoints/final'))

    if case == 'gpt-dropout-accum-until4':
        # negative control: the same resume with a different RNG state in the checkpoint must NOT reproduce the
        # straight run (so the equality above really depends on restoring the RNG, i.e. dropout is active)
        ctrl = tmp_path / 'control'
        Trainer(GPT(mc, init_seed=0), tc, train, val, out_dir=ctrl).fit(until=until)
        ck = list_checkpoints(ctrl / 'checkpoints')[-1]
        rng = load_file(str(ck / 'rng.safetensors'))
        rng['torch_cpu'] = torch.Generator().manual_seed(999).get_state()
        save_file(rng, str(ck / 'rng.safetensors'))
        Trainer(GPT(mc, init_seed=0), tc, train, val, out_dir=ctrl).fit()
        c = losses(ctrl)
        assert len(c) == 8 and c[:until] == a[:until] and c[until:] != a[until:]


def test_unfreeze_across_resume_restores_trainable_qk(tmp_path):
    "After resuming past the release step, the released layer's Q/K is a trainable parameter in the optimizer."
    mc, tc = mcfg(variant='oelm-freeze', unfreeze_at=(3,)), tcfg(max_steps=6)
    train, val = copy_data()
    Trainer(GPT(mc, init_seed=0), tc, train, val, out_dir=tmp_path).fit(until=4)
    tr = Trainer(GPT(mc, init_seed=1), tc, train, val, out_dir=tmp_path)
    assert tr.resume()
    trainable = {n for n, p in tr.raw.named_parameters() if p.requires_grad}
    assert 'transformer.h.1.attn.q_proj.weight' in trainable and 'transformer.h.1.attn.k_proj.weight' in trainable
    assert 'transformer.h.0.attn.q_proj.weight' not in trainable  # one step in unfreeze_at: only the top layer


# ====================================================================== 2. SIGKILL while a checkpoint is written
CHILD = textwrap.dedent('''
    import json, sys, time
    from pathlib import Path
    import torch
    torch.set_num_threads(1)
    import oelm_nb.train.trainer as T
    import oelm_nb.train.checkpoint as C
    from oelm_nb.base.core import ModelConfig, TrainConfig
    from oelm_nb.model.gpt import GPT

    spec = json.loads(Path(sys.argv[1]).read_text())
    out, kill_at = Path(sys.argv[2]), spec['kill_at']
    sys.path.insert(0, sys.argv[3])  # tests/, for the copy task
    from oelm_nb.train.trainer import copy_task_data  # the train chapter's copying task (its examples use it too)
    _orig = C.save_file

    def slow_save_file(tensors, filename, *a, **k):
        _orig(tensors, filename, *a, **k)
        p = Path(filename)
        if p.name == 'optimizer.safetensors' and p.parent.name.startswith(f'.tmp-step_{kill_at:07d}'):
            with open(p, 'r+b') as f: f.truncate(p.stat().st_size // 2)  # a half-written file ...
            time.sleep(600)                                               # ... and the parent kills us here

    C.save_file = slow_save_file
    train = copy_task_data(n_seqs=128, half=8, vocab=64, seed=0)
    val = copy_task_data(n_seqs=32, half=8, vocab=64, seed=1)
    mc, tc = ModelConfig.from_dict(spec['model']), TrainConfig.from_dict(spec['train'])
    T.Trainer(GPT(mc, init_seed=0), tc, train, val, out_dir=out).fit()
    print('FINISHED WITHOUT BEING KILLED')
''')

def test_sigkill_during_checkpoint_then_resume(tmp_path):
    mc, tc = mcfg(dropout=0.1), tcfg(ckpt_every=1, keep_last=3)
    out, kill_at = tmp_path / 'run', 3
    (tmp_path / 'spec.json').write_text(json.dumps({'model': mc.to_dict(), 'train': tc.to_dict(), 'kill_at': kill_at}))
    (tmp_path / 'child.py').write_text(CHILD)
    root = out / 'checkpoints'
    proc = subprocess.Popen([sys.executable, str(tmp_path / 'child.py'), str(tmp_path / 'spec.json'), str(out),
                             str(Path(__file__).parent)],
                            env=SUB_ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 90
        while True:
            tmps = list(root.glob(f'.tmp-step_{kill_at:07d}-*')) if root.exists() else []
            if tmps and (tmps[0] / 'optimizer.safetensors').exists(): break
            if proc.poll() is not None:
                pytest.fail(f'child exited ({proc.returncode}) before the checkpoint write: {proc.communicate()}')
            if time.time() > deadline: pytest.fail('the checkpoint of the kill step never started')
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None: proc.kill(); proc.wait()
    assert proc.returncode == -signal.SIGKILL

    # the killed write left its temporary directory behind, incomplete (no meta.json)
    leftovers = list(root.glob('.tmp-*'))
    assert leftovers and not any((p / 'meta.json').exists() for p in leftovers)
    # the latest complete checkpoint is the one before, and it is fully usable
    cks = list_checkpoints(root)
    assert cks and cks[-1].name == f'step_{kill_at - 1:07d}'
    meta = json.loads((cks[-1] / 'meta.json').read_text())
    assert meta['step'] == kill_at - 1 and read_checkpoint_meta(cks[-1])['step'] == kill_at - 1
    fresh = GPT(mc, init_seed=77)
    load_weights(fresh, cks[-1])
    saved = tensors_of(cks[-1])
    sd = fresh.state_dict()
    assert all(torch.equal(sd[k], v) for k, v in saved.items())
    assert os.path.realpath(root / 'latest') == os.path.realpath(cks[-1])

    # a new trainer resumes from it and finishes; the leftovers are pruned
    train, val = copy_data()
    summary = Trainer(GPT(mc, init_seed=5), tc, train, val, out_dir=out).fit()
    assert summary['status'] == 'completed' and summary['steps'] == tc.max_steps
    assert not [p.name for p in root.iterdir() if p.name.startswith('.tmp-')]
    assert steps(out) == list(range(1, tc.max_steps + 1))  # step kill_at was logged before the kill: not duplicated
    # and the killed-and-resumed run is the same run as an uninterrupted one (different process, same numbers)
    Trainer(GPT(mc, init_seed=0), tc, train, val, out_dir=tmp_path / 'straight').fit()
    assert losses(out) == losses(tmp_path / 'straight')


class _Killed(BaseException):
    "Stands for the process dying at this point (nothing runs afterwards but the resume)."

def test_crash_while_resaving_the_same_step_keeps_a_resumable_checkpoint(tmp_path, monkeypatch):
    # eval_every == ckpt_every: at step 2 the trainer saves 'best' and then the periodic checkpoint of the same step;
    # the second save deletes the first one with rmtree before renaming the new one in place.
    mc, tc = mcfg(), tcfg(max_steps=6, eval_every=2, ckpt_every=2)
    train, val = copy_data()
    real_rmtree = shutil.rmtree

    def dying_rmtree(path, *a, **k):
        p = Path(path)
        if p.name.startswith('step_') and (p / 'meta.json').exists():
            (p / 'model.safetensors').unlink()  # rmtree removes entries one by one, in directory order ...
            raise _Killed()                     # ... and the process is killed before it reaches meta.json
        return real_rmtree(path, *a, **k)

    monkeypatch.setattr(shutil, 'rmtree', dying_rmtree)
    try: Trainer(GPT(mc, init_seed=0), tc, train, val, out_dir=tmp_path).fit()
    except _Killed: pass  # (a trainer that never deletes a complete checkpoint is not killed here, and passes)
    monkeypatch.setattr(shutil, 'rmtree', real_rmtree)
    # every checkpoint list_checkpoints calls complete must load, and the run must be resumable
    for ck in list_checkpoints(tmp_path / 'checkpoints'):
        load_weights(GPT(mc, init_seed=1), ck)
    assert Trainer(GPT(mc, init_seed=1), tc, train, val, out_dir=tmp_path).fit()['status'] == 'completed'


# ====================================================================== 3. DDP (torchrun, gloo) == one process
B, DDP_STEPS, DDP_TOL = 4, 10, T.DDP_LOSS_TOL  # the library's tolerance (`oelm doctor` asks for the same)

def ddp_spec(stories: Path, out_dir: Path, batch_size: int):
    return resolve_spec('qk-freeze', 'oelm-freeze', 'tiny', seed=0, steps=DDP_STEPS, out_dir=str(out_dir), data=str(stories),
                        overrides={'model.vocab_size': 320, 'model.block_size': 32, 'model.n_layer': 2, 'model.n_head': 2,
                                   'model.n_embd': 32, 'model.dropout': 0.0, 'train.batch_size': batch_size,
                                   'train.eval_every': 5, 'train.eval_batches': 2, 'train.log_every': 1,
                                   'train.lr': 1e-2, 'train.min_lr': 1e-3, 'train.device': 'cpu', 'train.progress': False,
                                   'train.dtype': 'float32'})  # the tolerance below is fp32 rounding

@pytest.fixture(scope='module')
def ddp_runs(stories, tmp_path_factory):
    "The same spec trained by torchrun with 2 gloo processes x batch B, and by one process with batch 2B."
    tmp = tmp_path_factory.mktemp('ddp')
    ddp_dir, one_dir = tmp / 'ddp', tmp / 'one'
    ddp_dir.mkdir()
    ddp_spec(stories, ddp_dir, batch_size=B).save_json(tmp / 'cfg.json')
    cmd = [sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2',
           '-m', 'oelm_nb.app.cli', 'train', '--config', str(tmp / 'cfg.json'), '--no-progress']
    res = subprocess.run(cmd, cwd=tmp, env=SUB_ENV, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    single = train_run(ddp_spec(stories, one_dir, batch_size=2 * B), progress=False)
    return ddp_dir, one_dir, single

@pytest.mark.slow
def test_ddp_two_processes_match_one_process_with_the_same_global_batch_in_loss_weights_and_evals(ddp_runs, stories):
    ddp_dir, one_dir, single = ddp_runs
    s_ddp, s_one = read_json(ddp_dir / 'summary.json'), read_json(one_dir / 'summary.json')
    assert s_ddp['status'] == s_one['status'] == single['status'] == 'completed'
    assert s_ddp['world_size'] == 2 and s_one['world_size'] == 1
    assert s_ddp['steps'] == s_one['steps'] == DDP_STEPS and s_ddp['tokens'] == s_one['tokens']

    m_ddp, m_one = read_metrics(ddp_dir), read_metrics(one_dir)
    assert [r['step'] for r in m_ddp] == [r['step'] for r in m_one] == list(range(1, DDP_STEPS + 1))
    assert [r['tokens'] for r in m_ddp] == [r['tokens'] for r in m_one]
    # the same function, not bit for bit (float32 reductions in another order): why DDP_LOSS_TOL holds, see nbs/train/42_trainer.ipynb
    dev = [abs(a['train_loss'] - b['train_loss']) for a, b in zip(m_ddp, m_one)]
    print(f'DDP vs single-process max |train_loss diff| over {DDP_STEPS} steps: {max(dev):.3e}')
    assert max(dev) < DDP_TOL, dev
    # negative control: the training actually moved, so agreement is not just "both stayed at init"
    assert m_one[0]['train_loss'] - m_one[-1]['train_loss'] > 1000 * DDP_TOL
    # the final weights agree too: evaluated on one and the same sample they give the same loss
    val = load_split(stories, 'val')
    spec = ddp_spec(stories, one_dir, batch_size=2 * B)
    ev = [T.evaluate(load_weights(GPT(spec.model, init_seed=1), d / 'checkpoints' / 'final'), val, 32, 2 * B, 2,
                     torch.device('cpu'))['val_loss'] for d in (ddp_dir, one_dir)]
    assert abs(ev[0] - ev[1]) < DDP_TOL
    assert ev[1] == pytest.approx(m_one[-1]['val_loss'], abs=1e-6)  # and that sample is the single run's own
    # the evaluations during training agree too (one test with the above: a module fixture that two tests share is
    # trained once per xdist worker that runs one of them, and torchrun is the costliest here)
    ev = [(a['val_loss'], b['val_loss']) for a, b in zip(m_ddp, m_one) if 'val_loss' in a or 'val_loss' in b]
    assert len(ev) == 2 and all(abs(a - b) < DDP_TOL for a, b in ev), ev


# ====================================================================== 4. NaN / inf
@pytest.mark.parametrize('bad', [float('nan'), float('inf')])
def test_non_finite_loss_raises_and_keeps_last_good_checkpoint(tmp_path, bad):
    mc, tc = mcfg(), tcfg(ckpt_every=1, keep_last=5)
    train, val = copy_data()
    calls = {'n': 0}

    def hook(model, batch):
        loss, extra = lm_loss(model, batch)
        calls['n'] += 1
        return (loss * bad if calls['n'] > 3 else loss), extra

    with pytest.raises(TrainingDiverged, match='not finite'):
        Trainer(GPT(mc, init_seed=0), tc, train, val, out_dir=tmp_path, loss_fn=hook).fit()
    cks = list_checkpoints(tmp_path / 'checkpoints')
    assert cks[-1].name == 'step_0000003'  # nothing written for the diverged step
    fresh = load_weights(GPT(mc, init_seed=9), cks[-1])
    assert all(torch.isfinite(v).all() for v in fresh.state_dict().values())
    assert max(steps(tmp_path)) == 3 and all(math.isfinite(l) for l in losses(tmp_path))
    # and training resumes from it once the cause is gone
    assert Trainer(GPT(mc, init_seed=9), tc, train, val, out_dir=tmp_path).fit()['status'] == 'completed'


# ====================================================================== 5. checkpoint contents
def test_checkpoint_layout_links_and_keep_last(tmp_path):
    # eval only at the end (eval_every=0): best == final, so the periodic checkpoints alone test keep_last
    mc, tc = mcfg(), tcfg(max_steps=6, ckpt_every=1, keep_last=2, eval_every=0)
    train, val = copy_data()
    Trainer(GPT(mc, init_seed=0), tc, train, val, out_dir=tmp_path).fit()
    root = tmp_path / 'checkpoints'
    for link in ('best', 'final', 'latest'):
        assert (root / link).is_symlink(), link
        target = os.readlink(root / link)
        assert re.fullmatch(r'step_\d{7}', target) and (root / target).is_dir()
    assert os.readlink(root / 'final') == os.readlink(root / 'latest') == 'step_0000006'
    assert step_dirs(root) == ['step_0000005', 'step_0000006']  # keep_last=2
    assert sorted(p.name for p in root.iterdir()) == ['best', 'final', 'latest', 'step_0000005', 'step_0000006']
    for ck in list_checkpoints(root):
        files = list(ck.iterdir())
        assert all(f.is_file() and f.suffix in ('.safetensors', '.json') for f in files), files
        assert {'model.safetensors', 'optimizer.safetensors', 'rng.safetensors', 'meta.json'} <= {f.name for f in files}
        meta = read_checkpoint_meta(ck)
        assert meta['step'] == int(ck.name[5:]) and meta['tokens'] == meta['step'] * tc.batch_size * mc.block_size


def test_keep_last_with_best_moving_to_final(stories, tmp_path):
    mc, tc = mcfg(vocab_size=320, block_size=32), tcfg(max_steps=8, ckpt_every=1, keep_last=2, eval_every=2)
    Trainer(GPT(mc, init_seed=0), tc, load_split(stories, 'train'), load_split(stories, 'val'), out_dir=tmp_path).fit()
    evals = [r['val_loss'] for r in read_metrics(tmp_path) if 'val_loss' in r]
    assert evals == sorted(evals, reverse=True)  # precondition: val loss improves at every eval (best moves to final)
    root = tmp_path / 'checkpoints'
    linked = {os.readlink(root / n) for n in ('best', 'final', 'latest')}
    kept = step_dirs(root)
    assert set(kept) <= set(kept[-tc.keep_last:]) | linked, kept


def test_load_weights_mismatch_names_the_file(tmp_path):
    mc, tc = mcfg(), tcfg(max_steps=2, eval_every=0)
    train, val = copy_data()
    Trainer(GPT(mc, init_seed=0), tc, train, val, out_dir=tmp_path).fit()
    ck = list_checkpoints(tmp_path / 'checkpoints')[-1]
    path = str(ck / 'model.safetensors')
    for other in (mcfg(n_layer=3), mcfg(n_embd=64), mcfg(vocab_size=80)):
        with pytest.raises(CheckpointError) as e:
            load_weights(GPT(other, init_seed=0), ck)
        assert path in str(e.value), str(e.value)
    with pytest.raises(CheckpointError, match=re.escape(str(ck / 'lora.safetensors'))):
        load_weights(GPT(mc, init_seed=0), ck, key='lora')
    with pytest.raises(CheckpointError, match='meta.json'):
        read_checkpoint_meta(tmp_path)  # not a checkpoint directory
    load_weights(GPT(mc, init_seed=3), ck)  # control: the matching model loads


# ====================================================================== 6. bad configs through the CLI
def run_cli(*args, cwd) -> subprocess.CompletedProcess:
    "`oelm ARGS` in this process (the subject is the command's one-line error; the console script's exit status: test_cli)."
    return oelm_main(*args)

def one_error_line(res: subprocess.CompletedProcess, command: str) -> str:
    assert res.returncode == 2, (res.returncode, res.stdout, res.stderr)
    lines = [l for l in res.stderr.splitlines() if l.strip()]
    assert len(lines) == 1, res.stderr  # one line, no traceback
    assert lines[0].startswith(f'oelm {command}: error: '), lines[0]
    return lines[0]

def _valid_spec_dict(tmp_path) -> dict:
    return resolve_spec('qk-freeze', 'gpt', 'tiny', steps=2, out_dir=str(tmp_path / 'run')).to_dict()

@pytest.mark.parametrize('kind', ['missing', 'invalid-json', 'unknown-train-field', 'unknown-top-field'])
def test_train_bad_config_exits_2_with_one_line(tmp_path, kind):
    cfg = tmp_path / 'cfg.json'
    if kind == 'missing': cfg = tmp_path / 'no_such_config.json'
    elif kind == 'invalid-json': cfg.write_text('{"model": {"vocab_size": 64,}')
    else:
        d = _valid_spec_dict(tmp_path)
        if kind == 'unknown-train-field': d['train']['learnig_rate'] = 1e-3
        else: d['learnig_rate'] = 1e-3
        cfg.write_text(json.dumps(d))
    line = one_error_line(run_cli('train', '--config', str(cfg), '--no-progress', cwd=tmp_path), 'train')
    if kind in ('missing', 'invalid-json'): assert str(cfg) in line
    if kind == 'missing': assert 'does not exist' in line
    if kind == 'invalid-json': assert 'JSON' in line
    if kind.startswith('unknown'): assert 'learnig_rate' in line
    assert not (tmp_path / 'run').exists()  # nothing was trained


def test_data_prepare_corrupt_jsonl_names_file_and_line(tmp_path):
    src = tmp_path / 'stories.jsonl'
    src.write_text('{"text": "Once upon a time."}\n{"text": "Tom had a red ball."}\n{"text": "broken\n{"text": "x"}\n')
    line = one_error_line(run_cli('data', 'prepare', '--source', str(src), '--out', str(tmp_path / 'out'), '--quiet',
                                  cwd=tmp_path), 'data')
    assert str(src) in line and 'line 3' in line
    assert not (tmp_path / 'out' / 'meta.json').exists()


# ====================================================================== 7. no unsafe deserialization
def _calls(text: str, name: str) -> list[str]:
    "Every call `name(...)` in `text`, with its balanced argument list."
    out = []
    for m in re.finditer(re.escape(name) + r'\s*\(', text):
        depth, i = 0, m.end() - 1
        for j in range(i, len(text)):
            depth += {'(': 1, ')': -1}.get(text[j], 0)
            if depth == 0: out.append(text[m.start():j + 1]); break
    return out

def unsafe_uses(text: str) -> list[str]:
    bad = re.findall(r'\b(?:cPickle|pickle|dill|cloudpickle|joblib)\.loads?\b', text)
    bad += [c for c in _calls(text, 'torch.load') if not re.search(r'weights_only\s*=\s*True', c)]
    bad += [c for n in ('np.load', 'numpy.load') for c in _calls(text, n) if re.search(r'allow_pickle\s*=\s*True', c)]
    return bad

def test_the_detector_itself_flags_unsafe_calls():
    assert unsafe_uses('x = pickle.load(f)') and unsafe_uses('cPickle.loads(b)')
    assert unsafe_uses("torch.load(p, map_location='cpu')") and unsafe_uses('torch.load(open(p), weights_only=False)')
    assert not unsafe_uses("torch.load(p, map_location=dict(a=1), weights_only=True)")
    assert unsafe_uses('np.load(p, allow_pickle=True)') and not unsafe_uses('np.load(p)')

def test_package_has_no_unsafe_deserialization():
    files = sorted(PKG.rglob("*.py"))
    assert len(files) >= 8  # the package source is really here
    found = {str(f.relative_to(PKG)): u for f in files if (u := unsafe_uses(f.read_text()))}
    assert not found, found


# ====================================================================== 8. optional loggers
def test_tensorboard_logger_writes_events(tmp_path):
    pytest.importorskip('tensorboard')
    mc, tc = mcfg(), tcfg(max_steps=3, loggers=('tensorboard',))
    train, val = copy_data()
    Trainer(GPT(mc, init_seed=0), tc, train, val, out_dir=tmp_path).fit()
    events = list((tmp_path / 'tensorboard').glob('events.out.tfevents.*'))
    assert events and all(e.stat().st_size > 0 for e in events)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(tmp_path / 'tensorboard')); acc.Reload()
    assert {'train_loss', 'lr', 'val_loss'} <= set(acc.Tags()['scalars'])
    assert [e.step for e in acc.Scalars('train_loss')] == [1, 2, 3]
    assert [e.value for e in acc.Scalars('train_loss')] == pytest.approx(losses(tmp_path), rel=1e-6)

def test_missing_wandb_is_a_config_error(tmp_path):
    if importlib.util.find_spec('wandb') is not None: pytest.skip('wandb is installed')
    train, val = copy_data()
    with pytest.raises(ConfigError, match='pip install'):
        Trainer(GPT(mcfg(), init_seed=0), tcfg(max_steps=2, loggers=('wandb',)), train, val, out_dir=tmp_path).fit()


# ====================================================================== 9. metrics
def test_the_metrics_module_imports_no_torch():
    "Reports read runs without torch: oelm_nb.base.metrics imports neither torch nor any module that does (a fresh process)."
    probe = ("import sys, oelm_nb.base.metrics as m; print(m.__file__); "
             "print(sorted(n for n in sys.modules if n.split('.')[0] == 'torch'))")
    res = subprocess.run([sys.executable, '-c', probe], env=SUB_ENV, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    where, torch_modules = res.stdout.strip().splitlines()
    assert Path(where).resolve().parent == PKG / 'base' and torch_modules == '[]', res.stdout

def test_counting_a_model_imports_no_dynamo():
    """`oelm run` builds each variant's model on the meta device to count it (the memory check): torch fills a meta
    tensor through Python reference ops whose first call imports torch._dynamo, 2 s of every `oelm run`'s start. The
    model skips those fills (a meta tensor has no values); a fresh process, as `oelm run` starts."""
    probe = ("import sys; from oelm_nb.model.gpt import shape_model, model_config; from oelm_nb.model.freeze import param_report\n"
             "for v in ('gpt', 'oelm', 'oelm-freeze', 'gauss-freeze'): print(v, param_report(shape_model(model_config('tiny', variant=v))).to_dict())\n"
             "print('torch._dynamo' in sys.modules)")
    res = subprocess.run([sys.executable, '-c', probe], env=SUB_ENV, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    *counts, dynamo = res.stdout.strip().splitlines()
    from oelm_nb.model.freeze import param_report
    for line, v in zip(counts, ('gpt', 'oelm', 'oelm-freeze', 'gauss-freeze')):  # the counts of the model built to train
        assert line == f"{v} {param_report(GPT(model_config('tiny', variant=v), init_seed=0)).to_dict()}", line
    assert dynamo == 'False', res.stdout

class _Crash(Exception):
    "A crash in the middle of training (after steps were logged past the last checkpoint)."

def test_metrics_records_and_resume_without_duplicates(tmp_path):
    mc, tc = mcfg(dropout=0.1), tcfg(max_steps=8, ckpt_every=2, eval_every=2)
    train, val = copy_data()
    calls = {'n': 0}

    def hook(model, batch):  # a loss hook with an extra scalar; crashes during step 6 on the first run
        calls['n'] += 1
        if calls['n'] == 6 and not calls.get('resumed'): raise _Crash()
        loss, _ = lm_loss(model, batch)
        return loss, {'aux': 0.5}

    with pytest.raises(_Crash):
        Trainer(GPT(mc, init_seed=0), tc, train, val, out_dir=tmp_path, loss_fn=hook).fit()
    assert steps(tmp_path) == [1, 2, 3, 4, 5]  # step 5 logged, last checkpoint at 4
    calls['resumed'] = True
    summary = Trainer(GPT(mc, init_seed=3), tc, train, val, out_dir=tmp_path, loss_fn=hook).fit()
    recs = read_metrics(tmp_path)
    assert [r['step'] for r in recs] == list(range(1, 9))  # step 5 re-logged once, not twice

    for r in recs:
        assert RECORD_KEYS <= set(r), r
        assert r['tokens'] == r['step'] * tc.batch_size * tc.grad_accum * mc.block_size
        assert r['lr'] == pytest.approx(lr_at(r['step'] - 1, tc))
        assert math.isfinite(r['train_loss']) and r['aux'] == pytest.approx(0.5)
        assert r['elapsed_s'] >= 0 and (r['tokens_per_s'] > 0 or math.isnan(r['tokens_per_s']))
    evals = [r for r in recs if 'val_loss' in r]
    assert [r['step'] for r in evals] == [2, 4, 6, 8]
    for r in evals:
        assert r['val_ppl'] == pytest.approx(math.exp(r['val_loss']), rel=1e-12)
        assert 0.0 <= r['recall_acc'] <= 1.0 and r['recall_n'] > 0
    assert summary['final_val_loss'] == evals[-1]['val_loss'] and summary['recall_acc'] == evals[-1]['recall_acc']


def test_restart_without_checkpoint_does_not_duplicate_metrics(tmp_path):
    mc, tc = mcfg(), tcfg(max_steps=5, eval_every=0, ckpt_every=0)  # no checkpoint before the end
    train, val = copy_data()
    calls = {'n': 0}

    def hook(model, batch):
        calls['n'] += 1
        if calls['n'] == 3: raise _Crash()
        return lm_loss(model, batch)

    with pytest.raises(_Crash):
        Trainer(GPT(mc, init_seed=0), tc, train, val, out_dir=tmp_path, loss_fn=hook).fit()
    assert steps(tmp_path) == [1, 2] and not list_checkpoints(tmp_path / 'checkpoints')
    assert Trainer(GPT(mc, init_seed=0), tc, train, val, out_dir=tmp_path).fit()['status'] == 'completed'
    assert steps(tmp_path) == [1, 2, 3, 4, 5]


def test_no_recall_accuracy_without_recall_positions(tmp_path):
    train, val = copy_data()
    strip = lambda d: TokenData(tokens=d.tokens, recall=None, vocab_size=d.vocab_size, meta=d.meta)
    summary = Trainer(GPT(mcfg(), init_seed=0), tcfg(max_steps=2), strip(train), strip(val), out_dir=tmp_path).fit()
    evals = [r for r in read_metrics(tmp_path) if 'val_loss' in r]
    assert evals and all('recall_acc' not in r for r in evals) and summary['recall_acc'] is None


def test_story_corpus_eval_reports_recall(stories, tmp_path):
    "Real prepared data (recall files from prepare_data) gives recall_acc in the eval records."
    mc = mcfg(vocab_size=320, block_size=128)
    Trainer(GPT(mc, init_seed=0), tcfg(max_steps=2), load_split(stories, 'train'), load_split(stories, 'val'),
            out_dir=tmp_path).fit()
    evals = [r for r in read_metrics(tmp_path) if 'val_loss' in r]
    assert evals and all(0.0 <= r['recall_acc'] <= 1.0 and r['recall_n'] > 0 for r in evals)


def test_data_and_eval_hooks_replace_token_windows():
    "A study with its own batches (not windows of train_data) trains through the same loop via batch_fn/eval_fn."
    import torch.nn.functional as F
    from oelm_nb.base.core import ModelConfig, TrainConfig
    from oelm_nb.model.gpt import GPT
    from oelm_nb.train.trainer import Trainer
    data = torch.randint(0, 32, (64, 9))
    seen, evals = [], []
    def batch_fn(step, micro):
        seen.append((step, micro)); rows = data[(step * 2 + micro) % 60:(step * 2 + micro) % 60 + 4]
        return rows[:, :-1], rows[:, 1:], None
    def eval_fn(model):
        evals.append(1)
        with torch.no_grad(): logits, _ = model(data[:8, :-1])
        loss = F.cross_entropy(logits.reshape(-1, 32), data[:8, 1:].reshape(-1)).item()
        return {'val_loss': loss, 'val_ppl': math.exp(loss)}
    model = GPT(ModelConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=16, dropout=0.0), init_seed=0)
    t = Trainer(model, TrainConfig(max_steps=6, batch_size=4, grad_accum=2, eval_every=3, log_every=1, warmup_steps=1, progress=False),
                None, batch_fn=batch_fn, eval_fn=eval_fn, tokens_per_batch=32)
    s = t.fit()
    assert seen == [(st, mi) for st in range(6) for mi in range(2)]
    assert len(evals) == 2 and s['tokens'] == 6 * 2 * 32 and s['best_val_loss'] is not None
    assert [r['step'] for r in t.records] == [1, 2, 3, 4, 5, 6]


def test_chance_recall_is_counted_on_the_scored_positions():
    "evaluate's recall_chance: the share of the positions recall_acc scores whose target is the chance token (numpy)."
    import numpy as np
    data = copy_task_data(n_seqs=64, half=8, vocab=16, seed=1)
    data.meta = {'recall': {'chance_token': 3}}
    T_, B, N = 24, 4, 2
    model = GPT(ModelConfig(n_layer=1, n_head=2, n_embd=16, block_size=T_, vocab_size=16, dropout=0.0))
    out = T.evaluate(model, data, T_, B, N, torch.device('cpu'))
    starts = T.eval_starts(len(data.tokens), T_, B * N)
    idx = starts[:, None] + np.arange(1, T_ + 1)
    y, rec = np.asarray(data.tokens)[idx].astype(int), np.asarray(data.recall)[idx].astype(int)
    scored = (rec > 0) & (rec <= np.arange(1, T_ + 1))  # the antecedent inside the window
    assert out['recall_n'] == scored.sum() and out['recall_chance'] == pytest.approx((y[scored] == 3).mean())
    data.meta = {}
    assert 'recall_chance' not in T.evaluate(model, data, T_, B, N, torch.device('cpu'))  # no chance token: none
