# relaxkv-sglang: one-command install, test, demo and benchmarks.
# `make install` is idempotent: a stamp records the hash of everything it
# installed from; a second run with nothing changed does nothing and says so.

PYTHON      ?= python3.11
VENV        := .venv
PY          := $(VENV)/bin/python
PIP         := $(PY) -m pip --disable-pip-version-check
STAMP       := $(VENV)/.relaxkv-installed
REQS        := requirements/cpu-torch.txt requirements/cpu-nodeps.txt requirements/cpu-runtime.txt requirements/dev.txt requirements/bench.txt requirements/gpu.txt pyproject.toml setup.py
HAVE_CUDA   := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1 || echo 0)
INPUT_HASH  := $(shell cat $(REQS) | sha256sum | cut -c1-16)-cuda$(HAVE_CUDA)
PYTEST_ARGS ?=

.PHONY: install test test-long test-all test-unit demo bench bench-quick gpu-bundle install-mooncake clean-venv

install:
	@if [ -f $(STAMP) ] && [ "$$(cat $(STAMP))" = "$(INPUT_HASH)" ] && $(PY) -c "import relaxkv_sglang, relaxkv_patches" 2>/dev/null; then \
		echo "make install: $(VENV) is up to date ($(INPUT_HASH)); nothing to do"; \
	else \
		$(MAKE) --no-print-directory _install; \
	fi

_install:
	@echo "make install: building $(VENV) (cuda=$(HAVE_CUDA))"
	@test -x $(PY) || $(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)
	@if [ "$(HAVE_CUDA)" = "1" ]; then \
		$(PIP) install -q -r requirements/gpu.txt; \
	else \
		$(PIP) install -q -r requirements/cpu-torch.txt && \
		$(PIP) install -q --no-deps -r requirements/cpu-nodeps.txt && \
		$(PIP) install -q --no-deps -r requirements/cpu-runtime.txt; \
	fi
	@$(PIP) install -q --no-deps -r requirements/dev.txt -r requirements/bench.txt
	@$(PIP) install -q --no-deps --no-build-isolation -e .
	@$(PY) -m relaxkv_patches.install_pth
	@$(PY) -c "import torch, sglang, relaxkv_sglang; print('make install: torch', torch.__version__, '| sglang', sglang.__version__)"
	@echo "$(INPUT_HASH)" > $(STAMP)
	@echo "make install: done"

# `make test` leaves out the tests marked `long` (each over ~30 s); `make test-long` runs only
# those; `make test-all` (what CI runs, .ci/run) runs both, one after the other.
test: install
	$(PY) -m pytest -q -m "not long" $(PYTEST_ARGS)

test-long: install
	$(PY) -m pytest -q -m long $(PYTEST_ARGS)

test-all: test test-long

test-unit: install
	$(PY) -m pytest -q tests/unit $(PYTEST_ARGS)

demo: install
	$(PY) -m benchmarks.demo

bench: install
	$(PY) -m benchmarks.run_all

bench-quick: install
	$(PY) -m benchmarks.run_all --quick

# What scripts/gpu_check.sh carries to a GPU machine (docs/gpu.md).
gpu-bundle: install
	$(PY) -m relaxkv_sglang.gpu_check.bundle

# Mooncake's store for the HiCache chunk tier (docs/scaling.md); apt needs root.
install-mooncake: install
	apt-get install -y -q libibverbs1 libnuma1 || (apt-get update -q && apt-get install -y -q libibverbs1 libnuma1)
	$(PIP) install -q --no-deps -r requirements/mooncake.txt
	$(PY) -c "from mooncake.store import MooncakeDistributedStore; from relaxkv_sglang.mooncake_service import mooncake_binary; print('make install-mooncake:', mooncake_binary('mooncake_master'))"

clean-venv:
	rm -rf $(VENV)
