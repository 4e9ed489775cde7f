VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test lint demo chaos clean bench bench-quick bench-peers

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test,embedded]'
	touch $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check leasework tests bench
	$(VENV)/bin/mypy

test: lint
	$(VENV)/bin/pytest -q -m 'not chaos' tests

chaos: $(STAMP)
	$(VENV)/bin/pytest -q -m chaos tests

demo: $(STAMP)
	$(VENV)/bin/leasework demo

# Benchmarks (bench/README.md): each script makes its own database on the local server and prints
# a table. `make bench` takes about 10 minutes; `make bench BENCH_FLAGS=--quick` (or
# `make bench-quick`) about 2. Set BENCH_DSN for another server.
BENCH_DSN ?= postgresql://postgres@127.0.0.1:5432/postgres
BENCH_FLAGS ?=
BENCHES := throughput pickup_latency claim_flatness bulk_enqueue recovery

bench: $(STAMP)
	@for b in $(BENCHES); do \
		echo; $(PY) bench/$$b.py --dsn '$(BENCH_DSN)' $(BENCH_FLAGS) || exit 1; \
	done
	@echo; bench/peers.sh --dsn '$(BENCH_DSN)' $(BENCH_FLAGS)

# PGQueuer and Procrastinate beside leasework and the raw loops, in bench/.venv-peers (made on
# first use, gitignored): never dependencies of leasework.
bench-peers:
	bench/peers.sh --dsn '$(BENCH_DSN)' $(BENCH_FLAGS)

bench-quick:
	$(MAKE) bench BENCH_FLAGS=--quick

clean:
	rm -rf $(VENV) bench/.venv-peers .pytest_cache .mypy_cache .ruff_cache
