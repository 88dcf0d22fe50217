# Every target sets up its own virtual environment, so a fresh clone needs only
# `make demo` or `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast bench clean install

# The tools whose own loaders test hetplan's exports (pyproject's `tools`
# extra, which a test keeps equal to this list), without the GPU-side packages
# they declare: --no-deps. DeepSpeed is a source package: built against the
# torch above (--no-build-isolation), no compiled ops (DS_BUILD_OPS=0).
TOOLS := torchtitan==0.3.0 tyro==1.0.17 docstring-parser==0.18.0 typeguard==4.6.1 spmd-types==0.2.3 \
	megatron-core==0.16.1 \
	deepspeed==0.19.8 hjson==3.1.0 py-cpuinfo==9.0.0 msgpack==1.2.4 einops==0.8.2 ninja==1.13.2 \
	psutil==7.2.2 nvidia-ml-py==13.615.71
# torchtitan 0.2.x (TOML job files) beside 0.3, loaded by the tests from here.
TORCHTITAN_OLD := torchtitan==0.2.2

$(STAMP): pyproject.toml Makefile
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "torch==2.13.0"
	# the HF release the runtime's staged forwards (runtime/hf_stages.py) are tested with: CI stays reproducible
	$(BIN)/pip install -q "transformers==5.24.0"
	$(BIN)/pip install -q -e ".[torch,test]"
	DS_BUILD_OPS=0 $(BIN)/pip install -q --no-deps --no-build-isolation $(TOOLS)
	$(BIN)/pip install -q --no-deps --upgrade --target $(VENV)/tools/$(subst ==,-,$(TORCHTITAN_OLD)) $(TORCHTITAN_OLD)
	# headless Chromium for tests/test_report_html.py (skipped without it); installed only as root
	command -v chromium >/dev/null || { [ "$$(id -u)" = 0 ] && apt-get update -qq && apt-get install -y -q chromium >/dev/null; } || true
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/hetplan plan

test: $(STAMP)
	$(BIN)/ruff check src tests benchmarks examples
	$(BIN)/mypy
	$(BIN)/python -m pytest

bench: $(STAMP)
	for f in benchmarks/bench_*.py; do $(BIN)/python $$f || exit 1; done

clean:
	rm -rf $(VENV)
