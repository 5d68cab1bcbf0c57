"""`rank_sync` across two real processes (torch.distributed over gloo, as SGLang's TP group is on CPU).

Each rank plans the same drafted trees with its own measured step costs, skewed by rank the way a slow or
busy TP rank skews them: rank 1 measures a drafter pass 50x slower and verify passes 20x slower. Planned
locally, the two ranks choose different verify widths, and only rank 0's best tree pays for its drafter
pass (the test of the speculation gate's ceiling): drafting and verifying their own plans, they would run
different collectives. Through `RankSync` both ranks verify rank 0's
rows. `DraftHead` gathers each rank's vocabulary shard of the LM head into the full draft logits, and a
draft vocabulary's rows from the shards that hold them.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from calibration_profiles import QWEN3_8B
from sglang_server import free_port

from bastion_sglang import kernels
from bastion_sglang.controller import AdaptivePolicy, build_trees, plan_batch
from bastion_sglang.controller.batch_objective import PAYING_SPEEDUP
from bastion_sglang.controller.latency import LatencyFit, LatencyModel
from bastion_sglang.controller.profile import StepCosts
from bastion_sglang.controller.roofline import RooflineModel, lookup_gpu
from bastion_sglang.step.rank_sync import DraftHead, RankSync

WORLD = 2
BATCH = 3
CONTEXTS = [120, 800, 2000]
FIT = LatencyFit(beta_fixed=4e-3, alpha_gemm=1.4, alpha_tok=3e-5, alpha_attn=1.1, alpha_kv=1.5)
DRAFT_SECONDS = {0: 2.5e-3, 1: 0.125}  # per rank: measured drafter seconds per step
VERIFY_SKEW = {0: 1.0, 1: 20.0}  # per rank: measured / predicted verify seconds
VOCAB = 100  # the logits kept; the LM head is padded to VOCAB_PADDED rows, split over the ranks
VOCAB_PADDED = 128
HIDDEN = 16
DRAFT_VOCAB = [99, 3, 64, 70, 0, 63, 41, 88]
"""A draft vocabulary with ids in both ranks' shards (rank 0 holds 0..63, rank 1 64..99), the edges too."""


@dataclass(frozen=True)
class WorldGroup:
    """The torch.distributed world as the `rank_sync.RankGroup` SGLang's GroupCoordinator provides."""

    world_size: int
    rank_in_group: int
    ranks: list[int]
    cpu_group: Any

    def broadcast(self, input_: torch.Tensor, src: int = 0) -> torch.Tensor:
        dist.broadcast(input_, src=self.ranks[src])
        return input_

    def all_gather(self, input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
        parts = [torch.empty_like(input_) for _ in range(self.world_size)]
        dist.all_gather(parts, input_)
        return torch.cat(parts, dim=dim)


def _local_rows(rank: int) -> tuple[bool, kernels.TreeBatch]:
    """What `rank` would do on its own: whether its best tree beats plain decoding (what the gate's ceiling
    tests) and its planned verify rows."""
    generator = torch.Generator().manual_seed(11)  # the drafted trees are the same on every rank
    logits = 4.0 * torch.randn(BATCH, 15, 64, generator=generator, dtype=torch.float64)
    top = torch.log_softmax(logits, -1).topk(4, -1)
    trees = build_trees(top.values, top.indices, 32)
    latency = LatencyModel(RooflineModel(QWEN3_8B, lookup_gpu("H100 SXM")), fit=FIT)
    for width in (2, 8, 16):
        latency.observe_batch(
            [width] * BATCH, CONTEXTS, VERIFY_SKEW[rank] * latency.predict_batch([width] * BATCH, CONTEXTS)
        )
    costs = StepCosts(t_draft=DRAFT_SECONDS[rank], t_aux=5e-4, l_ar=latency.predict_plain_batch(CONTEXTS))
    plan = plan_batch(trees, CONTEXTS, latency, costs, AdaptivePolicy(), allow_plain=True)
    bonus = torch.tensor([7, 8, 9], dtype=torch.int64)
    return plan.speculative_speedup > PAYING_SPEEDUP, kernels.flatten_trees(trees, bonus, plan.width)


def _rank_main(rank: int, port: int, out: Path) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        group = WorldGroup(WORLD, rank, list(range(WORLD)), dist.group.WORLD)
        sync = RankSync(group)
        wants_draft, local = _local_rows(rank)
        horizon = sync.share_horizon(3 if wants_draft else 0)  # rank 1 alone would skip the drafter
        shared = sync.share_rows(local, horizon > 0)

        weight = torch.randn(VOCAB_PADDED, HIDDEN, generator=torch.Generator().manual_seed(3))
        per_rank = VOCAB_PADDED // WORLD
        lm_head = types.SimpleNamespace(
            weight=weight[rank * per_rank : (rank + 1) * per_rank],
            shard_indices=types.SimpleNamespace(
                num_added_elements=0,
                org_vocab_start_index=rank * per_rank,
                org_vocab_end_index=min((rank + 1) * per_rank, VOCAB),
            ),
        )
        # the drafter's hidden states over the shared horizon: the all-gather needs the same shape everywhere
        hidden = torch.randn(BATCH, horizon, HIDDEN, generator=torch.Generator().manual_seed(5))
        draft_logits = DraftHead.of(lm_head, VOCAB, group)(hidden)
        vocabulary_head = DraftHead.of(lm_head, VOCAB, group, DRAFT_VOCAB)
        torch.save(
            {
                "leads": sync.leads,
                "wants_draft": wants_draft,
                "horizon": horizon,
                "local": [local.tokens, local.parents, local.depths],
                "shared": [shared.tokens, shared.parents, shared.depths],
                "draft_logits": draft_logits,
                "vocabulary_logits": vocabulary_head(hidden),
                "vocabulary_top_ids": vocabulary_head.top_k(hidden, 4).token_ids,
                "full_logits": hidden @ weight[:VOCAB].T,
            },
            out / f"rank{rank}.pt",
        )
    finally:
        dist.destroy_process_group()


def _run_ranks(tmp_path: Path) -> list[dict[str, Any]]:
    mp.spawn(_rank_main, args=(free_port(), tmp_path), nprocs=WORLD, join=True)
    return [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(WORLD)]


def test_ranks_with_skewed_step_times_verify_rank_zeros_tree(tmp_path: Path) -> None:
    first, second = _run_ranks(tmp_path)
    assert (first["leads"], second["leads"]) == (True, False)

    # without the broadcast the ranks would disagree: rank 1's best tree does not pay, its plan is narrower
    assert first["wants_draft"] and not second["wants_draft"]
    local_widths = [rank["local"][0].shape[1] for rank in (first, second)]
    assert local_widths[0] > local_widths[1], local_widths

    assert first["horizon"] == second["horizon"] == 3
    for mine, shared_first, shared_second in zip(
        first["local"], first["shared"], second["shared"], strict=True
    ):
        assert torch.equal(shared_first, mine)
        assert torch.equal(shared_second, mine)

    for rank in (first, second):
        assert rank["draft_logits"].shape == (BATCH, 3, VOCAB)
        torch.testing.assert_close(rank["draft_logits"], rank["full_logits"], rtol=1e-5, atol=1e-5)
        # over a draft vocabulary every rank holds its rows whole: the whole head's logits at its ids
        masked = torch.full_like(rank["full_logits"], float("-inf"))
        masked[..., DRAFT_VOCAB] = rank["full_logits"][..., DRAFT_VOCAB]
        torch.testing.assert_close(rank["vocabulary_logits"], masked, rtol=1e-5, atol=1e-5)
        assert torch.equal(rank["vocabulary_top_ids"], kernels.topk_logprobs(masked, 4).token_ids)


def test_one_rank_passes_everything_through() -> None:
    sync = RankSync(None)
    _, rows = _local_rows(0)
    assert sync.leads
    assert sync.share_horizon(0) == 0 and sync.share_horizon(5) == 5
    assert sync.share_rows(rows, True) is rows
    weight = torch.randn(VOCAB_PADDED, HIDDEN)
    hidden = torch.randn(2, HIDDEN)
    head = DraftHead.of(types.SimpleNamespace(weight=weight), VOCAB, None)
    torch.testing.assert_close(head(hidden), hidden @ weight[:VOCAB].T)


def test_the_head_takes_a_strided_view_of_the_drafters_block() -> None:
    """The draft stage hands the head positions 1..h of the drafter's [B, γ, H] block, a strided view: the
    head flattens it into one [B·h, H] product and returns [B, h, V] logits, row for row."""
    weight = torch.randn(VOCAB_PADDED, HIDDEN)
    block = torch.randn(3, 6, HIDDEN)
    hidden = block[:, 1:5]
    assert not hidden.is_contiguous()
    logits = DraftHead.of(types.SimpleNamespace(weight=weight), VOCAB, None)(hidden)
    assert logits.shape == (3, 4, VOCAB)
    for b in range(3):
        torch.testing.assert_close(logits[b], block[b, 1:5] @ weight[:VOCAB].T)
