"""`launch_server --dp-size 2 --speculative-algorithm BASTION` on CPU: two replicas, each its own controller.

SGLang's data-parallel controller starts one scheduler (and one BASTION worker) per replica, one core each
(`SGLANG_CPU_OMP_THREADS_BIND=0|1`), and hands requests out round robin. Checks: greedy output over HTTP
equals Hugging Face `generate()` on the same fp32 weights (no speculation); `/metrics` carries BASTION's
series of both replicas, told apart by SGLang's `dp_rank` label, each with its own decode steps.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
from engine_support import make_model_pair
from sglang_server import CPU_FLAGS, generate_greedy, hf_greedy, launch_server, metric_values

pytestmark = pytest.mark.slow

DP_SIZE = 2
PROMPTS = [list(b"hello world"), list(b"the quick brown fox"), list(b"BASTION serves"), list(b"abc")]
MAX_NEW_TOKENS = 16
FIXED_NODES = 3


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return make_model_pair(tmp_path_factory.mktemp("bastion_dp"))


@pytest.fixture(scope="module")
def server(models: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    target, drafter = models
    args = [
        "--model-path", str(target),
        "--speculative-algorithm", "BASTION",
        "--speculative-draft-model-path", str(drafter),
        *CPU_FLAGS,
        "--mem-fraction-static", "0.05",
        "--max-total-tokens", "8192",
        "--enable-metrics",
        "--dp-size", str(DP_SIZE),
        "--load-balance-method", "round_robin",
        "--bastion-max-budget", str(FIXED_NODES),
        "--bastion-policy", f"fixed:{FIXED_NODES}",
        "--bastion-topk", "2",
    ]  # fmt: skip
    log = tmp_path_factory.mktemp("dp_server_log") / "server.log"
    with launch_server(args, log, env={"SGLANG_CPU_OMP_THREADS_BIND": "0|1"}) as running:
        yield running.url


@pytest.fixture(scope="module")
def greedy(server: str) -> list[list[int]]:
    return generate_greedy(server, PROMPTS, MAX_NEW_TOKENS)


def test_greedy_over_two_replicas_equals_hugging_face(
    greedy: list[list[int]], models: tuple[Path, Path]
) -> None:
    assert greedy == hf_greedy(models[0], PROMPTS, MAX_NEW_TOKENS)


def test_metrics_of_both_replicas_are_scraped(server: str, greedy: list[list[int]]) -> None:
    text = requests.get(f"{server}/metrics", timeout=60).text
    per_replica: dict[str, dict[str, float]] = {}
    for name in ("sglang:bastion_tree_nodes_count", "sglang:bastion_tree_nodes_sum"):
        for labels, value in metric_values(text, name):
            (replica,) = re.findall(r'dp_rank="(\d+)"', labels)
            per_replica.setdefault(replica, {})[name] = value
    assert set(per_replica) == {str(rank) for rank in range(DP_SIZE)}, per_replica
    for replica, values in per_replica.items():
        count = values["sglang:bastion_tree_nodes_count"]
        assert count > 0, f"replica {replica} ran no decode step"
        assert values["sglang:bastion_tree_nodes_sum"] == FIXED_NODES * count, replica
    stages = {
        replica
        for labels, _ in metric_values(text, "sglang:bastion_step_stage_seconds_count")
        for replica in re.findall(r'dp_rank="(\d+)"', labels)
    }
    assert stages == set(per_replica)
