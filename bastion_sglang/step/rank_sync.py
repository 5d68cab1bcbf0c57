"""What a BASTION decode step sends between tensor-parallel ranks, and the group that carries it.

Under `--tp-size N` every rank runs the scheduler and the worker on the same batch, and every forward is a
collective: the ranks must run the drafter together and verify the same tree. The planner reads state
that each rank measures for itself (the latency model's EMA of verify seconds, the step-cost tracker, the
speculation gate's back-off), so rank 0 decides and the others follow; the acceptance and latency
statistics that drive the plan are rank 0's. The group is SGLang's `get_dp_tp_group()` (the whole TP
group; the attention-TP group under DP attention): its `cpu_group` (gloo) carries host integers, its
device group (NCCL on CUDA, gloo on CPU) the verify rows.

Per decode step, with B requests, verify width W (root + W - 1 draft nodes per request), drafter block
γ, padded vocabulary V_pad (the LM head's rows over all ranks) and N ranks:
1. before drafting, rank 0 → all, cpu group: the draft horizon h (positions the LM head scores,
   `controller.horizon`; 0: skip the drafter), int64 [1] (8 bytes);
2. drafting, all ↔ all, device group: the draft logits, each rank's vocabulary shard [B, h, V_pad / N]
   all-gathered to [B, h, V_pad] (B·h·V_pad elements of the model dtype on every rank); nothing with a
   draft vocabulary, whose head rows every rank holds whole (gathered once, at start-up);
3. after planning a drafted step, rank 0 → all, cpu group: W, int64 [1] (8 bytes; 1 = plain decoding);
4. when W > 1, rank 0 → all, device group: the verify rows, int64 [3, B, W] (tokens, parents, depths:
   24·B·W bytes).

A skipped step sends the first message only (W = 1: the rows are the roots, which every rank holds).
Every request of a step verifies W - 1 nodes (the plan's width is common to the batch), so W is the per-
request node count too. What no step sends: the accept walk's inputs. The target's logits reach every
rank whole (SGLang's logits processor all-gathers them), penalties, grammar and seeds are per request and
identical, so the accept walk, greedy or seeded, runs to the same tokens on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from bastion_sglang import kernels
from bastion_sglang.kernels.types import DraftTopK, TreeBatch

LEADER = 0
"""The rank (in the group) that plans and whose decisions the others take."""


class RankGroup(Protocol):
    """What this module uses of SGLang's `GroupCoordinator` (`sglang.srt.distributed.parallel_state`)."""

    world_size: int
    rank_in_group: int
    ranks: list[int]  # global ranks of the group, by rank in the group
    cpu_group: Any  # torch.distributed ProcessGroup (gloo) for host tensors

    def broadcast(self, input_: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Broadcast `input_` in place from the group's rank `src` over the device group."""

    def all_gather(self, input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's `input_` along `dim`, in rank order, over the device group."""


def scheduler_group() -> RankGroup | None:
    """The TP group this scheduler's batch runs on (SGLang's `get_dp_tp_group()`), None with one rank."""
    from bastion_sglang.integration.sglang_adapter import get_dp_tp_group

    group = get_dp_tp_group()
    return group if group.world_size > 1 else None


class RankSync:
    """Rank 0's per-step decisions, shared with the other ranks of `group` (see the module docstring).

    group None (one rank): every method returns its argument, with no communication.
    """

    def __init__(self, group: RankGroup | None) -> None:
        self._group = group
        self._host = torch.zeros(1, dtype=torch.int64)  # [1] host buffer of the integer messages

    @property
    def leads(self) -> bool:
        """Whether this rank plans: rank 0 of the group, or the only rank."""
        return self._group is None or self._group.rank_in_group == LEADER

    def share_horizon(self, horizon: int) -> int:
        """Rank 0's draft horizon for this step, 0 to skip the drafter (what other ranks pass is ignored)."""
        return self._share_int(horizon)

    def share_rows(self, rows: TreeBatch, drafted: bool) -> TreeBatch:
        """Rank 0's verify rows for this step.

        rows: this rank's TreeBatch [B, W] (tokens, parents, depths int64; column 0 the roots, which every
        rank holds), whatever it planned. drafted: whether the step drafted (the shared decision); a skipped
        step's rows are the roots only and nothing is sent. Returns rank 0's rows, of rank 0's width.
        """
        if self._group is None or not drafted:
            return rows
        batch = rows.tokens.shape[0]
        width = self._share_int(rows.tokens.shape[1])
        if width == 1:
            return rows if rows.tokens.shape[1] == 1 else _roots(rows)
        if self.leads:
            packed = torch.stack([rows.tokens, rows.parents, rows.depths])  # [3, B, W] int64
        else:
            packed = torch.empty((3, batch, width), dtype=torch.int64, device=rows.tokens.device)
        self._group.broadcast(packed, src=LEADER)
        return TreeBatch(tokens=packed[0], parents=packed[1], depths=packed[2])

    def _share_int(self, value: int) -> int:
        """Rank 0's `value`, over the cpu group (host to host: no device sync)."""
        if self._group is None:
            return value
        self._host[0] = value
        torch.distributed.broadcast(self._host, src=self._group.ranks[LEADER], group=self._group.cpu_group)
        return int(self._host[0])


def _roots(rows: TreeBatch) -> TreeBatch:
    """The width-1 rows (roots only) of `rows` [B, W]."""
    return TreeBatch(tokens=rows.tokens[:, :1], parents=rows.parents[:, :1], depths=rows.depths[:, :1])


@dataclass(frozen=True)
class DraftHead:
    """The target's LM head as the draft step applies it: hidden states to logits over the vocabulary.

    weight: the rows the draft step multiplies, [V_local, H]. With the whole vocabulary and one rank the
    first V rows of the head; under TP the rank's vocabulary shard (SGLang's `VocabParallelEmbedding`:
    V_pad / N rows, padding last on the last ranks), gathered over `group` after the matmul. With a draft
    vocabulary (`integration.draft_vocab`) the rows of its ids, [Vd, H], whole on every rank (gathered
    once, when the head is made), and `token_ids` [Vd] int64 those ids. vocab_size: V, the logits kept.
    Those rows are a copy: weights updated in place later (SGLang's weight-update endpoints) reach the
    verify pass, not the draft head, which then drafts with the old rows (output stays the target's).
    """

    weight: torch.Tensor  # [V_local, H], or [Vd, H] with a draft vocabulary
    vocab_size: int
    group: RankGroup | None
    token_ids: torch.Tensor | None = None  # [Vd] int64, None: the whole vocabulary

    @classmethod
    def of(
        cls,
        lm_head: torch.nn.Module,
        vocab_size: int,
        group: RankGroup | None,
        token_ids: list[int] | None = None,
    ) -> DraftHead:
        """The head over the target's `lm_head` module; group: its TP group (None with one rank); token_ids:
        the draft vocabulary's ids (None: the whole vocabulary).

        Raises ValueError for a sharded head whose shards hold added vocabulary (LoRA extra tokens): their
        rows do not follow the base vocabulary in rank order, so the concatenated shards are not ids 0..V-1.
        """
        weight = lm_head.weight
        added = 0 if group is None else int(lm_head.shard_indices.num_added_elements)
        if added != 0:
            raise ValueError(
                f"the target's LM head holds {added} added-vocabulary rows per TP shard; BASTION's draft "
                "head under --tp-size > 1 supports the base vocabulary only"
            )
        if token_ids is None:
            return cls(weight if group is not None else weight[:vocab_size], vocab_size, group)
        ids = torch.tensor(token_ids, dtype=torch.int64, device=weight.device)
        if group is None:
            return cls(weight.index_select(0, ids), vocab_size, None, ids)
        return cls(_gathered_rows(weight, lm_head.shard_indices, ids, group), vocab_size, None, ids)

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [..., H] drafter hidden states, any strides. Returns [..., V] logits in the weight's dtype;
        with a draft vocabulary -inf outside it.

        The product runs on one contiguous [N, H] matrix. The drafter's positions 1..h are a strided view of
        its [B, γ, H] output, and torch.matmul of such a [B, h, H] view does not fold into one GEMM: on the
        2-core CPU at B = 8, h = 15 (fp32, the demo pair's head) it took 71 ms where the folded GEMM takes 40.
        """
        logits = self._product(hidden)
        if self.token_ids is not None:
            full = logits.new_full((*logits.shape[:-1], self.vocab_size), float("-inf"))
            return full.index_copy_(-1, self.token_ids, logits)
        if self.group is None:
            return logits
        return self.group.all_gather(logits.contiguous(), dim=-1)[..., : self.vocab_size]

    def top_k(self, hidden: torch.Tensor, k: int) -> DraftTopK:
        """`kernels.topk_logprobs` of this head's logits of hidden [B, h, H]: DraftTopK [B, h, k]. With a
        draft vocabulary the log-softmax and top-k run over its Vd logits alone (the same values as over
        `__call__`'s [B, h, V], whose other logits are -inf) and the ids are mapped to the target's."""
        if self.token_ids is None:
            return kernels.topk_logprobs(self(hidden), k)
        top = kernels.topk_logprobs(self._product(hidden), k)
        return DraftTopK(logprobs=top.logprobs, token_ids=self.token_ids[top.token_ids])

    def _product(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] times this rank's rows: [..., V_local] (or [..., Vd])."""
        rows = hidden.reshape(-1, hidden.shape[-1]).to(self.weight.dtype)
        return torch.matmul(rows, self.weight.T).view(*hidden.shape[:-1], -1)


def _gathered_rows(weight: torch.Tensor, shard: Any, ids: torch.Tensor, group: RankGroup) -> torch.Tensor:
    """The head's rows of `ids` [Vd] on every rank, [Vd, H]: each rank fills the rows its vocabulary shard
    holds (base vocabulary ids org_vocab_start_index..org_vocab_end_index - 1, stored from local row 0) and
    zeros the others; the ranks' matrices are all-gathered over `group` and summed, each row coming from the
    one rank that holds it."""
    start, end = int(shard.org_vocab_start_index), int(shard.org_vocab_end_index)
    held = (ids >= start) & (ids < end)
    rows = torch.zeros((ids.shape[0], weight.shape[1]), dtype=weight.dtype, device=weight.device)
    rows[held] = weight.index_select(0, ids[held] - start)
    gathered = group.all_gather(rows.unsqueeze(0).contiguous(), dim=0)  # [N, Vd, H]
    return gathered.sum(dim=0)
