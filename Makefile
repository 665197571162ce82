# Quick start: `make demo` and `make test` do all set-up on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
BIN = $(VENV)/bin
STAMP = $(VENV)/.installed

.PHONY: install demo test bench clean

$(STAMP): setup.cfg pyproject.toml
	@echo "Installing tfdist and its dependencies (TensorFlow, Keras) into $(VENV): a few minutes the first time..."
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	@echo "tfdist demo: data-parallel training of a digits classifier on 4 virtual CPU devices"
	$(BIN)/python keras_examples/data_parallel.py --devices=4

test: $(STAMP)
	$(BIN)/python -m pytest

bench: $(STAMP)
	$(BIN)/python tools/bench_data_parallel.py
	$(BIN)/python tools/bench_profiling.py
	$(BIN)/python tools/bench_ps.py
	$(BIN)/python tools/bench_zero.py
	$(BIN)/python tools/bench_tensor.py
	$(BIN)/python tools/bench_pipeline.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
