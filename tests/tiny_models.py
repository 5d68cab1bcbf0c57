"""Tiny real models on disk for CPU tests: a random-weight HF target with its tokenizer, and a DFlash drafter.

Both folders load by path the way a served model does: the target with `AutoModelForCausalLM` /
`AutoTokenizer` (and SGLang's loaders), the drafter with SGLang 0.5.23's `DFlashDraftModel` and with
`bastion_sglang.reference.drafter`. Weights are fp32 safetensors; every function is deterministic in `seed`.

Tokenizer: byte-level BPE with no merges, so ids 0..255 are the 256 byte symbols and any text encodes; four
special tokens follow (`SPECIAL_TOKENS`, ids 256..259). The model vocabulary may be larger than the
tokenizer's (as Qwen's is); the extra rows are never produced by the tokenizer but the model can emit them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    LlamaConfig,
    PreTrainedTokenizerFast,
    Qwen3Config,
)

from bastion_sglang.integration.drafter_config import default_target_layer_ids

BYTE_VOCAB = 256
"""Ids 0..255: one token per byte (GPT-2 byte-to-unicode symbols)."""
SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|pad|>", "<|mask|>")
BOS_ID, EOS_ID, PAD_ID, MASK_ID = range(BYTE_VOCAB, BYTE_VOCAB + len(SPECIAL_TOKENS))
CHAT_TEMPLATE = (
    "{% for message in messages %}<|bos|>{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|bos|>assistant: {% endif %}"
)
ROPE_THETA = 10000.0


def byte_symbols() -> list[str]:
    """The byte-level alphabet in byte order: printable bytes stand for themselves, the rest for U+0100.."""
    printable = {
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    }
    symbols, extra = [], 0
    for byte in range(BYTE_VOCAB):
        if byte in printable:
            symbols.append(chr(byte))
        else:
            symbols.append(chr(BYTE_VOCAB + extra))
            extra += 1
    return symbols


def make_tokenizer() -> PreTrainedTokenizerFast:
    """The byte-level tokenizer described in the module docstring (vocabulary of 260)."""
    vocab = {symbol: i for i, symbol in enumerate(byte_symbols())}
    for offset, special in enumerate(SPECIAL_TOKENS):
        vocab[special] = BYTE_VOCAB + offset
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
        mask_token="<|mask|>",
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def make_tiny_target(
    path: str | Path,
    *,
    arch: Literal["qwen3", "llama"] = "qwen3",
    vocab_size: int = 512,
    hidden_size: int = 64,
    num_layers: int = 4,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 16,
    intermediate_size: int = 128,
    initializer_range: float = 0.02,
    seed: int = 0,
) -> Path:
    """Save a random-weight causal LM (fp32 safetensors) plus the byte-level tokenizer to `path`.

    arch: "qwen3" (q/k norms, explicit head_dim) or "llama". vocab_size must cover the 260 tokenizer ids.
    initializer_range: std of the normal weight init (larger values give peakier, less tied logits).
    `eos_token_id` is set in config.json and generation_config.json. Returns the folder.
    """
    if vocab_size < BYTE_VOCAB + len(SPECIAL_TOKENS):
        raise ValueError(
            f"vocab_size {vocab_size} is below the tokenizer's {BYTE_VOCAB + len(SPECIAL_TOKENS)}"
        )
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=4096,
        initializer_range=initializer_range,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA},
        tie_word_embeddings=False,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
    )
    if arch == "qwen3":
        config = Qwen3Config(**common)
    elif arch == "llama":
        config = LlamaConfig(**common)
    else:
        raise ValueError(f"unknown arch {arch!r}; expected 'qwen3' or 'llama'")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    out = Path(path)
    model.save_pretrained(out)
    make_tokenizer().save_pretrained(out)
    return out


def make_tiny_drafter(
    path: str | Path,
    target_path: str | Path,
    *,
    num_layers: int = 2,
    block_size: int = 16,
    target_layer_ids: list[int] | None = None,
    intermediate_size: int | None = None,
    weight_std: float = 0.02,
    seed: int = 0,
) -> Path:
    """Save a random DFlash drafter for the target at `target_path`, in the z-lab checkpoint format.

    Shapes follow the target: hidden size, heads, head_dim, vocabulary; the mask token is the tokenizer's
    <|mask|>. target_layer_ids default to DFlash's spread over the target's layers (written out explicitly,
    as the released checkpoints do). Weight names are exactly the z-lab ones (no embedding, no LM head).
    """
    target = json.loads((Path(target_path) / "config.json").read_text())
    hidden = int(target["hidden_size"])
    heads = int(target["num_attention_heads"])
    kv_heads = int(target["num_key_value_heads"])
    head_dim = int(target.get("head_dim") or hidden // heads)
    ffn = int(intermediate_size or target["intermediate_size"])
    target_layers = int(target["num_hidden_layers"])
    layer_ids = (
        list(target_layer_ids)
        if target_layer_ids is not None
        else default_target_layer_ids(target_layers, num_layers)
    )
    config = {
        "architectures": ["DFlashDraftModel"],
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "model_type": "qwen3",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "block_size": block_size,
        "bos_token_id": target.get("bos_token_id"),
        "eos_token_id": target.get("eos_token_id"),
        "dflash_config": {"mask_token_id": MASK_ID, "target_layer_ids": layer_ids},
        "dtype": "float32",
        "head_dim": head_dim,
        "hidden_act": "silu",
        "hidden_size": hidden,
        "initializer_range": weight_std,
        "intermediate_size": ffn,
        "layer_types": ["full_attention"] * num_layers,
        "max_position_embeddings": int(target.get("max_position_embeddings", 4096)),
        "max_window_layers": num_layers,
        "num_attention_heads": heads,
        "num_hidden_layers": num_layers,
        "num_key_value_heads": kv_heads,
        "num_target_layers": target_layers,
        "rms_norm_eps": float(target.get("rms_norm_eps", 1e-6)),
        "rope_scaling": None,
        "rope_theta": ROPE_THETA,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": int(target["vocab_size"]),
    }
    generator = torch.Generator().manual_seed(seed)

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * weight_std

    def norm_weight(size: int) -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(size, generator=generator)

    weights = {
        "fc.weight": normal(hidden, len(layer_ids) * hidden),
        "hidden_norm.weight": norm_weight(hidden),
        "norm.weight": norm_weight(hidden),
    }
    for i in range(num_layers):
        prefix = f"layers.{i}"
        weights |= {
            f"{prefix}.self_attn.q_proj.weight": normal(heads * head_dim, hidden),
            f"{prefix}.self_attn.k_proj.weight": normal(kv_heads * head_dim, hidden),
            f"{prefix}.self_attn.v_proj.weight": normal(kv_heads * head_dim, hidden),
            f"{prefix}.self_attn.o_proj.weight": normal(hidden, heads * head_dim),
            f"{prefix}.self_attn.q_norm.weight": norm_weight(head_dim),
            f"{prefix}.self_attn.k_norm.weight": norm_weight(head_dim),
            f"{prefix}.mlp.gate_proj.weight": normal(ffn, hidden),
            f"{prefix}.mlp.up_proj.weight": normal(ffn, hidden),
            f"{prefix}.mlp.down_proj.weight": normal(hidden, ffn),
            f"{prefix}.input_layernorm.weight": norm_weight(hidden),
            f"{prefix}.post_attention_layernorm.weight": norm_weight(hidden),
        }
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file({k: v.contiguous() for k, v in weights.items()}, str(out / "model.safetensors"))
    return out
