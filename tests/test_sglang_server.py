"""`python -m sglang.launch_server --speculative-algorithm BASTION` on CPU, driven over HTTP.

One server for the module, started with `--bastion-*` flags and `--enable-metrics`. Checks: greedy output
over HTTP equals Hugging Face `generate()` on the same fp32 weights; the flags reached the scheduler's
worker (fixed:3 verifies exactly 3 nodes per request per step, seen in `sglang:bastion_tree_nodes`);
BASTION's Prometheus series appear on `/metrics` with SGLang's labels.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests
from sglang_server import CPU_FLAGS, generate_greedy, hf_greedy, launch_server, metric_values
from tiny_models import make_tiny_drafter, make_tiny_target

pytestmark = pytest.mark.slow

PROMPTS = [list(b"hello world"), list(b"the quick brown fox"), list(b"BASTION serves")]
MAX_NEW_TOKENS = 16
FIXED_NODES = 3
STARTUP_SECONDS = 400


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("bastion_server")
    target = make_tiny_target(root / "target", vocab_size=260, initializer_range=0.1)
    return target, make_tiny_drafter(root / "drafter", target, target_layer_ids=[0, 2])


@pytest.fixture(scope="module")
def server_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("server_log") / "server.log"


@pytest.fixture(scope="module")
def server(models: tuple[Path, Path], server_log: Path) -> Iterator[str]:
    target, drafter = models
    args = [
        "--model-path", str(target),
        "--speculative-algorithm", "BASTION",
        "--speculative-draft-model-path", str(drafter),
        *CPU_FLAGS,
        "--mem-fraction-static", "0.05",
        "--max-total-tokens", "8192",
        "--enable-metrics",
        "--bastion-max-budget", str(FIXED_NODES),
        "--bastion-policy", f"fixed:{FIXED_NODES}",
        "--bastion-topk", "2",
    ]  # fmt: skip
    with launch_server(args, server_log, startup_seconds=STARTUP_SECONDS) as running:
        yield running.url


@pytest.fixture(scope="module")
def greedy(server: str) -> list[list[int]]:
    return generate_greedy(server, PROMPTS, MAX_NEW_TOKENS)


def test_greedy_over_http_equals_hugging_face(greedy: list[list[int]], models: tuple[Path, Path]) -> None:
    assert greedy == hf_greedy(models[0], PROMPTS, MAX_NEW_TOKENS)


def test_metrics_show_the_cli_budget_and_sglang_labels(server: str, greedy: list[list[int]]) -> None:
    text = requests.get(f"{server}/metrics", timeout=60).text
    (labels, count), *_ = metric_values(text, "sglang:bastion_tree_nodes_count")
    (_, total), *_ = metric_values(text, "sglang:bastion_tree_nodes_sum")
    assert count > 0
    assert total == FIXED_NODES * count, "fixed:3 from the command line must verify 3 nodes every time"
    assert 'model_name="' in labels and 'tp_rank="0"' in labels
    for name in (
        "sglang:bastion_expected_accept_length_count",
        "sglang:bastion_accept_length_count",
        "sglang:bastion_verify_seconds_estimated_count",
        "sglang:bastion_verify_seconds_observed_count",
        "sglang:bastion_uncalibrated_steps_total",
    ):
        samples = metric_values(text, name)
        assert samples and samples[0][1] > 0, f"{name} missing or zero"
    (_, factor), *_ = metric_values(text, "sglang:bastion_latency_ema_factor")
    assert factor > 0
    (_, accepted_sum), *_ = metric_values(text, "sglang:bastion_accept_length_sum")
    # Every decode step commits >= 1 token per request; the prefill emits each request's first token.
    assert accepted_sum >= len(PROMPTS) * (MAX_NEW_TOKENS - 1)
    # One sample per request per step in each per-request series, one per verify pass in each pass series.
    per_request = {
        name: metric_values(text, name)[0][1]
        for name in (
            "sglang:bastion_tree_nodes_count",
            "sglang:bastion_expected_accept_length_count",
            "sglang:bastion_accept_length_count",
        )
    }
    assert len(set(per_request.values())) == 1, per_request
    (_, estimated), *_ = metric_values(text, "sglang:bastion_verify_seconds_estimated_count")
    (_, observed), *_ = metric_values(text, "sglang:bastion_verify_seconds_observed_count")
    (_, uncalibrated), *_ = metric_values(text, "sglang:bastion_uncalibrated_steps_total")
    assert estimated == observed == uncalibrated
    assert estimated <= count <= estimated * len(PROMPTS)


def test_kv_pool_is_whole_again_when_idle(server: str, greedy: list[list[int]], server_log: Path) -> None:
    """SGLang's idle check (SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE, on by default) compares free +
    evictable + held KV slots with the pool size once the scheduler is idle, and stops the server with
    "memory leak detected" when a tree's rejected slots were not freed."""
    time.sleep(5)  # let the scheduler go idle and run its check
    assert requests.get(f"{server}/health_generate", timeout=60).status_code == 200
    assert "leak" not in server_log.read_text().lower()


def test_aborted_requests_finish_as_aborted_and_free_their_kv(
    server: str, greedy: list[list[int]], server_log: Path
) -> None:
    """abort_all mid-generation: every request ends with finish reason abort, the server keeps serving, and
    SGLang's idle check finds the KV pool whole (the aborted trees' slots were freed)."""

    def generate(prompt: list[int]) -> dict:
        params = {"temperature": 0.0, "max_new_tokens": 1000, "ignore_eos": True}
        response = requests.post(
            f"{server}/generate", json={"input_ids": prompt, "sampling_params": params}, timeout=300
        )
        return response.json()

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        futures = [pool.submit(generate, prompt) for prompt in PROMPTS]
        time.sleep(3)
        requests.post(f"{server}/abort_request", json={"abort_all": True}, timeout=60).raise_for_status()
        results = [future.result() for future in futures]
    reasons = [result["meta_info"]["finish_reason"]["type"] for result in results]
    assert reasons == ["abort"] * len(PROMPTS), results
    time.sleep(5)  # idle: SGLang checks the pool
    assert requests.get(f"{server}/health_generate", timeout=60).status_code == 200
    assert "leak" not in server_log.read_text().lower()
