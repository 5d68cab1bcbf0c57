"""DFlash2's candidate selector in plain torch: the math of SGLang 0.5.23 `srt/models/dflash.py`
(`candidate_topk`, `DFlash2DraftModel._transform_unary_logits`, `CandidateSelector.build_lattice`,
`_score_edges`), with the same parameter names, so weights move between the two unchanged.

Terms. A block's D slots are its positions after the anchor (the verified token the block starts with);
h_e [h] is the drafter's final hidden state of slot e. Its K candidates are the top-K token ids of the
target's LM head on h_e (raw logits, largest first), and their unary logits u[e, c] are those raw logits
transformed: x · output_multiplier, then softcap · tanh(x / softcap) where a softcap is set, in float32. r is
the selector rank; A (`predecessor_codebook`) and B (`successor_codebook`) are [vocab, r] tables, P
(`hidden_projection`) an [r, h] linear map.

Scores. scores[e, p, c] = u[e, c] + Σ_j A[pred(e, p), j] · (P h_e)_j · B[cand(e, c), j], where pred(e, p) is
candidate p of slot e - 1, and the anchor token for slot 0 (so the K rows of slot 0 are one row). log-softmax
over c of scores / T is the distribution SGLang's walk samples slot e from after candidate p
(`controller.lattice_tree.selector_logprobs`).

Weights, as SGLang's `DFlash2DraftModel` names them: `candidate_selector.predecessor_codebook` [vocab, r],
`candidate_selector.successor_codebook` [vocab, r], `candidate_selector.hidden_projection.weight` [r, h].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from bastion_sglang.integration.drafter_config import SelectorConfig


def transform_unary_logits(logits: torch.Tensor, selector: SelectorConfig) -> torch.Tensor:
    """Raw LM-head logits [..., K] -> float32 unary logits [..., K]: the multiplier, then the softcap, with
    SGLang's operations in SGLang's order (`_transform_unary_logits`). Monotone, so the top-K of the raw
    logits are the top-K of the transformed ones."""
    out = logits.float().clone()
    if selector.output_multiplier != 1.0:
        out.mul_(selector.output_multiplier)
    softcap = selector.final_logit_softcapping
    if softcap is not None:
        out.div_(softcap).tanh_().mul_(softcap)
    return out


@dataclass(frozen=True)
class SlotCandidates:
    """The LM head's top-K of N hidden states (`candidate_topk`)."""

    ids: torch.Tensor  # [N, K] int64: candidate token ids, largest raw logit first
    raw: torch.Tensor  # [N, K] in the head's dtype: their raw logits
    logits: torch.Tensor  # [N, V] in the head's dtype: every raw logit


def candidate_topk(hidden: torch.Tensor, lm_head_weight: torch.Tensor, k: int) -> SlotCandidates:
    """The LM head's top-k per row, as SGLang's `candidate_topk` takes it on one rank (a bias-free head,
    `torch.topk`). hidden: [N, h]; lm_head_weight: [V, h]."""
    if hidden.dim() != 2 or lm_head_weight.dim() != 2 or hidden.shape[1] != lm_head_weight.shape[1]:
        raise ValueError(
            f"hidden must be [N, h] and lm_head_weight [V, h], got {tuple(hidden.shape)} and "
            f"{tuple(lm_head_weight.shape)}"
        )
    logits = torch.matmul(hidden.to(lm_head_weight.dtype), lm_head_weight.T)
    values, ids = torch.topk(logits, k, dim=-1)
    return SlotCandidates(ids.long(), values, logits)


def score_edges(
    *,
    predecessor_table: torch.Tensor,
    successor_table: torch.Tensor,
    candidate_ids: torch.Tensor,
    unary_logits: torch.Tensor,
    hidden: torch.Tensor,
    anchor_token_ids: torch.Tensor,
    top_k: int,
) -> torch.Tensor:
    """The lattice scores of the module docstring: the torch reference of SGLang's `_score_edges`, with its
    signature and its operations.

    predecessor_table, successor_table: [vocab, r]; candidate_ids: [b, D, K] int64; unary_logits: [b, D, K]
    float32; hidden: [b, D, r] projected hidden states (P h); anchor_token_ids: [b] int64; top_k: K.
    Returns scores [b, D, K, K] (float32 where the unary logits are).
    """
    keys = successor_table[candidate_ids]  # [b, D, K, r]
    predecessor_ids = torch.cat(
        [anchor_token_ids[:, None, None].expand(-1, 1, top_k), candidate_ids[:, :-1]], dim=1
    )  # [b, D, K]: slot 0 reads the anchor, slot e the candidates of slot e - 1
    predecessors = predecessor_table[predecessor_ids]  # [b, D, K, r]
    return unary_logits[:, :, None] + torch.einsum("blpr,blcr->blpc", predecessors * hidden[:, :, None], keys)


class CandidateSelector(nn.Module):
    """SGLang's `CandidateSelector` (its parameters and `build_lattice`), trainable.

    hidden_size: h; vocab_size: rows of the codebooks (the target's vocabulary); rank: r; top_k: K.
    SGLang starts both codebooks at zero (a checkpoint fills them); `reset_for_training` gives training a
    start whose scores equal the unary logits and whose gradients are not zero.
    """

    def __init__(self, *, hidden_size: int, vocab_size: int, rank: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.zeros(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.zeros(vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)

    @torch.no_grad()
    def reset_for_training(self, generator: torch.Generator, std: float = 0.02) -> None:
        """A random predecessor codebook and projection and a zero successor codebook: every score starts at
        its unary logit (the lattice is then DFlash's independent positions), and the successor codebook's
        gradient is not zero."""
        for parameter in (self.predecessor_codebook, self.hidden_projection.weight):
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * std)
        self.successor_codebook.zero_()

    def build_lattice(
        self,
        *,
        candidate_ids: torch.Tensor,
        unary_logits: torch.Tensor,
        hidden_states: torch.Tensor,
        anchor_token_ids: torch.Tensor,
    ) -> torch.Tensor:
        """scores [b, D, K, K] (`score_edges`) from candidate_ids [b, D, K] int64, unary_logits [b, D, K]
        float32, the drafter's hidden states of the D slots [b, D, h] and the anchors [b] int64."""
        return score_edges(
            predecessor_table=self.predecessor_codebook,
            successor_table=self.successor_codebook,
            candidate_ids=candidate_ids,
            unary_logits=unary_logits,
            hidden=self.hidden_projection(hidden_states),
            anchor_token_ids=anchor_token_ids,
            top_k=self.top_k,
        )
