#!/usr/bin/env bash
# On the GPU machine (no network), from the repository root, with .gpu-bundle carried beside it:
#   scripts/gpu-install.sh && export PYTHONPATH=/tmp/sglang-src SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1
# Installs the bundle's wheels and this package (editable) into python3's environment, unpacks the
# trimmed SGLang sources to /tmp/sglang-src, and adds a .pth line that serves `sgl_kernel` from
# BASTION's torch stand-ins when sglang-kernel is absent (bastion_sglang/sgl_kernel_finder.py).
set -euo pipefail
cd "$(dirname "$0")/.."
bundle=${GPU_BUNDLE:-.gpu-bundle}
sources=${SGLANG_SOURCES:-/tmp/sglang-src}
pip=(python3 -m pip install --quiet --no-index --no-deps --no-cache-dir)
"${pip[@]}" "$bundle"/wheels/*.whl
"${pip[@]}" --no-build-isolation -e .
rm -rf "$sources" && mkdir -p "$sources"
tar -xzf "$bundle/sglang-src.tar.gz" -C "$sources"
site=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
python3 -c 'from bastion_sglang.sgl_kernel_finder import PTH_LINE; print(PTH_LINE, end="")' \
    > "$site/bastion_sgl_kernel_fallback.pth"
PYTHONPATH="$sources" python3 -c 'import sglang, sgl_kernel; print("sglang", sglang.__version__, "from", sglang.__file__); print(sgl_kernel.__doc__)'
