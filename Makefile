# Every target sets up its own virtual environment, so a fresh clone needs only
# `make demo` or `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast bench clean install

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "torch==2.13.0"
	$(BIN)/pip install -q -e ".[torch,test]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/hetplan plan

test: $(STAMP)
	$(BIN)/python -m pytest

bench: $(STAMP)
	for f in benchmarks/bench_*.py; do $(BIN)/python $$f || exit 1; done

clean:
	rm -rf $(VENV)
