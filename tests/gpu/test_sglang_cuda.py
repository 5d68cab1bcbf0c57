"""BASTION in `sglang.launch_server` on CUDA: greedy output equals the non-speculative server.

Backends triton and flashinfer with CUDA graphs on: BASTION captures a target-verify graph per width bucket
(`bastion_sglang.step.graphs`) and pads each step's width up to the next bucket; fixed:N_max verifies at the
largest bucket, adaptive at varying buckets, and fixed:N with N + 1 between buckets through padding; with
`--page-size 16` a tree commit copies the accepted path's KV
(`bastion_sglang.step.commit`). Skipped where CUDA is absent.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from sglang_server import generate_greedy, launch_server
from tiny_models import make_tiny_drafter, make_tiny_target

PROMPTS = [list(text.encode()) for text in ("hello world", "the quick brown fox", "abc", "once upon a time")]
MAX_NEW_TOKENS = 48
BACKEND_DTYPES = {"triton": "float32", "flashinfer": "bfloat16"}
STARTUP_SECONDS = 600


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("bastion_cuda")
    target = make_tiny_target(root / "target", vocab_size=260, initializer_range=0.1)
    return target, make_tiny_drafter(root / "drafter", target, target_layer_ids=[0, 2])


def _generate(
    models: tuple[Path, Path], backend: str, bastion: list[str] | None, log: Path, page_size: int = 1
) -> list[list[int]]:
    """Start a server (BASTION when `bastion` lists its flags), send the prompts greedily, stop it."""
    target, drafter = models
    args = [
        "--model-path", str(target),
        "--attention-backend", backend,
        "--dtype", BACKEND_DTYPES[backend],
        "--mem-fraction-static", "0.3",
        "--cuda-graph-max-bs-decode", "8",
        "--page-size", str(page_size),
    ]  # fmt: skip
    if bastion is not None:
        args += [
            "--speculative-algorithm",
            "BASTION",
            "--speculative-draft-model-path",
            str(drafter),
            *bastion,
        ]
    with launch_server(args, log, startup_seconds=STARTUP_SECONDS, stop_seconds=120) as server:
        return generate_greedy(server.url, PROMPTS, MAX_NEW_TOKENS, timeout=600)


@pytest.mark.parametrize("backend", sorted(BACKEND_DTYPES))
@pytest.mark.parametrize("policy", ["fixed:8", "adaptive"])
def test_bastion_equals_no_speculation_on_cuda(
    models: tuple[Path, Path], tmp_path: Path, backend: str, policy: str
) -> None:
    reference = _generate(models, backend, None, tmp_path / "reference.log")
    flags = ["--bastion-max-budget", "8", "--bastion-policy", policy, "--bastion-topk", "4"]
    assert _generate(models, backend, flags, tmp_path / "bastion.log") == reference


GRAPH_REPLAY = re.compile(r"BASTION: first target-verify CUDA graph replay at width (\d+)")


@pytest.mark.parametrize("backend", sorted(BACKEND_DTYPES))
def test_verify_graphs_at_each_bucket_equal_no_speculation(
    models: tuple[Path, Path], tmp_path: Path, backend: str
) -> None:
    """Buckets 4, 8, 16 with N_max 16: fixed:3 (W = 4) replays the width-4 graph, fixed:10 (W = 11) the
    width-16 graph with 5 padding positions per request, adaptive whatever it chooses; every output equals
    the non-speculative server's, and graph replays happened at more than one width."""
    reference = _generate(models, backend, None, tmp_path / "reference.log")
    flags = ["--bastion-max-budget", "16", "--bastion-topk", "4", "--bastion-width-buckets", "4,8,16"]
    replayed: set[int] = set()
    for policy, expected in (("fixed:3", {4}), ("fixed:10", {16}), ("adaptive", None)):
        log = tmp_path / f"bastion-{policy.replace(':', '-')}.log"
        assert _generate(models, backend, [*flags, "--bastion-policy", policy], log) == reference, policy
        text = log.read_text(errors="replace")
        assert "BASTION: target-verify CUDA graphs at widths [4, 8, 16]" in text
        widths = {int(width) for width in GRAPH_REPLAY.findall(text)}
        assert widths, f"{policy}: no verify graph replay logged"
        assert widths <= {4, 8, 16}
        if expected is not None:
            assert widths == expected, policy
        replayed |= widths
    assert len(replayed) > 1, replayed


@pytest.mark.parametrize("backend", sorted(BACKEND_DTYPES))
def test_paged_kv_equals_no_speculation_on_cuda(
    models: tuple[Path, Path], tmp_path: Path, backend: str
) -> None:
    """`--page-size 16`: each tree step copies its accepted path's KV into the request's pages (SGLang's
    `move_kv_cache`, its Triton copy on CUDA); greedy output equals the non-speculative server's at that page
    size."""
    reference = _generate(models, backend, None, tmp_path / "reference.log", page_size=16)
    flags = ["--bastion-max-budget", "8", "--bastion-policy", "fixed:8", "--bastion-topk", "4"]
    assert _generate(models, backend, flags, tmp_path / "bastion.log", page_size=16) == reference
