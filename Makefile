# Every target sets up what it needs: a fresh clone runs `make demo` or `make test` and nothing else.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.pdkv-installed
SYSLIB := $(VENV)/.pdkv-syslibs

.PHONY: demo test typecheck lint lint-imports pytest bench diagram venv clean

venv: $(STAMP) $(SYSLIB)

$(STAMP): pyproject.toml constraints.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[dev,diagrams,mooncake-cpu,prometheus]'
	@touch $@

$(SYSLIB): $(STAMP) scripts/ensure-syslibs.sh
	./scripts/ensure-syslibs.sh $(PY)
	@touch $@

demo: venv
	$(PY) -m pdkv demo

typecheck: venv
	$(PY) -m mypy

lint-imports: venv
	$(VENV)/bin/lint-imports --no-cache

pytest: venv
	$(PY) -m pytest

test: typecheck lint-imports
	$(PY) -m pytest

bench: venv
	$(PY) -m pdkv bench all

diagram: venv
	$(PY) -m pdkv diagram

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .hypothesis

lint: venv
	$(VENV)/bin/ruff check src tests
