VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test lint demo chaos clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
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

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
