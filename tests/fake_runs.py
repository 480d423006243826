"""A test helper (not part of the library): write batch directories by hand, as `oelm run` would leave them.

`fake_batch(root, study, runs)` writes `batch.json` (with each variant's planned overrides) and, per run, a
`summary.json` and optionally a `metrics.jsonl`, so that the verdict functions can be tested on exactly the
numbers a test chooses: normal batches, one seed, failed runs, missing metrics.
"""
from __future__ import annotations
import json
from pathlib import Path


def fake_run(root: Path, variant: str, seed: int, summary: dict | None, metrics: list[dict] | None = None) -> Path:
    "One run folder `<variant>-s<seed>`; `summary=None` leaves it without a summary (an interrupted run)."
    d = Path(root) / f'{variant}-s{seed}'
    d.mkdir(parents=True, exist_ok=True)
    if summary is not None:
        (d / 'summary.json').write_text(json.dumps({'variant': variant, 'seed': seed, **summary}))
    if metrics: (d / 'metrics.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in metrics))
    return d


def fake_batch(root, study: str, runs: dict, seeds=(0,), plan: dict | None = None) -> Path:
    """`runs`: variant -> function(seed) -> summary dict (or None for no summary, or a dict with status 'failed').
    `plan`: variant -> planned overrides, recorded in batch.json as the runner does."""
    root = Path(root); root.mkdir(parents=True, exist_ok=True)
    plan = plan or {}
    (root / 'batch.json').write_text(json.dumps({'study': study, 'preset': 'tiny', 'variants': list(runs), 'seeds': list(seeds),
                                                 'plan': {v: {'overrides': plan.get(v, {}), 'upstream': []} for v in runs}}))
    for v, make in runs.items():
        for s in seeds:
            summary = make(s)
            if summary is not False: fake_run(root, v, s, summary)
    return root


def failed(error: str = 'RuntimeError: boom') -> dict:
    return {'status': 'failed', 'error': error}


def write_precision(root: Path, metric: str, a: str, b: str, mean: float = 0.08, low: float = 0.041, high: float = 0.12,
                    n: int = 8) -> Path:
    "A precision.json as `oelm run --precision` writes it (Stein's design on `metric` of `a` vs `b`, its final interval)."
    import json
    rec = {'design': 'stein', 'metric': metric, 'a': a, 'b': b, 'relative': True, 'scale': 'log', 'confidence': 0.95,
           'half_width': 0.05, 'pilot_seeds': [0, 1, 2, 3, 4], 'n0': 5, 's0': 0.04, 't': 2.776, 'needed': n, 'n': n,
           'max_seeds': 64, 'capped': False, 'seeds': list(range(n)), 'n_used': n, 'missing_seeds': [],
           'mean': mean, 'low': low, 'high': high}
    (Path(root) / 'precision.json').write_text(json.dumps(rec))
    return Path(root) / 'precision.json'
