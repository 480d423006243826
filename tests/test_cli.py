"""The `oelm` command line from outside: `params`, `bench`, `data prepare` and every `--help`.

Each check runs `oelm_nb.app.cli.main`, the console script's function, in this process (`cli_helpers.oelm_main`: exit
status, stdout and stderr as a subprocess would give them, without an interpreter start-up and a torch import per
command); one test runs the installed console script itself, so its exit status is checked where users meet it. Expected numbers come from arithmetic on the
architecture, never from the library: parameter counts from the config fields, the FLOPs that frozen Q/K save
from the matmul shapes, the optimizer bytes from AdamW's two fp32 moments.
"""
from __future__ import annotations
import json, subprocess

import numpy as np
import pytest
from cli_helpers import oelm_main, run_oelm
from oelm_nb.lab.study import study_names


def run_all(*commands: tuple[str, ...]) -> list[subprocess.CompletedProcess]:
    "Run several `oelm` commands, one after the other; their results in order."
    return [oelm_main(*c) for c in commands]


def ok_json(res: subprocess.CompletedProcess):
    assert res.returncode == 0, f'{res.args}: exit {res.returncode}\n{res.stderr}'
    return json.loads(res.stdout)


def usage_error(res: subprocess.CompletedProcess, command: str) -> str:
    "The stderr of a command that must exit 2 with a one-line `oelm <command>: error: ...` message, no traceback."
    assert res.returncode == 2, f'{res.args}: expected exit 2, got {res.returncode}\n{res.stdout}\n{res.stderr}'
    assert 'Traceback' not in res.stderr, res.stderr
    assert f'oelm {command}: error:' in res.stderr, res.stderr
    return res.stderr


def gpt_params(V, T, L, d, ff, k=None, bias=True, attn_bias=False) -> int:
    "Parameters of a GPT of this package: tied token table [V, k] (+ k<->d projections), positions, blocks, final LN."
    k, b, ab = k or d, int(bias), int(attn_bias)
    emb = V * k + ((k * d + b * d) + (d * k + b * k) if k < d else 0)
    ln = d + b * d
    return emb + T * d + L * (2 * ln + 4 * (d * d + ab * d) + (d * ff + b * ff) + (ff * d + b * d)) + ln


# medium512: V=50257, T=512, 6 layers, d=512, d_ff=2048
MEDIUM = dict(V=50257, T=512, L=6, d=512, ff=2048)
MEDIUM_TOTAL = gpt_params(**MEDIUM)
MEDIUM_QK = MEDIUM['L'] * 2 * MEDIUM['d'] ** 2  # Q and K weights of every layer


# ====================================================================== oelm params
@pytest.mark.slow
def test_params_medium512_accounting_and_overrides():
    assert MEDIUM_TOTAL == 44_896_768 and MEDIUM_QK == 3_145_728  # the documented counts, from arithmetic alone
    p = '--preset', 'medium512', '--json', '--study', 'qk-freeze'  # another study may plan 'gpt' too: name the one counted
    gpt, frz, vocab, wte, bad = run_all(('params', *p, '--variant', 'gpt'), ('params', *p, '--variant', 'oelm-freeze'),
                                        ('params', *p, '--variant', 'gpt', '--set', 'model.vocab_size=10000'),
                                        ('params', *p, '--variant', 'oelm-freeze', '--set', 'model.n_embd_wte=128'),
                                        ('params', *p, '--variant', 'gpt', '--set', 'model.n_head=7'))
    gpt, frz, vocab, wte = map(ok_json, (gpt, frz, vocab, wte))
    assert (gpt['total'], gpt['trainable'], gpt['frozen']) == (44_896_768, 44_896_768, 0)
    assert (frz['total'], frz['trainable'], frz['frozen']) == (44_896_768, 41_751_040, 3_145_728)
    assert gpt['variant'] == 'gpt' and frz['variant'] == 'oelm-freeze' and frz['config']['variant'] == 'oelm-freeze'
    assert sum(c['total'] for c in frz['components'].values()) == frz['total']
    assert frz['components']['attention.qk'] == {'total': MEDIUM_QK, 'trainable': 0, 'frozen': MEDIUM_QK}

    # --set model.vocab_size=10000: only the tied table shrinks, by (50257 - 10000) rows of 512
    assert vocab['config']['vocab_size'] == 10_000
    assert vocab['total'] == gpt['total'] - (50257 - 10_000) * 512 == gpt_params(**{**MEDIUM, 'V': 10_000})
    assert vocab['frozen'] == 0 and vocab['trainable'] == vocab['total']
    # --set model.n_embd_wte=128: table [V, 128] instead of [V, 512], plus scale_up (128->512) and scale_down (512->128) with biases
    assert wte['config']['n_embd_wte'] == 128
    assert wte['total'] == frz['total'] - 50257 * (512 - 128) + (128 * 512 + 512) + (512 * 128 + 128) == gpt_params(**MEDIUM, k=128)
    assert wte['frozen'] == MEDIUM_QK and wte['trainable'] == wte['total'] - MEDIUM_QK

    err = usage_error(bad, 'params')
    assert 'ModelConfig.n_head=7' in err and 'n_embd=512' in err
    assert bad.stdout == ''


# ====================================================================== oelm bench
@pytest.mark.slow
def test_bench_counts_flops_and_optimizer_state_exactly():
    good, few = run_all(('bench', '--preset', 'tiny', '--variants', 'oelm,oelm-freeze', '--steps', '10', '--warmup', '1',
                         '--block-size', '32', '--json'),
                        ('bench', '--preset', 'tiny', '--variants', 'oelm,oelm-freeze', '--steps', '5', '--block-size', '32', '--json'))
    rows = {r['variant']: r for r in ok_json(good)}
    assert list(rows) == ['oelm', 'oelm-freeze', 'reference']  # the nanoGPT-structured yardstick is timed alongside
    from oelm_nb.model.gpt import PRESETS  # the tiny preset's shape (the bench code is what is under test)
    n_layer, d = PRESETS['tiny']['n_layer'], PRESETS['tiny']['n_embd']
    tokens = 1 * 32  # default --batch-size 1 x --block-size 32
    frozen = n_layer * 2 * d * d
    a, b = rows['oelm'], rows['oelm-freeze']
    assert a['tokens_per_step'] == b['tokens_per_step'] == tokens
    # frozen Q/K skip their two weight-gradient matmuls: 2 x (2 x tokens x d x d) FLOPs per layer
    assert a['flops_per_step'] - b['flops_per_step'] == n_layer * 4 * tokens * d * d
    assert b['flops_saved_vs_first'] == n_layer * 4 * tokens * d * d and a['flops_saved_vs_first'] == 0
    # AdamW keeps exp_avg and exp_avg_sq (fp32) per trainable weight
    assert a['optimizer_state_bytes'] - b['optimizer_state_bytes'] == 2 * 4 * frozen == b['optimizer_bytes_saved_vs_first']
    assert a['trainable_params'] - b['trainable_params'] == frozen
    assert a['optimizer_state_bytes'] == 2 * 4 * a['trainable_params']
    for r in (a, b):  # timings: only that they were measured
        for k in ('step_time_median_s', 'tokens_per_s'):
            assert isinstance(r[k], (int, float)) and np.isfinite(r[k]) and r[k] > 0, (r['variant'], k, r[k])
        assert r['step_time_iqr_s'] >= 0
    from oelm_nb.model.device import autocast_dtype
    import torch
    dtype = 'float32' if autocast_dtype(torch.device('cpu')) is None else 'bfloat16'  # the default precision, resolved
    ref = rows['reference']
    assert np.isclose(ref['flops_per_step'], ref['achieved_flops_per_s'] * ref['step_time_median_s'])
    for r in rows.values():
        assert r['dtype'] == dtype and r['peak_source'].startswith('measured')
        assert 0 < r['fraction_of_peak'] and np.isclose(r['fraction_of_peak'], r['achieved_flops_per_s'] / r['peak_flops_per_s'])
        assert r['ratio_to_reference_median'] > 0 and r['peak_memory_bytes'] > 50 * 2**20  # CPU: peak RSS of its own process
    assert ref['ratio_to_reference_median'] == 1.0

    err = usage_error(few, 'bench')
    assert 'steps=5' in err and 'too few' in err
    assert few.stdout == ''


# ====================================================================== oelm data prepare
def test_data_prepare_writes_a_dataset_and_rejects_a_missing_source(tmp_path):
    out, missing = tmp_path / 'ds', tmp_path / 'no-such-corpus.txt'
    good, bad = run_all(('data', 'prepare', '--source', 'synthetic', '--out', str(out), '--set', 'data.vocab_size=300',
                         '--set', 'data.n_train_stories=100', '--set', 'data.n_val_stories=20', '--quiet'),
                        ('data', 'prepare', '--source', str(missing), '--out', str(tmp_path / 'never')))
    assert good.returncode == 0, good.stderr
    for f in ('train.bin', 'val.bin', 'tokenizer.json', 'meta.json'): assert (out / f).is_file(), f
    meta = json.loads((out / 'meta.json').read_text())
    assert meta['n_docs'] == {'train': 100, 'val': 20}
    assert meta['vocab_size'] <= 300 and meta['requested_vocab_size'] == 300
    size = np.dtype(meta['dtype']).itemsize
    for split in ('train', 'val'):
        tok = np.fromfile(out / f'{split}.bin', dtype=meta['dtype'])
        assert (out / f'{split}.bin').stat().st_size == meta['n_tokens'][split] * size and len(tok) > 0
        assert int(tok.max()) < meta['vocab_size']
        assert (tok == meta['eot_id']).sum() == meta['n_docs'][split]  # one end-of-text per story
    json.loads((out / 'tokenizer.json').read_text())

    err = usage_error(bad, 'data')
    assert str(missing) in err
    assert not (tmp_path / 'never' / 'meta.json').exists()


# ====================================================================== --help
HELP = [(), ('params',), ('data',), ('data', 'prepare'), ('train',), ('run',), ('report',), ('bench',)]


@pytest.mark.slow
def test_every_help_exits_0():
    results = run_all(*[(*c, '--help') for c in HELP])
    for c, res in zip(HELP, results):
        assert res.returncode == 0, f'oelm {" ".join(c)} --help: exit {res.returncode}\n{res.stderr}'
        assert res.stdout.startswith('usage: oelm' + ''.join(' ' + w for w in c)), res.stdout[:200]
    top = results[0].stdout
    for sub in ('params', 'data', 'train', 'run', 'report', 'bench'): assert sub in top


def test_the_console_script_returns_mains_exit_status():
    "The installed `oelm` script, in a subprocess: 0 for --version, 2 and a one-line error for a bad request."
    import oelm_nb
    v = run_oelm('--version')
    assert v.returncode == 0 and v.stdout.strip() == f'oelm_nb {oelm_nb.__version__}', v.stdout + v.stderr
    bad = run_oelm('params', '--study', 'qk-freeze', '--variant', 'gpt', '--set', 'model.n_head=7')
    assert 'ModelConfig.n_head=7' in usage_error(bad, 'params') and len(bad.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_version_and_study_help_lists_variants_options_and_defaults():
    import oelm_nb
    from oelm_nb.lab.study import studies
    from oelm_nb.app.cli import build_parser
    v = oelm_main('--version')
    assert v.returncode == 0 and v.stdout.strip() == f'oelm_nb {oelm_nb.__version__}'
    for name, study in studies().items():
        h = oelm_main('run', name, '--help')
        assert h.returncode == 0, h.stderr
        text = ' '.join(h.stdout.split())  # argparse wraps lines
        for variant in study.variants('tiny', 1000, {}): assert variant in text, (name, variant)
        # every option of `oelm run <study>` has help text, and every one with a default other than None/False states it
        sub = next(a for a in build_parser()._subparsers._group_actions[0].choices['run']._subparsers._group_actions[0].choices.items() if a[0] == name)[1]
        for action in sub._actions:
            if action.dest in ('help',): continue
            assert action.help, f'oelm run {name}: {action.option_strings} has no help'
            if action.default not in (None, False): assert 'default' in action.help, f'oelm run {name}: {action.option_strings} hides its default'
    assert 'also available (--variants): oelm-freeze-half, oelm-progressive, oelm-learnable' in ' '.join(oelm_main('run', 'qk-freeze', '--help').stdout.split())


@pytest.mark.slow
def test_params_takes_the_study_variants():
    "oelm params --variant finds the one study that plans it (here the Q/K study) and counts its model settings (freeze_layers of oelm-freeze-half)."
    r = oelm_main('params', '--variant', 'oelm-freeze-half', '--json')
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d['config']['variant'] == 'oelm-freeze' and d['config']['freeze_layers'] == 1  # tiny: 2 layers, half frozen
    full = json.loads(oelm_main('params', '--study', 'qk-freeze', '--variant', 'oelm-freeze', '--json').stdout)
    assert d['frozen'] < full['frozen']
    bad = oelm_main('params', '--study', 'qk-freeze', '--variant', 'oelm-freez')
    assert bad.returncode == 2 and 'oelm-freeze-half' in bad.stderr
    unknown = oelm_main('params', '--variant', 'oelm-freez')  # without --study: no study plans it, so name one
    assert unknown.returncode == 2 and 'no registered study plans it; name the study with --study NAME' in unknown.stderr


def test_params_counts_a_variant_that_several_studies_build_alike(monkeypatch):
    "Studies that plan one variant name and build the same model for it count as one; models that differ need --study."
    from dataclasses import replace
    from oelm_nb.lab.study import STUDIES, Variant, get_study
    qk = get_study('qk-freeze'); half = qk.variant('oelm-freeze-half')
    monkeypatch.setitem(STUDIES, 'qk-twin', replace(qk, name='qk-twin', variants=lambda p, s, o: {'oelm-freeze-half': half}))
    r = oelm_main('params', '--variant', 'oelm-freeze-half', '--json')
    assert r.returncode == 0 and json.loads(r.stdout)['study'] in ('qk-freeze', 'qk-twin'), r.stderr
    deeper = Variant({**half.overrides, 'model.freeze_layers': 2})
    monkeypatch.setitem(STUDIES, 'qk-deep', replace(qk, name='qk-deep', variants=lambda p, s, o: {'oelm-freeze-half': deeper}))
    r = oelm_main('params', '--variant', 'oelm-freeze-half', '--json')
    assert r.returncode == 2 and 'which build different models; name one with --study NAME' in r.stderr, r.stderr
    assert all(n in r.stderr for n in ('qk-freeze', 'qk-twin', 'qk-deep')) and r.stdout == ''


@pytest.mark.parametrize('study', study_names())  # every registered study, the toy of tests/toy_study too
def test_params_counts_every_studys_variant(study):
    "`oelm params --study NAME --variant V` counts the model a run of V trains (`Study.build_model`, else a GPT)."
    import contextlib, io
    from oelm_nb.app.cli import main
    from oelm_nb.lab.study import get_study
    v = get_study(study).planned()[-1]
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf): assert main(['params', '--study', study, '--variant', v, '--json']) == 0
    d = json.loads(buf.getvalue())
    assert (d['study'], d['study_variant']) == (study, v) and d['total'] == d['trainable'] + d['frozen'] > 0


def test_loggers_flag_sets_the_train_loggers_and_rejects_unknown_names(tmp_path):
    from oelm_nb.app.cli import build_parser, run_flags
    from oelm_nb.lab.study import get_study
    args = build_parser().parse_args(['run', 'qk-freeze', '--loggers', 'tensorboard,wandb'])
    assert run_flags(get_study('qk-freeze'), args)[1]['train.loggers'] == ['tensorboard', 'wandb']
    r = oelm_main('run', 'qk-freeze', '--loggers', 'tensorbord', '--out', str(tmp_path / 'b'))
    assert r.returncode == 2 and "unknown ['tensorbord']" in r.stderr and not (tmp_path / 'b').exists()


# ---------------------------------------------------------------- a study's flags: one per field of its options dataclass
def test_study_flags_come_from_the_options_dataclass(capsys):
    from oelm_nb.app.cli import build_parser, run_flags
    from oelm_nb.lab.study import get_study
    parse = lambda *argv: build_parser(['run', *argv]).parse_args(['run', *argv])
    pca, cvfp = get_study('pca'), get_study('cvfp')
    # a list takes its values one after another (as argparse's nargs='+') or as one list: the same plan either way
    spaced, listed = parse('pca', '--ks', '8', '16', '--seeds', '0'), parse('pca', '--ks', '[8, 16]', '--seeds', '0')
    assert run_flags(pca, spaced)[2] == run_flags(pca, listed)[2] == {'ks': [8, 16]}
    assert spaced.seeds == [0]  # the values stop at the next flag
    assert run_flags(pca, parse('pca'))[2] == {}  # a field left at None was not given: the study's default applies
    # dashes in the flag, a bool as a switch, a Literal's values checked
    a = parse('cvfp', '--init-samples', '5', '--train-embedding', '--phase1', 'sequential')
    assert run_flags(cvfp, a)[2] == {'init_samples': 5, 'train_embedding': True, 'phase1': 'sequential'}
    assert run_flags(cvfp, parse('cvfp', '--train-embedding', 'false'))[2] == {'train_embedding': False}
    for bad, said in ((['--phase1', 'sideways'], '--phase1 sideways: expected one of parallel, sequential'),
                      (['--init-samples', 'many'], '--init-samples many: expected int'),
                      (['--ks', '8'], 'unrecognized arguments: --ks')):  # a flag of another study
        with pytest.raises(SystemExit):
            parse('cvfp', *bad)
        assert said in capsys.readouterr().err  # one line: the flag as written, the value, what it accepts
    with pytest.raises(SystemExit):
        parse('pca', '--ks', '8', 'x')
    assert "--ks [8, 'x']: expected a list of int" in capsys.readouterr().err
