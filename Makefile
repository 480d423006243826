# Two commands on a fresh machine: `make run` and `make test`. Everything else is optional.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.oelm-installed
RUN_STAMP := $(VENV)/.oelm-run-installed
# torch's build is chosen here, on purpose: TORCH_PIN the release, TORCH_INDEX the wheel index it comes from. Left empty,
# pip's own: PyPI's torch on Linux is a CUDA build with several GB of NVIDIA libraries (a CPU wheel at hand wins, as
# on this project's CI). A CPU-only machine: TORCH_INDEX=https://download.pytorch.org/whl/cpu (the CPU build, a few
# hundred MB); a GPU machine: https://download.pytorch.org/whl/cu130 (or cu126, cu128: at most the CUDA version that
# nvidia-smi shows). To change the build of an existing .venv: rm -rf .venv, then make setup TORCH_INDEX=...
TORCH_PIN ?= torch==2.13.0
TORCH_INDEX ?=
PIP := $(BIN)/python -m pip --disable-pip-version-check -q
# no byte-compiling of every installed file (torch, jupyterlab: tens of thousands): Python compiles what it imports, once,
# on first use (measured on 2 cores: set-up 96-118 s -> 54 s)
NOCOMPILE := --no-compile
# ...but then Python must be allowed to keep what it compiles: where the environment sets PYTHONDONTWRITEBYTECODE (this
# project's CI image does), every process compiled torch again (import torch 7.4 s instead of 3.0 s on 2 cores; make test
# starts a few hundred processes). Processes started from here write their bytecode, and set-up writes that of what a
# run, the notebooks and the tests import (tools/compile_imports.py, about 30 s).
unexport PYTHONDONTWRITEBYTECODE
# pip warns about every missing local mirror folder; keep the real errors visible
PIPFILTER := 2>&1 | grep -v "is ignored: it is neither a file nor a directory" || true
RUN_OUT ?= runs/qk-freeze
# when this make started: `make test` prints its total
MAKE_T0 := $(shell date +%s)

.PHONY: all setup run test test-pythons test-fast sync-check readme-check layers nbtest nbdev-test pytest docs readme lab loggers clean

all: test

# torch first (the pinned CPU/CUDA wheel), then the package, so the package's torch range is already satisfied and pip never
# pulls another torch build. Two steps: what a run needs ($(RUN_STAMP): `make run`), then the extras for tests, docs and
# Hugging Face ($(STAMP): `make setup`, `make test`), so `make run` on a fresh machine skips about 23 s of installs.
$(RUN_STAMP): settings.ini setup.py
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@echo "[setup] installing $(TORCH_PIN) into $(VENV) from $(or $(TORCH_INDEX),pip's index (a CUDA build on Linux unless a CPU wheel is at hand; TORCH_INDEX chooses))"
	@set -o pipefail; $(PIP) install $(NOCOMPILE) "$(TORCH_PIN)" $(if $(TORCH_INDEX),--index-url "$(TORCH_INDEX)") $(PIPFILTER)
	@echo "[setup] installing oelm_nb (editable)"
	@set -o pipefail; $(PIP) install $(NOCOMPILE) -e . $(PIPFILTER)
	@$(BIN)/python -c "import torch, oelm_nb, papermill; print('[setup] ok: torch', torch.__version__, \
		'(cuda ' + torch.version.cuda + ' build)' if torch.version.cuda else '(cpu build)', '| oelm_nb', oelm_nb.__version__)"
	@$(BIN)/python -c "import shutil, torch; torch.version.cuda and not shutil.which('nvidia-smi') and print('[setup] warning:', \
		'a CUDA build of torch on a machine without an NVIDIA driver (nvidia-smi): GBs that never run; for the CPU build:', \
		'rm -rf .venv && make setup TORCH_INDEX=https://download.pytorch.org/whl/cpu (details: .venv/bin/oelm doctor --check torch)')"
	@$(BIN)/python -m ipykernel install --sys-prefix --name python3 --display-name "Python 3 (oelm_nb)" >/dev/null
	@$(BIN)/python tools/compile_imports.py run
	@touch $(RUN_STAMP)

$(STAMP): $(RUN_STAMP)
	@echo "[setup] installing the extras for tests, docs and Hugging Face (oelm_nb[dev,hf])"
	@set -o pipefail; $(PIP) install $(NOCOMPILE) -e ".[dev,hf]" $(PIPFILTER)
	@$(BIN)/python -c "import nbdev, pytest, importlinter"
	@$(BIN)/python tools/compile_imports.py dev
	@$(BIN)/python tests/browser_check.py --hint
	@touch $(STAMP)

setup: $(STAMP)

# TensorBoard and Weights & Biases for `oelm run --loggers tensorboard,wandb` (metrics.jsonl needs neither).
loggers: $(STAMP)
	@set -o pipefail; $(PIP) install $(NOCOMPILE) -e ".[log]" $(PIPFILTER)

# The main job: the Q/K freeze study on the embedded corpus, ending in a report. Four seeds per variant (a paired
# interval with 3 degrees of freedom), seeds 8-11: the formation sweep (nbs/reports/qk_task_sweep.ipynb) chose the task
# (64 distinct names, a 512-token vocabulary) on seeds 0-7. The study's `tiny` preset is a ladder of budgets, 250, 375
# and 500 steps, from one warmup-stable-decay run per seed (a cooldown branch at each shorter budget), so the report
# says whether the frozen variant's gap closes with tokens; within ten minutes on 2 cores with set-up.
RUN_FLAGS ?= --preset tiny --variants gpt,oelm,oelm-freeze --seeds 8 9 10 11 --jobs 2
run: $(RUN_STAMP)
	$(BIN)/oelm run qk-freeze $(RUN_FLAGS) --out $(RUN_OUT)

# Notebooks clean and exported in sync, the layer contract, then the notebooks' own checks, then pytest.
# readme-check after nbtest: the index notebook the README comes from is then run among the notebook checks, 2 at a time,
# and the README reads it from their cache (before them it ran alone, one core idle: ~15 s on 2 cores)
test: $(STAMP) sync-check layers nbtest readme-check pytest
	@echo "[test] all checks passed in $$(( $$(date +%s) - $(MAKE_T0) )) s (set-up included when this make ran it)"

sync-check: $(STAMP)
	@PATH="$(abspath $(BIN)):$$PATH" bash tools/check_sync.sh

# The layer contract (.importlinter): each module imports only the layers below it, the studies know no other study.
layers: $(STAMP)
	@echo "[test] layers: lint-imports (.importlinter)"
	@$(BIN)/lint-imports --no-cache --no-logo

# Every notebook nbdev_test tests, run by nbdev's own nbdev.test.test_nb (its rules: cells flagged slow/cuda or `eval: false`
# skipped), each in a fresh process, 2 at a time, then processed for the docs into the docs build's cache (_mkdocs/proc):
# the docs test in pytest and `make docs` render these notebooks instead of running them again.
nbtest: $(STAMP)
	@echo "[test] notebook checks: nbdev's test_nb on every library notebook (cells flagged slow/cuda are skipped)"
	@PATH="$(abspath $(BIN)):$$PATH" $(BIN)/python tools/build_docs.py --check-only --jobs 2

# nbdev's own runner, as is (nbs/experiments and nbs/reports hold a .notest file: papermill notebooks, not tests);
# the cores shared between the 2 workers (BLAS threads), as `make nbtest` does: oversubscribed cores make torch ~10x slower
nbdev-test: $(STAMP)
	@cd nbs && PATH="$(abspath $(BIN)):$$PATH" OMP_NUM_THREADS=$$(( ($$(getconf _NPROCESSORS_ONLN) + 1) / 2 )) \
		../$(BIN)/nbdev_test --n_workers 2 --timing

# worksteal: an idle worker takes queued tests from the busy one, so a long test near the end does not leave a core idle
# (measured: pytest 471 s -> 448 s on 2 cores). Three workers on 2 cores: a worker waiting for a process it started (a
# batch, a kill, a server) or for a shared batch another worker trains leaves its core to the third (every process a
# test starts trains on one thread: conftest.py), measured on 2 cores: 385 s with 2 workers, 331 s with 3.
PYTEST_WORKERS ?= 3
pytest: $(STAMP)
	@echo "[test] pytest"
	@$(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist worksteal -q --durations=15 tests

# For maintainers: `make setup` and `make test` on every Python the package promises (settings.ini min_python to 3.13)
# that is found under pyenv or on PATH, each in a fresh clone of HEAD (committed work only) with its own .venv under
# PYTHONS_DIR, one after the other; a table of the results and times at the end, exit 1 if one failed. CI runs
# `make test` once. PYTHONS=3.12 picks versions; TORCH_PIN/TORCH_INDEX pass on to each set-up.
PYTHONS ?=
PYTHONS_DIR ?= /tmp/oelm-pythons
test-pythons:
	@PYTHONS="$(PYTHONS)" PYTHONS_DIR="$(PYTHONS_DIR)" TORCH_PIN="$(TORCH_PIN)" TORCH_INDEX="$(TORCH_INDEX)" bash tools/test_pythons.sh

# The developer's inner loop (under 2 minutes): the layer contract, the checks of the notebooks changed since the last
# commit (git status; all of them: `make nbtest`), and the tests not marked `slow` (batches, papermill, processes end to
# end are left to `make test`).
test-fast: $(STAMP) layers
	@echo "[test-fast] notebook checks of the notebooks changed since the last commit"
	@PATH="$(abspath $(BIN)):$$PATH" $(BIN)/python tools/build_docs.py --check-only --changed --jobs 2
	@echo "[test-fast] pytest, tests marked slow left out"
	@$(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist worksteal -q -m "not slow" --durations=5 tests
	@echo "[test-fast] all checks passed in $$(( $$(date +%s) - $(MAKE_T0) )) s (make test runs everything)"

# README.md is generated from nbs/index.ipynb (executed, as nbdev_readme would render it with Quarto).
readme-check: $(STAMP)
	@PATH="$(abspath $(BIN)):$$PATH" $(BIN)/python tools/build_readme.py --check

readme: $(STAMP)
	@PATH="$(abspath $(BIN)):$$PATH" $(BIN)/python tools/build_readme.py

# The docs site, without Quarto: the notebooks run and processed by nbdev (cached by `make nbtest`), the report pages on
# example batches, then mkdocs-material + mkdocs-jupyter (mkdocs.yml) -> _docs/ (tools/build_docs.py --help for options;
# nbdev_docs still works where Quarto is installed).
docs: $(STAMP)
	@PATH="$(abspath $(BIN)):$$PATH" $(BIN)/python tools/build_docs.py

# JupyterLab at the project root: nbs/ (start at nbs/index.ipynb; the run explorer is nbs/report/34_explorer.ipynb) and the
# batches under runs/ side by side. Every notebook the project ships is trusted first (all folders of nbs/), so their
# outputs show as saved. LAB_ARGS passes on to `jupyter lab`, e.g. make lab LAB_ARGS="--port=8890 --ip=0.0.0.0 --no-browser"
LAB_ARGS ?=
lab: $(STAMP)
	@find nbs -name '*.ipynb' -not -path '*/.ipynb_checkpoints/*' -print0 | xargs -0 $(BIN)/jupyter trust >/dev/null 2>&1 || true
	$(BIN)/jupyter lab --notebook-dir=. --config=tools/jupyter_server_config.py $$([ "$$(id -u)" = 0 ] && echo --allow-root) $(LAB_ARGS)

clean:
	rm -rf _docs _proc _mkdocs build dist *.egg-info .pytest_cache
