"""One settings path: the layers a run's value comes from (preset < study < batch < data < variant < user), the record
of them in config.json, what a user value replaces, and a value scoped to some variants."""
from __future__ import annotations
import json, subprocess, sys
from pathlib import Path

import pytest

from oelm_nb.base.core import ConfigError
from oelm_nb.base.rundir import fingerprint
from oelm_nb.lab.spec import resolve_spec, LAYERS, RunSpec
from oelm_nb.lab.batch import Batch, plan_batch, override_notes


def test_each_value_records_the_layer_that_set_it_and_a_later_layer_wins():
    base = resolve_spec('pca', 'pca-lora-k8', 'tiny', steps=40)
    o = base.origins
    assert set(o.values()) <= set(LAYERS)
    assert o['model.n_embd'] == 'preset' and o['train.batch_size'] == 'study' and o['train.seed'] == 'batch'
    assert o['settings.lora_rank'] == 'variant' and o['train.lr'] == 'variant'  # the fine-tuning phase's own rate
    assert o['train.max_steps'] == 'variant'  # the phase's steps (half the batch's) beat --steps
    assert o['train.grad_clip'] == 'default'
    # user > variant: the rate is replaced, and the record says which value it replaced
    user = resolve_spec('pca', 'pca-lora-k8', 'tiny', steps=40, overrides={'train.lr': 3e-3})
    assert (user.train.lr, user.origins['train.lr'], user.replaced) == (3e-3, 'user', {'train.lr': base.train.lr})
    # a scoped value reaches only the variants its pattern names, and beats an unscoped one
    both = {'train.lr': 3e-3, 'pca-lora-*:train.lr': 2e-3}
    assert resolve_spec('pca', 'pca-lora-k8', 'tiny', steps=40, overrides=both).train.lr == 2e-3
    assert resolve_spec('pca', 'baseline', 'tiny', steps=40, overrides=both).train.lr == 3e-3
    only = resolve_spec('pca', 'baseline', 'tiny', steps=40, overrides={'pca-lora-*:train.lr': 2e-3})
    assert only.train.lr != 2e-3 and only.origins['train.lr'] == 'study'


def test_the_record_is_kept_in_config_json_but_is_not_the_runs_identity(tmp_path):
    s = resolve_spec('qk-freeze', 'oelm-freeze', 'tiny', steps=30, overrides={'train.lr': 1e-3})
    s.save_json(tmp_path / 'config.json')
    d = json.loads((tmp_path / 'config.json').read_text())
    assert d['origins']['train.lr'] == 'user' and d['origins']['model.variant'] == 'variant'
    assert RunSpec.load_json(tmp_path / 'config.json') == s
    bare = {k: v for k, v in d.items() if k not in ('origins', 'replaced')}
    assert fingerprint(d) == fingerprint(bare)  # a run recorded before origins existed resumes and is skipped as before


def test_the_batch_says_what_a_user_value_replaces(tmp_path):
    b = Batch('pca', tmp_path, steps=40, options={'ks': [8]}, overrides={'train.lr': 3e-3})
    lines = []
    plan_batch(b, log=lines.append)
    note = [l for l in lines if 'replaces' in l]
    assert len(note) == 1 and 'train.lr=0.003' in note[0] and 'pca-lora-k8' in note[0] and 'baseline-cont' in note[0]
    assert "--set 'PATTERN:train.lr=VALUE'" in note[0]
    quiet = []
    plan_batch(Batch('pca', tmp_path, steps=40, options={'ks': [8]}, overrides={'baseline:train.lr': 3e-3}),
               log=quiet.append)
    assert not [l for l in quiet if 'replaces' in l]  # the baseline sets no rate of its own
    with pytest.raises(ConfigError, match="matches none of this batch's variants"):
        plan_batch(Batch('pca', tmp_path, steps=40, options={'ks': [8]}, overrides={'lora-*:train.lr': 3e-3}))


def oelm(*args):
    "`oelm ARGS` in this process (its exit status and output; the console script itself: test_cli)."
    from cli_helpers import oelm_main
    return oelm_main(*args)


def test_every_command_takes_the_one_set_syntax():
    r = oelm('params', '--set', 'model.n_embd=128', '--json')
    assert r.returncode == 0 and json.loads(r.stdout)['config']['n_embd'] == 128, r.stderr
    bare = oelm('bench', '--set', 'n_embd=128', '--json')
    assert bare.returncode == 2 and 'SECTION.FIELD' in bare.stderr and '--set model.n_embd=128' in bare.stderr
