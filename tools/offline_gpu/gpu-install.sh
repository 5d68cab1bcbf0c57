#!/usr/bin/env bash
# On the GPU machine (no network), from the repository root, with .gpu-bundle carried beside it:
#   tools/offline_gpu/gpu-install.sh && export PYTHONPATH=/tmp/sglang-src SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1
# Installs the bundle's wheels and this package (editable) into python3's environment, unpacks the
# trimmed SGLang sources to /tmp/sglang-src, and writes the .pth file that serves `sgl_kernel` from
# BASTION's torch stand-ins when sglang-kernel is absent (tools/offline_gpu/sgl_kernel_finder.py; it warns
# once per process when it does). Only for that machine: `remove-pth` of the same module undoes it.
set -euo pipefail
cd "$(dirname "$0")/../.."
bundle=${GPU_BUNDLE:-.gpu-bundle}
sources=${SGLANG_SOURCES:-/tmp/sglang-src}
pip=(python3 -m pip install --quiet --no-index --no-deps --no-cache-dir)
"${pip[@]}" "$bundle"/wheels/*.whl
"${pip[@]}" --no-build-isolation -e .
rm -rf "$sources" && mkdir -p "$sources"
tar -xzf "$bundle/sglang-src.tar.gz" -C "$sources"
PYTHONPATH=tools python3 -m offline_gpu.sgl_kernel_finder write-pth
PYTHONPATH="$sources" python3 -c 'import sglang, sgl_kernel; print("sglang", sglang.__version__, "from", sglang.__file__); print(sgl_kernel.__doc__)'
