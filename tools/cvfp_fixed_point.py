#!/usr/bin/env python
"""Does CVFP's Phase 1 reach its fixed point? The measurements of the page `nbs/reports/cvfp_fixed_point.ipynb`, on the
command line, one JSON object per line.

The New-LLM guidelines compared Phase 1's parallel contexts with a sequential pass of the trained block (mean cosine
0.9969 on 56,602 tokens); `oelm_nb.studies.cvfp.fixed_point.fixed_point_agreement` is that comparison. This tool runs
`oelm_nb.studies.cvfp.fixed_point_runs` on the first SAMPLES training stories of a batch made by `oelm run cvfp` (its
`data/` and `embed-s0/`; an embedding run is enough: `oelm run cvfp --variants embed --seeds 0 --out DIR`):

    curves   `phase1_curves`: Phase 1 as `train_phase1` runs it (no validation), measured after every learning iteration
    table    `study_run`: the study's run (Phase 1 with validation tokens, the best iteration kept, then Phase 2 for 10
             epochs on the cache before and now)

Widths above the embedding's are reached by lifting the trained embedding with a fixed random orthonormal map (its
geometry kept); `--random-embedding` draws a full-rank Gaussian one instead.

    OMP_NUM_THREADS=1 .venv/bin/python tools/cvfp_fixed_point.py curves runs/cvfp-fp --algorithm MCDL --width 64
    OMP_NUM_THREADS=1 .venv/bin/python tools/cvfp_fixed_point.py table runs/cvfp-fp --algorithm ODCM --width 768
"""
from __future__ import annotations
import argparse, ast, contextlib, json, sys
from pathlib import Path

import torch

from oelm_nb.studies.cvfp.method import CVFPModel, DIVERSITY_LOSSES
from oelm_nb.studies.cvfp.fixed_point_runs import batch_tokens, phase1_curves, row_config, study_run, widen


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1])
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
    tokens = batch_tokens(a.batch, a.samples)
    emb = widen(tokens.embedding, a.width, a.random_embedding)
    over = {k: ast.literal_eval(v) for k, v in (s.split('=', 1) for s in a.set)}
    head = {'samples': a.samples, 'tokens': len(tokens.ids), 'algorithm': a.algorithm, 'width': a.width,
            'embedding': 'random' if a.random_embedding else 'trained', 'set': over}
    m = CVFPModel(row_config(emb, a.algorithm, **over), emb)
    if a.what == 'curves': rows = phase1_curves(m, tokens.ids, a.iterations)
    else:
        with contextlib.redirect_stdout(sys.stderr):  # the Trainer's log line; stdout is one JSON object per line
            rows = [study_run(m, tokens.ids, tokens.val_ids)]
    for row in rows: print(json.dumps({**head, **row}), flush=True)


if __name__ == '__main__':
    sys.exit(main())
