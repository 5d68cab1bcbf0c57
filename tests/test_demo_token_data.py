"""The committed token data of the demo target (`data/demo-regenerated`, `training.token_data`).

Its manifest validates; every chunk matches its SHA-256 and token counts; every sequence is a training-split
prompt of its set (never a held-out one) in the demo target's chat template, answered in at most
max_new_tokens tokens of the target's vocabulary; the chunks follow the manifest's plan in order; and the
target fingerprint is the demo target's from `bastion demo setup`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from transformers import AutoTokenizer

from bastion_sglang.assets.prompt_sets import chat_prompt_ids, load_prompts
from bastion_sglang.training.data import target_fingerprint
from bastion_sglang.training.token_data import TokenSequence, load_token_data, read_token_manifest

if TYPE_CHECKING:
    from demo_target import DemoTarget

pytest_plugins = ["demo_target"]

DATA = Path(__file__).resolve().parents[1] / "data" / "demo-regenerated"
MAX_DATA_BYTES = 12 * 1024 * 1024


@pytest.fixture(scope="module")
def sequences() -> list[TokenSequence]:
    return load_token_data(DATA)  # checks every chunk's SHA-256, array shapes and token counts


def test_manifest_validates_and_plans_the_training_split_only() -> None:
    manifest = read_token_manifest(DATA)
    assert manifest is not None and manifest.chunks
    assert manifest.split == "train"
    assert manifest.prompt_sets == ("humaneval", "mtbench", "sharegpt")
    assert (manifest.settings.max_new_tokens, manifest.settings.dtype) == (128, "float32")
    train = {p.key for name in manifest.prompt_sets for p in load_prompts(name, "train")}
    heldout = {p.key for name in manifest.prompt_sets for p in load_prompts(name, "heldout")}
    assert set(manifest.planned_keys) == train
    assert not set(manifest.planned_keys) & heldout
    skipped = set(manifest.skipped_keys)
    in_order = [key for key in manifest.planned_keys if key not in skipped]
    assert manifest.done_keys == in_order[: len(manifest.done_keys)]  # plan order, long prompts skipped
    assert sum(f.stat().st_size for f in DATA.iterdir()) <= MAX_DATA_BYTES


def test_sequences_are_training_prompts_answered_within_the_limits(sequences: list[TokenSequence]) -> None:
    manifest = read_token_manifest(DATA)
    assert manifest is not None
    assert [s.key for s in sequences] == manifest.done_keys
    assert sum(len(s.response) for s in sequences) == manifest.response_tokens
    drafter = DATA.parents[1] / "models" / "smollm2-135m-instruct-dflash"
    vocab = json.loads((drafter / "config.json").read_text())
    for sequence in sequences:
        assert 1 <= len(sequence.response) <= manifest.settings.max_new_tokens
        assert len(sequence.prompt) <= manifest.settings.max_prompt_tokens
        assert int(max(sequence.prompt.max(), sequence.response.max())) < vocab["vocab_size"]


def test_data_comes_from_the_demo_target_and_its_chat_template(
    demo_target: DemoTarget, sequences: list[TokenSequence]
) -> None:
    manifest = read_token_manifest(DATA)
    assert manifest is not None
    assert manifest.settings.target_fingerprint == target_fingerprint(demo_target.path)
    tokenizer = AutoTokenizer.from_pretrained(demo_target.path)
    prompts = {p.key: p for name in manifest.prompt_sets for p in load_prompts(name, "train")}
    for sequence in sequences[:: max(1, len(sequences) // 200)]:
        assert sequence.prompt.tolist() == chat_prompt_ids(tokenizer, prompts[sequence.key])
