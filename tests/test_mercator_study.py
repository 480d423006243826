"""The Mercator study from outside: `oelm run mercator` end to end on tiny settings, its flags and plan, and HF mode
on tiny Qwen2 checkpoints written here (no download).

The batch asks for three students only; the runner must add their upstream `teacher` and `pretrain` runs itself and
run them first; the students fine-tune the pre-trained student for half the steps.
Checks compare against independent sources: the teacher's own config.json (KV widths, layer count), the layer
map recomputed from those, perplexity as exp(loss), the safetensors files on disk.
"""
from __future__ import annotations
import dataclasses, json, math, re, shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from oelm_nb.base.core import ConfigError
from oelm_nb.lab.spec import resolve_spec
from oelm_nb.lab.study import get_study
from oelm_nb.studies.mercator.method import cosine_stage, layer_map, pass_label
from oelm_nb.studies.mercator.study import mercator_common, mercator_run, MercatorSettings
from oelm_nb.studies.mercator.hf import resolve_checkpoint, resolve_dataset, load_texts, load_records
from cli_helpers import oelm_main, oelm_inline, read_json, html_text
from shared_runs import shared_batch, completed

pytestmark = pytest.mark.slow  # batches and processes end to end: `make test` runs them, `make test-fast` does not

STUDENTS = ('mercator-b0.01', 'logit-kd', 'no-distill')


@pytest.fixture(scope='module')
def batch(tmp_path_factory):
    """The students mercator-b0.01, logit-kd and no-distill with the runs they need, seed 0, 6 steps, and the report: trained in-process
    once per session (tests/shared_runs.py); the HF-mode batch below goes through `oelm run` (in-process runs, the report by papermill)."""
    out, rec = shared_batch(tmp_path_factory, 'shared-mercator', 'mercator', variants=list(STUDENTS), steps=6, report=True)
    return completed((out, rec)), '\n'.join(rec['log'])


def test_batch_runs_teacher_first_and_students_distil_from_it(batch):
    out, log = batch
    assert "added upstream run(s) ['teacher', 'pretrain']" in log
    assert all(read_json(out / f'{v}-s0' / 'summary.json')['status'] == 'completed' for v in (*STUDENTS, 'teacher', 'pretrain'))
    for up in ('teacher', 'pretrain'): assert log.index(f'{up}-s0: completed') < min(log.index(f'{v}-s0: started') for v in STUDENTS)
    p_dir = out / 'pretrain-s0'
    p_cfg, p_sum = read_json(p_dir / 'config.json'), read_json(p_dir / 'summary.json')
    assert p_sum['role'] == 'pretrain' and p_sum['steps'] == 6
    t_dir = out / 'teacher-s0'
    t_cfg, t_sum = read_json(t_dir / 'config.json'), read_json(t_dir / 'summary.json')
    assert t_sum['status'] == 'completed' and t_sum['role'] == 'teacher'
    assert (t_dir / 'checkpoints' / 'final' / 'model.safetensors').is_file()
    tm = t_cfg['model']
    for v in STUDENTS:
        d = out / f'{v}-s0'
        cfg, s = read_json(d / 'config.json'), read_json(d / 'summary.json')
        sm = cfg['model']
        # a smaller student of the same family: fewer layers, heads and a narrower KV width than the teacher
        assert sm['n_layer'] < tm['n_layer'] and sm['n_head'] < tm['n_head'] and sm['n_embd'] < tm['n_embd']
        assert sm['n_embd'] // sm['n_head'] != tm['n_embd'] // tm['n_head']  # head dims differ too
        assert Path(s['teacher_dir']) == t_dir.resolve()
        assert Path(s['teacher_checkpoint']).parent == (t_dir / 'checkpoints').resolve()
        assert s['teacher_kv'] == [tm['n_layer'], tm['n_embd']] and s['student_kv'] == [sm['n_layer'], sm['n_embd']]
        assert s['layer_map'] == layer_map(tm['n_layer'], sm['n_layer'])
        assert s['teacher_val_ppl'] == pytest.approx(t_sum['best_val_ppl'])
        # summary fields
        assert s['status'] == 'completed' and s['role'] == 'student' and s['steps'] == 3 and s['variant'] == v  # half the pre-training
        # the Mercator guide's protocol: fine-tune the pre-trained student (same architecture), projector at 20x, clip 0.5
        assert cfg['model'] == p_cfg['model'] and s['start'] == 'pretrain' and s['start_val_ppl'] == p_sum['best_val_ppl']
        assert Path(s['start_checkpoint']).parent == (p_dir / 'checkpoints').resolve()
        assert s['lr_projector'] == pytest.approx(20 * s['lr_student']) and s['grad_clip'] == cfg['train']['grad_clip'] == 0.5
        assert s['kv_pass'] == pass_label(s['final_kv_cos_centered']) and s['kv_pass_raw'] == pass_label(s['final_kv_cos'])
        assert s['collapsed'] == (s['final_kv_cos'] - s['final_kv_cos_centered'] > 0.1)
        assert s['task'] == 'recall' and s['task_acc'] == s['recall_acc']
        assert s['kd_weight'] == (1.0 if v == 'logit-kd' else 0.0)
        assert s['best_val_ppl'] == pytest.approx(math.exp(s['best_val_loss']), rel=1e-9)
        assert s['val_loss'] == s['final_val_loss']
        for k in ('final_kv_cos', 'final_kv_cos_centered'): assert -1.0 <= s[k] <= 1.0
        assert s['kv_stage'] == cosine_stage(s['final_kv_cos']) and s['kv_stage_centered'] == cosine_stage(s['final_kv_cos_centered'])
        assert len(s['kv_cos_centered_layers']) == sm['n_layer']
        assert s['distill'] == (v == 'mercator-b0.01')
        # optimizer settings: separate learning rates, gradient accumulation
        assert cfg['train']['grad_accum'] > 1 and s['lr_projector'] != s['lr_student'] == cfg['train']['lr']
        # projector and student saved as safetensors in the final checkpoint; projector widths teacher -> student
        final = d / 'checkpoints' / 'final'
        proj = load_file(str(final / 'projector.safetensors'))
        for kind in 'kv':
            for i in range(sm['n_layer']):
                assert proj[f'{kind}.{i}.net.1.weight'].shape[1] == tm['n_embd']
                assert proj[f'{kind}.{i}.net.4.weight'].shape[0] == sm['n_embd']
        assert (final / 'model.safetensors').is_file()
        # the cosine is logged during training and at every evaluation
        recs = [json.loads(l) for l in (d / 'metrics.jsonl').read_text().splitlines() if l.strip()]
        assert [r['step'] for r in recs] == list(range(1, 4))
        assert all('kv_cos' in r and 'kv_cos_centered' in r and 'kv_stage' in r for r in recs)
        assert all(('kd_loss' in r) == (v == 'logit-kd') for r in recs)
        assert recs[-1]['val_kv_cos'] == pytest.approx(s['final_kv_cos'])


def test_students_start_from_the_same_weights(batch):
    "Paired comparison: step 1's losses are computed before any update, so equal initial weights, projector and batches give equal values."
    out, _ = batch
    first = {v: json.loads((out / f'{v}-s0' / 'metrics.jsonl').read_text().splitlines()[0]) for v in STUDENTS}
    a, k, b = (first[v] for v in STUDENTS)
    assert a['step'] == b['step'] == k['step'] == 1
    assert a['ce_loss'] == pytest.approx(b['ce_loss'], rel=1e-6) == pytest.approx(k['ce_loss'], rel=1e-6)
    assert a['kv_loss'] == pytest.approx(b['kv_loss'], rel=1e-6)  # both score with Mercator beta 0.01; no-distill only detaches the student
    # the start is the pre-trained student: its step-1 cross-entropy equals the pre-trained model's on that batch, not a random init's
    from oelm_nb.lab.spec import RunSpec
    from oelm_nb.model.gpt import GPT
    from oelm_nb.train.checkpoint import load_weights
    spec = RunSpec.load_json(out / 'no-distill-s0' / 'config.json')
    s = read_json(out / 'no-distill-s0' / 'summary.json')
    from oelm_nb.train.trainer import train_starts
    from oelm_nb.data.corpus import load_split, batch as make_batch
    train_d, T = load_split(spec.resolved_data_dir, 'train'), spec.model.block_size
    micro = [make_batch(train_d, train_starts(len(train_d.tokens), T, spec.train.batch_size, spec.train.seed, 0, m, 0, 1), T)
             for m in range(spec.train.grad_accum)]
    def first_ce(model):
        with torch.no_grad(): return sum(torch.nn.functional.cross_entropy(model(x)[0].flatten(0, 1), y.flatten()).item() for x, y, _ in micro) / len(micro)
    pre = load_weights(GPT(spec.model, init_seed=99), Path(s['start_checkpoint']), 'model')
    assert first_ce(pre) == pytest.approx(b['ce_loss'], rel=1e-5)
    assert abs(first_ce(GPT(spec.model, init_seed=spec.train.seed)) - b['ce_loss']) > 1e-3  # not the random init of the old protocol
    w = [load_file(str(out / f'{v}-s0' / 'checkpoints' / 'final' / 'model.safetensors')) for v in STUDENTS]
    assert any(not torch.equal(w[0][k], w[2][k]) for k in w[0] if 'k_proj' in k)  # ...and the distilled one then trained differently


def test_report_answers_with_numbers_from_the_runs(batch):
    out, _ = batch
    text = html_text(out / 'report.html')
    sums = {v: read_json(out / f'{v}-s0' / 'summary.json') for v in (*STUDENTS, 'pretrain')}
    for heading in ('Questions and answers', 'Protocol', 'Task accuracy against no-distill', 'KV agreement per layer', 'MSE against Mercator'):
        assert heading in text
    assert 'does any distillation variant beat no-distill on validation PPL?' in text  # the answers table (mercator_answers)
    # the PPL answer names the best distilled student and its difference, computed here from the summaries (one seed: the ratio)
    base = sums['no-distill']['best_val_ppl']
    best = min(('mercator-b0.01', 'logit-kd'), key=lambda v: sums[v]['best_val_ppl'])
    assert f"best {best} {sums[best]['best_val_ppl'] / base - 1:+.2%}" in text
    for v in STUDENTS:
        s = sums[v]
        assert f"{s['best_val_ppl']:.3f}" in text and f"{s['final_kv_cos']:.3f}" in text and f"{s['final_kv_cos_centered']:.3f}" in text
        assert s['kv_pass'] in text
    # the protocol paragraph is read from the runs: pre-training and fine-tuning steps, the learning-rate ratio
    assert 'pre-trained as a language model for 6 steps' in text and 'fine-tunes for 3 steps' in text and '20x the student' in text
    assert f"best val PPL {sums['pretrain']['best_val_ppl']:.3f}" in text


def test_report_renders_when_a_run_failed(batch, tmp_path):
    out, _ = batch
    dst = tmp_path / 'copy'
    shutil.copytree(out, dst, symlinks=True, ignore=shutil.ignore_patterns('checkpoints', 'report.*'))
    (dst / 'no-distill-s0' / 'summary.json').write_text(json.dumps({'status': 'failed', 'error': 'RuntimeError: boom'}))
    r = oelm_main('report', str(dst))
    assert r.returncode == 0, r.stderr
    text = html_text(dst / 'report.html')
    assert 'RuntimeError: boom' in text
    assert 'no data' in text and 'the no-distill baseline did not complete' in text  # the answers table (mercator_answers)


# ---------------------------------------------------------------- flags and plan
def test_plan_flags():
    st = get_study('mercator')
    assert {f.name for f in dataclasses.fields(st.options)} == {'teacher', 'student', 'dataset', 'teacher_run', 'teacher_dtype'}
    assert mercator_common({}, 'tiny') == {}
    assert st.default_seeds == (0, 1) and len(st.planned()) == 13
    with pytest.raises(ConfigError, match='--teacher DIR and --student DIR'): st.variants('tiny', 400, {'teacher': '/x'})
    with pytest.raises(ConfigError, match='--data FILE'): mercator_common({'dataset': 'a.jsonl'}, 'tiny')
    with pytest.raises(ConfigError, match='no config.json'): mercator_common({'teacher_run': '/no/such/run'}, 'tiny')


def test_missing_dir_and_offline_hub_names_fail_clearly(tmp_path, monkeypatch):
    monkeypatch.setenv('HF_HUB_OFFLINE', '1')
    with pytest.raises(ConfigError, match=r"--teacher '/no/such/dir' is not a local directory.*huggingface-cli download"):
        resolve_checkpoint('/no/such/dir')
    with pytest.raises(ConfigError, match=r'not in the local Hugging Face cache.*--local-dir DIR'):
        resolve_checkpoint('Qwen/Qwen2.5-1.5B-Instruct-not-cached', '--teacher')
    empty = tmp_path / 'empty'; empty.mkdir()
    with pytest.raises(ConfigError, match='--student .*no config.json'): resolve_checkpoint(str(empty), '--student')
    with pytest.raises(ConfigError, match='--repo-type dataset openai/gsm8k-not-cached'): resolve_dataset('openai/gsm8k-not-cached:main')


def test_cli_teacher_flag_errors_before_anything_runs(tmp_path):
    out = tmp_path / 'b'
    r = oelm_main('run', 'mercator', '--teacher', str(tmp_path / 'missing'), '--student', str(tmp_path / 'missing2'), '--out', str(out))
    assert r.returncode == 2 and 'oelm run: error: --teacher' in r.stderr and 'huggingface-cli download' in r.stderr
    assert not out.exists()
    r = oelm_main('run', 'mercator', '--dataset', 'openai/gsm8k:main', '--out', str(out))
    assert r.returncode == 2 and '--data FILE' in r.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason='checks the CPU refusal of a 4-bit teacher')
def test_nf4_teacher_is_refused_on_cpu_before_anything_runs(tmp_path):
    out = tmp_path / 'b'
    r = oelm_main('run', 'mercator', '--teacher', str(tmp_path / 't'), '--student', str(tmp_path / 's'), '--teacher-dtype', 'nf4', '--out', str(out))
    assert r.returncode == 2 and 'nf4' in r.stderr and 'needs a CUDA GPU' in r.stderr and '--teacher-dtype bfloat16' in r.stderr
    assert not out.exists()
    r = oelm_main('run', 'mercator', '--teacher-dtype', 'nf4', '--out', str(out))
    assert r.returncode == 2 and 'is for HF checkpoints' in r.stderr


# ---------------------------------------------------------------- HF mode on tiny Qwen2 checkpoints
def _tokenizer(texts):
    from tokenizers import Tokenizer, models, trainers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    t = Tokenizer(models.BPE(unk_token='<unk>'))
    t.pre_tokenizer = pre_tokenizers.ByteLevel()
    t.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=300, special_tokens=['<pad>', '<unk>'], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=t, pad_token='<pad>', unk_token='<unk>')


def _qwen2(path, n_layers, n_heads, n_kv, head_dim, hidden, vocab, seed):
    transformers = pytest.importorskip('transformers')
    torch.manual_seed(seed)
    cfg = transformers.Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=n_layers,
                                   num_attention_heads=n_heads, num_key_value_heads=n_kv, head_dim=head_dim, max_position_embeddings=128)
    transformers.Qwen2ForCausalLM(cfg).save_pretrained(path)


def test_hf_mode_teacher_and_student_runs(tmp_path):
    pytest.importorskip('transformers')
    from oelm_nb.studies.mercator.gsm8k import write_gsm8k_sample, gsm8k_correct
    data = write_gsm8k_sample(tmp_path / 'gsm8k_like.jsonl', 60, seed=1)  # the GSM8K chapter's GSM8K-format file
    recs = [json.loads(l) for l in data.read_text().splitlines()]
    tok = _tokenizer([r['question'] + '\n' + r['answer'] for r in recs])
    t_dir, s_dir = tmp_path / 'teacher', tmp_path / 'student'
    V = len(tok) + 16  # embeddings padded beyond the tokenizer, as in Qwen2.5
    _qwen2(t_dir, 3, 4, 2, 16, 64, V, 0); _qwen2(s_dir, 2, 2, 1, 8, 32, V, 1)
    tok.save_pretrained(t_dir); tok.save_pretrained(s_dir)
    train, val = load_texts(str(data))
    assert len(train) + len(val) == 60 and len(val) == 3 and '####' in train[0]

    opts = {'teacher': str(t_dir), 'student': str(s_dir), 'dataset': str(data)}
    planned = mercator_common(opts, 'tiny')
    assert planned['settings.teacher_hf'] == str(t_dir.resolve()) and planned['train.lr'] == 5e-5 and planned['settings.lr_projector'] == 1e-3
    assert planned['train.grad_accum'] == 16 and planned['train.batch_size'] == 2 and planned['train.grad_clip'] == 0.5
    assert 'pretrain' not in get_study('mercator').variants('tiny', 3, {'teacher': str(t_dir), 'student': str(s_dir)})  # --student is pre-trained
    tiny = {'train.grad_accum': 2, 'train.eval_batches': 2, 'train.progress': False, 'train.device': 'cpu',
            'settings.task_eval': 3, 'settings.max_new_tokens': 6, 'data.val_fraction': 0.1}  # 6 of 60 records held out
    batch = tmp_path / 'batch'
    t_spec = resolve_spec('mercator', 'teacher', 'tiny', 0, 3, str(batch / 'teacher-s0'), 'synthetic', None, tiny, options=opts)
    t_sum = mercator_run(t_spec)
    assert t_sum['status'] == 'completed' and t_sum['role'] == 'teacher' and math.isfinite(t_sum['best_val_ppl'])
    assert t_sum['teacher_kv'] == [3, 32] and t_sum['student_kv'] == [2, 8] and t_sum['layer_map'] == [0, 2]
    assert t_sum['task'] == 'gsm8k' and t_sum['task_n'] == 3

    # Mercator and logit KD together: the logits are compared over the tokenizer's ids only (the embeddings are padded beyond it)
    spec = resolve_spec('mercator', 'mercator+logit', 'tiny', 0, 3, str(batch / 'mercator-b0.01-s0'), 'synthetic', None, tiny, options=opts)
    assert spec.train.lr == 5e-5 and spec.settings.lr_projector == 1e-3 and spec.train.grad_clip == 0.5  # the Mercator guide's values
    s = mercator_run(spec)
    assert s['status'] == 'completed' and s['steps'] == 3 and s['teacher_val_ppl'] == pytest.approx(t_sum['best_val_ppl'])
    assert s['kd_weight'] == 1.0 and s['distill'] and s['start'] == 'student_hf' and s['teacher_task_acc'] == t_sum['task_acc']
    recs_log = [json.loads(l) for l in (batch / 'mercator-b0.01-s0' / 'metrics.jsonl').read_text().splitlines() if l.strip()]
    assert all(math.isfinite(r['kd_loss']) and r['kd_loss'] >= 0 for r in recs_log)
    # exact match on the first 3 validation questions, scored again here from the recorded continuations
    _, val_recs = load_records(str(data), 0.1, t_spec.data.seed)
    assert s['task'] == 'gsm8k' and s['task_n'] == 3 and len(s['task_examples']) == 3
    for ex, rec in zip(s['task_examples'], val_recs):
        assert ex['question'] == rec['question'] and ex['correct'] == gsm8k_correct(ex['output'], rec['answer'])
    assert s['task_acc'] == sum(ex['correct'] for ex in s['task_examples']) / 3
    assert -1 <= s['final_kv_cos'] <= 1 and -1 <= s['final_kv_cos_centered'] <= 1 and math.isfinite(s['best_val_ppl'])
    proj = load_file(str(batch / 'mercator-b0.01-s0' / 'checkpoints' / 'final' / 'projector.safetensors'))
    assert proj['k.0.net.1.weight'].shape[1] == 32 and proj['v.1.net.4.weight'].shape[0] == 8
    from oelm_nb.studies.mercator.method import load_causal_lm
    student = load_causal_lm(batch / 'mercator-b0.01-s0' / 'student')  # saved with save_pretrained
    before = load_causal_lm(s_dir)
    assert any(not torch.equal(a, b) for (n, a), (_, b) in zip(student.state_dict().items(), before.state_dict().items()) if 'k_proj' in n)
    assert spec.settings.hf and isinstance(spec.settings, MercatorSettings)


def test_hf_mode_batch_through_the_cli_reports_gsm8k_accuracy(tmp_path):
    "`oelm run mercator --teacher --student --dataset` end to end (runs in-process, the report by papermill) on tiny Qwen2 checkpoints and a GSM8K-format file."
    pytest.importorskip('transformers')
    from oelm_nb.studies.mercator.gsm8k import write_gsm8k_sample
    data = write_gsm8k_sample(tmp_path / 'gsm8k.jsonl', 40, seed=2)
    recs = [json.loads(l) for l in data.read_text().splitlines()]
    tok = _tokenizer([r['question'] + '\n' + r['answer'] for r in recs])
    t_dir, s_dir = tmp_path / 'teacher', tmp_path / 'student'
    _qwen2(t_dir, 2, 4, 2, 8, 32, len(tok) + 16, 0); _qwen2(s_dir, 1, 2, 1, 8, 16, len(tok) + 16, 1)
    tok.save_pretrained(t_dir); tok.save_pretrained(s_dir)
    out = tmp_path / 'batch'
    r = oelm_inline('run', 'mercator', '--teacher', str(t_dir), '--student', str(s_dir), '--dataset', str(data), '--variants', 'no-distill,mercator-b0.01',
             '--seeds', '0', '--steps', '2', '--out', str(out), '--set', 'train.grad_accum=1', '--set', 'train.eval_batches=1',
             '--set', 'settings.task_eval=2', '--set', 'settings.max_new_tokens=4', '--set', 'data.val_fraction=0.1', '--set', 'train.device=cpu')
    assert r.returncode == 0, r.stdout + r.stderr
    assert "added upstream run(s) ['teacher']" in r.stdout and '3/3 runs completed' in r.stdout  # no pre-training: --student is pre-trained
    sums = {v: read_json(out / f'{v}-s0' / 'summary.json') for v in ('teacher', 'no-distill', 'mercator-b0.01')}
    assert all(s['task'] == 'gsm8k' and s['task_n'] == 2 for s in sums.values())
    text = html_text(out / 'report.html')
    assert 'GSM8K exact-match accuracy' in text and 'Does any distillation variant beat no-distill' in text
