"""DFlash drafter training: random anchors, blocks of B after each, decaying per-position loss weights.

Terms. A training sequence is a prompt of P tokens followed by the target's own (regenerated) response,
T tokens in all, with the target features of every position (`data.SequenceBatch`). An anchor a is a
response position (P <= a <= T - 2). Its block is the drafter input [t_a, MASK × (B-1)] at positions
a..a+B-1; the drafter predicts t_{a+k} at block position k = 1..B-1 (the tokens the target produced),
seeing the context features of positions 0..a-1 (exactly what inference has after committing t_a).

One forward serves many blocks: the queries of all blocks of a sequence run together, with an attention
mask that lets block j see the context keys p < a_j and its own block's keys (non-causally) and nothing
else, which is the DFlash training trick (each block as if drafted alone). The forward uses the modules
of `bastion_sglang.reference.drafter.DFlashDrafter` (its projections, norms and RoPE), so a trained
drafter is saved, loaded and run by that class and by SGLang's `DFlashDraftModel` unchanged.

Loss: cross-entropy of the target's token at each block position, weighted by w_k = exp(-(k-1)/γ)
(DFlash). γ = 7 for B = 16 (`DEFAULT_LOSS_DECAY`): position 1 weighs 1, position 8 weighs 0.37 and the
last position 0.14, so early positions (which decide most accepted tokens) dominate while the tail still
learns. The target's embedding and LM head are frozen and shared, not part of the drafter.
With `TrainConfig.sample_positions` each labelled position k goes through the LM head only with
probability p_k = w_k / max w, weighted by w_k / p_k: an unbiased estimate of the same loss at Σ p_k / (B-1)
of the LM-head cost (0.29 for B = 16, γ = 4), which on a CPU is most of a step (`sample_positions`).
With `TrainConfig.distill` = α the loss at each position is (1 - α)·CE(target token) + α·H(p, q): the
cross-entropy of the drafter's distribution q to the target's own next-token distribution p at that
position (its LM head on its last hidden state), which tells the drafter how sure the target was and what
else it considered, not only its choice (soft labels, as EAGLE trains its drafters).
Optimiser: AdamW, linear warmup then cosine decay to zero; bf16 autocast (fp32 master weights).
Initialisation: random; or (`TrainConfig.init_from_target`) the target layers that follow the last feature
layer, which reach a given loss in fewer steps when training time is short (`target_layer_init`); or
(`TrainConfig.init_from_drafter`) a trained drafter of the same shape, to continue training it on new data
or with a new schedule (`drafter_init`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from bastion_sglang.integration.drafter_config import DrafterConfig
from bastion_sglang.reference.drafter import DFlashDrafter, apply_rope, rope_cos_sin
from bastion_sglang.training.data import TrainingSequence
from bastion_sglang.training.loop import LogPoint, learning_rate, run_steps

logger = logging.getLogger(__name__)

DEFAULT_LOSS_DECAY = 7.0
"""γ of the per-position loss weights exp(-(k-1)/γ) (module docstring)."""
STATE_TENSORS_NAME = "state.pt"
STATE_JSON_NAME = "state.json"


class TrainConfig(BaseModel):
    """Hyper-parameters of one training run; a resumed run must use the same values."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    steps: int = Field(gt=0)
    batch_sequences: int = Field(default=4, gt=0, description="sequences per optimiser step")
    anchors_per_sequence: int = Field(default=32, gt=0, description="blocks drawn from each sequence")
    loss_decay: float = Field(default=DEFAULT_LOSS_DECAY, gt=0, description="γ of exp(-(k-1)/γ)")
    lr: float = Field(default=6e-4, gt=0)
    warmup_steps: int = Field(default=50, ge=0)
    weight_decay: float = Field(default=0.01, ge=0)
    grad_clip: float = Field(default=1.0, gt=0)
    seed: int = 0
    precision: Literal["bf16-mixed", "fp32"] = "bf16-mixed"
    init_from_target: bool = Field(
        default=False,
        description="draft layers start as copies of the target layers after the last feature layer "
        "(`target_layer_init`), fc as the identity on that layer's features; else random",
    )
    init_from_drafter: str | None = Field(
        default=None,
        description="z-lab drafter folder whose weights the run starts from (`drafter_init`); its config "
        "must equal the run's",
    )
    set_mix: Literal["natural", "equal"] = Field(
        default="natural",
        description="natural: sequences drawn in proportion to their prompt set's size; equal: every set "
        "drawn as often (`step_sequences`)",
    )
    sample_positions: bool = Field(
        default=False,
        description="put position k through the LM head with probability w_k / max w, weighted by "
        "max w (`sample_positions`): the same expected loss at a fraction of the LM-head cost",
    )
    distill: float = Field(
        default=0.0,
        ge=0.0,
        le=1.0,
        description="α: weight of the cross-entropy to the target's next-token distribution, 1 - α that of "
        "the target's token (`block_loss`); 0 trains on the target's tokens alone",
    )

    @model_validator(mode="after")
    def _one_initialisation(self) -> TrainConfig:
        if self.init_from_target and self.init_from_drafter is not None:
            raise ValueError("init_from_target and init_from_drafter exclude each other; choose one")
        return self


class AcceptancePoint(BaseModel):
    """Held-out chain acceptance measured at a checkpoint (`chain_acceptance`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    step: int
    mean: float = Field(description="mean accepted length per block, bonus included")
    blocks: int


class InitialDrafter(BaseModel):
    """The drafter a run started from (`TrainConfig.init_from_drafter`), as its own card described it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(description="folder name of the initial drafter")
    steps_done: int | None = Field(description="its training steps, from its card (None: no card)")
    train_seconds: float | None = Field(description="its training wall time, from its card")
    generation_dtype: str | None = Field(description="dtype of the target when its data was regenerated")


class TrainingState(BaseModel):
    """state.json beside state.pt: where a run is, for resuming and for the model card."""

    model_config = ConfigDict(extra="forbid")

    format_version: Literal[1] = 1
    config: TrainConfig
    drafter_config: DrafterConfig
    step: int = Field(ge=0, description="optimiser steps done")
    seconds: float = Field(ge=0, description="training wall time, summed over resumed sessions")
    supervised_positions: int = Field(ge=0, description="block positions with a label, summed")
    history: list[LogPoint] = Field(default_factory=list)
    acceptance: list[AcceptancePoint] = Field(default_factory=list, description="held-out, per checkpoint")
    validation: list[AcceptancePoint] = Field(
        default_factory=list,
        description="chain acceptance on training sequences kept out of training (settings are chosen on "
        "these, never on the held-out split), per checkpoint",
    )
    initialised_from: InitialDrafter | None = Field(
        default=None, description="the trained drafter the run started from (`TrainConfig.init_from_drafter`)"
    )


def position_weights(block_size: int, decay: float) -> torch.Tensor:
    """w_k = exp(-(k-1)/decay) for block positions k = 1..block_size-1 -> [block_size - 1] float32."""
    if block_size < 2:
        raise ValueError(f"block_size must be >= 2 (one anchor and one predicted token), got {block_size}")
    if decay <= 0:
        raise ValueError(f"loss decay γ must be positive, got {decay}")
    k = torch.arange(1, block_size, dtype=torch.float32)
    return torch.exp(-(k - 1) / decay)


@dataclass(frozen=True)
class BlockBatch:
    """Blocks of several sequences, padded to a common width (S sequences, n blocks each, B per block).

    features: [S, T, F·h] context features, zero-padded past each sequence's end.
    anchors: [S, n] int64 anchor positions (0 for padding blocks).
    noise_ids: [S, n·B] int64, block j = [t_{a_j}, mask × (B-1)].
    labels: [S, n, B-1] int64, t_{a_j+k} at block position k, -100 where there is none.
    teacher_hidden: [S, T, h] float32 the target's last hidden states, zero-padded, when every sequence
    has them (`TrainingSequence.teacher_hidden`), else None.
    """

    features: torch.Tensor
    anchors: torch.Tensor
    noise_ids: torch.Tensor
    labels: torch.Tensor
    teacher_hidden: torch.Tensor | None = None

    @property
    def block_size(self) -> int:
        return int(self.labels.shape[2]) + 1

    def to(self, device: torch.device) -> BlockBatch:
        teacher = None if self.teacher_hidden is None else self.teacher_hidden.to(device)
        tensors = (self.features, self.anchors, self.noise_ids, self.labels)
        return BlockBatch(*(t.to(device) for t in tensors), teacher_hidden=teacher)


def make_blocks(
    sequences: list[TrainingSequence],
    anchors: list[list[int]],
    block_size: int,
    mask_token_id: int,
) -> BlockBatch:
    """Build the blocks for the given anchors (one list per sequence, each anchor in its anchor_range)."""
    count = max(len(a) for a in anchors)
    width = max(int(s.tokens.shape[0]) for s in sequences)
    dim = int(sequences[0].features.shape[1])
    features = torch.zeros((len(sequences), width, dim), dtype=sequences[0].features.dtype)
    anchor_tensor = torch.zeros((len(sequences), count), dtype=torch.long)
    noise = torch.full((len(sequences), count, block_size), mask_token_id, dtype=torch.long)
    labels = torch.full((len(sequences), count, block_size - 1), -100, dtype=torch.long)
    for row, (sequence, chosen) in enumerate(zip(sequences, anchors, strict=True)):
        length = int(sequence.tokens.shape[0])
        features[row, :length] = sequence.features
        for j, anchor in enumerate(chosen):
            if anchor not in sequence.anchor_range:
                raise ValueError(
                    f"anchor {anchor} outside the sequence's anchor range {sequence.anchor_range}"
                )
            anchor_tensor[row, j] = anchor
            noise[row, j, 0] = sequence.tokens[anchor]
            targets = sequence.tokens[anchor + 1 : anchor + block_size]
            labels[row, j, : targets.shape[0]] = targets
    return BlockBatch(
        features, anchor_tensor, noise.view(len(sequences), -1), labels, teacher_hidden(sequences, width)
    )


def teacher_hidden(sequences: list[TrainingSequence], width: int) -> torch.Tensor | None:
    """[S, width, h] float32: the sequences' `teacher_hidden`, zero-padded; None unless all have them."""
    rows = [s.teacher_hidden for s in sequences]
    if any(row is None for row in rows):
        return None
    out = torch.zeros((len(rows), width, int(rows[0].shape[1])), dtype=torch.float32)
    for i, row in enumerate(rows):
        out[i, : row.shape[0]] = row
    return out


def block_attention_mask(anchors: torch.Tensor, context_width: int, block_size: int) -> torch.Tensor:
    """anchors [S, n] -> bool [S, 1, n·B, T + n·B]: block j sees context keys p < a_j and its own block."""
    sequences, count = anchors.shape
    queries = count * block_size
    block_of_query = torch.arange(queries, device=anchors.device) // block_size  # [n·B]
    query_anchor = anchors[:, block_of_query]  # [S, n·B]
    context = torch.arange(context_width, device=anchors.device)
    sees_context = context[None, None, :] < query_anchor[:, :, None]  # [S, n·B, T]
    same_block = block_of_query[:, None] == block_of_query[None, :]  # [n·B, n·B]
    sees_block = same_block[None].expand(sequences, -1, -1)
    return torch.cat([sees_context, sees_block], dim=-1)[:, None]


def drafter_forward(drafter: DFlashDrafter, embed: torch.nn.Embedding, batch: BlockBatch) -> torch.Tensor:
    """Hidden states of every block position -> [S, n·B, h] (after the drafter's final norm).

    Same math as `DFlashDrafter.append_context` + `forward` for each block alone: context K/V from
    hidden_norm(fc(features)) at positions 0..T-1, noise queries/keys at positions a_j..a_j+B-1.
    """
    config = drafter.config
    sequences, width, _ = batch.features.shape
    queries = batch.noise_ids.shape[1]
    block = batch.block_size
    device = batch.features.device
    context = drafter.hidden_norm(drafter.fc(batch.features.to(drafter.fc.weight.dtype)))  # [S, T, h]
    context_positions = torch.arange(width, device=device).repeat(sequences)  # [S·T]
    noise_positions = (batch.anchors[:, :, None] + torch.arange(block, device=device)[None, None, :]).reshape(
        -1
    )  # [S·n·B]
    context_cos, context_sin = rope_cos_sin(
        context_positions, config.head_dim, config.rope_theta, torch.float32
    )
    noise_cos, noise_sin = rope_cos_sin(noise_positions, config.head_dim, config.rope_theta, torch.float32)
    mask = block_attention_mask(batch.anchors, width, block)
    x = embed(batch.noise_ids)  # [S, n·B, h]
    flat_context = context.reshape(sequences * width, -1)
    for layer in drafter.layers:
        attn = layer.self_attn
        heads, kv_heads, head_dim = attn.heads, attn.kv_heads, attn.head_dim
        normed = layer.input_layernorm(x).reshape(sequences * queries, -1)
        q = attn.q_norm(attn.q_proj(normed).view(-1, heads, head_dim))
        q = apply_rope(q, noise_cos, noise_sin).view(sequences, queries, heads, head_dim).transpose(1, 2)
        k_context, v_context = attn.project_kv(flat_context, context_cos, context_sin)  # [kv, S·T, d]
        k_noise, v_noise = attn.project_kv(normed, noise_cos, noise_sin)  # [kv, S·n·B, d]
        keys = torch.cat(
            [
                k_context.view(kv_heads, sequences, width, head_dim),
                k_noise.view(kv_heads, sequences, queries, -1),
            ],
            dim=2,
        ).transpose(0, 1)  # [S, kv, T + n·B, d]
        values = torch.cat(
            [
                v_context.view(kv_heads, sequences, width, head_dim),
                v_noise.view(kv_heads, sequences, queries, -1),
            ],
            dim=2,
        ).transpose(0, 1)
        out = F.scaled_dot_product_attention(
            q, keys.to(q.dtype), values.to(q.dtype), attn_mask=mask, enable_gqa=heads != kv_heads
        )  # [S, heads, n·B, d]
        x = x + attn.o_proj(out.transpose(1, 2).reshape(sequences, queries, heads * head_dim))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return drafter.norm(x)


def teacher_log_probs(
    batch: BlockBatch, rows: torch.Tensor, lm_head: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's next-token log-probabilities behind the labels at `rows` (bool [S, n, B-1]).

    The label at block position k of anchor a is t_{a+k}, which the target chose at position a+k-1; the
    rows' positions repeat (blocks overlap), so the LM head runs once per distinct position.
    Returns (log_probs [U, V] float32, index [M] int64: row m's distribution is log_probs[index[m]]).
    """
    if batch.teacher_hidden is None:
        raise ValueError("distillation needs the target's last hidden states (BlockBatch.teacher_hidden)")
    sequences, width, _ = batch.teacher_hidden.shape
    offsets = torch.arange(batch.labels.shape[2], device=rows.device)
    positions = batch.anchors[:, :, None] + offsets[None, None, :]  # [S, n, B-1]: a + k - 1 for k = 1..B-1
    flat = (torch.arange(sequences, device=rows.device)[:, None, None] * width + positions)[rows]  # [M]
    distinct, index = torch.unique(flat, return_inverse=True)
    hidden = batch.teacher_hidden.reshape(sequences * width, -1)[distinct]  # [U, h]
    with torch.no_grad(), torch.autocast(hidden.device.type, enabled=False):  # float32 under bf16-mixed
        log_probs = F.log_softmax(F.linear(hidden, lm_head.float()), dim=-1)
    return log_probs, index


@dataclass(frozen=True)
class LossResult:
    """loss: weighted mean cross-entropy (scalar, differentiable); labelled: positions with a label;
    first_correct: correct argmax predictions at block position 1."""

    loss: torch.Tensor
    labelled: int
    first_correct: int
    first_total: int


def sample_positions(labels: torch.Tensor, weights: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """labels [S, n, B-1], weights [B-1] -> bool [S, n, B-1]: position k kept with probability w_k / max w,
    independently per block (the position of the largest weight always); drawn on the CPU from generator."""
    keep_probability = (weights / weights.max()).cpu()
    draws = torch.rand(labels.shape, generator=generator)
    return (draws < keep_probability[None, None, :]).to(labels.device)


def block_loss(
    drafter: DFlashDrafter,
    embed: torch.nn.Embedding,
    lm_head: torch.Tensor,
    batch: BlockBatch,
    weights: torch.Tensor,
    keep: torch.Tensor | None = None,
    distill: float = 0.0,
) -> LossResult:
    """Σ w_k·CE(t_{a+k}) / Σ w_k over labelled positions; lm_head [V, h] frozen, weights [B-1].

    keep: bool [S, n, B-1] from `sample_positions`, or None for every position. Only kept positions go
    through the LM head, each weighted max w (= w_k / p_k); the denominator stays Σ w_k over every labelled
    position, so the loss's expectation over keep is the full loss.
    distill: α in [0, 1]; above 0 each position's term is (1 - α)·CE(t_{a+k}) + α·H(p, q), p the target's
    distribution (`teacher_log_probs`, needs batch.teacher_hidden) and q the drafter's.
    """
    hidden = drafter_forward(drafter, embed, batch)
    sequences, count, predicted = batch.labels.shape
    hidden = hidden.view(sequences, count, predicted + 1, -1)[:, :, 1:]  # [S, n, B-1, h]
    valid = batch.labels >= 0
    weights = weights.to(hidden.device)
    per_position = weights[None, None, :].expand_as(batch.labels)  # [S, n, B-1]
    all_weight = per_position[valid].sum()
    rows = valid if keep is None else valid & keep
    logits = F.linear(hidden[rows], lm_head.to(hidden.dtype)).float()  # [M, V]
    labels = batch.labels[rows]
    position_weight = per_position[rows] if keep is None else weights.max().expand(labels.shape)
    log_q = F.log_softmax(logits, dim=-1)  # [M, V] the drafter's log-probabilities, once for both terms
    per_row = F.nll_loss(log_q, labels, reduction="none")  # [M] CE(t_{a+k})
    if distill > 0:
        teacher, index = teacher_log_probs(batch, rows, lm_head)
        soft = -(teacher.exp()[index] * log_q).sum(-1)  # [M] H(p, q)
        per_row = (1 - distill) * per_row + distill * soft
    loss = (position_weight * per_row).sum() / all_weight
    is_first = torch.zeros_like(batch.labels, dtype=torch.bool)
    is_first[:, :, 0] = True
    is_first = is_first[rows]  # [M]: rows of block position 1
    # .item()-style host syncs: two counts per step, for the progress log
    first_correct = int((logits[is_first].argmax(-1) == labels[is_first]).sum())
    return LossResult(loss, int(valid.sum()), first_correct, int(is_first.sum()))


def sample_anchors(
    sequences: list[TrainingSequence], count: int, generator: torch.Generator
) -> list[list[int]]:
    """Up to `count` distinct anchors per sequence, uniform over its anchor range, sorted."""
    chosen = []
    for sequence in sequences:
        span = sequence.anchor_range
        picks = torch.randperm(len(span), generator=generator)[:count]
        chosen.append(sorted(span.start + int(i) for i in picks))
    return chosen


def _epoch_order(count: int, seed: int, epoch: int) -> torch.Tensor:
    """The permutation of `count` sequences for one epoch of one stream, seeded with (seed, epoch)."""
    return torch.randperm(count, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))


def step_sequences(
    sequences: list[TrainingSequence], config: TrainConfig, step: int
) -> list[TrainingSequence]:
    """The `batch_sequences` sequences of optimiser step `step`, a pure function of (seed, step).

    natural mix: all sequences in one stream, a fresh permutation per epoch, so each set weighs its size.
    equal mix: the step's slots go round robin over the sets (sorted by name), each set a stream of its
    own with a fresh permutation per pass over it, so every set weighs the same whatever its size.
    """
    slots = range(step * config.batch_sequences, (step + 1) * config.batch_sequences)
    if config.set_mix == "natural":
        streams, slot_streams = [sequences], [(0, slot) for slot in slots]
    else:
        names = sorted({s.source for s in sequences})
        streams = [[s for s in sequences if s.source == name] for name in names]
        slot_streams = [(slot % len(names), slot // len(names)) for slot in slots]
    chosen = []
    for stream, position in slot_streams:
        members = streams[stream]
        epoch, index = divmod(position, len(members))
        order = _epoch_order(len(members), config.seed + 7_919 * stream, epoch)
        chosen.append(members[int(order[index])])
    return chosen


def batch_for_step(
    sequences: list[TrainingSequence], config: TrainConfig, step: int
) -> tuple[list[TrainingSequence], list[list[int]]]:
    """The sequences (`step_sequences`) and anchors of optimiser step `step`, a pure function of
    (seed, step): anchors come from a generator seeded with (seed, step), so a resumed run draws exactly
    the batches the uninterrupted run would have."""
    chosen = step_sequences(sequences, config, step)
    generator = torch.Generator().manual_seed(config.seed * 1_000_003 + step + 1)
    return chosen, sample_anchors(chosen, config.anchors_per_sequence, generator)


@dataclass(frozen=True)
class FrozenTarget:
    """The target's pieces the drafter shares: embedding table and LM head weight [V, h], both frozen."""

    embed: torch.nn.Embedding
    lm_head: torch.Tensor


def target_layer_init(target: Path, drafter_config: DrafterConfig) -> dict[str, torch.Tensor]:
    """Initial drafter weights taken from the target folder's safetensors (`TrainConfig.init_from_target`).

    Draft layer j copies target layer s + j, s = min(last feature layer + 1, L - draft layers): the layers
    that read the last captured features in the target. `norm` copies the target's final norm; `fc`
    [h, F·h] is the identity on the last feature slot and zero elsewhere. q_norm / k_norm stay ones.
    Returns a partial state dict of the drafter's names; KeyError names a tensor the target lacks.
    """
    from safetensors import safe_open

    draft_layers = drafter_config.num_hidden_layers
    target_layers = drafter_config.num_target_layers
    if target_layers is None:
        raise ValueError("the drafter config has no num_target_layers; cannot pick target layers to copy")
    layer_ids = drafter_config.target_layer_ids
    first = min(max(layer_ids) + 1, target_layers - draft_layers)
    names = {"norm.weight": "model.norm.weight"}
    for j in range(draft_layers):
        for part in (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
            "input_layernorm",
            "post_attention_layernorm",
        ):
            names[f"layers.{j}.{part}.weight"] = f"model.layers.{first + j}.{part}.weight"
    state: dict[str, torch.Tensor] = {}
    files = sorted(target.glob("*.safetensors"))
    for file in files:
        with safe_open(str(file), "pt") as tensors:
            available = set(tensors.keys())
            for mine, theirs in names.items():
                if theirs in available:
                    state[mine] = tensors.get_tensor(theirs).float()
    missing = [theirs for mine, theirs in names.items() if mine not in state]
    if missing:
        raise KeyError(
            f"{target}: no tensor {missing[0]} in {[f.name for f in files]} to initialise the drafter"
        )
    hidden = drafter_config.hidden_size
    fc = torch.zeros(hidden, len(layer_ids) * hidden)
    last = layer_ids.index(max(layer_ids))
    fc[:, last * hidden : (last + 1) * hidden] = torch.eye(hidden)
    state["fc.weight"] = fc
    return state


def drafter_init(folder: Path, drafter_config: DrafterConfig) -> dict[str, torch.Tensor]:
    """Initial weights from a trained z-lab drafter folder (`TrainConfig.init_from_drafter`), float32.

    The folder's config must equal `drafter_config` field for field (same shapes, target layers, block
    size and mask token); ValueError naming the first field that differs, and the option that sets it.
    """
    drafter = DFlashDrafter.from_pretrained(folder, target_num_layers=drafter_config.num_target_layers)
    stored = drafter.config.model_dump()
    for field, value in drafter_config.model_dump().items():
        if stored[field] != value:
            raise ValueError(
                f"{folder}: the drafter's {field} is {stored[field]!r} but this run's is {value!r}; "
                "train with the drafter's settings (--layers, --block-size, --target-layer-ids, "
                "--mask-token-id) or start without --init-from-drafter"
            )
    return {name: tensor.float() for name, tensor in drafter.state_dict().items()}


def load_frozen_target(target: Path, device: torch.device) -> FrozenTarget:
    """Read the target's input embedding and LM head (tied or not) from its folder, frozen, float32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    weight = model.get_input_embeddings().weight.detach().clone()
    head = model.get_output_embeddings().weight.detach().clone()
    embed = torch.nn.Embedding.from_pretrained(weight, freeze=True).to(device)
    return FrozenTarget(embed=embed, lm_head=head.to(device))


def read_training_state(path: Path, missing: str) -> TrainingState:
    """The run state in `path` (a state.json); ValueError naming the file: "<path>: <missing>" when it is
    absent, or what does not validate."""
    try:
        return TrainingState.model_validate_json(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"{path}: {missing}") from None
    except ValidationError as error:
        raise ValueError(f"{path}: not a training state: {error}") from None


class Trainer:
    """Runs `TrainConfig.steps` optimiser steps with checkpoints in `state_dir`, resumable."""

    def __init__(
        self,
        drafter_config: DrafterConfig,
        config: TrainConfig,
        frozen: FrozenTarget,
        sequences: list[TrainingSequence],
        state_dir: Path,
        device: torch.device,
        initial_weights: dict[str, torch.Tensor] | None = None,
        initialised_from: InitialDrafter | None = None,
        features: Callable[[list[TrainingSequence]], list[TrainingSequence]] | None = None,
    ) -> None:
        """initial_weights: a partial drafter state dict applied over the seeded random init;
        initialised_from: where they came from when they are a trained drafter's (kept in the state);
        features: fills in the features of each step's sequences when they come without (token-id
        data, `target_features.TargetFeatures.fill`)."""
        if not sequences:
            raise ValueError("no training sequence has a response of >= 2 tokens")
        self.config = config
        self.frozen = frozen
        self.sequences = sequences
        self.state_dir = state_dir
        self.device = device
        self.features = features
        self.weights = position_weights(drafter_config.block_size, config.loss_decay)
        torch.manual_seed(config.seed)
        self.drafter = DFlashDrafter(drafter_config)
        if initial_weights:
            unknown = sorted(set(initial_weights) - set(self.drafter.state_dict()))
            if unknown:
                raise KeyError(f"initial weights name tensors the drafter lacks: {unknown}")
            self.drafter.load_state_dict(initial_weights, strict=False)
        self.drafter = self.drafter.to(device).train()
        self.optimizer = torch.optim.AdamW(
            self.drafter.parameters(), lr=config.lr, betas=(0.9, 0.95), weight_decay=config.weight_decay
        )
        self.state = TrainingState(
            config=config,
            drafter_config=drafter_config,
            step=0,
            seconds=0.0,
            supervised_positions=0,
            initialised_from=initialised_from,
        )

    def resume(self) -> None:
        """Load state.json and state.pt from state_dir; ValueError naming a setting that differs."""
        json_path = self.state_dir / STATE_JSON_NAME
        stored = read_training_state(json_path, "no training state to resume; run without --resume")
        for name, (old, new) in {
            "config": (stored.config, self.config),
            "drafter_config": (stored.drafter_config, self.state.drafter_config),
        }.items():
            before = old.model_dump()
            for field, value in new.model_dump().items():
                if before[field] != value:
                    raise ValueError(
                        f"{json_path}: {name}.{field} was {before[field]!r}, this run has {value!r}; "
                        "resume with the same options or start a new run without --resume"
                    )
        tensors = torch.load(self.state_dir / STATE_TENSORS_NAME, map_location=self.device, weights_only=True)
        self.drafter.load_state_dict(tensors["drafter"])
        self.optimizer.load_state_dict(tensors["optimizer"])
        self.state = stored
        logger.info("resumed %s at step %d (%.0f s trained)", self.state_dir, stored.step, stored.seconds)

    def save(self) -> None:
        """Write state.pt then state.json (each through a temporary file and a rename)."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.state_dir / (STATE_TENSORS_NAME + ".tmp")
        torch.save({"drafter": self.drafter.state_dict(), "optimizer": self.optimizer.state_dict()}, tmp)
        tmp.replace(self.state_dir / STATE_TENSORS_NAME)
        tmp_json = self.state_dir / (STATE_JSON_NAME + ".tmp")
        tmp_json.write_text(self.state.model_dump_json(indent=1) + "\n", encoding="utf-8")
        tmp_json.replace(self.state_dir / STATE_JSON_NAME)

    def keep(self, batch: BlockBatch, step: int) -> torch.Tensor | None:
        """The positions of step's LM-head pass (`sample_positions`, drawn from a generator seeded with
        (seed, step) so that a resumed run draws the same), or None when every position goes."""
        if not self.config.sample_positions:
            return None
        generator = torch.Generator().manual_seed(self.config.seed * 1_000_033 + step + 1)
        return sample_positions(batch.labels, self.weights, generator)

    def train_step(self, step: int) -> LossResult:
        """One optimiser step on the batch of `step`."""
        sequences, anchors = batch_for_step(self.sequences, self.config, step)
        if self.features is not None:
            sequences = self.features(sequences)
        batch = make_blocks(
            sequences, anchors, self.state.drafter_config.block_size, self.state.drafter_config.mask_token_id
        ).to(self.device)
        for group in self.optimizer.param_groups:
            group["lr"] = learning_rate(self.config, step)
        with torch.autocast(
            self.device.type, dtype=torch.bfloat16, enabled=self.config.precision == "bf16-mixed"
        ):
            result = block_loss(
                self.drafter,
                self.frozen.embed,
                self.frozen.lm_head,
                batch,
                self.weights,
                self.keep(batch, step),
                self.config.distill,
            )
        self.optimizer.zero_grad(set_to_none=True)
        result.loss.backward()
        torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), self.config.grad_clip)
        self.optimizer.step()
        self.state.supervised_positions += result.labelled
        return result

    def run(
        self,
        *,
        checkpoint_seconds: float,
        log_every: int = 10,
        on_checkpoint: Callable[[Trainer], None] | None = None,
    ) -> TrainingState:
        """Train from the current step to config.steps; checkpoint every checkpoint_seconds and at the end.

        on_checkpoint: called with the trainer just before each checkpoint is written (to export the
        drafter, measure acceptance and record it in `state`, which the checkpoint then stores).
        SIGTERM or SIGINT ends the run after the current step, with a checkpoint (`loop.run_steps`).
        """
        run_steps(
            self,
            activity="train-drafter",
            checkpoint_seconds=checkpoint_seconds,
            log_every=log_every,
            on_checkpoint=on_checkpoint,
        )
        return self.state


class AcceptanceReport(BaseModel):
    """Chain acceptance of a drafter on held-out sequences (see `chain_acceptance`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    mean: float = Field(description="mean accepted length per block, bonus included (1..B)")
    blocks: int = Field(description="blocks measured")
    histogram: list[int] = Field(description="histogram[m] = blocks with m accepted drafts (0..B-1)")
    by_source: dict[str, float] = Field(description="mean accepted length per prompt set")


@torch.no_grad()
def chain_acceptance(
    drafter: DFlashDrafter,
    frozen: FrozenTarget,
    sequences: list[TrainingSequence],
    *,
    stride: int = 4,
    batch_sequences: int = 4,
    precision: Literal["bf16-mixed", "fp32"] = "bf16-mixed",
    draft_vocab: torch.Tensor | None = None,
) -> AcceptanceReport:
    """Mean accepted length of a chain draft, measured against the target's greedy continuation.

    For anchors a = P, P+stride, ... with a full block left (a + B - 1 <= T - 1), the drafter sees the
    context 0..a-1 and the block [t_a, MASK...]; the accepted length is 1 + the number of leading block
    positions k = 1, 2, ... whose argmax equals t_{a+k} (what greedy verification of that chain accepts;
    the 1 is the target's bonus token). `by_source` groups the blocks by the sequences' prompt sets.
    draft_vocab: [Vd] int64 token ids the argmax is taken over (a draft vocabulary, as the draft step
    serves it); None: the whole vocabulary.
    """
    block = drafter.config.block_size
    device = frozen.lm_head.device
    drafter.eval()
    accepted_by_source: dict[str, list[int]] = {}
    histogram = [0] * block
    for start in range(0, len(sequences), batch_sequences):
        group = sequences[start : start + batch_sequences]
        anchors = [list(range(s.prompt_length, int(s.tokens.shape[0]) - block + 1, stride)) for s in group]
        keep = [i for i, a in enumerate(anchors) if a]
        if not keep:
            continue
        batch = make_blocks(
            [group[i] for i in keep], [anchors[i] for i in keep], block, drafter.config.mask_token_id
        ).to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
            hidden = drafter_forward(drafter, frozen.embed, batch)
        count = batch.labels.shape[1]
        hidden = hidden.view(len(keep), count, block, -1)[:, :, 1:]
        if draft_vocab is None:
            predicted = F.linear(hidden.float(), frozen.lm_head).argmax(-1)  # [S, n, B-1]
        else:
            predicted = draft_vocab[F.linear(hidden.float(), frozen.lm_head[draft_vocab]).argmax(-1)]
        run = torch.cumprod((predicted == batch.labels).long(), dim=-1).sum(-1)  # [S, n]
        for row, i in enumerate(keep):
            lengths = run[row, : len(anchors[i])].tolist()
            accepted_by_source.setdefault(group[i].source, []).extend(lengths)
            for length in lengths:
                histogram[length] += 1
    drafter.train()
    every = [length for lengths in accepted_by_source.values() for length in lengths]
    if not every:
        raise ValueError("no held-out sequence has a full block after its prompt; generate longer responses")
    return AcceptanceReport(
        mean=1.0 + sum(every) / len(every),
        blocks=len(every),
        histogram=histogram,
        by_source={
            source: 1.0 + sum(lengths) / len(lengths)
            for source, lengths in sorted(accepted_by_source.items())
        },
    )
