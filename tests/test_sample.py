"""`oelm sample` from outside: a trained run speaks again from any of its checkpoints, with the run's tokenizer or as
token ids, and bad requests get a clear error (exit code 2) without loading anything they should not."""
from __future__ import annotations
import json, os, re, shutil
from pathlib import Path
import pytest
from cli_helpers import oelm_main
from shared_runs import qk_freeze_batch
from oelm_nb.base.core import ConfigError
from oelm_nb.lab.sample import sample

pytestmark = pytest.mark.slow  # batches and processes end to end: `make test` runs them, `make test-fast` does not


@pytest.fixture(scope='module')
def run(tmp_path_factory) -> Path:
    "One finished gpt run of 30 steps on a tiny corpus (checkpoints at 10, 20, 30): tests/shared_runs.py."
    return qk_freeze_batch(tmp_path_factory) / 'gpt-s0'


def samples(*args) -> list[dict]:
    res = oelm_main('sample', *map(str, args), '--json')
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout)


def test_samples_continue_the_prompt_and_repeat_with_the_seed(run):
    a = samples(run, '--prompt', 'Once upon a time', '--num-samples', '2', '--max-new-tokens', '20', '--seed', '3')
    assert len(a) == 2 and all(s['text'].startswith('Once upon a time') and s['prompt'] == 'Once upon a time' for s in a)
    again = sample(run, ['Once upon a time'], num_samples=2, max_new_tokens=20, seed=3)  # the library behind the command
    assert [s['ids'] for s in a] == [s['ids'] for s in again]
    assert [s['ids'] for s in a] != [s['ids'] for s in sample(run, ['Once upon a time'], num_samples=2, max_new_tokens=20, seed=4)]


@pytest.mark.parametrize('which, step', [('best', None), ('final', 30), ('latest', 30), ('10', 10), (20, 20)])
def test_every_checkpoint_name_loads_its_step(run, which, step):
    best = json.loads((run / 'summary.json').read_text())['best_step']
    got = sample(run, checkpoint=which, max_new_tokens=4, num_samples=1)[0]
    assert got['step'] == (best if step is None else step) and Path(got['checkpoint']).name == f'step_{got["step"]:07d}'


def test_plain_output_and_prompt_file(run, tmp_path):
    f = tmp_path / 'prompt.txt'; f.write_text('One day,', encoding='utf-8')
    res = oelm_main('sample', str(run), '--prompt-file', str(f), '--num-samples', '2', '--max-new-tokens', '10')
    assert res.returncode == 0, res.stderr
    assert res.stdout.count('---------------') == 2 and res.stdout.startswith('One day,') and 'step' in res.stderr


def test_without_a_tokenizer_samples_are_token_ids(run, tmp_path):
    copy = tmp_path / 'gpt-s0'; shutil.copytree(run, copy, symlinks=True)
    cfg = json.loads((copy / 'config.json').read_text())
    data = tmp_path / 'data'; shutil.copytree(cfg['data_dir'], data); (data / 'tokenizer.json').unlink()
    cfg['data_dir'] = str(data); (copy / 'config.json').write_text(json.dumps(cfg))
    s = samples(copy, '--prompt', '5 17 42', '--max-new-tokens', '6', '--num-samples', '1')[0]
    assert s['text'].split()[:3] == ['5', '17', '42'] and all(t.isdigit() for t in s['text'].split())
    res = oelm_main('sample', str(copy), '--prompt', 'Once upon')
    assert res.returncode == 2 and 'a list of token ids' in res.stderr


@pytest.mark.parametrize('kw, message', [
    ({'checkpoint': 7}, 'no checkpoint of step 7'),
    ({'checkpoint': 'bset'}, 'give best, final, latest or a step number'),
    ({'temperature': -1.0}, 'temperature=-1.0 must be >= 0'),
    ({'top_k': 0}, 'top_k=0 must be positive'),
])
def test_bad_requests_are_refused_with_the_reason(run, kw, message):
    with pytest.raises(ConfigError, match=re.escape(message)): sample(run, **kw)


def test_the_command_exits_2_on_a_bad_request(run):
    res = oelm_main('sample', str(run), '--checkpoint', '7')
    assert res.returncode == 2 and 'no checkpoint of step 7; it has steps 10, 20, 30' in res.stderr, res.stderr


def test_a_batch_directory_or_a_link_out_of_the_run_is_refused(run, tmp_path):
    res = oelm_main('sample', str(run.parent))
    assert res.returncode == 2 and 'is not a run directory' in res.stderr
    copy = tmp_path / 'gpt-s0'; shutil.copytree(run, copy, symlinks=True)
    (copy / 'checkpoints' / 'best').unlink(); os.symlink(str(tmp_path), copy / 'checkpoints' / 'best')
    res = oelm_main('sample', str(copy))
    assert res.returncode == 2 and 'does not point to one of the run' in res.stderr
