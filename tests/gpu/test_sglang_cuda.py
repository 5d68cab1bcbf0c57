"""BASTION in `sglang.launch_server` on CUDA: greedy output equals the non-speculative server.

Backends triton and flashinfer with CUDA graphs on; fixed:N_max verifies at the captured width (graph
replay), adaptive at varying widths (SGLang falls back to eager for widths it did not capture). Skipped
where SGLang or CUDA is absent.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("sglang")
torch = pytest.importorskip("torch")
requests = pytest.importorskip("requests")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from tiny_models import make_tiny_drafter, make_tiny_target  # noqa: E402

PROMPTS = [list(text.encode()) for text in ("hello world", "the quick brown fox", "abc", "once upon a time")]
MAX_NEW_TOKENS = 48
BACKEND_DTYPES = {"triton": "float32", "flashinfer": "bfloat16"}
STARTUP_SECONDS = 600


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("bastion_cuda")
    target = make_tiny_target(root / "target", vocab_size=260, initializer_range=0.1)
    return target, make_tiny_drafter(root / "drafter", target, target_layer_ids=[0, 2])


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _generate(
    models: tuple[Path, Path], backend: str, bastion: list[str] | None, log: Path
) -> list[list[int]]:
    """Start a server (BASTION when `bastion` lists its flags), send the prompts greedily, stop it."""
    target, drafter = models
    port = _free_port()
    command = [
        sys.executable, "-m", "sglang.launch_server",
        "--model-path", str(target),
        "--attention-backend", backend,
        "--dtype", BACKEND_DTYPES[backend],
        "--mem-fraction-static", "0.3",
        "--cuda-graph-max-bs", "8",
        "--host", "127.0.0.1",
        "--port", str(port),
    ]  # fmt: skip
    if bastion is not None:
        command += [
            "--speculative-algorithm",
            "BASTION",
            "--speculative-draft-model-path",
            str(drafter),
            *bastion,
        ]
    with log.open("w") as sink:
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_SECONDS
        while True:
            if process.poll() is not None:
                pytest.fail(f"server exited with {process.returncode}:\n{log.read_text()[-4000:]}")
            try:
                if requests.get(f"{url}/health_generate", timeout=30).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"server not ready after {STARTUP_SECONDS} s:\n{log.read_text()[-4000:]}")
            time.sleep(2)
        response = requests.post(
            f"{url}/generate",
            json={
                "input_ids": PROMPTS,
                "sampling_params": {"temperature": 0.0, "max_new_tokens": MAX_NEW_TOKENS, "ignore_eos": True},
            },
            timeout=600,
        )
        response.raise_for_status()
        return [out["output_ids"] for out in response.json()]
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=120)


@pytest.mark.parametrize("backend", sorted(BACKEND_DTYPES))
@pytest.mark.parametrize("policy", ["fixed:8", "adaptive"])
def test_bastion_equals_no_speculation_on_cuda(
    models: tuple[Path, Path], tmp_path: Path, backend: str, policy: str
) -> None:
    reference = _generate(models, backend, None, tmp_path / "reference.log")
    flags = ["--bastion-max-budget", "8", "--bastion-policy", policy, "--bastion-topk", "4"]
    assert _generate(models, backend, flags, tmp_path / "bastion.log") == reference
