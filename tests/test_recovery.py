"""Honest divergence handling and recoverable files (issue 13), tested from outside.

* the divergence rule: a step is good only if its loss and gradient norm are finite (a) and its loss has not
  exploded against the recent median (b); no checkpoint of non-finite or exploded weights is written (c); the error
  names the step, the rule with its numbers and the checkpoint really kept on disk;
* TrainConfig refuses learning rates float32 cannot hold and non-finite floats;
* metrics.jsonl survives a writer killed mid-line, and a damaged line elsewhere is a named error;
* a damaged newest checkpoint is set aside and the previous one resumed, with weights, optimizer and RNG of that one
  checkpoint (the resumed run is bitwise the uninterrupted one); with no usable checkpoint the error names each file;
* leftovers of dead writers are removed when a fit starts, a living writer's are kept;
* a checkpoint write that fails (disk full) leaves no partial directory;
* running out of memory in a step is a ConfigError naming the batch shape.

Everything runs on CPU with tiny float32 models in a few seconds per test.
"""
from __future__ import annotations
import errno, json, math, os, re, subprocess, sys, warnings
from pathlib import Path

import pytest
import torch
from torch import nn
from safetensors.torch import load_file

import oelm_nb.train.trainer as T
import oelm_nb.train.checkpoint as C
from oelm_nb.base.rundir import RecoveryWarning, pid_alive
from oelm_nb.base.core import ConfigError, ModelConfig, TrainConfig
from oelm_nb.model.gpt import GPT
from oelm_nb.train.checkpoint import CheckpointError, list_checkpoints, prune_checkpoints, read_checkpoint_meta
from oelm_nb.base.metrics import MetricsError, read_metrics
from oelm_nb.train.trainer import Trainer, lm_loss
from oelm_nb.train.trainer import TrainingDiverged, TrainingOutOfMemory, param_rms
from oelm_nb.train.trainer import copy_task_data  # the train chapter's copying task (its examples use it too)

TINY = dict(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)


# ====================================================================== helpers
def mcfg(**kw) -> ModelConfig: return ModelConfig(**{**TINY, 'dropout': 0.0, **kw})

def tcfg(**kw) -> TrainConfig:
    base = dict(max_steps=8, batch_size=4, lr=1e-2, min_lr=1e-3, warmup_steps=2, eval_every=2, eval_batches=2,
                log_every=1, device='cpu', dtype='float32', progress=False)
    return TrainConfig(**{**base, **kw})

def copy_data():
    return copy_task_data(n_seqs=128, half=8, vocab=64, seed=0), copy_task_data(n_seqs=32, half=8, vocab=64, seed=1)

def trainer(out_dir, mc=None, tc=None, init_seed=0, **kw) -> Trainer:
    train, val = copy_data()
    return Trainer(GPT(mc or mcfg(), init_seed=init_seed), tc or tcfg(), train, val, out_dir=out_dir, **kw)

def losses(run_dir) -> list[float]: return [r['train_loss'] for r in read_metrics(run_dir)]
def steps(run_dir) -> list[int]: return [r['step'] for r in read_metrics(run_dir)]

def weights(ckpt: Path, key: str = 'model') -> dict: return load_file(str(Path(ckpt) / f'{key}.safetensors'))

def assert_same_tensors(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k in a: assert torch.equal(a[k], b[k]), k

def cut(path: Path, keep: float = 0.5):
    "Truncate `path` as a write cut short would leave it."
    path.write_bytes(path.read_bytes()[:int(path.stat().st_size * keep)])

def dead_pid() -> int:
    "The id of a process that has exited (and been reaped)."
    p = subprocess.Popen([sys.executable, '-c', 'pass']); p.wait()
    assert not pid_alive(p.pid)
    return p.pid

@pytest.fixture
def live_pid():
    "The id of a running process (a sleeping child of this test)."
    p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])
    try:
        assert pid_alive(p.pid)
        yield p.pid
    finally:
        p.kill(); p.wait()

def all_step_dirs(root: Path) -> list[Path]:
    "Every checkpoint-like directory on disk, set-aside ones included."
    return sorted(p for p in root.iterdir() if p.is_dir() and not p.is_symlink() and 'step_' in p.name) if root.exists() else []


# ====================================================================== 1. the divergence rule
@pytest.mark.parametrize('ckpt_every, eval_every', [(1, 2), (0, 0), (3, 1)])
def test_lr_1e30_diverges_without_writing_bad_weights(tmp_path, ckpt_every, eval_every):
    mc, tc = mcfg(), tcfg(lr=1e30, ckpt_every=ckpt_every, eval_every=eval_every, max_steps=20)
    t = trainer(tmp_path, mc, tc)
    ref = param_rms(t._trained_params())
    with pytest.raises(TrainingDiverged) as e:
        t.fit()
    msg = str(e.value)
    m = re.match(r'(training diverged at step|the checkpoint of step) (\d+)', msg)
    assert m, msg
    assert re.search(r'rule \((a|b|c)\)', msg) and 'lower TrainConfig.lr (now 1e+30' in msg and 'grad_clip > 0' in msg
    # the first step with lr=1e30 already turns the weights into garbage: nothing of it may reach the disk
    root = tmp_path / 'checkpoints'
    for d in all_step_dirs(root):
        w = weights(d)
        assert all(torch.isfinite(v).all() for v in w.values()), d
        assert param_rms(w.values()) < 100 * ref, d
    kept = list_checkpoints(root)
    if kept:
        assert f'Kept: {kept[-1]} (step {int(kept[-1].name[5:])})' in msg, msg
    else:
        assert f'Kept: no checkpoint was written before step {m[2]}.' in msg, msg
    for tag in ('best', 'final', 'latest'):
        link = root / tag
        assert not link.is_symlink() or (root / os.readlink(link)) in kept


def test_exploding_loss_is_rule_b_and_names_the_real_kept_checkpoint(tmp_path):
    calls = {'n': 0}

    def spiking(model, batch):  # a finite loss 100x the recent ones from step 5 on
        loss, extra = lm_loss(model, batch)
        calls['n'] += 1
        return (loss * 100 if calls['n'] >= 5 else loss), extra

    with pytest.raises(TrainingDiverged) as e:
        trainer(tmp_path, tc=tcfg(ckpt_every=1, keep_last=10), loss_fn=spiking).fit()
    msg = str(e.value)
    assert msg.startswith('training diverged at step 5: rule (b): the loss exploded: ') and 'more than 4x the median' in msg, msg
    root = tmp_path / 'checkpoints'
    assert list_checkpoints(root)[-1].name == 'step_0000004'
    assert f'Kept: {root}/step_0000004 (step 4), the newest complete checkpoint on disk' in msg, msg
    assert steps(tmp_path) == [1, 2, 3, 4]  # the bad step was neither applied nor logged


def test_exploded_weights_are_never_checkpointed(tmp_path, monkeypatch):
    "Rule (c): weights that blew up (finite, 1e4x) after step 4 are refused before the write; best/final/latest stay good."
    real = T.Trainer.train_step

    def blow_up_after_4(self):
        rec = real(self)
        if self.step == 4:
            with torch.no_grad():
                for p in self._trained_params(): p.mul_(1e4)
        return rec

    monkeypatch.setattr(T.Trainer, 'train_step', blow_up_after_4)
    t = trainer(tmp_path, tc=tcfg(ckpt_every=1, keep_last=10))
    ref = param_rms(t._trained_params())
    with pytest.raises(TrainingDiverged) as e:
        t.fit()
    msg = str(e.value)
    assert msg.startswith('the checkpoint of step 4 was refused (nothing written): rule (c): the global RMS of the trained parameters is'), msg
    assert 'the limit is 100x' in msg
    root = tmp_path / 'checkpoints'
    assert [p.name for p in list_checkpoints(root)] == [f'step_{s:07d}' for s in (1, 2, 3)]
    assert f'Kept: {root}/step_0000003 (step 3)' in msg
    assert not list(root.glob('.tmp-*'))
    assert os.readlink(root / 'latest') == 'step_0000003' and (root / os.readlink(root / 'best')) in list_checkpoints(root)
    assert read_checkpoint_meta(root / 'step_0000003')['divergence']['ref_rms'] == ref


def test_divergence_history_is_checkpointed_and_resumed_exactly(tmp_path):
    "The recent losses and the reference RMS travel in meta.json: a resumed run's meta equals an uninterrupted run's."
    tc = tcfg(max_steps=30, ckpt_every=5, keep_last=10, eval_every=10)
    straight = trainer(tmp_path / 'straight', tc=tc)
    ref = param_rms(straight._trained_params())
    straight.fit()
    trainer(tmp_path / 'resumed', tc=tc).fit(until=25)
    trainer(tmp_path / 'resumed', tc=tc, init_seed=7).fit()
    meta = read_checkpoint_meta(tmp_path / 'straight' / 'checkpoints' / 'step_0000025')['divergence']
    assert meta['ref_rms'] == ref and meta['recent_losses'] == losses(tmp_path / 'straight')[5:25]  # the last 20
    for s in (25, 30):
        a, b = (read_checkpoint_meta(tmp_path / r / 'checkpoints' / f'step_{s:07d}')['divergence'] for r in ('straight', 'resumed'))
        assert a == b
    assert losses(tmp_path / 'straight') == losses(tmp_path / 'resumed')


# ====================================================================== 2. configuration
@pytest.mark.parametrize('field, value, says', [
    ('lr', 1e39, 'TrainConfig.lr=1e+39 is invalid: must be positive and representable in float32'),
    ('lr', float('inf'), 'TrainConfig.lr=inf is invalid: must be a finite number'),
    ('lr', float('nan'), 'TrainConfig.lr=nan is invalid: must be a finite number'),
    ('min_lr', float('nan'), 'TrainConfig.min_lr=nan is invalid'),
    ('weight_decay', float('inf'), 'TrainConfig.weight_decay=inf is invalid'),
    ('grad_clip', float('inf'), 'TrainConfig.grad_clip=inf is invalid'),
    ('eps', float('inf'), 'TrainConfig.eps=inf is invalid'),
    ('beta2', float('nan'), 'TrainConfig.beta2=nan is invalid'),
])
def test_non_finite_or_float32_overflowing_train_config_is_a_config_error(tmp_path, field, value, says):
    with pytest.raises(ConfigError, match=re.escape(says)):
        TrainConfig(**{field: value})
    # the same from a JSON config file (json writes 1e39 as a number and inf/nan as Infinity/NaN)
    f = tmp_path / 'train.json'
    f.write_text(json.dumps({field: value}))
    with pytest.raises(ConfigError, match=re.escape(says)):
        TrainConfig.load_json(f)

def test_large_finite_lr_is_still_allowed():
    assert TrainConfig(lr=1e30, min_lr=0.0).lr == 1e30  # it diverges, but that is the trainer's rule, not a config error


# ====================================================================== 3. metrics.jsonl
def test_cut_off_last_metrics_line_is_dropped_and_resume_leaves_a_clean_file(tmp_path):
    tc = tcfg(ckpt_every=2)
    trainer(tmp_path / 'straight', tc=tc).fit()
    run = tmp_path / 'run'
    trainer(run, tc=tc).fit(until=4)
    f = run / 'metrics.jsonl'
    with open(f, 'a') as fh: fh.write('{"step": 5, "tokens": 320, "train_lo')  # a writer killed mid-line
    with pytest.warns(RecoveryWarning, match=re.escape(f'{f}: line 5 is cut off')):
        assert steps(run) == [1, 2, 3, 4]
    with pytest.warns(RecoveryWarning, match='line 5 is cut off'):
        assert trainer(run, tc=tc, init_seed=3).fit()['status'] == 'completed'
    text = f.read_text()
    assert text.endswith('\n') and all(json.loads(l)['step'] == i for i, l in enumerate(text.splitlines(), 1))
    with warnings.catch_warnings():
        warnings.simplefilter('error')  # clean now: no warning any more
        assert steps(run) == list(range(1, 9))
    assert losses(run) == losses(tmp_path / 'straight')


@pytest.mark.parametrize('content, line, says', [
    ('{"step": 1}\n{"step": 2, "train_loss": \n{"step": 3}\n', 2, 'is not valid JSON'),
    ('{"step": 1}\n\n[2, 3]\n{"step": 4}\n', 3, "is not a record: expected a JSON object with an integer 'step'"),
    ('{"step": 1}\n{"step": "2"}\n', 2, "is not a record: expected a JSON object with an integer 'step'"),
    ('{"step": 1}\n{"train_loss": 2.0}\n', 2, "is not a record"),
])
def test_damaged_metrics_line_is_a_named_error(tmp_path, content, line, says):
    f = tmp_path / 'metrics.jsonl'
    f.write_text(content)
    with pytest.raises(MetricsError, match=re.escape(f'{f}: line {line} {says}')) as e:
        read_metrics(tmp_path)
    assert f'Fix: repair or delete line {line}' in str(e.value)
    # and a resume does not silently rewrite it
    with pytest.raises(MetricsError, match=re.escape(f'{f}: line {line}')):
        trainer(tmp_path, tc=tcfg(max_steps=2)).fit()
    assert f.read_text() == content


# ====================================================================== 4. damaged checkpoints
def test_truncated_optimizer_falls_back_and_the_run_is_bitwise_the_uninterrupted_one(tmp_path):
    mc, tc = mcfg(dropout=0.1), tcfg(grad_accum=2, ckpt_every=2, keep_last=5)  # dropout: the RNG must come along too
    trainer(tmp_path / 'straight', mc, tc).fit()
    run = tmp_path / 'run'
    trainer(run, mc, tc).fit(until=6)
    root = run / 'checkpoints'
    bad = root / 'step_0000006' / 'optimizer.safetensors'
    cut(bad)
    with pytest.warns(RecoveryWarning) as rec:
        summary = trainer(run, mc, tc, init_seed=99).fit()
    msgs = [str(w.message) for w in rec if w.category is RecoveryWarning]
    assert len(msgs) == 1 and f'{bad} is unreadable' in msgs[0], msgs
    assert 'moved aside to corrupt-step_0000006; resuming from step_0000004 (step 4)' in msgs[0]
    assert summary['status'] == 'completed' and steps(run) == list(range(1, 9))
    assert (root / 'corrupt-step_0000006' / 'optimizer.safetensors').exists()
    assert 'corrupt-step_0000006' not in [p.name for p in list_checkpoints(root)]
    assert losses(run) == losses(tmp_path / 'straight')
    assert_same_tensors(weights(root / 'final'), weights(tmp_path / 'straight' / 'checkpoints' / 'final'))
    for tag in ('best', 'final', 'latest'):
        assert os.readlink(root / tag).startswith('step_') and (root / os.readlink(root / tag) / 'meta.json').exists()


def _extra_trainer(out_dir, tc, init_seed=0):
    "A trainer with an extra module (a projector) that the loss uses, so it has its own checkpoint file."
    torch.manual_seed(init_seed)
    proj = nn.Linear(4, 4)
    def loss_fn(model, batch):
        loss, extra = lm_loss(model, batch)
        return loss + 1e-3 * proj.weight.square().sum(), extra
    return trainer(out_dir, tc=tc, init_seed=init_seed, loss_fn=loss_fn, extra_modules={'proj': (proj, 1.0)})

DAMAGE = {
    'model-truncated': ('model.safetensors', lambda f: cut(f), 'is unreadable'),
    'extra-module-truncated': ('proj.safetensors', lambda f: cut(f, 0.9), 'is unreadable'),
    'optimizer-truncated': ('optimizer.safetensors', lambda f: cut(f, 0.97), 'is unreadable'),
    'rng-missing': ('rng.safetensors', lambda f: f.unlink(), 'does not exist'),
    'rng-truncated': ('rng.safetensors', lambda f: cut(f), 'is unreadable'),
    'meta-invalid-json': ('meta.json', lambda f: cut(f), 'is corrupt'),
    'meta-step-not-int': ('meta.json', lambda f: f.write_text(json.dumps({**json.loads(f.read_text()), 'step': '4'})),
                          "expected a JSON object with an integer 'step'"),
    'meta-tokens-float': ('meta.json', lambda f: f.write_text(json.dumps({**json.loads(f.read_text()), 'tokens': 1.5})),
                          "field 'tokens' must be a non-negative integer"),
    'meta-best-not-dict': ('meta.json', lambda f: f.write_text(json.dumps({**json.loads(f.read_text()), 'best': [1.0]})),
                           "field 'best' must be an object"),
    'meta-step-mismatch': ('meta.json', lambda f: f.write_text(json.dumps({**json.loads(f.read_text()), 'step': 3})),
                           "'step' is 3 but the directory is step_0000004"),
    'meta-history-nan': ('meta.json', lambda f: f.write_text(json.dumps({**json.loads(f.read_text()),
                                                                         'divergence': {'recent_losses': [float('nan')], 'ref_rms': 0.1}})),
                         "field 'divergence' must be an object"),
}

@pytest.mark.parametrize('case', list(DAMAGE))
def test_damaged_newest_checkpoint_falls_back_to_the_previous_one(tmp_path, case):
    name, damage, says = DAMAGE[case]
    tc = tcfg(max_steps=6, ckpt_every=2, keep_last=5)
    _extra_trainer(tmp_path / 'straight', tc).fit()
    run = tmp_path / 'run'
    _extra_trainer(run, tc).fit(until=4)
    root = run / 'checkpoints'
    bad = root / 'step_0000004' / name
    damage(bad)
    t = _extra_trainer(run, tc, init_seed=5)
    with pytest.warns(RecoveryWarning, match=re.escape(str(bad))) as rec:
        assert t.resume()
    msg = next(str(w.message) for w in rec if w.category is RecoveryWarning)
    assert says in msg and 'resuming from step_0000002 (step 2)' in msg, msg
    # weights, optimizer state and RNG all come from step 2
    assert t.step == 2 and t._resumed_from == root / 'step_0000002'
    assert_same_tensors({k: v.cpu() for k, v in t.raw.state_dict().items() if k in weights(root / 'step_0000002')},
                        weights(root / 'step_0000002'))
    assert_same_tensors(t._resumed_opt[0], load_file(str(root / 'step_0000002' / 'optimizer.safetensors')))
    assert_same_tensors(t._resumed_rng, load_file(str(root / 'step_0000002' / 'rng.safetensors')))
    assert [p.name for p in list_checkpoints(root)] == ['step_0000002'] and (root / 'corrupt-step_0000004').is_dir()
    assert os.readlink(root / 'latest') == 'step_0000002'
    assert not (root / 'best').is_symlink() or (root / os.readlink(root / 'best') / 'meta.json').exists()
    # and the run goes on from there to the same end as an uninterrupted one
    assert _extra_trainer(run, tc, init_seed=5).fit()['status'] == 'completed'
    assert losses(run) == losses(tmp_path / 'straight')
    assert_same_tensors(weights(root / 'final', 'proj'), weights(tmp_path / 'straight' / 'checkpoints' / 'final', 'proj'))


def test_no_usable_checkpoint_names_every_bad_file_and_moves_nothing(tmp_path):
    tc = tcfg(max_steps=6, ckpt_every=2, keep_last=5)
    trainer(tmp_path, tc=tc).fit(until=4)
    root = tmp_path / 'checkpoints'
    cut(root / 'step_0000004' / 'model.safetensors')
    (root / 'step_0000002' / 'rng.safetensors').unlink()
    for _ in range(2):  # a second attempt fails the same way: nothing silently restarts from scratch
        with pytest.raises(CheckpointError) as e:
            trainer(tmp_path, tc=tc).fit()
        msg = str(e.value)
        assert msg.startswith(f'no usable checkpoint in {root}: ')
        assert f"{root / 'step_0000004' / 'model.safetensors'} is unreadable" in msg
        assert f"{root / 'step_0000002' / 'rng.safetensors'} does not exist" in msg
        assert 'move the checkpoints folder away to train from scratch' in msg
        assert [p.name for p in list_checkpoints(root)] == ['step_0000002', 'step_0000004']
    assert steps(tmp_path) == [1, 2, 3, 4]  # the metrics were not touched either


def test_explicit_bad_checkpoint_is_an_error_naming_the_file(tmp_path):
    tc = tcfg(max_steps=4, ckpt_every=2)
    trainer(tmp_path, tc=tc).fit()
    ck = tmp_path / 'checkpoints' / 'step_0000002'
    cut(ck / 'optimizer.safetensors')
    t = trainer(tmp_path, tc=tc, init_seed=3)
    with pytest.raises(CheckpointError, match=re.escape(f"{ck / 'optimizer.safetensors'} is unreadable")):
        t.resume(ck)
    assert t.step == 0 and ck.is_dir()  # nothing taken over, nothing moved
    assert t.resume(tmp_path / 'checkpoints' / 'step_0000004') and t.step == 4  # control: a good one loads


def test_links_never_point_at_a_set_aside_checkpoint(tmp_path):
    "A finished run whose final (and best, latest) checkpoint is damaged: the links move to what is resumed, or go."
    tc = tcfg(max_steps=6, ckpt_every=2, keep_last=5, eval_every=6)  # eval only at the end: best == final == step 6
    trainer(tmp_path, tc=tc).fit()
    root = tmp_path / 'checkpoints'
    assert {os.readlink(root / t) for t in ('best', 'final', 'latest')} == {'step_0000006'}
    cut(root / 'step_0000006' / 'model.safetensors')
    t = trainer(tmp_path, tc=tc)
    with pytest.warns(RecoveryWarning, match='corrupt-step_0000006'):
        assert t.resume() and t.step == 4
    assert os.readlink(root / 'latest') == 'step_0000004'
    assert not (root / 'final').is_symlink() and not (root / 'best').is_symlink()  # step 4's best is no checkpoint (no eval yet)
    assert trainer(tmp_path, tc=tc).fit()['status'] == 'completed'
    assert {os.readlink(root / t) for t in ('best', 'final', 'latest')} == {'step_0000006'}


# ====================================================================== 5. leftovers of interrupted writes
def test_leftovers_of_dead_writers_are_removed_at_start_and_a_living_writers_kept(tmp_path, live_pid):
    tc = tcfg(max_steps=6, ckpt_every=2, keep_last=5)
    trainer(tmp_path, tc=tc).fit(until=2)
    root, dead = tmp_path / 'checkpoints', dead_pid()
    dead_dir, live_dir = root / f'.tmp-step_0000004-{dead}', root / f'.tmp-step_0000004-{live_pid}'
    for d in (dead_dir, live_dir):
        d.mkdir(); (d / 'model.safetensors').write_bytes(b'partial')
    os.symlink('step_0000002', root / f'.latest.tmp{dead}')
    (tmp_path / f'.metrics.jsonl.tmp{dead}').write_text('{"step": 1}\n')
    (tmp_path / f'.summary.json.tmp{live_pid}').write_text('{}')
    (tmp_path / f'.summary.json.tmp{os.getpid()}').write_text('{}')  # this process has no write in flight at the start
    assert trainer(tmp_path, tc=tc).fit()['status'] == 'completed'
    assert not dead_dir.exists() and not (root / f'.latest.tmp{dead}').is_symlink()
    assert not (tmp_path / f'.metrics.jsonl.tmp{dead}').exists() and not (tmp_path / f'.summary.json.tmp{os.getpid()}').exists()
    assert live_dir.is_dir() and (tmp_path / f'.summary.json.tmp{live_pid}').exists()  # maybe a write in progress


def test_a_rewrite_killed_between_its_renames_is_put_back(tmp_path):
    "The old copy of a step moved aside by a rewrite that never landed is the only copy: it is restored, not deleted."
    tc = tcfg(max_steps=6, ckpt_every=2, keep_last=5)
    trainer(tmp_path / 'straight', tc=tc).fit()
    trainer(tmp_path, tc=tc).fit(until=4)
    root, dead = tmp_path / 'checkpoints', dead_pid()
    os.replace(root / 'step_0000004', root / f'.tmp-old-step_0000004-{dead}')
    t = trainer(tmp_path, tc=tc, init_seed=2)
    t._start_fit(resume=True).close()
    assert t.step == 4 and [p.name for p in list_checkpoints(root)] == ['step_0000002', 'step_0000004']  # not step 2
    assert not list(root.glob('.tmp-*'))
    assert trainer(tmp_path, tc=tc, init_seed=2).fit()['status'] == 'completed'
    assert losses(tmp_path) == losses(tmp_path / 'straight')


def test_prune_keeps_another_process_tmp_dir(tmp_path, live_pid):
    root = tmp_path
    mine, other = root / f'.tmp-step_0000010-{os.getpid()}', root / f'.tmp-step_0000010-{live_pid}'
    mine.mkdir(); other.mkdir()
    prune_checkpoints(root, keep_last=3)
    assert not mine.exists() and other.is_dir()


# ====================================================================== 6. a failing checkpoint write
def test_disk_full_during_a_checkpoint_leaves_no_partial_directory(tmp_path, monkeypatch):
    tc = tcfg(max_steps=6, ckpt_every=2, keep_last=5, eval_every=0)
    real = C.save_file

    def full_at_step_4(tensors, filename, *a, **k):
        if '.tmp-step_0000004-' in str(filename) and Path(filename).name == 'optimizer.safetensors':
            raise OSError(errno.ENOSPC, 'No space left on device', str(filename))
        return real(tensors, filename, *a, **k)

    monkeypatch.setattr(C, 'save_file', full_at_step_4)
    with pytest.raises(CheckpointError) as e:
        trainer(tmp_path, tc=tc).fit()
    msg, root = str(e.value), tmp_path / 'checkpoints'
    assert msg.startswith('writing the checkpoint of step 4 failed: [Errno 28] No space left on device'), msg
    assert f'the latest complete checkpoint is still {root}/step_0000002 (step 2)' in msg and 'free disk space' in msg
    assert sorted(p.name for p in root.iterdir()) == ['latest', 'step_0000002']  # no .tmp-step_0000004-*
    assert os.readlink(root / 'latest') == 'step_0000002'
    monkeypatch.setattr(C, 'save_file', real)  # space freed: the run resumes and finishes
    assert trainer(tmp_path, tc=tc).fit()['status'] == 'completed'


# ====================================================================== 7. out of memory
@pytest.mark.parametrize('error', [
    RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: you tried to allocate 99 GB"),
    torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 20.00 GiB'),
])
def test_out_of_memory_in_a_step_is_a_config_error_naming_the_batch(tmp_path, error):
    def hook(model, batch): raise error
    with pytest.raises(TrainingOutOfMemory) as e:
        trainer(tmp_path, tc=tcfg(batch_size=4, grad_accum=3), loss_fn=hook).fit()
    assert isinstance(e.value, ConfigError)
    msg = str(e.value)
    assert msg.startswith('step 1 ran out of memory on cpu (') and 'TrainConfig.batch_size=4, block_size=16, grad_accum=3' in msg
    assert 'e.g. batch_size=2, grad_accum=6' in msg, msg

def test_other_runtime_errors_are_not_renamed(tmp_path):
    def hook(model, batch): raise RuntimeError('mat1 and mat2 shapes cannot be multiplied')
    with pytest.raises(RuntimeError, match='shapes cannot be multiplied') as e:
        trainer(tmp_path, loss_fn=hook).fit()
    assert not isinstance(e.value, ConfigError)
