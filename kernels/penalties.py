"""SGLang's output penalties at every node of a verify tree, exactly as if each path had been decoded alone.

SGLang's penaltylib (0.5.23) keeps, per request, state cumulated over the tokens output so far, and its
sampler (without overlap scheduling, the mode BASTION runs in) applies the batch's penalizers to the
next-token logits one after the other, in place, in the iteration order of the orchestrator's penalizer set
(`BatchedPenalizerOrchestrator.apply`; the order is fixed within a process, see `Penalty`):

- FREQUENCY: logits -= cum_frequency, where cum_frequency[y] is `frequency_penalty` summed once per
  occurrence of y in the output (one float32 addition per occurrence, as `scatter_add_` builds it);
- PRESENCE: logits -= cum_presence, `presence_penalty` at every token that occurs;
- MIN_NEW_TOKENS: -inf at the request's EOS / stop token ids while fewer than `min_new_tokens` tokens have
  been output;
- REPETITION: at every token that occurs, logit < 0 -> logit * repetition_penalty, else
  logit / repetition_penalty.

In a verify tree the node at depth d predicts output token number n + d (n = tokens output so far, the
root included): its state is the request's plus the d tokens of its own path. `apply_tree_penalties`
applies the request's state to every node (broadcasts over [B, W, V], no per-node copy), then rewrites only
the entries of the tokens on each node's path (at most W - 1 per node) with the node's own counts. Every
entry goes through the same float operations, in the same order, as SGLang's sampler would apply them after
that path: the result is bit-identical to a per-path rerun.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import torch


class Penalty(enum.Enum):
    """One of SGLang's penalizers (`sglang.srt.sampling.penaltylib`)."""

    FREQUENCY = "frequency"
    MIN_NEW_TOKENS = "min_new_tokens"
    PRESENCE = "presence"
    REPETITION = "repetition"


@dataclass(frozen=True)
class OutputPenalties:
    """Penalty parameters and output so far of B requests (SGLang's `SamplingParams` fields)."""

    output_ids: torch.Tensor  # [B, L] int64: tokens output so far (root included), padded with V
    output_lens: torch.Tensor  # [B] int64: real length of each row of output_ids (n)
    frequency: torch.Tensor  # [B] float32: frequency_penalty (0: none)
    presence: torch.Tensor  # [B] float32: presence_penalty (0: none)
    repetition: torch.Tensor  # [B] float32: repetition_penalty (1: none)
    min_new_tokens: torch.Tensor  # [B] int64: EOS / stop ids are banned while fewer are output (0: none)
    stop_tokens: torch.Tensor  # [B, S] int64: the ids min_new_tokens bans, padded with V


def check_apply_tree_penalties(
    logits: torch.Tensor, tokens: torch.Tensor, ancestor_mask: torch.Tensor, penalties: OutputPenalties
) -> None:
    """Validate `apply_tree_penalties`'s arguments (shapes, dtypes, devices; never values)."""
    if logits.dim() != 3 or not logits.is_floating_point():
        raise ValueError(
            f"logits must be a floating [B, W, V] tensor, got {logits.dtype} {tuple(logits.shape)}"
        )
    batch, width, _ = logits.shape
    if tokens.shape != (batch, width) or tokens.dtype != torch.int64:
        raise ValueError(
            f"tokens must be int64 [B, W] = {(batch, width)}, got {tokens.dtype} {tuple(tokens.shape)}"
        )
    if ancestor_mask.shape != (batch, width, width) or ancestor_mask.dtype != torch.bool:
        raise ValueError(
            f"ancestor_mask must be bool [B, W, W] = {(batch, width, width)}, got "
            f"{ancestor_mask.dtype} {tuple(ancestor_mask.shape)}"
        )
    expected = {
        "output_lens": ((batch,), torch.int64),
        "frequency": ((batch,), torch.float32),
        "presence": ((batch,), torch.float32),
        "repetition": ((batch,), torch.float32),
        "min_new_tokens": ((batch,), torch.int64),
    }
    for name, (shape, dtype) in expected.items():
        value = getattr(penalties, name)
        if value.shape != shape or value.dtype != dtype:
            raise ValueError(
                f"penalties.{name} must be {dtype} {shape}, got {value.dtype} {tuple(value.shape)}"
            )
    for name in ("output_ids", "stop_tokens"):
        value = getattr(penalties, name)
        if value.dim() != 2 or value.shape[0] != batch or value.dtype != torch.int64:
            raise ValueError(
                f"penalties.{name} must be int64 [B = {batch}, *], got {value.dtype} {tuple(value.shape)}"
            )
    for name, value in (
        ("tokens", tokens),
        ("ancestor_mask", ancestor_mask),
        *((f"penalties.{name}", getattr(penalties, name)) for name in OutputPenalties.__dataclass_fields__),
    ):
        if value.device != logits.device:
            raise ValueError(f"{name} is on {value.device}, expected {logits.device} like logits")


def scale_by_repetition(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """SGLang's `apply_scaling_penalties`: values < 0 multiplied by the scale, the others divided by it.

    values: any floating shape; scales: float32, broadcastable to it. Returns a tensor in values' dtype.
    """
    return torch.where(values < 0, values * scales, values / scales).to(values.dtype)


def apply_tree_penalties(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    ancestor_mask: torch.Tensor,
    penalties: OutputPenalties,
    order: Sequence[Penalty],
) -> None:
    """Apply each node's output penalties to its logits, in place.

    logits: [B, W, V] floating, the target's logits after each verify position. tokens: [B, W] int64, the
    verify rows (column 0 = the root, already in penalties.output_ids). ancestor_mask: [B, W, W] bool,
    [b, j, k] True iff k is j or an ancestor of j (`VerifyLayout.ancestor_mask`). penalties: the requests'
    parameters and outputs. order: the penalizers in the order SGLang applies them (each once). Node j's
    path is its ancestors-or-self except the root; its depth is the path's length. No host sync.
    """
    check_apply_tree_penalties(logits, tokens, ancestor_mask, penalties)
    if sorted(order, key=lambda p: p.value) != sorted(Penalty, key=lambda p: p.value):
        raise ValueError(f"order must name every Penalty once, got {list(order)}")
    batch, width, vocab = logits.shape
    device = logits.device
    # [B, W, W]: k is on node j's path (the root is already in the output)
    on_path = ancestor_mask.clone()
    on_path[:, :, 0] = False
    depth = on_path.sum(-1)  # [B, W]
    raw = logits.gather(2, tokens[:, None, :].expand(batch, width, width))  # [B, W, W]: logit of token k at j

    # the requests' state after their output, as SGLang's penalizers cumulate it
    ids = penalties.output_ids
    cum_frequency = torch.zeros((batch, vocab + 1), dtype=torch.float32, device=device)
    cum_frequency.scatter_add_(1, ids, penalties.frequency[:, None].expand(ids.shape))
    seen = torch.zeros((batch, vocab + 1), dtype=torch.bool, device=device)
    seen.scatter_(1, ids, True)
    cum_frequency, seen = cum_frequency[:, :vocab], seen[:, :vocab]
    stop = torch.zeros((batch, vocab + 1), dtype=torch.bool, device=device)
    stop.scatter_(1, penalties.stop_tokens, True)
    stop = stop[:, :vocab]
    banned = (penalties.output_lens[:, None] + depth) < penalties.min_new_tokens[:, None]  # [B, W]

    # node j, path token k: the counts of the request's output plus j's path
    same = tokens[:, :, None] == tokens[:, None, :]  # [B, W, W]: tokens k and m are equal
    path_count = torch.einsum("bjm,bkm->bjk", on_path.float(), same.float()).to(torch.int64)  # [B, W, W]
    path_frequency = cum_frequency.gather(1, tokens)[:, None, :].expand(batch, width, width).clone()
    step = penalties.frequency[:, None, None]
    for added in range(width - 1):  # float32 additions one occurrence at a time, as scatter_add_ does
        path_frequency = torch.where(path_count > added, path_frequency + step, path_frequency)
    path_banned = banned[:, :, None] & stop.gather(1, tokens)[:, None, :]

    values = raw  # [B, W, W]: the path entries, penalised with the node's own state
    for penalty in order:
        if penalty is Penalty.FREQUENCY:
            logits.sub_(cum_frequency[:, None, :])
            values = (values.float() - path_frequency).to(logits.dtype)
        elif penalty is Penalty.PRESENCE:
            logits.sub_(torch.where(seen, penalties.presence[:, None], 0.0)[:, None, :])
            values = (values.float() - penalties.presence[:, None, None]).to(logits.dtype)
        elif penalty is Penalty.MIN_NEW_TOKENS:
            logits.masked_fill_(banned[:, :, None] & stop[:, None, :], float("-inf"))
            values = values.masked_fill(path_banned, float("-inf"))
        else:
            scales = torch.where(seen, penalties.repetition[:, None], 1.0)
            logits.copy_(scale_by_repetition(logits, scales[:, None, :]))
            values = scale_by_repetition(values, penalties.repetition[:, None, None])

    # entries off node j's path rewrite an entry the scatter writes anyway: node j's own token with its
    # path value (j >= 1 is on its own path), or for the root row its root token with its current value
    own_value = values.diagonal(dim1=1, dim2=2).clone()  # [B, W]
    own_value[:, 0] = logits[:, 0, :].gather(1, tokens[:, :1])[:, 0]
    index = torch.where(on_path, tokens[:, None, :], tokens[:, :, None])
    logits.scatter_(2, index, torch.where(on_path, values, own_value[:, :, None]))
