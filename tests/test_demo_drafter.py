"""The committed demo drafter in a real `sglang.Engine` next to the converted SmolLM2-135M-Instruct target.

`models/smollm2-135m-instruct-dflash` (trained by `bastion train-drafter`, see its README.md) must load in
SGLang's DFlash draft model next to the target from `bastion demo setup` (converted at most once into
the user cache by the `demo_target` plugin), and on 8 held-out prompts (4 HumanEval, 4 MT-Bench,
never seen in training) at T = 0 with MAX_NEW_TOKENS new tokens each, one batch:
- the chain policy (DFlash's single path of 15 drafted tokens) accepts more than CHAIN_TAU_FLOOR tokens per
  verify pass on average (bonus included), well above the 1.0 of an untrained drafter;
- best-first trees of 64 nodes (`fixed:64`) accept more per verify pass than the chain;
- the adaptive policy, planning with a GPU-shaped latency profile (SERVING_FIT: a verify pass of the target
  costs about a plain decode step, 18 ms vs 17 ms, nearly the same from 1 to a few hundred tokens, and the
  drafter 2 ms, as for a memory-bound target on a GPU; the profile weighed as 1 / α = 1e6 passes, so the
  CPU's own timings do not reshape it), grows trees and accepts more per verify pass than the chain. With a
  CPU profile it would rightly choose small trees or plain decoding (verify cost rises steeply with width on
  a CPU, and a plain step costs half a speculative one), which says nothing about its τ.
τ = completion tokens / verify passes, summed over the requests (SGLang's `spec_verify_ct`).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from calibration_profiles import serving_plan_flags
from transformers import AutoTokenizer

from bastion_sglang.assets.prompt_sets import chat_prompt_ids, load_prompts
from bastion_sglang.integration.config import BastionConfig
from bastion_sglang.integration.drafter_config import DrafterConfig
from bastion_sglang.registration import attach_config, make_config

if TYPE_CHECKING:
    from demo_target import DemoTarget

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]
pytest_plugins = ["demo_target"]

DRAFTER = Path(__file__).resolve().parents[1] / "models" / "smollm2-135m-instruct-dflash"
PROMPTS_PER_SET = 4
MAX_NEW_TOKENS = 48
CHAIN_TAU_FLOOR = 1.5
MAX_DRAFTER_BYTES = 25 * 1024 * 1024


@pytest.fixture(scope="module")
def target(demo_target: DemoTarget) -> Path:
    return demo_target.path


@pytest.fixture(scope="module")
def prompts(target: Path) -> list[list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(target)
    chosen = [p for name in ("humaneval", "mtbench") for p in load_prompts(name, "heldout")[:PROMPTS_PER_SET]]
    return [chat_prompt_ids(tokenizer, prompt) for prompt in chosen]


def _tau(target: Path, prompts: list[list[int]], name: str, config: BastionConfig) -> float:
    """Mean accepted length of one greedy batch through an Engine running BASTION with `config`."""
    from sglang.srt.entrypoints.engine import Engine
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import ServerArgs

    load_plugins()
    server_args = ServerArgs(
        model_path=str(target),
        speculative_algorithm="BASTION",
        speculative_draft_model_path=str(DRAFTER),
        device="cpu",
        attention_backend="torch_native",
        disable_cuda_graph=True,
        dtype="float32",
        max_total_tokens=8192,
        mem_fraction_static=0.2,
        random_seed=0,
        log_level="error",
    )
    attach_config(server_args, config)
    engine = Engine(server_args=server_args)
    try:
        outputs = engine.generate(
            input_ids=prompts,
            sampling_params={"temperature": 0.0, "max_new_tokens": MAX_NEW_TOKENS, "ignore_eos": True},
        )
    finally:
        engine.shutdown()
    completion = sum(out["meta_info"]["completion_tokens"] for out in outputs)
    passes = sum(out["meta_info"]["spec_verify_ct"] for out in outputs)
    assert completion == MAX_NEW_TOKENS * len(prompts)
    print(f"{name}: tau {completion / passes:.3f} ({completion} tokens, {passes} verify passes)")
    return completion / passes


@pytest.fixture(scope="module")
def taus(
    target: Path, prompts: list[list[int]], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, float]:
    configs = {
        "chain": make_config(policy="chain"),
        "fixed:64": make_config(policy="fixed:64"),
        "adaptive": make_config(policy="adaptive", **serving_plan_flags(tmp_path_factory.mktemp("profile"))),
    }
    return {name: _tau(target, prompts, name, config) for name, config in configs.items()}


def test_committed_drafter_fits_the_size_budget_and_the_target(target: Path) -> None:
    assert (DRAFTER / "README.md").is_file()
    assert sum(f.stat().st_size for f in DRAFTER.iterdir()) <= MAX_DRAFTER_BYTES
    config = DrafterConfig.from_json(DRAFTER)
    assert config.block_size == 16
    assert config.hidden_size == 576


def test_chain_accepts_more_than_the_floor(taus: dict[str, float]) -> None:
    assert taus["chain"] > CHAIN_TAU_FLOOR


def test_trees_accept_more_than_the_chain(taus: dict[str, float]) -> None:
    assert taus["fixed:64"] > taus["chain"]


def test_adaptive_with_a_gpu_profile_accepts_more_than_the_chain(taus: dict[str, float]) -> None:
    assert taus["adaptive"] > taus["chain"]
