"""Triton version of `accept_walk` (CUDA only; same signature as `reference.accept_walk`).

One program per request scans its verify row in blocks of positions. For every position of a block it
chases the parent chain (vectorised over the block, one step per depth) and checks that each node on
the chain carries the target's token after its parent; the nodes that pass form the accepted path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bastion_sglang.kernels.types import NO_NODE, AcceptResult, TreeBatch

_BLOCK_W = 128
"""Positions checked at once by one program."""


# NOTE: `width` is the verify width of this step and changes from step to step; not specialised to
# avoid one compilation per value.
@triton.jit(do_not_specialize=["width"])
def _accept_walk_kernel(
    tokens_ptr,  # [B, W] int64: token at each position (column 0 = root)
    parents_ptr,  # [B, W] int64: parent position, NO_NODE (-1) for the root
    depths_ptr,  # [B, W] int64: 0 for the root
    target_ptr,  # [B, W] int64: the target's token after each position
    accept_index_out,  # [B, W] int64, filled with NO_NODE by the caller
    accept_length_out,  # [B] int64
    bonus_out,  # [B] int64
    width,
    BLOCK_W: tl.constexpr,
):
    request = tl.program_id(0).to(tl.int64)
    row = request * width
    accepted_count = 0
    deepest_depth = -1
    deepest_node = 0
    for start in range(0, width, BLOCK_W):
        node = start + tl.arange(0, BLOCK_W)
        valid = node < width
        current = node.to(tl.int64)
        accepted = valid
        active = valid & (current > 0)
        while tl.max(active.to(tl.int32), axis=0) > 0:
            parent = tl.load(parents_ptr + row + current, mask=active, other=0)
            token = tl.load(tokens_ptr + row + current, mask=active, other=0)
            expected = tl.load(target_ptr + row + parent, mask=active, other=0)
            accepted = accepted & ((token == expected) | ~active)
            current = tl.where(active, parent, current)
            active = active & accepted & (current > 0)
        depth = tl.load(depths_ptr + row + node, mask=valid, other=0).to(tl.int32)
        # One accepted node per depth (sibling tokens are distinct): its slot in accept_index is its depth.
        tl.store(accept_index_out + row + depth, node, mask=accepted)
        accepted_count += tl.sum(accepted.to(tl.int32), axis=0)
        block_depth = tl.max(tl.where(accepted, depth, -1), axis=0)
        block_node = tl.max(tl.where(accepted & (depth == block_depth), node, -1), axis=0)
        deepest_node = tl.where(block_depth > deepest_depth, block_node, deepest_node)
        deepest_depth = tl.maximum(deepest_depth, block_depth)
    tl.store(accept_length_out + request, accepted_count - 1)
    tl.store(bonus_out + request, tl.load(target_ptr + row + deepest_node))


def accept_walk(trees: TreeBatch, target_tokens: torch.Tensor) -> AcceptResult:
    """Triton `reference.accept_walk`: same inputs and outputs, no host sync."""
    batch, width = trees.tokens.shape
    device = trees.tokens.device
    accept_index = torch.full((batch, width), NO_NODE, dtype=torch.int64, device=device)
    accept_length = torch.empty(batch, dtype=torch.int64, device=device)
    bonus_tokens = torch.empty(batch, dtype=torch.int64, device=device)
    if batch > 0:
        _accept_walk_kernel[(batch,)](
            trees.tokens.contiguous(),
            trees.parents.contiguous(),
            trees.depths.contiguous(),
            target_tokens.contiguous(),
            accept_index,
            accept_length,
            bonus_tokens,
            width,
            BLOCK_W=_BLOCK_W,
        )
    return AcceptResult(accept_index=accept_index, accept_length=accept_length, bonus_tokens=bonus_tokens)
