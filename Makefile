# Every target sets up what it needs: a fresh clone runs `make demo` or `make test` and nothing else.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.pdkv-installed
SYSLIB := $(VENV)/.pdkv-syslibs
SGLANG := $(VENV)/.pdkv-sglang

.PHONY: demo test typecheck lint lint-imports pytest bench diagram venv sglang clean

venv: $(STAMP) $(SYSLIB)

$(STAMP): pyproject.toml constraints.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[dev,diagrams,mooncake-cpu,prometheus]'
	@touch $@

$(SYSLIB): $(STAMP) scripts/ensure-syslibs.sh
	./scripts/ensure-syslibs.sh $(PY)
	@touch $@

# SGLang 0.5.23's CPU import closure, for the adapter tests (tests/adapters). --no-deps: SGLang's own
# requirements pull a CUDA torch and GPU kernels; the pinned list is what its transfer path imports on CPU,
# and the check after it proves torch is still the CPU 2.13.0 of constraints.txt.
sglang: $(SGLANG)

$(SGLANG): $(STAMP) requirements/sglang-cpu.txt constraints.txt
	$(PY) -m pip install -q --no-deps -c constraints.txt -r requirements/sglang-cpu.txt
	$(PY) -c "import torch; assert torch.__version__.startswith('2.13.0') and torch.version.cuda is None, torch.__version__"
	@touch $@

demo: venv
	$(PY) -m pdkv demo

typecheck: venv
	$(PY) -m mypy

lint-imports: venv
	$(VENV)/bin/lint-imports --no-cache

pytest: venv $(SGLANG)
	$(PY) -m pytest

test: typecheck lint-imports $(SGLANG)
	$(PY) -m pytest

bench: venv
	$(PY) -m pdkv bench all

diagram: venv
	$(PY) -m pdkv diagram

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .hypothesis

lint: venv
	$(VENV)/bin/ruff check src tests
