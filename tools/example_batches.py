#!/usr/bin/env python
"""Example batches for the docs site: each study's report executed on seconds-long runs.

The report pages of the site would otherwise show code without a single output. At docs time this
script runs one small batch per study (the tiny preset, a 300-story corpus with a 300-token
vocabulary, 2 seeds, a few dozen steps) in one process per study, each run called in-process
(`oelm_nb.runner.execute_inline`, no notebook per run), and renders the study's report on it with
papermill, as `oelm run` does. The numbers on those pages show what the report computes; runs this
short answer nothing, and each page says so.

Usage: python tools/example_batches.py STUDY OUT_DIR   (one batch; tools/build_docs.py calls it)
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

SMALL_CORPUS = {'data.n_train_stories': 300, 'data.n_val_stories': 40, 'data.vocab_size': 300, 'model.vocab_size': 300,
                'train.eval_batches': 2}

# study -> the batch: `oelm_nb.runner.run_study` keyword arguments on top of the small corpus
EXAMPLES: dict[str, dict] = {
    'qk-freeze': dict(steps=30),
    'pca': dict(steps=30, options={'ks': [8, 16]}),
    'cvfp': dict(steps=30, options={'algorithms': ['MCDL', 'ODCM'], 'samples': [2, 4, 8, 16]},
                 overrides={'settings.val_tokens': 600, 'settings.check_tokens': 200, 'settings.phase1_max_iterations': 3,
                            'settings.phase1_min_iterations': 2, 'settings.speed_iterations': 3, 'settings.phase2_epochs': 2,
                            'settings.tokens': 400}),
    'mercator': dict(steps=30),
}


def describe(study: str) -> str:
    "One sentence for the page: what the example batch ran."
    ex = EXAMPLES[study]
    opts = ''.join(f", --{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}" for k, v in ex.get('options', {}).items())
    return (f"the tiny preset, {ex['steps']} optimizer steps per run, seeds 0 and 1{opts}, on a 300-story corpus with a "
            f"300-token vocabulary")


def run_example(study: str, out: Path, log=print):
    "Run the example batch of `study` into `out` (runs in this process) and render its report; returns the BatchResult."
    from oelm_nb.runner import run_study, execute_inline
    ex = EXAMPLES[study]
    res = run_study(study, seeds=[0, 1], steps=ex['steps'], out_dir=out, options=ex.get('options'),
                    overrides={**SMALL_CORPUS, **ex.get('overrides', {})}, execute=execute_inline, report=True, log=log)
    if res.failed: raise RuntimeError(f"example batch {study}: run(s) {', '.join(res.failed)} did not complete; see {out}")
    return res


if __name__ == '__main__':
    if len(sys.argv) != 3 or sys.argv[1] not in EXAMPLES:
        sys.exit(f"usage: python tools/example_batches.py STUDY OUT_DIR, STUDY one of {', '.join(EXAMPLES)}")
    t0 = time.time()
    res = run_example(sys.argv[1], Path(sys.argv[2]), log=lambda s: None)
    print(f'[docs] example batch {sys.argv[1]}: {len(res.statuses)} runs and the report in {time.time() - t0:.0f}s')
