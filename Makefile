# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch (a bare `torch` requirement would pull a multi-GB CUDA build).
TORCH_PIN ?= torch==2.13.0

.PHONY: demo test soak lint bench clean

# pip byte-compiles each package's files one at a time; --no-compile leaves that to one
# `compileall -j 0` over the whole venv, on every core. Where PYTHONDONTWRITEBYTECODE is set,
# nothing else would ever write that bytecode, and every process the suite starts would compile
# torch and the frameworks from source again (an import of torch and lightning: 21 s -> 9 s).
# transformers' model packages other than the few the tests build are left out (45 MB of source).
PIP_INSTALL := $(PY) -m pip install -q --no-compile
COMPILE_SKIP := transformers/models/(?!(auto|bert|gpt2)/)

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP_INSTALL) --upgrade pip
	$(PIP_INSTALL) "$(TORCH_PIN)"
	$(PIP_INSTALL) -e ".[dev]"
	@# A few files in third-party packages do not compile (templates, other Pythons): not an error.
	$(PY) -m compileall -q -j 0 -x '$(COMPILE_SKIP)' \
	  "$$($(PY) -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" >/dev/null || true
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/stepscope demo --out runs/demo

# pytest-xdist workers: one per CPU this shell may run on, at most 4 (tests/conftest.py keeps
# the tests that start process worlds on one worker at a time, the in-process ones beside them).
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 2); echo $$(( n < 4 ? n : 4 )))

# The suite builds the docs site itself (mkdocs --strict, tests/unit/test_docs_site.py) and
# checks that docs/benchmarks.md is rendered from the records (test_benchmark_results.py).
# PYTHONDONTWRITEBYTECODE is cleared for the suite: it starts hundreds of Python processes, and
# they share the bytecode of src/ and of the tests' rewritten asserts (in __pycache__/, ignored).
test: $(VENV)/.installed
	$(VENV)/bin/ruff check src tests benchmarks
	PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -q -m "not soak" -n $(TEST_WORKERS) --dist loadgroup

# The GPU check (benchmarks/gpu_check.py, docs/gpu-check.md). `make gpu-check-prepare` where a
# package index is reachable fetches stepscope's runtime dependencies (all but torch) as wheels
# for CPython 3.10-3.12 on manylinux x86_64; `make gpu-check` on the GPU machine installs the
# ones its Python lacks from them offline and runs the check with that machine's CUDA torch,
# stepscope from src/. `make gpu-check DRY=1` runs every check's code on CPU and measures nothing.
GPU_PYTHON ?= $(if $(DRY),$(if $(wildcard $(PY)),$(PY),$(PYTHON)),$(PYTHON))
PREP_PYTHON ?= $(if $(wildcard $(PY)),$(PY),$(PYTHON))
GPU_WHEELS ?= .gpu-wheels
GPU_SITE ?= .gpu-site
GPU_PY_VERSIONS ?= 3.10 3.11 3.12
GPU_CHECK_ARGS ?=
GPU_PATH = $(CURDIR)/$(GPU_SITE):$(CURDIR)/src

.PHONY: gpu-check gpu-check-prepare

gpu-check-prepare:
	@deps="$$($(PREP_PYTHON) benchmarks/gpu_check.py --list-deps)" || exit 2; \
	for v in $(GPU_PY_VERSIONS); do \
	  $(PREP_PYTHON) -m pip download -q --only-binary=:all: --platform manylinux2014_x86_64 \
	    --platform manylinux_2_28_x86_64 --python-version $$v -d $(GPU_WHEELS) $$deps || exit 2; \
	done; \
	echo "gpu-check-prepare: $$(ls $(GPU_WHEELS) | wc -l) wheels in $(GPU_WHEELS)/ for Python $(GPU_PY_VERSIONS)"

gpu-check:
	@missing="$$(PYTHONPATH=$(GPU_PATH) $(GPU_PYTHON) benchmarks/gpu_check.py --missing-deps)" || exit 2; \
	if [ -n "$$missing" ]; then \
	  if [ ! -d $(GPU_WHEELS) ]; then \
	    echo "gpu-check: $(GPU_PYTHON) lacks $$missing and there is no $(GPU_WHEELS)/: run make gpu-check-prepare first" >&2; \
	    exit 2; \
	  fi; \
	  PIP_ROOT_USER_ACTION=ignore $(GPU_PYTHON) -m pip install -q --no-index --find-links $(GPU_WHEELS) --target $(GPU_SITE) --upgrade \
	    --no-deps $$missing || exit 2; \
	fi; \
	PYTHONPATH=$(GPU_PATH) timeout -k 10 480 $(GPU_PYTHON) benchmarks/gpu_check.py $(if $(DRY),--dry-run) $(GPU_CHECK_ARGS)

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
