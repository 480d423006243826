"""Shared pytest setup for the oelm_nb test suites.

The suites test the installed package from outside (``import oelm_nb``), never
the notebooks' own cells. Everything here is generic: a hypothesis profile,
markers, CPU thread limits and a few small fixtures any suite may use.
"""
from __future__ import annotations
import os

import pytest
import torch
from hypothesis import HealthCheck, settings


# ---------------------------------------------------------------- hypothesis
# torch's first call in a process is slow (lazy init), so no per-example deadline;
# few examples keep the suites fast on a 2-core CI runner. HYPOTHESIS_PROFILE=thorough
# runs more examples locally.
settings.register_profile('ci', deadline=None, max_examples=20, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile('thorough', deadline=None, max_examples=200,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get('HYPOTHESIS_PROFILE', 'ci'))

# ---------------------------------------------------------------- torch on CPU
# One intra-op thread per test process (override with OELM_TEST_THREADS): the suites use
# small models, and under pytest-xdist (`pytest -n 2`) or on a busy 2-core runner extra
# OpenMP threads spin against each other (measured here: the same suite took 7 s with one
# thread and over 100 s with two threads on a loaded 2-core machine).
torch.set_num_threads(int(os.environ.get('OELM_TEST_THREADS', '1')))
# The same for the processes the tests start (oelm commands, cluster jobs, example batches), unless the runner or a test sets
# their threads itself: two xdist workers each waiting on a child that takes both cores oversubscribe a 2-core machine.
for _v in ('OMP_NUM_THREADS', 'MKL_NUM_THREADS'): os.environ.setdefault(_v, os.environ.get('OELM_TEST_THREADS', '1'))

# What `oelm` does in its own process: nbformat's schema validation leaves out a module that takes about 3 s to import
# and that it does not use (execute.SKIPPED_IMPORTS); each xdist worker and every child forked from it renders reports.
from oelm_nb.lab.execute import skip_slow_imports  # noqa: E402
skip_slow_imports()


# ---------------------------------------------------------------- the toy study
# tests/ holds a study registered as a lab would register one (tests/toy_study, tests/toy_study-0.1.dist-info): pytest
# puts tests/ on sys.path, and the processes the tests start (oelm, papermill kernels) get it on PYTHONPATH, so the toy is
# a registered study everywhere in a test session and the "every study" tests cover it without naming it.
_TESTS = os.path.dirname(os.path.abspath(__file__))
os.environ['PYTHONPATH'] = os.pathsep.join(p for p in (_TESTS, os.environ.get('PYTHONPATH')) if p)


def pytest_configure(config):
    config.addinivalue_line('markers', 'slow: takes more than a few seconds (deselect with -m "not slow")')
    config.addinivalue_line('markers', 'cuda: needs a CUDA GPU (skipped where none is present)')


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available(): return
    skip = pytest.mark.skip(reason='needs a CUDA GPU')
    for item in items:
        if 'cuda' in item.keywords: item.add_marker(skip)


# ---------------------------------------------------------------- fixtures
@pytest.fixture(autouse=True, scope='session')
def _reports_in_process():
    """Reports rendered in a test process (`oelm_main('report', ...)`, `render_report`, in-process batches) execute their
    notebook in a fork of that process instead of a papermill kernel (`shared_runs.execute_report_inline`): same notebook,
    same page, seconds less each. `oelm` started as a process renders through papermill, as a user's does."""
    from oelm_nb.lab import render
    from shared_runs import execute_report_inline
    with pytest.MonkeyPatch.context() as mp:  # session-wide: the batches of module and session fixtures too
        mp.setattr(render, 'execute_report', execute_report_inline)
        yield


@pytest.fixture(autouse=True)
def _seed_torch():
    "Every test starts from the same global RNG state (tests that need other seeds set them)."
    torch.manual_seed(0)
    yield


@pytest.fixture
def random_tokens():
    "A function (vocab_size, batch, seq_len, seed) -> int64 token tensor, deterministic by seed."
    def make(vocab_size: int, batch: int, seq_len: int, seed: int = 0) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        return torch.randint(0, vocab_size, (batch, seq_len), generator=g)
    return make
