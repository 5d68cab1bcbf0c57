"""DrafterConfig parsing (both key places, the default layer spread), the pairing checks, the tiny model
helpers, and the z-lab checkpoint round trip."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tiny_models import EOS_ID, MASK_ID, make_tiny_drafter, make_tiny_target
from transformers import AutoModelForCausalLM, AutoTokenizer

from bastion_sglang.integration.drafter_config import (
    DEFAULT_BLOCK_SIZE,
    DrafterConfig,
    DrafterMismatchError,
    check_drafter_fits,
    default_target_layer_ids,
)
from bastion_sglang.reference import DFlashDrafter

# The released z-lab/Qwen3-8B-DFlash-b16 config, abridged to the keys DrafterConfig reads.
QWEN3_8B_DRAFTER = {
    "architectures": ["DFlashDraftModel"],
    "model_type": "qwen3",
    "block_size": 16,
    "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_attention_heads": 32,
    "num_hidden_layers": 5,
    "num_key_value_heads": 8,
    "num_target_layers": 36,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "vocab_size": 151936,
}
QWEN3_8B_TARGET = {"hidden_size": 4096, "vocab_size": 151936, "num_hidden_layers": 36}

ZLAB_LAYER_WEIGHTS = (
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "self_attn.q_norm.weight",
    "self_attn.k_norm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
)


def without(config: dict, *keys: str) -> dict:
    return {k: v for k, v in config.items() if k not in keys}


def test_parses_the_released_config() -> None:
    config = DrafterConfig.from_json(QWEN3_8B_DRAFTER)
    assert config.mask_token_id == 151669
    assert config.target_layer_ids == (1, 9, 17, 25, 33)
    assert config.num_context_features == 5 and config.block_size == 16 and config.num_target_layers == 36
    assert config.rope_theta == 1e6 and config.rope_scaling is None and config.head_dim == 128
    check_drafter_fits(config, QWEN3_8B_TARGET)


def test_dflash_keys_at_the_top_level_parse_the_same() -> None:
    top_level = {**without(QWEN3_8B_DRAFTER, "dflash_config"), "mask_token_id": 151669}
    top_level["target_layer_ids"] = [1, 9, 17, 25, 33]
    assert DrafterConfig.from_json(top_level) == DrafterConfig.from_json(QWEN3_8B_DRAFTER)


def test_dflash_config_wins_over_the_top_level() -> None:
    both = {**QWEN3_8B_DRAFTER, "mask_token_id": 7, "target_layer_ids": [2, 3], "block_size": 10}
    both["dflash_config"] = {**QWEN3_8B_DRAFTER["dflash_config"], "block_size": 8}
    config = DrafterConfig.from_json(both)
    assert config.mask_token_id == 151669 and config.target_layer_ids == (1, 9, 17, 25, 33)
    assert config.block_size == 8


def test_default_spread_matches_dflash() -> None:
    assert default_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)  # the released Qwen3-8B drafter's ids
    assert default_target_layer_ids(28, 5) == (1, 7, 13, 19, 25)
    assert default_target_layer_ids(36, 1) == (18,)
    assert default_target_layer_ids(4, 2) == (1, 1)
    with pytest.raises(ValueError, match="needs a target of >= 4 layers"):
        default_target_layer_ids(3, 2)


def test_missing_layer_ids_are_spread_over_the_runtime_target_first() -> None:
    config = without(QWEN3_8B_DRAFTER, "dflash_config")
    config["mask_token_id"] = 151669
    assert DrafterConfig.from_json(config).target_layer_ids == (1, 9, 17, 25, 33)  # num_target_layers 36
    assert DrafterConfig.from_json(config, target_num_layers=28).target_layer_ids == (1, 7, 13, 19, 25)
    with pytest.raises(ValueError, match="no target_layer_ids and no num_target_layers"):
        DrafterConfig.from_json(without(config, "num_target_layers"))


def test_missing_values_are_named() -> None:
    with pytest.raises(ValueError, match="no mask_token_id"):
        DrafterConfig.from_json({**QWEN3_8B_DRAFTER, "dflash_config": {"target_layer_ids": [1]}})
    with pytest.raises(ValueError, match="'hidden_size' is missing"):
        DrafterConfig.from_json(without(QWEN3_8B_DRAFTER, "hidden_size"))
    assert DrafterConfig.from_json(without(QWEN3_8B_DRAFTER, "block_size")).block_size == DEFAULT_BLOCK_SIZE


@pytest.mark.parametrize(
    ("target", "message"),
    [
        (
            {**QWEN3_8B_TARGET, "hidden_size": 2560},
            "hidden_size 4096 differs from the target's hidden_size 2560",
        ),
        (
            {**QWEN3_8B_TARGET, "vocab_size": 151000},
            "mask_token_id 151669 is outside the target's vocabulary",
        ),
        (
            {**QWEN3_8B_TARGET, "vocab_size": 152064},
            "vocab_size 151936 differs from the target's vocab_size 152064",
        ),
        ({**QWEN3_8B_TARGET, "num_hidden_layers": 30}, r"has ids \[33\] outside 0..28"),
        ({**QWEN3_8B_TARGET, "num_hidden_layers": 34}, r"has ids \[33\] outside 0..32"),
        ({**QWEN3_8B_TARGET, "num_hidden_layers": 40}, "num_target_layers 36 differs from the target's"),
        ({"text_config": {**QWEN3_8B_TARGET, "hidden_size": 2560}}, "hidden_size 2560"),
    ],
)
def test_each_mismatch_is_reported(target: dict, message: str) -> None:
    with pytest.raises(DrafterMismatchError, match=message):
        check_drafter_fits(DrafterConfig.from_json(QWEN3_8B_DRAFTER), target)


def test_tiny_target_loads_with_its_tokenizer(tmp_path: Path) -> None:
    path = make_tiny_target(tmp_path / "target", arch="llama", vocab_size=300)
    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = tokenizer("héllo <|mask|>")["input_ids"]
    assert ids[-1] == MASK_ID and tokenizer.decode(ids) == "héllo <|mask|>"
    assert tokenizer.eos_token_id == EOS_ID and tokenizer.mask_token_id == MASK_ID
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat == "<|bos|>user: hi\n<|bos|>assistant: "
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.config.eos_token_id == EOS_ID and model.generation_config.eos_token_id == EOS_ID
    assert model.config.vocab_size == 300 and type(model).__name__ == "LlamaForCausalLM"


def test_tiny_drafter_has_the_zlab_layout_and_fits_its_target(tmp_path: Path) -> None:
    target = make_tiny_target(tmp_path / "target", num_layers=6)
    drafter = make_tiny_drafter(tmp_path / "drafter", target, num_layers=3, block_size=8)
    raw = json.loads((drafter / "config.json").read_text())
    assert raw["architectures"] == ["DFlashDraftModel"] and raw["model_type"] == "qwen3"
    assert raw["dflash_config"] == {"mask_token_id": MASK_ID, "target_layer_ids": [1, 2, 3]}
    weights = load_file(str(drafter / "model.safetensors"))
    expected = {"fc.weight", "hidden_norm.weight", "norm.weight"} | {
        f"layers.{i}.{name}" for i in range(3) for name in ZLAB_LAYER_WEIGHTS
    }
    assert set(weights) == expected
    assert tuple(weights["fc.weight"].shape) == (64, 3 * 64)
    config = DrafterConfig.from_json(drafter)
    check_drafter_fits(config, json.loads((target / "config.json").read_text()))


def test_zlab_round_trip_keeps_weights_and_config(tmp_path: Path) -> None:
    target = make_tiny_target(tmp_path / "target")
    source = make_tiny_drafter(tmp_path / "drafter", target, target_layer_ids=[0, 2], seed=3)
    loaded = DFlashDrafter.from_pretrained(source)
    saved = loaded.save_pretrained(tmp_path / "saved")
    again = DFlashDrafter.from_pretrained(saved)
    assert again.config == loaded.config == DrafterConfig.from_json(source)
    original = load_file(str(source / "model.safetensors"))
    rewritten = load_file(str(saved / "model.safetensors"))
    assert set(original) == set(rewritten) == set(again.state_dict())
    for name, tensor in original.items():
        assert torch.equal(rewritten[name], tensor) and torch.equal(again.state_dict()[name], tensor), name


def test_loading_rejects_a_checkpoint_that_does_not_match_its_config(tmp_path: Path) -> None:
    target = make_tiny_target(tmp_path / "target")
    drafter = make_tiny_drafter(tmp_path / "drafter", target)
    raw = json.loads((drafter / "config.json").read_text())
    raw["dflash_config"]["target_layer_ids"] = [0, 1, 2]  # fc expects 3 features, the weights hold 2
    (drafter / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=r"fc.weight has shape \(64, 128\), the config implies \(64, 192\)"):
        DFlashDrafter.from_pretrained(drafter)
    raw["num_hidden_layers"] = 3
    raw["dflash_config"]["target_layer_ids"] = [0, 1]
    (drafter / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=r"missing \['layers.2"):
        DFlashDrafter.from_pretrained(drafter)


def test_dflash_variants_are_recorded_and_refused_by_the_reference_drafter() -> None:
    assert DrafterConfig.from_json(QWEN3_8B_DRAFTER).variant_features == ()
    variant = {**QWEN3_8B_DRAFTER, "layer_types": ["sliding_attention"] * 5, "use_gemma_norm": False}
    variant["dflash_config"] = {
        **QWEN3_8B_DRAFTER["dflash_config"],
        "conv_kernel_size": 4,
        "projector_type": None,
    }
    config = DrafterConfig.from_json(variant)
    assert config.variant_features == ("conv_kernel_size=4", "layer_types='sliding_attention'")
    with pytest.raises(ValueError, match=r"plain DFlash only; this config sets .*conv_kernel_size=4"):
        DFlashDrafter(config)
