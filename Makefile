# Everything installs itself: `make test` on a clean clone needs only Python 3.11, Java 17 and the
# Spanner emulator binary.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: venv jars test lint run bench-reader bench-ingest clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

jars: .jars/.fetched

# Delta jars for Spark, resolved once from Maven Central so nothing downloads at test or run time.
.jars/.fetched: $(STAMP) pipeline/session.py
	$(PY) -m pipeline.session fetch .jars
	touch .jars/.fetched

test: venv jars
	$(PY) -m ruff check ingest pipeline emulator tests bench
	$(PY) -m pytest

lint: venv
	$(PY) -m ruff check ingest pipeline emulator tests bench

# Local run: start an emulator, bootstrap the sample database, run a workload and tail the stream.
run: venv
	$(PY) -m emulator.local_run

bench-reader: venv
	$(PY) bench/reader_throughput.py

bench-ingest: venv
	$(PY) bench/ingest_throughput.py

clean:
	rm -rf $(VENV) .jars .pytest_cache .hypothesis build *.egg-info
