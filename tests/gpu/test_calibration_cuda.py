"""`bastion calibrate` on CUDA: peaks near the datasheet; both engines write a profile that auto finds.

Tiny models (tests/tiny_models.py) keep it to seconds: the verify latencies are launch-bound and not
meaningful, but the timing path (CUDA events), the metadata (driver, CUDA version) and the SGLang engine's
TARGET_VERIFY path through BASTION's verify input on a real CUDA attention backend are exercised.
Each engine runs in a child process (SGLang's runtime context is process-global).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny_models import make_tiny_drafter, make_tiny_target

from bastion_sglang.calibration.identity import RuntimeIdentity
from bastion_sglang.calibration.lookup import ProfileSource, resolve_latency_profile
from bastion_sglang.calibration.microbench import measure_peaks
from bastion_sglang.calibration.store import ProfileStore
from bastion_sglang.controller.profile import load_profile
from bastion_sglang.controller.roofline import lookup_gpu

GRID = ["--max-width", "32", "--max-context", "256", "--repeats", "3", "--warmup", "2", "--dtype", "bfloat16"]
PROMPTS = (
    "def add(a, b):",
    "The capital of France is",
    "Once upon a time",
    "SELECT * FROM",
    "1, 2, 3,",
    "Hello",
)


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("calibration_cuda")
    target = make_tiny_target(root / "target")
    return target, make_tiny_drafter(root / "drafter", target)


def test_measured_peaks_are_near_the_datasheet(device: torch.device) -> None:
    name = torch.cuda.get_device_name(device)
    try:
        sheet = lookup_gpu(name)
    except ValueError:
        pytest.skip(f"{name} has no KNOWN_GPUS entry")
    peaks = measure_peaks(device, torch.bfloat16, name)
    assert 0.3 * sheet.peak_flops < peaks.matmul_flops < 1.1 * sheet.peak_flops
    assert 0.5 * sheet.bandwidth < peaks.copy_bandwidth < 1.1 * sheet.bandwidth


@pytest.mark.parametrize(("engine", "backend"), [("reference", "sdpa"), ("sglang", "triton")])
def test_calibrate_on_cuda_writes_a_profile_auto_finds(
    pair: tuple[Path, Path], tmp_path: Path, device: torch.device, engine: str, backend: str
) -> None:
    target, drafter = pair
    store = ProfileStore(tmp_path / "store")
    argv = [sys.executable, "-m", "bastion_sglang.calibration", "--model-path", str(target)]
    argv += ["--draft-model-path", str(drafter), "--engine", engine, "--attention-backend", backend]
    argv += ["--device", "cuda", *GRID, "--store", str(store.root)]
    prompts = tmp_path / "prompts.jsonl"  # a file, not a prompt-set package: GPU machines may lack those
    prompts.write_text("".join(json.dumps({"prompt": text}) + "\n" for text in PROMPTS))
    argv += ["--acceptance-prompts", str(prompts), "--acceptance-num-prompts", str(len(PROMPTS))]
    argv += ["--acceptance-max-new-tokens", "16"]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-4000:]
    (path,) = store.root.glob("*.json")
    profile = load_profile(path)
    assert profile.metadata.device_name == torch.cuda.get_device_name(device)
    assert profile.metadata.cuda_version == torch.version.cuda
    assert all(sample.seconds > 0 for sample in profile.samples)
    identity = RuntimeIdentity.for_runtime(
        device=device, model_path=target, dtype=torch.bfloat16, attention_backend=backend, tp_size=1
    )
    resolved = resolve_latency_profile("auto", identity, store)
    assert (resolved.source, resolved.path) == (ProfileSource.STORE, path)
