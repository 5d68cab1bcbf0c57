"""The target model on Transformers: a preallocated KV cache, masked forwards, tail-only compaction.

Cache layout. `SlotCache` is a Transformers `Cache` whose layers hold K and V as [capacity, kv_heads, d]
row buffers allocated once per sequence; rows 0..length-1 are the committed tokens, and a forward writes
its new rows after them and attends to rows 0..length+T-1 through views (no copy, unlike a growing
concatenated cache). After a verify pass the accepted rows are moved to the front of the tree block and
the length is cut to the committed tokens: only rows of the tree block are touched.

Masks. Every forward takes an explicit additive mask [1, 1, T, length + T]: 0 where attention is allowed,
the dtype's minimum elsewhere; the cached prefix is always visible and `visible` [T, T] rules inside the
new block (lower-triangular for prefill, the ancestor mask for a tree). Positions are explicit too.

Attention kernels on CUDA. A forward runs SDPA with the memory-efficient kernel (math as the fallback), never
cuDNN. PyTorch may pick cuDNN attention for an additive mask on Hopper, and cuDNN builds a graph per (query
length, key length), cached by shape; every decoding step brings a new key length, and an adaptive budget a
new query length too. Measured on one H200 (torch 2.11, the demo target's shape, 30 layers, bf16, cuDNN
allowed): verify passes of 185 to 640 tokens took 26-40 ms at shapes run before in the process (once 49 ms)
and 74-125 ms at new ones, and the reference engine's adaptive steps (370-640 nodes, a new width every step)
verified in 63-83 ms where fixed:256 took 25-27 ms in the same rounds. That pattern is the one a per-shape
graph build gives; the kernel chosen was not recorded, and runs with this restriction are still to be made.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AutoModelForCausalLM, PreTrainedModel
from transformers.cache_utils import Cache, CacheLayerMixin

from bastion_sglang.kernels import apply_kv_moves
from bastion_sglang.kernels.types import KvMoves

MASK_ALIGN = 16
"""Row length granularity (elements) of the additive attention masks."""
CUDA_ATTENTION_BACKENDS = (SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)
"""SDPA kernels a forward may use on CUDA: no per-shape setup, so new shapes cost what seen ones do."""


def attention_backends(device: torch.device) -> tuple[SDPBackend, ...] | None:
    """The SDPA kernels a forward on `device` is restricted to; None leaves PyTorch's choice (CPU)."""
    return CUDA_ATTENTION_BACKENDS if device.type == "cuda" else None


class SlotCacheLayer(CacheLayerMixin):
    """One attention layer's K/V rows: key_rows, value_rows [capacity, kv_heads, d], rows < length valid."""

    is_sliding = False
    is_compileable = False

    def __init__(
        self, capacity: int, kv_heads: int, head_dim: int, device: torch.device, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.key_rows = torch.zeros((capacity, kv_heads, head_dim), device=device, dtype=dtype)
        self.value_rows = torch.zeros((capacity, kv_heads, head_dim), device=device, dtype=dtype)
        self.length = 0
        self.is_initialized = True
        self._refresh_views()

    def _refresh_views(self) -> None:
        """keys / values: the valid rows as [1, kv_heads, length, d] views, as Transformers reads them."""
        self.keys = self.key_rows[: self.length].permute(1, 0, 2).unsqueeze(0)
        self.values = self.value_rows[: self.length].permute(1, 0, 2).unsqueeze(0)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Nothing to do: the buffers exist from construction."""

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write key/value_states [1, kv_heads, T, d] at rows length..length+T-1; return all valid rows."""
        count = key_states.shape[-2]
        end = self.length + count
        if end > self.key_rows.shape[0]:
            raise ValueError(f"KV cache of {self.key_rows.shape[0]} rows cannot take {end} tokens")
        self.key_rows[self.length : end] = key_states[0].transpose(0, 1)
        self.value_rows[self.length : end] = value_states[0].transpose(0, 1)
        self.length = end
        self._refresh_views()
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return int(self.key_rows.shape[0])

    def truncate(self, length: int) -> None:
        """Keep rows 0..length-1."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} rows to {length}")
        self.length = length
        self._refresh_views()


class SlotCache(Cache):
    """A Transformers cache of `SlotCacheLayer`s, one per decoder layer (batch 1)."""

    def __init__(
        self,
        num_layers: int,
        capacity: int,
        kv_heads: int,
        head_dim: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        super().__init__(
            layers=[SlotCacheLayer(capacity, kv_heads, head_dim, device, dtype) for _ in range(num_layers)]
        )

    @property
    def length(self) -> int:
        """Tokens held (the same in every layer)."""
        return self.layers[0].length

    def truncate(self, length: int) -> None:
        """Keep the first `length` tokens in every layer."""
        for layer in self.layers:
            layer.truncate(length)

    def move_rows(self, moves: KvMoves) -> None:
        """Apply `moves` (absolute row indices) to K and V of every layer, in place."""
        for layer in self.layers:
            apply_kv_moves(layer.key_rows, moves)
            apply_kv_moves(layer.value_rows, moves)


@dataclass(frozen=True)
class TargetOutput:
    """What one target forward over T new tokens returns."""

    logits: torch.Tensor  # [T, V] in the model's dtype: next-token logits after each new token ([1, V]:
    # after the last one only, when asked for)
    features: torch.Tensor | None  # [T, F·h]: cat of the feature layers' outputs, None when none requested


def load_causal_lm(
    path: str | Path, *, device: torch.device, dtype: torch.dtype, attn_implementation: str = "sdpa"
) -> PreTrainedModel:
    """Load a causal LM folder onto `device` in `dtype` with "sdpa" or "eager" attention, in eval mode."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation)
    return model.to(device).eval()


class TargetModel:
    """A Hugging Face causal LM driven with explicit positions and masks over a `SlotCache`.

    feature_layers: target layers (0-based) whose outputs (HF hidden_states[l + 1]) each forward returns,
    concatenated in this order; () to skip collecting hidden states.
    """

    def __init__(self, model: PreTrainedModel, feature_layers: tuple[int, ...] = ()) -> None:
        layers = int(model.config.num_hidden_layers)
        bad = [layer for layer in feature_layers if not 0 <= layer < layers]
        if bad:
            raise ValueError(f"feature layers {bad} are outside the target's layers 0..{layers - 1}")
        self.model = model.eval()
        self.feature_layers = tuple(feature_layers)

    @property
    def device(self) -> torch.device:
        return self.model.get_input_embeddings().weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.get_input_embeddings().weight.dtype

    def new_cache(self, capacity: int) -> SlotCache:
        """An empty cache for up to `capacity` tokens (committed plus one verify block)."""
        config = self.model.config
        heads = int(config.num_attention_heads)
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
        kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
        return SlotCache(int(config.num_hidden_layers), capacity, kv_heads, head_dim, self.device, self.dtype)

    def attention_mask(self, cached: int, visible: torch.Tensor) -> torch.Tensor:
        """Additive mask [1, 1, T, cached + T]: prefix all visible, `visible` [T, T] bool inside the block.

        The rows are allocated padded to a multiple of MASK_ALIGN elements (a view is returned), the
        alignment the memory-efficient SDPA kernel needs; otherwise it would pad a copy every layer.
        """
        count = visible.shape[0]
        keys = cached + count
        padded = -(-keys // MASK_ALIGN) * MASK_ALIGN
        mask = torch.zeros((1, 1, count, padded), device=visible.device, dtype=self.dtype)[..., :keys]
        mask[0, 0, :, cached:].masked_fill_(~visible, torch.finfo(self.dtype).min)
        return mask

    @torch.no_grad()
    def forward(
        self,
        cache: SlotCache,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        visible: torch.Tensor,
        last_logits_only: bool = False,
    ) -> TargetOutput:
        """Run T new tokens after the cached ones and append their K/V to `cache`.

        tokens: [T] int64; positions: [T] int64 rotary positions; visible: [T, T] bool, [i, j] True iff new
        token i may attend to new token j (every cached token is visible to all).
        last_logits_only: compute the LM head for the last token only (TargetOutput.logits is then [1, V]).
        """
        if (
            tokens.dim() != 1
            or positions.shape != tokens.shape
            or visible.shape != (*tokens.shape, *tokens.shape)
        ):
            raise ValueError(
                f"tokens [T], positions [T], visible [T, T] expected, got {tuple(tokens.shape)}, "
                f"{tuple(positions.shape)}, {tuple(visible.shape)}"
            )
        collect = bool(self.feature_layers)
        backends = attention_backends(tokens.device)
        with sdpa_kernel(list(backends)) if backends is not None else contextlib.nullcontext():
            out = self.model(
                input_ids=tokens[None],
                position_ids=positions[None],
                attention_mask=self.attention_mask(cache.length, visible),
                past_key_values=cache,
                use_cache=True,
                output_hidden_states=collect,
                logits_to_keep=1 if last_logits_only else 0,
            )
        features = (
            torch.cat([out.hidden_states[layer + 1][0] for layer in self.feature_layers], dim=-1)
            if collect
            else None
        )
        return TargetOutput(logits=out.logits[0], features=features)

    def prefill(self, cache: SlotCache, tokens: torch.Tensor, last_logits_only: bool = True) -> TargetOutput:
        """Causal forward of tokens [T] at positions cache.length.. (a prompt); logits of the last token only
        unless last_logits_only is False."""
        count = tokens.shape[0]
        positions = torch.arange(cache.length, cache.length + count, device=tokens.device)
        causal = torch.ones((count, count), dtype=torch.bool, device=tokens.device).tril()
        return self.forward(cache, tokens, positions, causal, last_logits_only)
