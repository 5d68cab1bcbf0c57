"""The reference engine's pair bench on a tiny fp32 pair: identical work for every policy in every round,
lossless outputs, the Williams order, the summary's ratios; and the attention kernels of CUDA forwards."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_models import make_tiny_drafter, make_tiny_target
from torch.nn.attention import SDPBackend
from transformers import AutoModelForCausalLM

from bastion_sglang.bench.plan import repeat_order
from bastion_sglang.bench.report import Spread
from bastion_sglang.controller.latency import LatencyModel
from bastion_sglang.controller.roofline import HardwareSpec, ModelShape, RooflineModel
from bastion_sglang.reference.pair_bench import (
    PairBenchReport,
    PairRound,
    PolicyResult,
    format_table,
    run_pair_bench,
    summarize,
)
from bastion_sglang.reference.target import attention_backends

HARDWARE = HardwareSpec(name="test-cpu", peak_flops=1e11, bandwidth=2e10)
NEW_TOKENS = 12


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[AutoModelForCausalLM, Path, LatencyModel]:
    folder = tmp_path_factory.mktemp("pair")
    target = make_tiny_target(folder / "target", arch="llama")
    drafter = make_tiny_drafter(folder / "drafter", target, num_layers=2, block_size=16)
    model = AutoModelForCausalLM.from_pretrained(target).eval()
    roofline = RooflineModel(ModelShape.from_hf_config(model.config.to_dict()), HARDWARE, bytes_per_element=4)
    return model, drafter, LatencyModel(roofline, width_buckets=(2, 4, 8, 16, 32, 64))


def test_every_policy_does_the_same_lossless_work_in_williams_order(
    pair: tuple[AutoModelForCausalLM, Path, LatencyModel],
) -> None:
    model, drafter, latency = pair
    prompts = [[5, 17, 42, 99, 7], [260, 3, 3, 80]]
    policies = ("ar", "chain", "fixed:4", "adaptive")
    seen: list[PairBenchReport] = []
    report = run_pair_bench(
        model,
        drafter,
        latency,
        prompts,
        target_name="tiny",
        policies=policies,
        temperatures=(0.0, 0.8),
        repeats=2,
        max_new_tokens=NEW_TOKENS,
        max_nodes=16,
        on_round=seen.append,
    )
    assert [r.repeats for r in seen] == [1, 1, 2, 2]
    assert report.width_buckets == [2, 4, 8, 16, 32, 64]  # the passes' padding, as the latency model's
    assert report.orders == [list(repeat_order(list(policies), 0)), list(repeat_order(list(policies), 1))]
    assert report.orders[0] != report.orders[1]
    assert len(report.results) == len(policies) * 2
    for result in report.results:
        assert [r.repeat for r in result.rounds] == [1, 2]
        for measured in result.rounds:
            assert measured.decode_tokens == len(prompts) * (NEW_TOKENS - 1)  # EOS ignored: same work
            assert measured.same_output_as_ar == 1.0  # fp32, seeded: every policy emits ar's tokens
            if result.policy == "ar":
                assert measured.mean_nodes == 0 and measured.tau == 1.0
            if result.policy == "fixed:4":
                assert measured.mean_nodes == 4.0
    assert [s.rates.temperature for s in report.summaries] == [0.0, 0.8]
    assert "adaptive/best" in format_table(report)
    assert latency.ema_factor == 1.0  # every policy run planned with its own copy


def test_summary_ratios_follow_the_medians_and_pair_rounds() -> None:
    def result(policy: str, rates: list[float], temperature: float = 0.0) -> PolicyResult:
        rounds = [
            PairRound(
                repeat=i + 1,
                decode_tokens=100,
                decode_seconds=100 / rate,
                prefill_seconds=0.1,
                decode_tokens_per_second=rate,
                steps=10,
                tau=1.0,
                mean_nodes=0.0,
                mean_verify_ms=1.0,
                mean_draft_ms=0.0,
                verify_prediction_mape=0.0,
                token_latency_p50_ms=1.0,
                token_latency_p90_ms=1.0,
                same_output_as_ar=1.0,
            )
            for i, rate in enumerate(rates)
        ]
        return PolicyResult(
            policy=policy, temperature=temperature, rounds=rounds, decode_tokens_per_second=Spread.of(rates)
        )

    results = [
        result("ar", [8.0, 10.0, 6.0]),
        result("fixed:8", [12.0, 6.0, 12.0]),
        result("fixed:64", [11.0, 11.0, 11.0]),
        result("adaptive", [9.0, 9.0, 12.0]),
        result("adaptive", [99.0, 99.0, 99.0], temperature=0.7),  # another temperature: left out
        result("fixed:16", [50.0, 50.0, 50.0], temperature=0.7),
    ]
    summary = summarize(0.0, results)
    assert summary.rates.best_policy == "fixed:8" and summary.best_fixed_policy == "fixed:8"
    assert summary.rates.adaptive_vs_best == pytest.approx(9.0 / 12.0)
    assert summary.adaptive_vs_best_fixed == pytest.approx(9.0 / 12.0)
    assert summary.rates.adaptive_vs_ar == pytest.approx(9.0 / 8.0)
    paired = summary.rates.adaptive_vs_best_per_repeat
    assert paired is not None
    assert (paired.min, paired.median, paired.max) == pytest.approx((0.75, 1.0, 1.5))


def test_rejects_repeated_policies_and_empty_rounds(
    pair: tuple[AutoModelForCausalLM, Path, LatencyModel],
) -> None:
    model, drafter, latency = pair
    with pytest.raises(ValueError, match="distinct"):
        run_pair_bench(model, drafter, latency, [[5, 6]], target_name="tiny", policies=("ar", "ar"))
    with pytest.raises(ValueError, match="repeats"):
        run_pair_bench(model, drafter, latency, [[5, 6]], target_name="tiny", repeats=0)


def test_cuda_forwards_never_use_cudnn_attention() -> None:
    backends = attention_backends(torch.device("cuda"))
    assert backends is not None
    assert SDPBackend.CUDNN_ATTENTION not in backends
    assert SDPBackend.EFFICIENT_ATTENTION in backends
    assert attention_backends(torch.device("cpu")) is None
