"""The GPU bundle's trimmed SGLang: serving imports from it alone, with BASTION's stand-ins active.

Builds the trimmed tree from the SGLang installed here (no network; the wheel download is a separate step
of `offline_gpu.gpu_bundle`), then runs `gpu_bundle_imports.py` (beside this file) in a subprocess
whose PYTHONPATH starts with the trimmed tree (then the checkout's `tools/`), once on the CPU path and once
with torch reporting CUDA (module-level imports only), where `sgl_kernel` comes from BASTION's stand-in
finder.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import sglang
from offline_gpu.gpu_bundle import is_dropped, trim_sglang

IMPORT_CHECK = Path(__file__).with_name("gpu_bundle_imports.py")
TOOLS = Path(__file__).resolve().parents[2] / "tools"


@pytest.mark.parametrize(
    ("relative", "dropped"),
    [
        ("srt/models/llama.py", False),
        ("srt/models/qwen3.py", False),
        ("srt/models/dflash.py", False),
        ("srt/models/registry.py", False),
        ("srt/models/deepseek_v2.py", True),
        ("srt/models/deepseek_common/utils.py", True),
        ("srt/rust_extensions/_server.cpython-312-x86_64-linux-gnu.so", True),
        ("srt/rust_extensions/loader.py", False),
        ("multimodal_gen/runtime/__init__.py", True),
        ("test/runners.py", True),
        ("benchmark/one_batch.py", False),
        ("benchmark/__init__.py", False),
        ("benchmark/bench_serving.py", True),
        ("benchmark/datasets/__init__.py", True),
        ("srt/layers/__pycache__/sampler.cpython-312.pyc", True),
        ("srt/layers/moe/moe_runner/triton_utils/configs/triton_3_6_0/E=8.json", False),
        ("kernels/jit/csrc/elementwise/activation.cuh", False),
    ],
)
def test_trim_rules(relative: str, dropped: bool) -> None:
    assert is_dropped(Path(relative)) is dropped


@pytest.fixture(scope="module")
def trimmed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("trimmed")
    report = trim_sglang(Path(sglang.__file__).parent, root)
    assert report.kept_files > 0 and report.dropped_files > 0
    assert not list((root / "sglang").rglob("*.so"))
    assert not (root / "sglang" / "multimodal_gen").exists()
    return root


def _start_import_check(root: Path, mode: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(TOOLS)]), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, str(IMPORT_CHECK), str(root), mode]
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(process: subprocess.Popen[str]) -> tuple[int, str, str]:
    stdout, stderr = process.communicate(timeout=240)
    return process.returncode, stdout, stderr


@pytest.mark.slow
def test_import_check_fails_when_the_trim_drops_a_serving_module(trimmed: Path) -> None:
    """The check sees only the trimmed tree: a module missing there is missing, whatever is installed."""
    registry = trimmed / "sglang" / "srt" / "speculative" / "spec_registry.py"
    hidden = registry.with_suffix(".hidden")
    registry.rename(hidden)
    try:
        returncode, _, stderr = _finish(_start_import_check(trimmed, "cpu"))
    finally:
        hidden.rename(registry)
    assert returncode != 0
    assert "No module named 'sglang.srt.speculative.spec_registry'" in stderr


MODES = ("cpu", "cuda-imports")


@pytest.fixture(scope="module")
def import_checks(trimmed: Path) -> dict[str, tuple[int, str, str]]:
    """Both modes' import checks, run side by side (each is one Python process importing ~1,300 modules)."""
    processes = {mode: _start_import_check(trimmed, mode) for mode in MODES}
    return {mode: _finish(process) for mode, process in processes.items()}


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_serving_path_imports_from_trimmed_sources(
    import_checks: dict[str, tuple[int, str, str]], mode: str
) -> None:
    returncode, stdout, stderr = import_checks[mode]
    assert returncode == 0, stderr[-3000:]
    assert stdout.startswith("OK ")
