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
	$(MAKE) docs
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

# The docs site (mkdocs-material): warnings are errors. The CLI reference page is generated
# from the argument parser at build time, the benchmarks page from benchmarks/results/.
.PHONY: docs wheel-check
docs: $(VENV)/.installed
	$(PY) benchmarks/render_results.py --check
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

# Build the wheel, install it with a CPU torch into a fresh venv, and check that its demo
# names the slow rank. Downloads the dependencies: not part of `make test`.
WHEEL_CHECK ?= build/wheel-check
wheel-check:
	rm -rf dist $(WHEEL_CHECK)
	$(PYTHON) -m pip wheel . --no-deps -w dist
	$(PYTHON) -m venv $(WHEEL_CHECK)/venv
	$(WHEEL_CHECK)/venv/bin/pip install -q "$(TORCH_PIN)"
	$(WHEEL_CHECK)/venv/bin/pip install -q dist/stepscope-*.whl
	cd $(WHEEL_CHECK) && venv/bin/stepscope demo --out demo --no-fixed > demo.txt
	cat $(WHEEL_CHECK)/demo.txt
	grep -Eq "straggler.*(rank 1|r1)" $(WHEEL_CHECK)/demo.txt
