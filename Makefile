# Two commands on a fresh machine: `make run` and `make test`. Everything else is optional.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.oelm-installed
TORCH_PIN ?= torch==2.13.0
PIP := $(BIN)/python -m pip --disable-pip-version-check -q
# pip warns about every missing local mirror folder; keep the real errors visible
PIPFILTER := 2>&1 | grep -v "is ignored: it is neither a file nor a directory" || true
RUN_OUT ?= runs/qk-freeze

.PHONY: all setup run test test-fast sync-check readme-check layers nbtest nbdev-test pytest docs readme lab loggers clean

all: test

# torch first (the pinned CPU/CUDA wheel), then the package with its dev extras, so the
# package's torch range is already satisfied and pip never pulls another torch build.
$(STAMP): settings.ini setup.py
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@echo "[setup] installing $(TORCH_PIN) into $(VENV)"
	@set -o pipefail; $(PIP) install "$(TORCH_PIN)" $(PIPFILTER)
	@echo "[setup] installing oelm_nb[dev,hf] (editable)"
	@set -o pipefail; $(PIP) install -e ".[dev,hf]" $(PIPFILTER)
	@$(BIN)/python -c "import torch, oelm_nb, nbdev, papermill; print('[setup] ok: torch', torch.__version__, '| oelm_nb', oelm_nb.__version__)"
	@$(BIN)/python -m ipykernel install --sys-prefix --name python3 --display-name "Python 3 (oelm_nb)" >/dev/null
	@touch $(STAMP)

setup: $(STAMP)

# TensorBoard and Weights & Biases for `oelm run --loggers tensorboard,wandb` (metrics.jsonl needs neither).
loggers: $(STAMP)
	@set -o pipefail; $(PIP) install -e ".[log]" $(PIPFILTER)

# The main job: the Q/K freeze study on the embedded corpus, ending in a report. Four seeds per variant (a paired
# interval with 3 degrees of freedom); a 512-token vocabulary halves the step (the LM head is half of it at 2,048) and
# buys the steps in which the recall circuit forms, all within ten minutes on 2 cores with set-up.
RUN_FLAGS ?= --preset tiny --variants gpt,oelm,oelm-freeze --seeds 0 1 2 3 --steps 1800 --set data.vocab_size=512 --jobs 2
run: $(STAMP)
	$(BIN)/oelm run qk-freeze $(RUN_FLAGS) --out $(RUN_OUT)

# Notebooks clean and exported in sync, the layer contract, then the notebooks' own checks, then pytest.
test: $(STAMP) sync-check readme-check layers nbtest pytest
	@echo "[test] all checks passed"

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
# (measured: pytest 471 s -> 448 s on 2 cores).
pytest: $(STAMP)
	@echo "[test] pytest"
	@$(BIN)/python -m pytest -n 2 --dist worksteal -q --durations=15 tests

# The developer's inner loop (under 2 minutes): the notebook checks and the unit-level tests; tests marked `slow`
# (batches, papermill, processes end to end) are left to `make test`.
test-fast: $(STAMP) layers nbtest
	@echo "[test-fast] pytest, tests marked slow left out"
	@$(BIN)/python -m pytest -n 2 --dist worksteal -q -m "not slow" --durations=5 tests
	@echo "[test-fast] all checks passed (make test runs everything)"

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

lab: $(STAMP)
	$(BIN)/jupyter trust nbs/*.ipynb nbs/experiments/*.ipynb nbs/reports/*.ipynb >/dev/null 2>&1 || true
	$(BIN)/jupyter lab --notebook-dir=nbs --config=tools/jupyter_server_config.py $$([ "$$(id -u)" = 0 ] && echo --allow-root)

clean:
	rm -rf _docs _proc _mkdocs build dist *.egg-info .pytest_cache
