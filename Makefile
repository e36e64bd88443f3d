# The two commands of the README: `make demo` (the main job) and `make test`.
# Both create .venv on first use: torch first (CPU wheel), then the package pinned by
# constraints.txt.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

.PHONY: install demo test lint
install: $(STAMP)

demo: $(STAMP)
	$(BIN)/flashdraft demo --out demo-out

test: $(STAMP)
	$(BIN)/python -m pytest; rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected"; exit 0; fi; exit $$rc

lint: $(STAMP)
	$(BIN)/ruff check flashdraft tests scripts benchmarks
