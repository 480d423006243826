"""Issue 49, the parts a CPU can check: one MFU basis per row (the data-sheet table, looked up by the device names torch
reports), `oelm bench --compile` (eager and compiled rows in one run, the compile apart), and the micro-batch choice
from the memory estimate and a device's free memory.

Expected peaks are the data sheets' figures (dense, no sparsity: the sheets print tensor-core rows with sparsity, twice
these), written here by hand, never read back from the library.
"""
from __future__ import annotations
import json, math
from unittest import mock

import pytest
import torch
from cli_helpers import oelm_main
from oelm_nb.model.device import data_sheet_peak, peak_flops

TFLOPS = 1e12


@pytest.mark.parametrize('name, entry, bf16, fp32', [
    ('NVIDIA H100 80GB HBM3', 'H100 SXM', 989.4, 66.9),  # the SXM5 board names its memory, not its form factor
    ('NVIDIA H100 PCIe', 'H100 PCIe', 756.5, 51.2),
    ('NVIDIA H200', 'H200 SXM', 989.4, 66.9),
    ('NVIDIA A100-SXM4-80GB', 'A100 SXM', 312.0, 19.5),
    ('NVIDIA A100-SXM4-40GB', 'A100 SXM', 312.0, 19.5),
    ('NVIDIA A100-PCIE-40GB', 'A100 PCIe', 312.0, 19.5),
    ('NVIDIA A100 80GB PCIe', 'A100 PCIe', 312.0, 19.5),
    ('NVIDIA L4', 'L4', 121.0, 30.3),
])
def test_data_sheet_peaks_by_device_name(name, entry, bf16, fp32):
    assert data_sheet_peak(name, 'bfloat16') == (entry, bf16 * TFLOPS)
    assert data_sheet_peak(name, 'float16') == (entry, bf16 * TFLOPS)  # fp16 and bf16 share the tensor-core rate
    assert data_sheet_peak(name, 'float32') == (entry, pytest.approx(fp32 * TFLOPS))


def test_tf32_is_half_the_bf16_rate_on_the_data_sheets():
    for name in ('NVIDIA H100 80GB HBM3', 'NVIDIA H100 PCIe', 'NVIDIA H200', 'NVIDIA A100-SXM4-80GB', 'NVIDIA L4'):
        _, bf16 = data_sheet_peak(name, 'bfloat16')
        assert data_sheet_peak(name, 'tf32')[1] == pytest.approx(bf16 / 2, rel=0.01), name


@pytest.mark.parametrize('name', ['Some Future GPU', 'NVIDIA A10G', 'NVIDIA L40', 'NVIDIA H100'])
def test_unknown_gpus_fall_back_to_the_measured_peak_named_so(name):
    assert data_sheet_peak(name, 'bfloat16') is None
    with mock.patch('torch.cuda.get_device_name', return_value=name):
        peak, basis = peak_flops(torch.device('cuda'), torch.bfloat16, measured=123e12)
    assert peak == 123e12
    assert basis == f"measured 2048x2048 matmul 123 TFLOP/s, bf16 ('{name}' is not in DATA_SHEETS)"


def test_a_known_gpu_row_names_its_data_sheet_basis():
    with mock.patch('torch.cuda.get_device_name', return_value='NVIDIA H100 80GB HBM3'):
        assert peak_flops(torch.device('cuda'), torch.bfloat16, measured=1.0) == (
            989.4 * TFLOPS, 'H100 SXM bf16 dense data sheet 989 TFLOP/s')  # the data sheet wins over the measurement


def _bench_json(*extra: str) -> list[dict]:
    res = oelm_main('bench', '--preset', 'tiny', '--variants', 'oelm', '--no-reference', '--steps', '10',
                    '--warmup', '0', '--block-size', '16', '--dtypes', 'float32', '--no-memory', '--json', *extra)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def _one_basis(rows: list[dict]) -> str:
    bases = {r['peak_source'] for r in rows}
    assert len(bases) == 1, bases
    basis = bases.pop()
    assert basis.startswith('measured 2048x2048 matmul') and 'a CPU has no data sheet here' in basis
    for r in rows: assert r['measured_peak_flops_per_s'] == r['peak_flops_per_s'] > 0  # on a CPU they are one
    return basis


def test_bench_compile_without_a_compiler_says_why_in_the_row(monkeypatch):
    monkeypatch.setattr('shutil.which', lambda *a, **k: None)  # no g++, no clang++: compile is not even tried
    rows = _bench_json('--compile')
    assert [(r['variant'], r['mode']) for r in rows] == [('oelm', 'eager'), ('oelm', 'compiled')]
    eager, compiled = rows
    _one_basis(rows)
    assert eager['note'] is None and eager['rounds'] == 10 and eager['step_time_median_s'] > 0
    assert eager['first_step_s'] > 0  # warm-up raised to 1: the first step is never timed
    assert compiled['rounds'] == 0 and compiled['step_time_median_s'] is None and compiled['first_step_s'] is None
    assert compiled['note'].startswith('torch.compile not timed: no C++ compiler') and '\n' not in compiled['note']


@pytest.mark.slow
def test_bench_compile_times_eager_and_compiled_with_the_compile_apart():
    rows = _bench_json('--compile')
    eager, compiled = rows
    assert (eager['mode'], compiled['mode']) == ('eager', 'compiled') and compiled['note'] is None
    _one_basis(rows)
    assert eager['rounds'] == compiled['rounds'] == 10
    assert compiled['flops_per_step'] == eager['flops_per_step']  # counted on the eager model: the same work
    # the compile is reported apart and is far longer than a steady compiled step
    assert compiled['first_step_s'] > 5 * compiled['step_time_median_s']
    assert math.isclose(compiled['fraction_of_peak'],  # the JSON keeps 10 decimals
                        compiled['achieved_flops_per_s'] / compiled['peak_flops_per_s'], rel_tol=1e-6)


# ---------------------------------------------------------------------- the micro-batch that fits
GiB = 2 ** 30


@pytest.mark.parametrize('free_gib, preset_cut, chosen', [
    (80, (8, 4), (32, 1)),  # an H100's worth: the 32 sequences of a step in one pass
    (16, (8, 4), (16, 2)),  # 24 would fit; 16 is the largest cut of 32 that does
    (4, (8, 4), (4, 8)),
    (80, (8, 1), (8, 1)),  # never more sequences per pass than a step has
    (3, (8, 1), (2, 4)),   # the preset's 8 do not fit (3 would): accumulation keeps them
])
def test_largest_micro_batch_that_fits_keeps_the_effective_batch(free_gib, preset_cut, chosen):
    from oelm_nb.model.gpt import model_config
    from oelm_nb.train.memory import choose_micro_batch
    med = model_config('medium512')
    # by hand: fp32 weights, gradients and two AdamW moments of 44,896,768 weights; per sequence of 512 tokens the
    # logits (16 bytes per token and vocabulary entry), 6 blocks of 4 x (9 x 512 + 2 x 2048) bytes per token, and the
    # embeddings and final LayerNorm (4 x (4 x 512 + 2 x 512) bytes per token)
    fixed = 16 * 44_896_768
    per_seq = 16 * 512 * 50_257 + 6 * 4 * 512 * (9 * 512 + 2 * 2048) + 4 * 512 * 6 * 512
    b, acc = choose_micro_batch(med, *preset_cut, device='cuda', free=free_gib * GiB)  # a fake figure: no GPU needed
    assert (b, acc) == chosen and b * acc == preset_cut[0] * preset_cut[1]
    budget = 0.8 * free_gib * GiB  # the default 20% margin
    assert fixed + b * per_seq <= budget
    bigger = [d for d in range(b + 1, b * acc + 1) if (b * acc) % d == 0]  # the next larger cut does not fit
    assert not bigger or fixed + bigger[0] * per_seq > budget


def test_no_micro_batch_fits_is_a_named_error():
    from oelm_nb.base.core import ConfigError
    from oelm_nb.model.gpt import model_config
    from oelm_nb.train.memory import choose_micro_batch
    with pytest.raises(ConfigError, match='Even batch_size=1 needs about'):
        choose_micro_batch(model_config('medium512'), 8, 1, device='cuda', free=GiB // 2)


def test_trainer_cuts_micro_batches_only_on_cuda_and_when_asked(monkeypatch):
    import numpy as np
    from oelm_nb.base.core import ModelConfig, TrainConfig
    from oelm_nb.data.corpus import TokenData
    from oelm_nb.model.gpt import GPT
    from oelm_nb.train.trainer import Trainer
    data = TokenData(np.tile(np.arange(64, dtype=np.uint16), 16), None, 64, {})
    mcfg = ModelConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=32, dropout=0.0)
    tcfg = TrainConfig(batch_size=2, grad_accum=3, device='cpu', dtype='float32', progress=False)
    monkeypatch.setattr('oelm_nb.train.memory.available_memory', lambda device: (80 * GiB, 'a fake GPU'))
    plans = {}
    for mode in ('auto', 'config'):
        t = Trainer(GPT(mcfg, init_seed=0), tcfg.replace(micro_batch=mode), data)
        plans['cpu', mode] = t.micro
        t.device = torch.device('cuda')
        plans['cuda', mode] = t._micro_plan()
    assert plans == {('cpu', 'auto'): (2, 3), ('cpu', 'config'): (2, 3), ('cuda', 'auto'): (6, 1),
                     ('cuda', 'config'): (2, 3)}


def test_bench_without_a_study_times_the_presets_model_variants():
    "`oelm bench --preset tiny` names no study: it times the preset's model as each of the model layer's Q/K structures."
    from oelm_nb.lab.bench import MODEL_VARIANTS
    res = oelm_main('bench', '--preset', 'tiny', '--no-reference', '--steps', '10', '--warmup', '0', '--block-size', '16',
                    '--dtypes', 'float32', '--no-memory', '--json')
    assert res.returncode == 0, res.stderr
    rows = json.loads(res.stdout)
    assert [r['variant'] for r in rows] == list(MODEL_VARIANTS) == ['gpt', 'oelm', 'oelm-freeze']
    # the frozen Q/K are the only difference between oelm and oelm-freeze: 2 x d x d weights per layer
    from oelm_nb.model.gpt import PRESETS
    d, L = PRESETS['tiny']['n_embd'], PRESETS['tiny']['n_layer']
    by = {r['variant']: r for r in rows}
    assert by['oelm']['trainable_params'] - by['oelm-freeze']['trainable_params'] == L * 2 * d * d
    numerics = oelm_main('bench', '--preset', 'tiny', '--numerics', 'x')  # training runs needs a study: said so
    assert numerics.returncode == 2 and '--study' in numerics.stderr
