"""The DFlash block-diffusion drafter in plain torch, loading and saving the z-lab checkpoint format.

Math (the same as SGLang 0.5.23 `srt/models/dflash.py` with its worker's context materialisation):

- Context feature of a committed position: x = hidden_norm(fc(cat_l h_l)), h_l the output of target layer
  l for l in `target_layer_ids` (HF `hidden_states[l + 1]`), concatenated in that order: [F·h] -> [h].
- Every draft layer keeps, per committed position, K = RoPE(k_norm(k_proj(x))) and V = v_proj(x): the
  context K/V. The context never passes through a layer norm or an MLP.
- A block of B noise tokens [bonus, MASK × (B-1)] at positions p..p+B-1 (p = committed length) is embedded
  with the target's embedding and run through pre-norm layers: h = input_layernorm(x);
  Q = RoPE(q_norm(q_proj(h))), K_noise = RoPE(k_norm(k_proj(h))), V_noise = v_proj(h); the B queries
  attend, without a causal mask, to [context K/V, noise K/V]; x += o_proj(attn); x += mlp(
  post_attention_layernorm(x)) with a SwiGLU MLP. Then the final norm.
- Draft logits of the B-1 masked positions: the target's LM head applied to the last B-1 hidden states.

Weights are stored as `DRAFTER_WEIGHTS_NAME` with exactly the z-lab names (no embedding, no LM head).

A DFlash2 drafter (`DrafterConfig.selector` set) is the same backbone plus SGLang's candidate selector
(`reference.selector`), stored under its SGLang names (`candidate_selector.*`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from bastion_sglang.integration.drafter_config import DrafterConfig
from bastion_sglang.reference.selector import CandidateSelector

DRAFTER_WEIGHTS_NAME = "model.safetensors"
"""File holding a drafter's weights inside its checkpoint folder."""
DRAFTER_CONFIG_NAME = "config.json"


class RMSNorm(nn.Module):
    """x / sqrt(mean(x²) + eps) · weight over the last dim, computed in float32, returned in x's dtype."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style rotary tables: positions [T] int64 -> (cos, sin), each [T, head_dim] in `dtype`."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)  # [head_dim / 2] float32
    angles = positions.float()[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, d] rotated by the tables cos/sin [T, d] (rotate-half convention)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class DraftAttention(nn.Module):
    """Non-causal attention of the noise queries over [context K/V, noise K/V] (module docstring)."""

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        hidden, heads, kv_heads, head_dim = (
            config.hidden_size,
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
        )
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)
        self.q_norm = RMSNorm(head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(head_dim, config.rms_norm_eps)

    def project_kv(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, h] -> (K [kv_heads, T, d] normed and rotated, V [kv_heads, T, d])."""
        k = apply_rope(self.k_norm(self.k_proj(x).view(-1, self.kv_heads, self.head_dim)), cos, sin)
        v = self.v_proj(x).view(-1, self.kv_heads, self.head_dim)
        return k.transpose(0, 1), v.transpose(0, 1)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        key_rows: torch.Tensor,
        value_rows: torch.Tensor,
        context: int,
    ) -> torch.Tensor:
        """x [B, h] normed noise states; cos/sin [B, d] -> [B, h].

        key_rows, value_rows: this layer's cache [kv_heads, capacity, d] with the context in rows
        0..context-1; the block's K/V are written to rows context..context+B-1 (scratch, not committed)
        and the queries attend to rows 0..context+B-1 in place.
        """
        block = x.shape[0]
        q = apply_rope(self.q_norm(self.q_proj(x).view(-1, self.heads, self.head_dim)), cos, sin)
        key_rows[:, context : context + block], value_rows[:, context : context + block] = self.project_kv(
            x, cos, sin
        )
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],
            key_rows[None, :, : context + block],
            value_rows[None, :, : context + block],
            is_causal=False,
            enable_gqa=self.heads != self.kv_heads,
        )  # [1, heads, B, d]
        return self.o_proj(out[0].transpose(0, 1).reshape(block, -1))


class DraftMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) · up(x))."""

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    """One pre-norm draft decoder layer."""

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        self.self_attn = DraftAttention(config)
        self.mlp = DraftMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        key_rows: torch.Tensor,
        value_rows: torch.Tensor,
        context: int,
    ) -> torch.Tensor:
        """x [B, h] residual stream of the noise block -> [B, h] (cache arguments: `DraftAttention`)."""
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, key_rows, value_rows, context)
        return x + self.mlp(self.post_attention_layernorm(x))


class DraftContextCache:
    """Per draft layer, the context K/V of the committed positions 0..length-1, preallocated once.

    keys, values: [num_layers, kv_heads, capacity + block_size, d] in the drafter's dtype; rows < length
    are the context, the block_size rows after them are scratch for the noise block of a forward.
    """

    def __init__(
        self, config: DrafterConfig, capacity: int, device: torch.device, dtype: torch.dtype
    ) -> None:
        if capacity < 1:
            raise ValueError(f"draft cache capacity must be >= 1, got {capacity}")
        rows = capacity + config.block_size
        shape = (config.num_hidden_layers, config.num_key_value_heads, rows, config.head_dim)
        self.keys = torch.empty(shape, device=device, dtype=dtype)
        self.values = torch.empty(shape, device=device, dtype=dtype)
        self.capacity = capacity
        self.length = 0


class DFlashDrafter(nn.Module):
    """DFlash draft model (module docstring); embedding and LM head are the target's, passed per call.
    `candidate_selector` is DFlash2's selector, None for a DFlash drafter."""

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        if config.hidden_act != "silu" or config.attention_bias:
            raise ValueError(
                f"the reference drafter supports hidden_act 'silu' without attention bias, got "
                f"hidden_act={config.hidden_act!r}, attention_bias={config.attention_bias}"
            )
        if config.variant_features:
            raise ValueError(
                "the reference drafter implements plain DFlash only; this config sets "
                f"{list(config.variant_features)}"
            )
        if config.rope_scaling is not None and config.rope_scaling.get("rope_type", "default") != "default":
            raise ValueError(f"the reference drafter supports plain RoPE only, got {config.rope_scaling!r}")
        if config.num_attention_heads % config.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads {config.num_attention_heads} must be a multiple of "
                f"num_key_value_heads {config.num_key_value_heads}"
            )
        self.config = config
        hidden = config.hidden_size
        self.fc = nn.Linear(config.num_context_features * hidden, hidden, bias=False)
        self.hidden_norm = RMSNorm(hidden, config.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(hidden, config.rms_norm_eps)
        selector = config.selector
        self.candidate_selector = (
            None
            if selector is None
            else CandidateSelector(
                hidden_size=hidden, vocab_size=config.vocab_size, rank=selector.rank, top_k=selector.top_k
            )
        )

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        target_num_layers: int | None = None,
    ) -> DFlashDrafter:
        """Load a z-lab-format checkpoint folder (DFlash or DFlash2). Every weight must be present with its
        exact shape.

        target_num_layers: the runtime target's layers, for configs without target_layer_ids.
        """
        folder = Path(path)
        config = DrafterConfig.from_json(folder, target_num_layers=target_num_layers)
        drafter = cls(config)
        state = load_file(str(folder / DRAFTER_WEIGHTS_NAME))
        expected = drafter.state_dict()
        missing = sorted(set(expected) - set(state))
        unexpected = sorted(set(state) - set(expected))
        if missing or unexpected:
            raise ValueError(
                f"{folder}: drafter weights do not match: missing {missing}, unexpected {unexpected}"
            )
        for name, tensor in state.items():
            if tuple(tensor.shape) != tuple(expected[name].shape):
                raise ValueError(
                    f"{folder}: weight {name} has shape {tuple(tensor.shape)}, "
                    f"the config implies {tuple(expected[name].shape)}"
                )
        drafter.load_state_dict(state)
        return drafter.to(device=device, dtype=dtype).eval()

    def save_pretrained(self, path: str | Path) -> Path:
        """Write config.json and the weights in the z-lab format; returns the folder."""
        folder = Path(path)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / DRAFTER_CONFIG_NAME).write_text(json.dumps(self.config.to_json(), indent=2) + "\n")
        state = {name: tensor.detach().contiguous().cpu() for name, tensor in self.state_dict().items()}
        save_file(state, str(folder / DRAFTER_WEIGHTS_NAME))
        return folder

    def new_cache(self, capacity: int) -> DraftContextCache:
        """An empty context cache for up to `capacity` committed positions (plus one block of scratch)."""
        weight = self.fc.weight
        return DraftContextCache(self.config, capacity, weight.device, weight.dtype)

    @torch.no_grad()
    def append_context(self, cache: DraftContextCache, features: torch.Tensor) -> None:
        """Add committed positions cache.length .. cache.length + n - 1 to the context.

        features: [n, F·h] concatenated target-layer outputs of those positions (F = num_context_features).
        """
        count = int(features.shape[0])
        if features.dim() != 2 or features.shape[1] != self.fc.in_features:
            raise ValueError(
                f"context features must be [n, {self.fc.in_features}], got {tuple(features.shape)}"
            )
        if cache.length + count > cache.capacity:
            raise ValueError(
                f"draft cache holds {cache.capacity} positions; {cache.length} + {count} overflow it"
            )
        if count == 0:
            return
        x = self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))
        positions = torch.arange(cache.length, cache.length + count, device=x.device)
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, x.dtype)
        for index, layer in enumerate(self.layers):
            k, v = layer.self_attn.project_kv(x, cos, sin)
            cache.keys[index, :, cache.length : cache.length + count] = k
            cache.values[index, :, cache.length : cache.length + count] = v
        cache.length += count

    @torch.no_grad()
    def forward(self, noise_embeds: torch.Tensor, cache: DraftContextCache) -> torch.Tensor:
        """noise_embeds [B, h]: target embeddings of the block at positions cache.length.. -> [B, h].

        B <= block_size; the context is read in place and left unchanged.
        """
        block = noise_embeds.shape[0]
        if block > self.config.block_size:
            raise ValueError(f"a block holds at most {self.config.block_size} tokens, got {block}")
        positions = torch.arange(cache.length, cache.length + block, device=noise_embeds.device)
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, noise_embeds.dtype)
        x = noise_embeds
        for index, layer in enumerate(self.layers):
            x = layer(x, cos, sin, cache.keys[index], cache.values[index], cache.length)
        return self.norm(x)
