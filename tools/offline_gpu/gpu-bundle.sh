#!/usr/bin/env bash
# Build .gpu-bundle/ (git-ignored): trimmed SGLang 0.5.23 sources and the cp312 wheels the GPU image lacks.
# Needs the package registries; prints the bundle's size. Extra arguments go to the builder, e.g.
#   tools/offline_gpu/gpu-bundle.sh --sglang-package .venv/lib/python3.11/site-packages/sglang --skip-wheels
set -euo pipefail
cd "$(dirname "$0")/../.."
python=.venv/bin/python
[ -x "$python" ] || python=python3
PYTHONPATH=tools exec "$python" -m offline_gpu.gpu_bundle "$@"
