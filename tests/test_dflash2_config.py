"""DFlash2 drafter configs: the published format parses, every selector field is honoured or refused by
name, DFlash configs parse as before, and a DFlash2 checkpoint round-trips through the reference drafter."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file
from tiny_dflash2 import make_tiny_dflash2_drafter
from tiny_models import make_tiny_target

from bastion_sglang.integration.drafter_config import (
    DFLASH2_ARCHITECTURES,
    DrafterConfig,
    SelectorConfig,
)
from bastion_sglang.reference import DFlashDrafter

# A published DFlash2 config (z-lab Qwen3.8-27B-DFlash2), abridged to the keys DrafterConfig reads.
PUBLISHED_DFLASH2 = {
    "architectures": ["DFlash2DraftModel"],
    "attention_bias": False,
    "is_causal": False,
    "dflash_config": {
        "block_size": 8,
        "conv_group_size": 16,
        "conv_kernel_size": 2,
        "mask_token_id": 248070,
        "selector_rank": 256,
        "selector_top_k": 16,
        "target_layer_ids": [5, 19, 33, 47, 61],
    },
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 5120,
    "intermediate_size": 17408,
    "layer_types": ["sliding_attention"] * 5,
    "num_attention_heads": 32,
    "num_hidden_layers": 5,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_parameters": {"rope_theta": 10000000, "rope_type": "default"},
    "sliding_window": 2048,
    "vocab_size": 248320,
}
# The same drafter's backbone as a plain DFlash config, without the variants the reference refuses.
PLAIN_BACKBONE = {
    **PUBLISHED_DFLASH2,
    "architectures": ["DFlashDraftModel"],
    "layer_types": ["full_attention"] * 5,
    "dflash_config": {"block_size": 16, "mask_token_id": 248070, "target_layer_ids": [5, 19, 33, 47, 61]},
}


def dflash2(**dflash: object) -> dict:
    """PLAIN_BACKBONE as a DFlash2 drafter with the given dflash_config keys added."""
    return {
        **PLAIN_BACKBONE,
        "architectures": ["DFlash2DraftModel"],
        "dflash_config": {**PLAIN_BACKBONE["dflash_config"], **dflash},
    }


def test_the_published_dflash2_config_parses_and_names_what_the_reference_lacks() -> None:
    config = DrafterConfig.from_json(PUBLISHED_DFLASH2)
    assert config.selector == SelectorConfig(rank=256, top_k=16)
    assert config.block_size == 8 and config.target_layer_ids == (5, 19, 33, 47, 61)
    assert config.variant_features == (
        "conv_kernel_size=2",
        "layer_types='sliding_attention'",
    )
    with pytest.raises(ValueError, match=r"plain DFlash only; this config sets .*conv_kernel_size=2"):
        DFlashDrafter(config)


@pytest.mark.parametrize("architecture", DFLASH2_ARCHITECTURES)
@pytest.mark.parametrize("block_size", [8, 16])
def test_each_dflash2_architecture_and_block_size_is_honoured(architecture: str, block_size: int) -> None:
    raw = dflash2(selector_rank=32, selector_top_k=8, output_multiplier=0.5, final_logit_softcapping=30.0)
    raw["architectures"] = [architecture]
    raw["dflash_config"]["block_size"] = block_size
    config = DrafterConfig.from_json(raw)
    assert config.selector == SelectorConfig(
        architecture=architecture, rank=32, top_k=8, output_multiplier=0.5, final_logit_softcapping=30.0
    )
    assert config.block_size == block_size and config.variant_features == ()
    assert DrafterConfig.from_json(config.to_json()) == config


def test_softcap_follows_sglang_null_zero_and_negative_are_no_cap() -> None:
    for softcap in (None, 0, 0.0, -3.0):
        config = DrafterConfig.from_json(
            dflash2(selector_rank=4, selector_top_k=2, final_logit_softcapping=softcap)
        )
        assert config.selector is not None and config.selector.final_logit_softcapping is None


@pytest.mark.parametrize(
    ("dflash", "message"),
    [
        ({"selector_top_k": 8}, r"needs dflash_config.selector_rank, a positive integer, got None"),
        ({"selector_rank": 32}, r"needs dflash_config.selector_top_k, a positive integer, got None"),
        (
            {"selector_rank": 0, "selector_top_k": 8},
            r"dflash_config.selector_rank, a positive integer, got 0",
        ),
        ({"selector_rank": 2.5, "selector_top_k": 8}, r"selector_rank, a positive integer, got 2.5"),
        ({"selector_rank": "32", "selector_top_k": 8}, r"dflash_config.selector_rank must be a number"),
        (
            {"selector_rank": 4, "selector_top_k": 2, "output_multiplier": 0},
            r"output_multiplier must be positive",
        ),
        (
            {"selector_rank": 4, "selector_top_k": 300000},
            r"selector_top_k 300000 exceeds .* vocab_size 248320",
        ),
    ],
)
def test_bad_selector_fields_are_named(dflash: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DrafterConfig.from_json(dflash2(**dflash))


@pytest.mark.parametrize(
    "key", ["selector_rank", "selector_top_k", "output_multiplier", "final_logit_softcapping"]
)
def test_a_top_level_selector_field_sglang_would_ignore_is_refused(key: str) -> None:
    raw = {**dflash2(selector_rank=4, selector_top_k=2), key: 3}
    with pytest.raises(ValueError, match=rf"top-level {key} = 3.* SGLang reads dflash_config.{key} only"):
        DrafterConfig.from_json(raw)
    same = {**dflash2(**{"selector_rank": 4, "selector_top_k": 2, key: 3}), key: 3}
    assert DrafterConfig.from_json(same).selector is not None


def test_selector_fields_on_a_dflash_architecture_stay_refused_variants() -> None:
    raw = {**PLAIN_BACKBONE, "architectures": ["DFlashDraftModel"]}
    raw["dflash_config"] = {
        **PLAIN_BACKBONE["dflash_config"],
        "selector_rank": 32,
        "selector_top_k": 8,
        "output_multiplier": 2.0,
        "final_logit_softcapping": 30.0,
    }
    config = DrafterConfig.from_json(raw)
    assert config.selector is None
    assert config.variant_features == (
        "selector_rank=32",
        "final_logit_softcapping=30.0",
        "output_multiplier=2.0",
    )
    with pytest.raises(ValueError, match=r"plain DFlash only; this config sets .*selector_rank=32"):
        DFlashDrafter(config)
    first_dflash = {**raw, "architectures": ["DFlashDraftModel", "DFlash2DraftModel"]}
    assert DrafterConfig.from_json(first_dflash).selector is None  # SGLang builds the first it knows


def test_dflash_configs_parse_without_a_selector_and_write_as_before() -> None:
    config = DrafterConfig.from_json(PLAIN_BACKBONE)
    assert config.selector is None and config.variant_features == ()
    written = config.to_json()
    assert written["architectures"] == ["DFlashDraftModel"]
    assert written["auto_map"] == {"AutoModel": "dflash.DFlashDraftModel"}
    assert set(written["dflash_config"]) == {"mask_token_id", "target_layer_ids"}
    with pytest.raises(ValueError, match="architectures must be a list"):
        DrafterConfig.from_json({**PLAIN_BACKBONE, "architectures": "DFlash2DraftModel"})


def test_a_dflash2_checkpoint_round_trips_with_sglangs_weight_names(tmp_path: Path) -> None:
    target = make_tiny_target(tmp_path / "target")
    source = make_tiny_dflash2_drafter(
        tmp_path / "drafter", target, rank=6, top_k=3, output_multiplier=0.75, final_logit_softcapping=4.0
    )
    loaded = DFlashDrafter.from_pretrained(source)
    assert loaded.config.selector == SelectorConfig(
        rank=6, top_k=3, output_multiplier=0.75, final_logit_softcapping=4.0
    )
    saved = loaded.save_pretrained(tmp_path / "saved")
    raw = json.loads((saved / "config.json").read_text())
    assert raw["architectures"] == ["DFlash2DraftModel"] and "auto_map" not in raw
    assert {k: raw["dflash_config"][k] for k in ("selector_rank", "selector_top_k")} == {
        "selector_rank": 6,
        "selector_top_k": 3,
    }
    weights = load_file(str(saved / "model.safetensors"))
    assert tuple(weights["candidate_selector.predecessor_codebook"].shape) == (512, 6)
    assert tuple(weights["candidate_selector.successor_codebook"].shape) == (512, 6)
    assert tuple(weights["candidate_selector.hidden_projection.weight"].shape) == (6, 64)
    original = load_file(str(source / "model.safetensors"))
    assert set(weights) == set(original)
    again = DFlashDrafter.from_pretrained(saved)
    assert again.config == loaded.config
    for name, tensor in original.items():
        assert (again.state_dict()[name] == tensor).all(), name
    raw["dflash_config"]["selector_rank"] = 5
    (saved / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=r"hidden_projection.weight has shape \(6, 64\), the config implies"):
        DFlashDrafter.from_pretrained(saved)
