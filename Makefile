# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch (a bare `torch` requirement would pull a multi-GB CUDA build).
TORCH_PIN ?= torch==2.13.0

.PHONY: demo test soak lint bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_PIN)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/stepscope demo --out runs/demo

test: $(VENV)/.installed
	$(VENV)/bin/ruff check src tests benchmarks
	$(PY) -m pytest -q -m "not soak"

# Repeated clean and faulty runs (false-alarm rates); minutes, not part of `make test`.
soak: $(VENV)/.installed
	$(PY) -m pytest -q -m soak

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/mypy

bench: $(VENV)/.installed
	$(PY) benchmarks/overhead.py

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache .mypy_cache
