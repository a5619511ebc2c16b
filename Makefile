# The two commands of the README, each doing all its set-up on a fresh machine:
#   make demo   builds jax_kv into .venv and generates with the default model (SmolLM2-135M)
#   make serve  the same, then serves it at http://127.0.0.1:8000/v1 (OpenAI's API)
#   make test   builds jax_kv into .venv, checks formatting and lint, installs the wheel into a
#               clean venv and generates from outside the source tree (make wheel-smoke),
#               then runs the test suite
# GPU build: JAX_KV_CUDA=ON make install (needs nvcc; see README "Running on a GPU").

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
SOURCES := $(shell git ls-files 'ffi/*' 'cuda/*' 'cmake/*' CMakeLists.txt pyproject.toml 2>/dev/null)
PY_FILES := jax_kv tests bench
CXX_FILES := $(shell git ls-files '*.cc' '*.h' '*.cu' '*.cuh' 2>/dev/null)

.PHONY: install install-test demo serve test lint wheel-smoke format clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# Build requirements go into the venv first so the editable build can skip isolation
# (no second download of jaxlib into a throwaway build environment).
$(VENV)/.installed: $(BIN)/python $(SOURCES)
	$(BIN)/pip install -q "scikit-build-core>=0.10" "nanobind>=2.4" "jax>=0.8" "jaxlib>=0.8"
	$(BIN)/pip install -q --no-build-isolation -C build-dir=build/venv -e .
	touch $@

# The test extra: transformers and the CPU build of torch, the references the tests compare to.
$(VENV)/.installed-test: $(VENV)/.installed
	$(BIN)/pip install -q --no-build-isolation -C build-dir=build/venv -e ".[test,dev]"
	touch $@

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

demo: install
	$(BIN)/python -m jax_kv generate --max-new-tokens 32

# The OpenAI-compatible server on the default model (the serve extra: Starlette, uvicorn).
serve: install
	$(BIN)/pip install -q --no-build-isolation -C build-dir=build/venv -e ".[serve]"
	$(BIN)/python -m jax_kv serve

lint: install-test
	$(BIN)/ruff check $(PY_FILES)
	$(BIN)/ruff format --check $(PY_FILES)
	$(BIN)/clang-format --dry-run -Werror $(CXX_FILES)

# The tests run from the editable install, inside the source tree, where the repo root (and
# its cuda/ folder) is importable; this checks what users get: the wheel in a clean venv,
# without the cuda extra, run from a scratch directory (about a minute; see the script).
wheel-smoke: install
	scripts/wheel_smoke.sh

# wheel-smoke through a sub-make, not as a prerequisite: under make -j it would build the wheel
# in build/venv while lint's editable install builds there too. Before pytest: it fails fast.
test: lint
	$(MAKE) --no-print-directory wheel-smoke
	$(BIN)/python -m pytest -q
	# The in-process tensor-parallel tests need 4 devices, a flag JAX reads once at start: their
	# own run (the multi-process and serve tests set it in their children, in the run above).
	XLA_FLAGS=--xla_force_host_platform_device_count=4 $(BIN)/python -m pytest -q \
		tests/parallel/test_tensor_parallel.py

format: install-test
	$(BIN)/ruff format $(PY_FILES)
	$(BIN)/ruff check --fix $(PY_FILES)
	$(BIN)/clang-format -i $(CXX_FILES)

clean:
	rm -rf $(VENV) .venv-wheel build
