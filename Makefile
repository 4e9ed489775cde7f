VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test test-alone fuzz mutants lint docs screenshots demo chaos clean bench bench-quick bench-long bench-peers bench-async compat

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test,embedded]'
	touch $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check leasework tests bench tools
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports --no-cache

# The manual (docs/, mkdocs.yml) as a site in site/: --strict turns every warning (a broken link
# or anchor, a page left out of the nav, an unreadable docstring) into a failure.
docs: $(STAMP)
	$(VENV)/bin/mkdocs build --strict

# The dashboard's screenshots in docs/images/ (docs/dashboard.md shows them), taken by its browser
# test in headless Chromium on the test's own data; commit them when the pages change.
screenshots: $(STAMP)
	LEASEWORK_SCREENSHOTS='$(CURDIR)/docs/images' $(VENV)/bin/pytest -q tests/db/test_dashboard_screenshots.py

# The tiers are folders (tests/README.md): `make test` runs every one but tests/chaos (unit, db,
# process, security), `make chaos` tests/chaos alone; the manual's site is built first.
# Each tier runs on TEST_WORKERS pytest workers (pytest-xdist; each worker has its own database,
# tests/conftest.py): unit, db and security a test file per worker, then tests/process, whose
# supervisors and faults wait on conditions with generous deadlines, a test per worker.
TEST_WORKERS ?= 2
test: lint docs
	$(VENV)/bin/pytest -q -n $(TEST_WORKERS) --dist loadfile tests/unit tests/db tests/security
	$(VENV)/bin/pytest -q -n $(TEST_WORKERS) --dist load tests/process

# Each test file in a pytest of its own (tests/chaos excepted): every one must pass alone, not
# only in the suite's order (tests/alone.py). Slow: one session, database and all, per file.
test-alone: $(STAMP)
	$(PY) -m tests.alone

# The property tests with fresh random examples, five rounds (the suite draws the same examples
# every time: tests/conftest.py). A find goes in as a regression test.
fuzz: $(STAMP)
	for round in 1 2 3 4 5; do \
	  HYPOTHESIS_PROFILE=fuzz $(VENV)/bin/pytest -q -p no:cacheprovider \
	    $$(grep -rl --include='*.py' --exclude-dir=chaos '@given' tests) || exit 1; \
	done

# Bugs planted in Python source, each in a copy of the package, that the named tests must catch
# (tests/mutants.py; the SQL ones are tests/db/test_mutations.py, in `make test`). About a minute.
mutants: $(STAMP)
	$(PY) -m tests.mutants

chaos: $(STAMP)
	$(VENV)/bin/pytest -q tests/chaos

demo: $(STAMP)
	$(VENV)/bin/leasework demo

# Benchmarks (bench/README.md): each script makes its own database on the local server, prints
# a table and appends its figures to $(BENCH_RESULTS) (made afresh each time); bench/summary.py then
# prints issue 7's eight targets, issue 16's five and issue 29's three from them, last. `make bench` takes about 22
# minutes (the set with idle.py's 8, the peers, the async handlers beside the peers and a short
# ingest); `make bench BENCH_FLAGS=--quick` (or `make bench-quick`) about 6.
# backlog.py (issue 29: 1,000,000 queued runs the workers may not claim, five ways, and the
# fairness case) adds about 15 minutes while those drains are slow (each is stopped after 60 s),
# a few once they are not.
# `make bench-long` runs the long four (bloat.py on a private cluster, 1,000,000 jobs; a 1 GiB
# ingest killed and resumed; scale.py, the scaling curve over 4 hosts in network namespaces, as
# root; backlog.py's held snapshot, two 6.5-minute runs on a private cluster): about 45 minutes. A script that fails is recorded and the rest still
# run; the exit status is then non-zero. Set BENCH_DSN for another server.
BENCH_DSN ?= postgresql://postgres@127.0.0.1:5432/postgres
BENCH_FLAGS ?=
BENCHES := throughput pickup_latency claim_flatness bulk_enqueue recovery idle backlog
BENCH_RESULTS ?= $(CURDIR)/bench/.results.jsonl
BENCH_LONG_RESULTS ?= $(CURDIR)/bench/.results-long.jsonl
# The short ingest of `make bench` (target 7's peak RSS and chunks redone, on a 64 MiB file; the
# 1 GiB figures are `make bench-long`'s).
BENCH_INGEST ?= --mb 64 --embedder stub --kill-after 8
# `run NAME COMMAND...`: a failed script leaves {"script": NAME, "failed": STATUS} for the summary.
BENCH_RUN = status=0; run() { name=$$1; shift; echo; "$$@" || { rc=$$?; status=1; \
	echo "{\"script\": \"$$name\", \"failed\": $$rc}" >> "$$LEASEWORK_BENCH_RESULTS"; }; }

bench: $(STAMP)
	@rm -f '$(BENCH_RESULTS)'; export LEASEWORK_BENCH_RESULTS='$(BENCH_RESULTS)'; $(BENCH_RUN); \
	for b in $(BENCHES); do \
		run $$b.py $(PY) bench/$$b.py --dsn '$(BENCH_DSN)' $(BENCH_FLAGS); \
	done; \
	run peers.py bench/peers.sh --dsn '$(BENCH_DSN)' $(BENCH_FLAGS); \
	run async_io.py bench/peers.sh async_io.py --dsn '$(BENCH_DSN)' $(BENCH_FLAGS); \
	run ingest_large.py $(PY) bench/ingest_large.py --dsn '$(BENCH_DSN)' $(BENCH_INGEST); \
	echo; $(PY) bench/summary.py "$$LEASEWORK_BENCH_RESULTS"; exit $$status

# Not in `make bench` (it would pass 15 minutes): bloat.py in full (a private cluster, ~11 min;
# its --quick run ends before the first autovacuum, so it shows no plateau), the 1 GiB ingest,
# scale.py (1 to 64 processes over 4 hosts, direct and through PgBouncer, ~10 min; its own private
# cluster, so BENCH_DSN does not apply; needs root for the namespaces, and pgbouncer) and
# backlog.py's case (f) (a snapshot held 5 minutes under 400 runs/s, beside the same run with
# none: ~14 min; a private cluster, for autovacuum, so BENCH_DSN does not apply either).
bench-long: $(STAMP)
	@rm -f '$(BENCH_LONG_RESULTS)'; export LEASEWORK_BENCH_RESULTS='$(BENCH_LONG_RESULTS)'; \
	$(BENCH_RUN); \
	run bloat.py $(PY) bench/bloat.py; \
	run ingest_large.py $(PY) bench/ingest_large.py --dsn '$(BENCH_DSN)' \
		--mb 1024 --embedder stub --kill-after 120; \
	run scale.py $(PY) bench/scale.py; \
	run backlog.py $(PY) bench/backlog.py --cases f; \
	echo; $(PY) bench/summary.py "$$LEASEWORK_BENCH_RESULTS"; exit $$status

# PGQueuer and Procrastinate beside leasework and the raw loops, in bench/.venv-peers (made on
# first use, gitignored): never dependencies of leasework.
bench-peers:
	bench/peers.sh --dsn '$(BENCH_DSN)' $(BENCH_FLAGS)

# Issue 16's async handlers beside Procrastinate and PGQueuer (IO-bound and no-op runs, a child's
# memory at rest), in the same virtualenv; `make bench` runs it too, and the summary shows it.
bench-async:
	bench/peers.sh async_io.py --dsn '$(BENCH_DSN)' $(BENCH_FLAGS)

bench-quick:
	$(MAKE) bench BENCH_FLAGS=--quick BENCH_INGEST='--mb 32 --embedder stub --kill-after 4'

# Rolling upgrades: the previous release's workers must keep running on the new schema. `make
# compat PREV=<git rev of that release>` runs its db and unit tests (its own code and SQL) against
# this schema.sql and these migrations, in a temporary worktree (.compat, removed afterwards),
# with this suite's movable database clock (tests/clock.py, as a plugin: its tests move time).
compat: $(STAMP)
	@test -n "$(PREV)" || { echo "make compat: set PREV=<git rev of the previous release>" >&2; exit 2; }
	@rm -rf .compat; git worktree prune; git worktree add -q --detach .compat $(PREV)
	@cp schema.sql .compat/schema.sql; cp leasework/migrations/*.sql .compat/leasework/migrations/
	@cp tests/clock.py .compat/tests/leasework_test_clock.py
	@cd .compat && PYTHONPATH=$(CURDIR)/.compat $(CURDIR)/$(VENV)/bin/python -m pytest -q \
		-m 'not chaos' -p no:cacheprovider -p tests.leasework_test_clock tests/db tests/unit \
		--deselect tests/db/test_migrations.py; \
		status=$$?; cd $(CURDIR); git worktree remove --force .compat; exit $$status

clean:
	rm -rf $(VENV) site bench/.venv-peers bench/.results*.jsonl .pytest_cache .mypy_cache .ruff_cache
