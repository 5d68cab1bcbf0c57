"""The DFlash drafter's config.json (z-lab checkpoint format), parsed once and checked against a target.

Terms. L: the target's decoder layers. A drafter reads the outputs of target layers `target_layer_ids`
(0-based, HF style: `hidden_states[l + 1]`); SGLang captures them as the input of layer l + 1, so every id
must lie in 0..L-2. `mask_token_id` fills the block positions the drafter predicts; it is looked up in the
target's embedding, so it must be below the target's vocabulary size.

Parsing follows SGLang 0.5.23 (`speculative/dflash_utils.py:parse_dflash_draft_config`): `block_size`,
`num_target_layers`, `mask_token_id` and `target_layer_ids` are read from `dflash_config` first, then from
the top level; a missing `block_size` means 16; missing `target_layer_ids` are spread over the target's
layers as DFlash does (`default_target_layer_ids`).

DFlash2. A config whose first DFlash architecture is one of `DFLASH2_ARCHITECTURES` is a DFlash2 drafter:
the DFlash backbone plus SGLang's candidate selector (`SelectorConfig`). SGLang reads its four fields
(`selector_rank`, `selector_top_k`, `output_multiplier`, `final_logit_softcapping`) from `dflash_config`
only; each is honoured there, and a different value of one at the top level (which SGLang ignores) is
refused by name. On any other architecture those fields stay DFlash variants (`variant_features`), as SGLang
builds its plain `DFlashDraftModel` and bypasses them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

DEFAULT_BLOCK_SIZE = 16
"""Block size SGLang assumes when a drafter config names none."""
PLAIN_VALUES: dict[str, object] = {
    "conv_kernel_size": 0,
    "selector_rank": 0,
    "projector_type": None,
    "attention_sink_bias": False,
    "attention_value_scale": None,
    "final_logit_softcapping": 0,
    "output_multiplier": 1.0,
    "use_gemma_norm": False,
    "is_causal": False,
}
"""Keys of DFlash variants (grouped convolutions, candidate selectors, Domino projectors, attention sinks,
...) with the value a plain DFlash drafter has; a value other than that or null makes it a variant
(`DrafterConfig.variant_features`)."""


DFLASH_ARCHITECTURE = "DFlashDraftModel"
"""SGLang's plain DFlash model class."""
DFLASH2_ARCHITECTURES = ("DFlash2DraftModel", "DFlash2BeamDraftModel", "MiniMaxDFlash2DraftModel")
"""SGLang 0.5.23's DFlash2 model classes (`srt/models/dflash.py`): one model, three names."""
SELECTOR_KEYS = ("selector_rank", "selector_top_k", "output_multiplier", "final_logit_softcapping")
"""The `dflash_config` keys a DFlash2 drafter honours (`SelectorConfig`)."""


class SelectorConfig(BaseModel):
    """A DFlash2 drafter's candidate selector and the transform of its unary logits (SGLang's
    `DFlashDraftConfig` fields of the same names; `reference.selector` defines the math)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    architecture: str = Field(default=DFLASH2_ARCHITECTURES[0], description="one of DFLASH2_ARCHITECTURES")
    rank: int = Field(gt=0, description="r: columns of the [vocab, r] codebooks and rows of the projection")
    top_k: int = Field(gt=0, description="K: candidates kept per slot")
    output_multiplier: float = Field(default=1.0, gt=0, description="factor on the unary logits")
    final_logit_softcapping: float | None = Field(
        default=None, gt=0, description="c: unary logits become c·tanh(x / c) after the factor; None: no cap"
    )

    @model_validator(mode="after")
    def _known_architecture(self) -> SelectorConfig:
        if self.architecture not in DFLASH2_ARCHITECTURES:
            raise ValueError(
                f"selector architecture {self.architecture!r} is not one of {list(DFLASH2_ARCHITECTURES)}"
            )
        return self


class DrafterMismatchError(ValueError):
    """A drafter does not fit the target it is paired with (hidden size, vocabulary or target layers)."""


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """DFlash's default feature layers: num_draft_layers ids spread evenly over 1..L-3, rounded.

    One draft layer reads layer L // 2. Matches SGLang's `build_target_layer_ids` (round half to even, as
    Python's round does). Raises ValueError for non-positive counts or, with several draft layers, L < 4.
    """
    if num_target_layers <= 0:
        raise ValueError(f"num_target_layers must be positive, got {num_target_layers}")
    if num_draft_layers <= 0:
        raise ValueError(f"num_draft_layers must be positive, got {num_draft_layers}")
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    start, end = 1, num_target_layers - 3
    if end < start:
        raise ValueError(
            f"spreading {num_draft_layers} feature layers needs a target of >= 4 layers, got "
            f"{num_target_layers}; set dflash_config.target_layer_ids explicitly"
        )
    span = end - start
    return tuple(round(start + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers))


class DrafterConfig(BaseModel):
    """The fields of a DFlash drafter config that the drafter math and the pairing checks need."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    hidden_size: int = Field(gt=0, description="width of the drafter = the target's hidden size")
    num_hidden_layers: int = Field(gt=0, description="draft decoder layers")
    num_attention_heads: int = Field(gt=0)
    num_key_value_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    intermediate_size: int = Field(gt=0, description="SwiGLU width of each draft layer")
    rms_norm_eps: float = Field(gt=0)
    rope_theta: float = Field(gt=0)
    rope_scaling: dict[str, Any] | None = Field(
        default=None, description="rope scaling parameters; None (or rope_type 'default') is plain RoPE"
    )
    vocab_size: int = Field(gt=0)
    hidden_act: str = "silu"
    attention_bias: bool = False
    block_size: int = Field(gt=0, description="tokens per draft block: the bonus token + block_size-1 masks")
    num_target_layers: int | None = Field(default=None, gt=0, description="L the drafter was trained on")
    mask_token_id: int = Field(ge=0)
    target_layer_ids: tuple[int, ...] = Field(min_length=1, description="target layers read, 0-based")
    variant_features: tuple[str, ...] = Field(
        default=(),
        description="'key=value' of DFlash variant settings (PLAIN_VALUES), sliding layers included",
    )
    selector: SelectorConfig | None = Field(default=None, description="DFlash2's selector; None: DFlash")

    @model_validator(mode="after")
    def _selector_fits(self) -> DrafterConfig:
        if self.selector is not None and self.selector.top_k > self.vocab_size:
            raise ValueError(
                f"selector_top_k {self.selector.top_k} exceeds the drafter's vocab_size {self.vocab_size}"
            )
        return self

    @property
    def num_context_features(self) -> int:
        """Target layers concatenated per position: fc maps [num_context_features·h] -> [h]."""
        return len(self.target_layer_ids)

    @classmethod
    def from_json(
        cls, source: str | Path | Mapping[str, Any], *, target_num_layers: int | None = None
    ) -> DrafterConfig:
        """Parse a drafter config: a dict, a config.json path, or the checkpoint folder holding it.

        target_num_layers: the runtime target's layer count; when the config has no target_layer_ids they
        are spread over it (SGLang does the same), else over the config's num_target_layers.
        Raises ValueError naming the missing or bad key.
        """
        raw, where = _read(source)
        dflash = raw.get("dflash_config") or {}
        if not isinstance(dflash, Mapping):
            raise ValueError(f"{where}: dflash_config must be an object, got {dflash!r}")

        def pick(key: str) -> Any:
            return dflash[key] if dflash.get(key) is not None else raw.get(key)

        def need(key: str) -> Any:
            if raw.get(key) is None:
                raise ValueError(f"{where}: required key {key!r} is missing")
            return raw[key]

        heads = int(need("num_attention_heads"))
        hidden = int(need("hidden_size"))
        layers = int(need("num_hidden_layers"))
        rope = raw.get("rope_parameters") or {}
        rope_theta = raw.get("rope_theta") or rope.get("rope_theta")
        if rope_theta is None:
            raise ValueError(f"{where}: no rope_theta (looked at the top level and in rope_parameters)")
        rope_scaling = raw.get("rope_scaling")
        if rope_scaling is None and rope.get("rope_type", "default") != "default":
            rope_scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
        mask_token_id = pick("mask_token_id")
        if mask_token_id is None:
            raise ValueError(
                f"{where}: no mask_token_id (looked in dflash_config and at the top level); "
                "add dflash_config.mask_token_id"
            )
        num_target_layers = pick("num_target_layers")
        layer_ids = pick("target_layer_ids")
        if layer_ids is None:
            spread_over = target_num_layers or num_target_layers
            if spread_over is None:
                raise ValueError(
                    f"{where}: no target_layer_ids and no num_target_layers to spread them over; "
                    "pass target_num_layers or add dflash_config.target_layer_ids"
                )
            layer_ids = default_target_layer_ids(int(spread_over), layers)
        elif not isinstance(layer_ids, list | tuple) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in layer_ids
        ):
            raise ValueError(f"{where}: target_layer_ids must be a list of ints, got {layer_ids!r}")
        block_size = pick("block_size")
        selector = _selector(raw, dflash, where)
        honoured = SELECTOR_KEYS if selector is not None else ()
        variants = [
            f"{key}={pick(key)!r}"
            for key, plain in PLAIN_VALUES.items()
            if key not in honoured and pick(key) not in (None, plain)
        ]
        variants += [
            f"layer_types={t!r}" for t in sorted(set(raw.get("layer_types") or ())) if t != "full_attention"
        ]
        return cls(
            hidden_size=hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            intermediate_size=int(need("intermediate_size")),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            vocab_size=int(need("vocab_size")),
            hidden_act=str(raw.get("hidden_act", "silu")),
            attention_bias=bool(raw.get("attention_bias", False)),
            block_size=int(block_size) if block_size is not None else DEFAULT_BLOCK_SIZE,
            num_target_layers=int(num_target_layers) if num_target_layers is not None else None,
            mask_token_id=int(mask_token_id),
            target_layer_ids=tuple(layer_ids),
            variant_features=tuple(variants),
            selector=selector,
        )

    def to_json(self) -> dict[str, Any]:
        """The config.json of a z-lab-format checkpoint (DFlash keys under dflash_config; a DFlash2
        drafter names its architecture and adds the selector's four keys there)."""
        dflash: dict[str, Any] = {
            "mask_token_id": self.mask_token_id,
            "target_layer_ids": list(self.target_layer_ids),
        }
        head: dict[str, Any] = {
            "architectures": [DFLASH_ARCHITECTURE],
            "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        }
        if self.selector is not None:
            head = {"architectures": [self.selector.architecture]}
            dflash |= {
                "selector_rank": self.selector.rank,
                "selector_top_k": self.selector.top_k,
                "output_multiplier": self.selector.output_multiplier,
                "final_logit_softcapping": self.selector.final_logit_softcapping,
            }
        return {
            **head,
            "model_type": "qwen3",
            "attention_bias": self.attention_bias,
            "block_size": self.block_size,
            "dflash_config": dflash,
            "head_dim": self.head_dim,
            "hidden_act": self.hidden_act,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "layer_types": ["full_attention"] * self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_hidden_layers": self.num_hidden_layers,
            "num_key_value_heads": self.num_key_value_heads,
            "num_target_layers": self.num_target_layers,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_scaling": self.rope_scaling,
            "rope_theta": self.rope_theta,
            "tie_word_embeddings": False,
            "vocab_size": self.vocab_size,
        }


def _selector(raw: Mapping[str, Any], dflash: Mapping[str, Any], where: str) -> SelectorConfig | None:
    """The selector of a DFlash2 config (module docstring), None for another architecture. ValueError naming
    the key: a missing or non-positive rank or top_k, a non-positive multiplier, a non-number, or a top-level
    value of one of SELECTOR_KEYS that differs from what SGLang reads in dflash_config."""
    architectures = raw.get("architectures") or []
    if not isinstance(architectures, list | tuple):
        raise ValueError(f"{where}: architectures must be a list of class names, got {architectures!r}")
    known = [name for name in architectures if name == DFLASH_ARCHITECTURE or name in DFLASH2_ARCHITECTURES]
    if not known or known[0] not in DFLASH2_ARCHITECTURES:
        return None

    def number(key: str, default: float | None) -> float | None:
        value = dflash.get(key, default)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise ValueError(f"{where}: dflash_config.{key} must be a number, got {value!r}")
        return value

    values: dict[str, Any] = {}
    for key in ("selector_rank", "selector_top_k"):
        value = number(key, None)
        if value is None or value != int(value) or value < 1:
            raise ValueError(
                f"{where}: architecture {known[0]} needs dflash_config.{key}, a positive integer, "
                f"got {value!r}"
            )
        values[key] = int(value)
    multiplier = number("output_multiplier", 1.0)
    if multiplier is None or multiplier <= 0:
        raise ValueError(f"{where}: dflash_config.output_multiplier must be positive, got {multiplier!r}")
    values["output_multiplier"] = float(multiplier)
    softcap = float(number("final_logit_softcapping", None) or 0.0)
    values["final_logit_softcapping"] = softcap if softcap > 0 else None  # SGLang: <= 0 or null is no cap
    for key in SELECTOR_KEYS:
        top = raw.get(key)
        if key == "final_logit_softcapping" and isinstance(top, int | float) and not isinstance(top, bool):
            top = float(top) if top > 0 else None
        if top is not None and top != values[key]:
            raise ValueError(
                f"{where}: top-level {key} = {top!r} differs from dflash_config's {values[key]!r}; SGLang "
                f"reads dflash_config.{key} only, so move the value there or remove the top-level key"
            )
    return SelectorConfig(
        architecture=known[0],
        rank=values["selector_rank"],
        top_k=values["selector_top_k"],
        output_multiplier=values["output_multiplier"],
        final_logit_softcapping=values["final_logit_softcapping"],
    )


def _read(source: str | Path | Mapping[str, Any]) -> tuple[dict[str, Any], str]:
    """(config dict, a name for it in messages) from a dict, a config.json path, or a checkpoint folder."""
    if isinstance(source, Mapping):
        return dict(source), "drafter config"
    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"{path}: cannot read drafter config: {error}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a drafter config must be a JSON object, got {type(data).__name__}")
    return data, str(path)


def check_drafter_fits(drafter: DrafterConfig, target_config: Mapping[str, Any]) -> None:
    """Raise DrafterMismatchError, naming the value and the fix, unless `drafter` can serve this target.

    target_config: the target's config.json as a dict (a nested `text_config` is read first).
    Checks: equal hidden sizes (the drafter reads target features and shares its embedding and LM head);
    mask_token_id below the target's vocabulary, and equal vocabularies; every target_layer_id in
    0..L-2; num_target_layers, when the checkpoint states it, equal to L.
    """
    text = target_config.get("text_config")
    target = {**target_config, **text} if isinstance(text, Mapping) else dict(target_config)
    hidden, vocab, layers = (target.get(k) for k in ("hidden_size", "vocab_size", "num_hidden_layers"))
    if hidden is None or vocab is None or layers is None:
        raise ValueError("target config needs hidden_size, vocab_size and num_hidden_layers")
    if drafter.hidden_size != hidden:
        raise DrafterMismatchError(
            f"drafter hidden_size {drafter.hidden_size} differs from the target's hidden_size {hidden}: "
            "the drafter reads the target's hidden states; use a drafter trained for this target"
        )
    if drafter.mask_token_id >= vocab:
        raise DrafterMismatchError(
            f"drafter mask_token_id {drafter.mask_token_id} is outside the target's vocabulary "
            f"(vocab_size {vocab}); set dflash_config.mask_token_id to a token id below {vocab}"
        )
    if drafter.vocab_size != vocab:
        raise DrafterMismatchError(
            f"drafter vocab_size {drafter.vocab_size} differs from the target's vocab_size {vocab}: "
            "drafter and target must share one tokenizer; use a drafter trained for this target"
        )
    bad = [i for i in drafter.target_layer_ids if not 0 <= i <= layers - 2]
    if bad:
        raise DrafterMismatchError(
            f"drafter target_layer_ids {list(drafter.target_layer_ids)} has ids {bad} outside "
            f"0..{layers - 2} for a target of {layers} layers (layer l is read as the input of layer l + 1); "
            "use a drafter trained for this target or fix dflash_config.target_layer_ids"
        )
    if drafter.num_target_layers is not None and drafter.num_target_layers != layers:
        raise DrafterMismatchError(
            f"drafter num_target_layers {drafter.num_target_layers} differs from the target's "
            f"num_hidden_layers {layers}: the drafter was trained on another target; use a drafter "
            "trained for this target"
        )
