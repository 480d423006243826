#!/usr/bin/env python
"""Does CVFP's Phase 1 reach its fixed point? The measurements of issue 30, on a batch's story corpus and embedding.

The New-LLM guidelines compared Phase 1's parallel contexts with a sequential pass of the trained block (mean cosine
0.9969 on 56,602 tokens); `oelm_nb.studies.cvfp.fixed_point.fixed_point_agreement` is that comparison. This tool measures it on
the first SAMPLES training stories of a batch made by `oelm run cvfp` (its `data/` and `embed-s0/`; an embedding run
is enough: `oelm run cvfp --variants embed --seeds 0 --out DIR`, about a minute):

    curves   Phase 1 as `train_phase1` runs it (no validation), measured after every learning iteration: the
             agreement of that iteration's contexts with a sequential pass of the updated block from the context their
             token 0 read, the CVFP and diversity losses, the effective rank, the share of tokens under the
             convergence thresholds 1e-3 (ours) and 0.1 (the guidelines' bug notes), the block's context gain (how
             much of a change of its context input reaches its output) and the settling sweeps
    table    the study's own run (`train_phase1` with validation tokens, the best iteration kept, then `train_phase2`
             for 10 epochs): the kept iteration's agreement, that of Phase 2's cache before issue 30 (one parallel sweep
             of the final weights) and now (the sequential pass), CVFP loss, effective ranks, validation PPL

Widths above the embedding's are reached by lifting the trained embedding with a fixed random orthonormal map (its
geometry kept); `--random-embedding` draws a full-rank Gaussian one instead. One JSON object per line on stdout.

    OMP_NUM_THREADS=1 .venv/bin/python tools/cvfp_fixed_point.py curves runs/cvfp-fp --algorithm MCDL --width 64
    OMP_NUM_THREADS=1 .venv/bin/python tools/cvfp_fixed_point.py table runs/cvfp-fp --algorithm ODCM --width 768
"""
from __future__ import annotations
import argparse, ast, contextlib, json, sys, time
from pathlib import Path

import torch
from safetensors.torch import load_file

from oelm_nb.data.corpus import load_split
from oelm_nb.studies.cvfp.method import (CVFPConfig, CVFPModel, DIVERSITY_LOSSES, context_scan, effective_rank, train_phase1,
                          train_phase2, val_effective_rank, _parallel_pass, _phase1_step, _sequential_pass, _settled)
from oelm_nb.studies.cvfp.study import first_stories, select_val_tokens
from oelm_nb.studies.cvfp.fixed_point import compare_contexts, shift


def load(batch: Path, samples: int, width: int, random_embedding: bool, val_tokens: int = 10_000):
    "The first `samples` training stories, the covered validation tokens, and the embedding at `width`."
    tr, va = load_split(batch / 'data', 'train'), load_split(batch / 'data', 'val')
    ids = first_stories(tr.tokens, tr.meta['eot_id'], samples)
    vids, _ = select_val_tokens(va.tokens, ids.numpy(), va.meta['eot_id'], val_tokens, 'covered')
    emb = load_file(str(batch / 'embed-s0' / 'embedding.safetensors'))['embedding']
    if random_embedding: return ids, vids, torch.randn(emb.shape[0], width, generator=torch.Generator().manual_seed(0))
    if width != emb.shape[1]:
        q, _ = torch.linalg.qr(torch.randn(width, emb.shape[1], generator=torch.Generator().manual_seed(0)))
        emb = emb @ q.T
    return ids, vids, emb


def gain(block, e: torch.Tensor, contexts: torch.Tensor, start: torch.Tensor) -> float:
    "Mean over tokens of |block(c + d) - block(c)| / |d| for a small random d: how much the block remembers."
    d = torch.randn(contexts.shape, generator=torch.Generator().manual_seed(1)) * 1e-3
    with torch.no_grad():
        c = shift(contexts, start)
        return ((block(c + d, e)[-1] - block(c, e)[-1]).norm(dim=-1) / d.norm(dim=-1)).mean().item()


def curves(m: CVFPModel, ids: torch.Tensor, iterations: int):
    "`train_phase1`'s loop without validation, measured after every learning iteration (one dict each)."
    cfg, block = m.cfg, m.context_block
    opt, div_fn = torch.optim.Adam(block.parameters(), lr=cfg.phase1_lr), DIVERSITY_LOSSES[cfg.diversity]
    e, carry, previous = m.embed(ids), m.zero_context(), None
    for it in range(iterations):
        rec = {'iteration': it}
        if previous is None: ctx = _sequential_pass(block, e, carry, grad=False)[-1]
        else:
            x, rec['settle_sweeps'] = _settled(block, e, carry, previous, cfg) if cfg.parallel else (previous, 0)
            outs = (_parallel_pass(block, e, carry, x, grad=True) if cfg.parallel
                    else _sequential_pass(block, e, carry, grad=True))
            ctx, terms = _phase1_step(opt, cfg, outs[-1], previous, div_fn)
            change = ((ctx - previous) ** 2).mean(-1)
            rec.update(cvfp=terms['cvfp'], diversity=terms['diversity'],
                       converged_1e3=(change < 1e-3).float().mean().item(),
                       converged_0_1=(change < 0.1).float().mean().item())
        start, previous, carry = carry, ctx.detach(), ctx[-1:].detach()
        rec['effective_rank'] = effective_rank(previous).percent
        if it:  # the guidelines' comparison with the weights after this iteration's step
            ag = compare_contexts(previous[:-1], context_scan(block, e[:-1], start)[-1])
            rec.update(cos_mean=ag.cos_mean, cos_min=ag.cos_min, mse=ag.mse, regime=ag.regime,
                       gain=gain(block, e, previous, start))
        yield rec


def table_row(m: CVFPModel, ids: torch.Tensor, vids: torch.Tensor) -> dict:
    "The study's run (`cvfp_run`'s Phase 1 and Phase 2 calls) and what issue 30 measures of it."
    t = time.perf_counter()
    r = train_phase1(m, ids, val_ids=vids)
    block, e = m.context_block, m.embed(ids)
    ag = lambda par, start: compare_contexts(par[:-1], context_scan(block, e[:-1], start)[-1])
    with torch.no_grad():  # Phase 2's cache before issue 30: one parallel sweep of the final weights
        old_cache = _parallel_pass(block, e, r.final_start, r.iterate, grad=False)
    kept = r.history[r.best_iteration] if r.best_iteration is not None else r.history[-1]
    row = {'iterations': r.iterations, 'kept_iteration': r.best_iteration, 'phase1_s': r.seconds,
           'agreement': ag(r.iterate, r.iterate_start).as_dict(),
           'cache_before': ag(old_cache[-1], r.final_start).as_dict(),
           'cache_now': ag(r.contexts, r.final_start).as_dict(),
           'cvfp': kept.get('cvfp'), 'diversity': kept.get('diversity'),
           'er_kept_iteration': kept.get('effective_rank'),
           'train_er_before': effective_rank(old_cache[-1]).percent, 'train_er_now': effective_rank(r.contexts).percent,
           'val_er': val_effective_rank(m, vids).percent, 'gain': gain(block, e, r.contexts, r.final_start)}
    for name, cache in (('before', old_cache), ('now', r.layer_outputs)):
        m2 = CVFPModel(m.cfg, m.embedding.weight)
        m2.context_block.load_state_dict(block.state_dict())
        with contextlib.redirect_stdout(sys.stderr):  # the Trainer's log line; stdout is one JSON object per line
            p2 = train_phase2(m2, ids, cache=[c.detach() for c in cache], val_ids=vids, cpu_budget_bytes=16 * 2**20)
        row.update({f'val_ppl_{name}': p2.val_ppl, f'val_acc_{name}': p2.val_acc})
    row['wall_s'] = time.perf_counter() - t
    return row


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('what', choices=('curves', 'table'))
    p.add_argument('batch', type=Path, help='a batch directory of `oelm run cvfp` with data/ and embed-s0/')
    p.add_argument('--samples', type=int, default=20, help='training stories (default 20: 2,504 tokens)')
    p.add_argument('--algorithm', default='MCDL', choices=list(DIVERSITY_LOSSES), help='diversity loss (default MCDL)')
    p.add_argument('--width', type=int, default=64, help='context and embedding width (default 64, the cpu preset)')
    p.add_argument('--random-embedding', action='store_true',
                   help='a full-rank Gaussian embedding instead of the lifted one')
    p.add_argument('--iterations', type=int, default=40, help='Phase 1 iterations of `curves` (default 40)')
    p.add_argument('--set', action='append', default=[], metavar='FIELD=VALUE',
                   help='a CVFPConfig field, e.g. --set dist_reg_weight=0.0 --set phase1_settle_sweeps=50 '
                        '--set parallel=False')
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    ids, vids, emb = load(a.batch, a.samples, a.width, a.random_embedding)
    over = {k: ast.literal_eval(v) for k, v in (s.split('=', 1) for s in a.set)}
    cfg = CVFPConfig(vocab_size=emb.shape[0], embed_dim=emb.shape[1], context_dim=a.width, diversity=a.algorithm,
                     phase2_epochs=10, **over)
    head = {'samples': a.samples, 'tokens': len(ids), 'algorithm': a.algorithm, 'width': a.width,
            'embedding': 'random' if a.random_embedding else 'trained', 'set': over}
    m = CVFPModel(cfg, emb)
    rows = curves(m, ids, a.iterations) if a.what == 'curves' else [table_row(m, ids, vids)]
    for row in rows: print(json.dumps({**head, **row}), flush=True)


if __name__ == '__main__':
    sys.exit(main())
