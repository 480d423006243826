"""A toy study, as a lab would add one: does a second layer help on a tiny story corpus?

It lives outside the package, in one folder (this one: the study, its experiment and report notebooks) plus one
registration (`../toy_study-0.1.dist-info/entry_points.txt`, what `pip install` of a package declaring the entry point
writes). The suites run with tests/ on sys.path, so the toy is a registered study in every test session: the "every
study" tests (test_cli, test_skeletons, test_precision, test_studies, test_runner) cover it without naming it, as they
would cover any study registered later, and test_new_study runs it end to end."""
from dataclasses import dataclass
from pathlib import Path
from oelm_nb.lab.study import Study, Variant, NoSettings
from oelm_nb.lab.run import train_run
from oelm_nb.report.evidence import Answer
from oelm_nb.report.tables import compare

HERE = Path(__file__).parent


@dataclass
class ToyOptions:
    """The toy study's flags."""
    depths: list[int] | None = None
    """model depths to compare, the first the reference (default: [1, 2])"""


def variants(preset: str, steps: int, options: dict) -> dict:
    return {f'depth-{n}': Variant({'model.n_layer': n}) for n in options.get('depths') or [1, 2]}


def answers(runs) -> list:
    names = sorted(runs.variant.unique()) if len(runs) else []
    if len(names) < 2: return [Answer('T1', 'does depth change val PPL?', 'no data')]
    c = compare(runs, names[-1], names[0], 'best_val_ppl')
    return [Answer('T1', f'{names[-1]} vs {names[0]}: val PPL', 'inconclusive', f'{c.mean:+.2%}', seeds=f'{c.n} seeds')]


def plot(spec, summary: dict):
    "A run's train loss."
    import matplotlib.pyplot as plt
    from oelm_nb.base.metrics import read_metrics
    recs = read_metrics(spec.out_dir)
    plt.figure(figsize=(5, 2.5)); plt.plot([r['step'] for r in recs], [r['train_loss'] for r in recs]); plt.xlabel('step')


TOY = Study('toy', 'Does a second layer help on a tiny story corpus?', NoSettings, variants, run=train_run,
            train={'tiny': dict(max_steps=12, batch_size=4, lr=5e-3, min_lr=5e-4, warmup_steps=2, eval_every=6,
                                eval_batches=2, log_every=3)},
            data={'tiny': dict(vocab_size=300, n_train_stories=150, n_val_stories=20)},
            options=ToyOptions, default_seeds=(0, 1), notebook=str(HERE / 'experiment.ipynb'),
            report=str(HERE / 'report.ipynb'), answers=answers, plot=plot,
            main=('best_val_ppl', 'depth-2', 'depth-1'))
