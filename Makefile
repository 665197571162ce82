# Quick start: `make demo` and `make test` do all set-up on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
BIN = $(VENV)/bin
STAMP = $(VENV)/.installed
# The test environment without the Model Garden (the `test` extra): where most
# tests run, as Keras imports scikit-learn, matplotlib and SciPy in every process
# where they are installed (tf-models-official brings them), a third of each
# process's start.
CORE_VENV ?= .venv-core
CORE_BIN = $(CORE_VENV)/bin
CORE_STAMP = $(CORE_VENV)/.installed

.PHONY: install venvs browser demo lint test test-fast bench clean

LINT_PATHS = tfdist conftest.py tests tools keras_examples

$(STAMP): setup.cfg pyproject.toml
	@echo "Installing tfdist and its dependencies (TensorFlow, Keras) into $(VENV): a few minutes the first time..."
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

$(CORE_STAMP): setup.cfg pyproject.toml
	test -x $(CORE_BIN)/python || $(PYTHON) -m venv $(CORE_VENV)
	$(CORE_BIN)/python -m pip install --quiet --upgrade pip
	$(CORE_BIN)/python -m pip install --quiet -e '.[test]'
	touch $(CORE_STAMP)

install: $(STAMP)

# Both environments; `make -j2 venvs` installs them side by side (.ci/run).
venvs: $(STAMP) $(CORE_STAMP)

# Debian's Chromium, for the test that searches a trace in TensorBoard's
# trace viewer (Playwright drives it). Where it cannot be installed (no
# apt-get, not root), that test is skipped and says why.
browser:
	@test -x /usr/bin/chromium || { command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ] && \
		{ apt-get install -y -qq --no-install-recommends chromium >/dev/null 2>&1 || \
		  { apt-get update -qq >/dev/null 2>&1 && \
		    apt-get install -y -qq --no-install-recommends chromium >/dev/null 2>&1; }; }; } || \
		echo "Chromium not installed: the trace viewer's browser test will be skipped."

demo: $(STAMP)
	@echo "tfdist demo: data-parallel training of a digits classifier on 4 virtual CPU devices"
	$(BIN)/python keras_examples/data_parallel.py --devices=4

# ruff; no Keras / TensorFlow internals outside tfdist/_compat/; imports only
# downward through the layers of tools/check_layers.py, no cycle; no module
# branching on the modes beyond its allowance (tools/check_mode_branches.py).
lint: $(STAMP)
	$(BIN)/ruff check $(LINT_PATHS)
	$(BIN)/python tools/check_internals.py
	$(BIN)/python tools/check_layers.py
	$(BIN)/python tools/check_mode_branches.py

# Every tier, then the tfdist/ docstring examples. The tests marked `alone`
# (tests/cluster: bounds on wall time, processes killed at set moments) run
# first, one at a time, with the machine to themselves; then every other test
# in three processes on the two cores (a cluster test waits on its
# subprocesses part of the time: in two, the cores were 16% idle), in two
# rounds of fresh processes: the cluster tier with the parity files a-s (the
# cluster tests first: their waits then overlap the others' training, not end
# the round with an idle machine), then the parity files t-z with the unit
# tier (single tests have taken 10-30x their fresh-process time late in a
# worker that ran the whole suite). Each process takes its share of its
# round's tests in file order and then takes over the others' last ones
# (`worksteal`), so a file's tests mostly share one process
# and its single-device references; the rounds share the references kept on
# disk (tests/helpers.py), emptied once here. These run in .venv-core, without
# the Model Garden (conftest.py leaves out what needs it); then the tests marked
# `model_garden` in .venv, which has it. Every command runs; the target fails
# if any did.
test: $(STAMP) $(CORE_STAMP) browser
	rm -rf .pytest_cache/tfdist-references; \
	export TFDIST_TEST_KEEP_REFERENCES=1; \
	status=0; \
	$(CORE_BIN)/python -m pytest -m alone tests/cluster || status=1; \
	$(CORE_BIN)/python -m pytest -n 3 --dist worksteal -m "not alone" \
		tests/cluster tests/parity/test_[a-s]*.py || status=1; \
	$(CORE_BIN)/python -m pytest -n 3 --dist worksteal \
		tests/parity/test_[t-z]*.py tests/unit || status=1; \
	$(BIN)/python -m pytest -n 2 --dist worksteal -m model_garden \
		tests/parity tests/cluster || status=1; \
	$(BIN)/python -m pytest tfdist || status=1; \
	exit $$status

# The unit tier (3 processes) and the docstring examples: no training, about two minutes.
test-fast: $(STAMP)
	$(BIN)/python -m pytest -n 3 --dist worksteal tests/unit
	$(BIN)/python -m pytest tfdist

bench: $(STAMP)
	$(BIN)/python tools/bench_data_parallel.py
	$(BIN)/python tools/bench_profiling.py
	$(BIN)/python tools/bench_ps.py
	$(BIN)/python tools/bench_zero.py
	$(BIN)/python tools/bench_tensor.py
	$(BIN)/python tools/bench_attention_split.py
	$(BIN)/python tools/bench_pipeline.py
	$(BIN)/python tools/bench_soak.py

clean:
	rm -rf $(VENV) $(CORE_VENV) build *.egg-info .pytest_cache
