"""Nothing a user does by the book loses work (issue 50): the commands a report or the console suggests keep the batch's
own settings, a command with other settings is refused before it touches the batch, a relative --data path trains, a
run a full disk stopped resumes, and bad input is one line naming the file or field and the fix.

Ctrl-C on a real `oelm run` process is test_runner's (its subject is the process boundary); everything here runs
in-process, on runs of a few steps."""
from __future__ import annotations
import errno, json, re, shlex
from pathlib import Path
from unittest import mock

import pytest
from shared_runs import SMALL_CORPUS, inline_batch
from cli_helpers import oelm_main, oelm_inline, read_json, read_jsonl, tiny_args


def one_line_error(res, command: str = 'run') -> str:
    "The stderr of a command that must exit 2 with one line `oelm COMMAND...: error: ...` and no traceback."
    assert res.returncode == 2, f'{res.args}: exit {res.returncode}\n{res.stdout}\n{res.stderr}'
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and f'oelm {command}' in lines[0] and 'error:' in lines[0], res.stderr
    return lines[0]


def state(d: Path) -> dict:
    "What a refused command must leave as it was: batch.json, the shared data's meta.json, the run directories."
    return {'batch': (d / 'batch.json').read_bytes(), 'data': (d / 'data' / 'meta.json').read_bytes(),
            'runs': sorted(p.name for p in d.iterdir() if p.is_dir())}


# ====================================================================== 1. suggested commands keep the batch's settings
@pytest.mark.slow
def test_every_suggested_command_keeps_the_batch_settings_and_other_settings_are_refused(tmp_path):
    from oelm_nb.report.tables import load_runs, batch_command
    from oelm_nb.studies.qk_freeze.answers import control_table
    d = inline_batch(tmp_path / 'b', 'qk-freeze', variants=['gpt', 'oelm-freeze'], steps=4)  # the commands train 3 more runs
    before = state(d)
    recorded = read_json(d / 'batch.json')

    # the report's old controls command (no --steps, no --set) is refused, naming what differs, and changes nothing
    plain = oelm_inline('run', 'qk-freeze', '--variants', 'gauss,gauss-freeze', '--seeds', '0', '--out', str(d))
    msg = one_line_error(plain)
    assert '--steps: 4 -> ' in msg and '--set data.vocab_size: 300 -> not given' in msg, msg
    assert state(d) == before
    # ... and the command the refusal suggests, the report's controls command and every control's command all run
    suggested = [msg.split("Run it with the batch's own settings: ")[1].split(' ; ')[0],
                 batch_command(d, ['gpt', 'oelm', 'oelm-freeze'])]
    suggested += [re.search(r'\((oelm run .*)\)$', gap).group(1) for gap in control_table(load_runs(d))['val PPL gap']
                  if gap.startswith('needs completed')]
    assert len(suggested) == 6, suggested
    from oelm_nb.lab import runner
    for cmd in suggested:
        argv = shlex.split(cmd)
        assert argv[:2] == ['oelm', 'run'] and argv[argv.index('--out') + 1] == str(d), cmd
        with mock.patch.object(runner, 'after_batch'):  # the study's timing and the report are not under test here
            res = oelm_inline(*argv[1:], '--no-report')
        assert res.returncode == 0, f'{cmd}\n{res.stdout}\n{res.stderr}'
    assert state(d)['data'] == before['data']  # the shared data was reused, never prepared again
    b = read_json(d / 'batch.json')
    assert {k: b[k] for k in ('study', 'preset', 'data', 'steps', 'overrides')} == \
           {k: recorded[k] for k in ('study', 'preset', 'data', 'steps', 'overrides')}
    for run in ('gauss-s0', 'gauss-freeze-s0', 'oelm-s0'):  # trained beside gpt-s0 with the same settings
        old, new = read_json(d / 'gpt-s0' / 'config.json'), read_json(d / run / 'config.json')
        assert new['train'] == old['train'] and new['data'] == old['data'], run
        assert new['model']['vocab_size'] == old['model']['vocab_size'] == 300
        assert read_json(d / run / 'summary.json')['steps'] == 4
    assert not any('.failed-' in p.name or '.replaced-' in p.name for p in d.iterdir())


def test_restart_with_other_settings_must_name_every_run_of_the_batch(tmp_path):
    "--restart sets aside only this command's runs: with others left in the batch, other settings are still refused."
    d = tmp_path / 'b'
    (d / 'gpt-s0').mkdir(parents=True); (d / 'oelm-s0').mkdir()
    (d / 'batch.json').write_text(json.dumps({'study': 'qk-freeze', 'preset': 'tiny', 'data': 'synthetic', 'steps': 4,
                                              'overrides': {}, 'options': {}, 'variants': ['gpt', 'oelm'], 'seeds': [0]}))
    res = oelm_main('run', 'qk-freeze', '--variants', 'gpt', '--seeds', '0', '--steps', '8', '--restart', '--out', str(d))
    msg = one_line_error(res)
    assert '--steps: 4 -> 8' in msg and "--restart sets aside only this command's runs, not oelm-s0" in msg, msg
    assert "--steps 4 --variants gpt --seeds 0 --out" in msg  # the batch's own command for what was asked
    (d / 'batch.json').write_text('[1, 2]')
    assert 'not a batch record' in one_line_error(oelm_main('run', 'qk-freeze', '--out', str(d)))


# ====================================================================== 2. a full disk: the run resumes
@pytest.mark.slow
def test_a_run_a_full_disk_stopped_resumes_with_the_numbers_of_an_uninterrupted_run(tmp_path):
    from oelm_nb.lab.runner import run_study
    from oelm_nb.lab.execute import execute_inline
    from oelm_nb.train import checkpoint as C
    kw = dict(variants=['gpt'], seeds=[0], steps=12, report=False, execute=execute_inline,
              overrides={**SMALL_CORPUS, 'train.ckpt_every': 4, 'train.eval_every': 4, 'train.dtype': 'float32'})
    real = C.save_file
    def full_at_step_8(tensors, filename, *a, **k):
        if '.tmp-step_0000008-' in str(filename): raise OSError(errno.ENOSPC, 'No space left on device', str(filename))
        return real(tensors, filename, *a, **k)
    out, lines = tmp_path / 'full', []
    with mock.patch.object(C, 'save_file', full_at_step_8):
        res = run_study('qk-freeze', out_dir=out, log=lines.append, **kw)
    sm = read_json(out / 'gpt-s0' / 'summary.json')
    assert res.failed == ['gpt-s0'] and sm['status'] == 'failed' and sm['resumable'] is True, sm
    assert 'No space left on device' in sm['error']

    lines = []  # space is back: the same call resumes the run from step 4, it is not set aside
    res = run_study('qk-freeze', out_dir=out, log=lines.append, **kw)
    log = '\n'.join(lines)
    assert not res.failed and 'gpt-s0: stopped before by CheckpointError' in log and 'resumed from step 4' in log, log
    assert not list(tmp_path.glob('full/gpt-s0.*'))
    ref = inline_batch(tmp_path / 'ref', 'qk-freeze', variants=['gpt'], steps=12, overrides=kw['overrides'])
    got, want = read_jsonl(out / 'gpt-s0' / 'metrics.jsonl'), read_jsonl(ref / 'gpt-s0' / 'metrics.jsonl')
    assert [r['step'] for r in got] == list(range(1, 13))
    assert [(r['train_loss'], r.get('val_loss')) for r in got] == [(r['train_loss'], r.get('val_loss')) for r in want]
    assert read_json(out / 'gpt-s0' / 'summary.json')['best_val_ppl'] == read_json(ref / 'gpt-s0' / 'summary.json')['best_val_ppl']


# ====================================================================== 3. --data with a relative path
@pytest.mark.slow
def test_a_relative_data_path_is_resolved_once_and_recorded_absolute(tmp_path, monkeypatch):
    from oelm_nb.data.corpus import generate_stories
    (tmp_path / 'some.txt').write_text('\n\n'.join(s.text for s in generate_stories(300, seed=1)) + '\n')
    monkeypatch.chdir(tmp_path)
    over = tiny_args(2)
    res = oelm_inline('run', 'qk-freeze', '--variants', 'gpt', '--seeds', '0', '--data', 'some.txt', '--no-report',
                      '--out', 'b', *over)
    assert res.returncode == 0, res.stdout + res.stderr
    absolute = str((tmp_path / 'some.txt').resolve())
    assert read_json(tmp_path / 'b' / 'batch.json')['data'] == absolute
    assert read_json(tmp_path / 'b' / 'gpt-s0' / 'config.json')['data']['source'] == absolute  # what the notebook reads
    assert read_json(tmp_path / 'b' / 'gpt-s0' / 'summary.json')['status'] == 'completed'
    again = oelm_inline('run', 'qk-freeze', '--variants', 'gpt', '--seeds', '0', '--data', absolute, '--no-report',
                        '--out', 'b', *over)  # the same data, given absolute: the same batch
    assert again.returncode == 0 and 'gpt-s0: already completed, skipped' in again.stdout, again.stdout + again.stderr


# ====================================================================== 4. one line, naming the file or field and the fix
@pytest.mark.parametrize('flag, value, says', [
    ('--seeds', 'abc', "argument --seeds: 'abc' is not a non-negative integer (0, 1, 2 ...)"),
    ('--steps', '1.5', "argument --steps: '1.5' is not a positive integer (1, 2, 3 ...)"),
])
def test_a_bad_number_is_one_line_naming_the_flag(flag, value, says):
    line = one_line_error(oelm_main('run', 'qk-freeze', flag, value), 'run qk-freeze')
    assert says in line and '--help' in line and '_non_negative' not in line, line


def test_out_pointing_at_a_file_is_refused_and_the_file_kept(tmp_path):
    f = tmp_path / 'notes.txt'; f.write_text('mine')
    line = one_line_error(oelm_main('run', 'qk-freeze', '--out', str(f)))
    assert f'--out {f}: a file, not a batch directory' in line and 'File exists' not in line, line
    assert f.read_text() == 'mine'


def test_report_on_a_batch_json_with_an_unknown_variant_is_one_line(tmp_path):
    (tmp_path / 'batch.json').write_text(json.dumps({'study': 'qk-freeze', 'variants': ['gpt', 'bogus'], 'seeds': [0]}))
    line = one_line_error(oelm_main('report', str(tmp_path)), 'report')
    assert f"{tmp_path / 'batch.json'}: variants names 'bogus', which study qk-freeze does not plan" in line, line
    assert 'correct it in' in line and not (tmp_path / 'report.html').exists()
    (tmp_path / 'batch.json').write_text(json.dumps({'study': 'qk-freeze', 'variants': ['gpt'], 'seeds': ['x']}))
    assert 'seeds ["x"] is not a list of non-negative integers' in one_line_error(oelm_main('report', str(tmp_path)), 'report')


FULL = OSError('252731 requested and 242967 written')  # numpy's tofile on a full disk: no errno, no file


def test_a_full_disk_while_preparing_data_is_one_line_naming_the_folder(tmp_path):
    from oelm_nb.lab import runner
    from oelm_nb.data import corpus
    out = tmp_path / 'b'
    with mock.patch.object(runner, 'prepare_data', side_effect=FULL):
        line = one_line_error(oelm_main('run', 'qk-freeze', '--variants', 'gpt', '--seeds', '0', '--out', str(out)))
    assert f"{out / 'data'}: preparing the data failed: 252731 requested and 242967 written; free space" in line, line
    with mock.patch.object(corpus, '_encode_split', side_effect=FULL):
        line = one_line_error(oelm_main('data', 'prepare', '--out', str(tmp_path / 'd'), '--quiet',
                                            '--set', 'data.n_train_stories=300', '--set', 'data.n_val_stories=40'), 'data')
    assert f"--out {tmp_path / 'd'}: writing the data failed: 252731 requested" in line and 'free space' in line, line
    assert not (tmp_path / 'd').exists()
