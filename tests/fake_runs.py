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
