"""The committed demo DFlash2 drafter (`models/smollm2-135m-instruct-dflash2`, trained by `bastion
train-drafter --arch dflash2` on the frozen demo DFlash drafter, stored as its selector and assembled with
the DFlash backbone by `demo_drafters.assemble_dflash2`) on the reference engine beside the demo target: it
fits the size budget, keeps its backbone's weights, and its lattice trees and chain emit exactly the target's
tokens in fp32, greedy and seeded-sampled, on held-out prompts."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from bastion_sglang.assets.prompt_sets import PROMPT_SETS, chat_prompt_ids, plan_prompts
from bastion_sglang.controller.roofline import CPU_HARDWARE
from bastion_sglang.demo.drafters import assemble_dflash2
from bastion_sglang.integration.drafter_config import DrafterConfig, SelectorConfig
from bastion_sglang.reference import ReferenceEngine
from bastion_sglang.reference.lattice_proposer import DFlash2Proposer
from bastion_sglang.training.card import read_card_metadata

if TYPE_CHECKING:
    from demo_target import DemoTarget

pytest_plugins = ["demo_target"]
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

MODELS = Path(__file__).resolve().parents[1] / "models"
PARTS = MODELS / "smollm2-135m-instruct-dflash2"
BACKBONE = MODELS / "smollm2-135m-instruct-dflash"
MAX_DRAFTER_BYTES = 25 * 1024 * 1024
NEW_TOKENS = 24
SAMPLING = dict(temperature=0.7, top_p=0.9, top_k=50, min_p=0.05, seed=3)


@pytest.fixture(scope="module")
def drafter(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The assembled checkpoint (backbone and selector in one model.safetensors)."""
    return assemble_dflash2(PARTS, BACKBONE, tmp_path_factory.mktemp("drafters"))


@pytest.fixture(scope="module")
def model(demo_target: DemoTarget) -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(demo_target.path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts(demo_target: DemoTarget) -> list[list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(demo_target.path)
    return [chat_prompt_ids(tokenizer, p) for p in plan_prompts(list(PROMPT_SETS), "heldout", 1)]


@pytest.fixture(scope="module")
def engine(model: PreTrainedModel, drafter: Path) -> ReferenceEngine:
    return ReferenceEngine(
        model, drafter, device="cpu", dtype=torch.float32, hardware=CPU_HARDWARE, max_nodes=64
    )


def test_the_drafter_fits_the_budget_and_keeps_its_backbone(drafter: Path) -> None:
    assert sum(f.stat().st_size for f in drafter.iterdir()) <= MAX_DRAFTER_BYTES
    config = DrafterConfig.from_json(drafter)
    assert config.selector == SelectorConfig(rank=32, top_k=8)
    assert config.model_copy(update={"selector": None}) == DrafterConfig.from_json(BACKBONE)
    weights, backbone = (
        load_file(str(drafter / "model.safetensors")),
        load_file(str(BACKBONE / "model.safetensors")),
    )
    assert set(weights) - set(backbone) == {
        "candidate_selector.predecessor_codebook",
        "candidate_selector.successor_codebook",
        "candidate_selector.hidden_projection.weight",
    }
    assert all(torch.equal(weights[name], tensor) for name, tensor in backbone.items())
    summary = read_card_metadata(drafter / "README.md").bastion_training
    assert summary.acceptance is not None and summary.backbone_acceptance is not None


@pytest.fixture(scope="module")
def generated(model: PreTrainedModel, prompts: list[list[int]]) -> list[list[int]]:
    """Transformers' greedy continuation of each prompt, NEW_TOKENS long (computed once for every policy)."""
    return [
        model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False)[
            0, len(prompt) :
        ].tolist()
        for prompt in prompts
    ]


@pytest.fixture(scope="module")
def plain_sampled(prompts: list[list[int]], engine: ReferenceEngine) -> list[list[int]]:
    """Plain decoding (`ar`) of each prompt under SAMPLING (computed once for every policy)."""
    return [engine.generate(prompt, NEW_TOKENS, policy="ar", **SAMPLING).tokens for prompt in prompts]


@pytest.mark.parametrize("policy", ["chain", "fixed:16", "fixed:64", "adaptive"])
def test_greedy_equals_generate(
    prompts: list[list[int]], generated: list[list[int]], engine: ReferenceEngine, policy: str
) -> None:
    assert isinstance(engine.proposer, DFlash2Proposer)
    for prompt, expected in zip(prompts, generated, strict=True):
        result = engine.generate(prompt, NEW_TOKENS, policy=policy)
        assert result.tokens == expected, (policy, prompt)


@pytest.mark.parametrize("policy", ["chain", "fixed:16"])
def test_seeded_sampling_equals_plain_decoding(
    prompts: list[list[int]], plain_sampled: list[list[int]], engine: ReferenceEngine, policy: str
) -> None:
    for prompt, plain in zip(prompts, plain_sampled, strict=True):
        assert engine.generate(prompt, NEW_TOKENS, policy=policy, **SAMPLING).tokens == plain, policy
