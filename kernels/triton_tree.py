"""Triton versions of `build_verify_layout` and `flat_custom_mask` (CUDA only; same signatures as reference).

Bool tensors are passed to the kernels as their uint8 storage (`tensor.view(torch.uint8)`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bastion_sglang.kernels import reference
from bastion_sglang.kernels.types import NO_NODE, TreeBatch, VerifyLayout

_NO_NODE = tl.constexpr(NO_NODE)
"""NO_NODE as a compile-time constant for the kernels."""

_BLOCK_J = 32
"""Verify positions handled by one program of the layout kernel."""

_BLOCK_K = 64
"""Candidate children / siblings compared per scan step of the layout kernel."""

_BLOCK_COLS = 1024
"""Mask columns written per step of the custom-mask kernel."""


# NOTE: `width` is the verify width of this step (a CUDA-graph bucket or any budget); it changes from
# step to step, so it is not specialised to avoid one compilation per value.
@triton.jit(do_not_specialize=["width"])
def _verify_layout_kernel(
    parents_ptr,  # [B, W] int64: parent position, NO_NODE (-1) for the root
    depths_ptr,  # [B, W] int64
    ctx_lens_ptr,  # [B] int64
    positions_out,  # [B, W] int64
    ancestor_mask_out,  # [B, W, W] uint8 (bool storage), zero-filled by the caller
    first_child_out,  # [B, W] int64
    next_sibling_out,  # [B, W] int64
    width,
    BLOCK_J: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One program per (block of BLOCK_J positions, request)."""
    block = tl.program_id(0)
    request = tl.program_id(1).to(tl.int64)
    row = request * width
    node = block * BLOCK_J + tl.arange(0, BLOCK_J)
    valid = node < width
    parent = tl.load(parents_ptr + row + node, mask=valid, other=_NO_NODE)
    depth = tl.load(depths_ptr + row + node, mask=valid, other=0)
    ctx_len = tl.load(ctx_lens_ptr + request)
    tl.store(positions_out + row + node, ctx_len + depth, mask=valid)

    # Ancestor mask row of each node: chase the parent chain up to the root, marking every node on it.
    mask_row = ancestor_mask_out + (row + node) * width
    ones = tl.full((BLOCK_J,), 1, tl.uint8)
    current = node.to(tl.int64)
    active = valid
    while tl.max(active.to(tl.int32), axis=0) > 0:
        tl.store(mask_row + current, ones, mask=active)
        current = tl.load(parents_ptr + row + current, mask=active, other=_NO_NODE)
        active = active & (current >= 0)

    # Children and later siblings sit at larger positions: scan positions from this block's start.
    first_child = tl.zeros((BLOCK_J,), tl.int32) + width
    next_sibling = tl.zeros((BLOCK_J,), tl.int32) + width
    for start in range(block * BLOCK_J, width, BLOCK_K):
        candidate = start + tl.arange(0, BLOCK_K)
        # -2 matches no position and no parent (parents are >= NO_NODE = -1).
        candidate_parent = tl.load(parents_ptr + row + candidate, mask=candidate < width, other=-2)
        is_child = candidate_parent[None, :] == node[:, None]
        is_sibling = (candidate_parent[None, :] == parent[:, None]) & (candidate[None, :] > node[:, None])
        first_child = tl.minimum(first_child, tl.min(tl.where(is_child, candidate[None, :], width), axis=1))
        next_sibling = tl.minimum(
            next_sibling, tl.min(tl.where(is_sibling, candidate[None, :], width), axis=1)
        )
    tl.store(first_child_out + row + node, tl.where(first_child < width, first_child, _NO_NODE), mask=valid)
    tl.store(
        next_sibling_out + row + node, tl.where(next_sibling < width, next_sibling, _NO_NODE), mask=valid
    )


# NOTE: `width` changes from step to step (see above); not specialised.
@triton.jit(do_not_specialize=["width"])
def _flat_custom_mask_kernel(
    ancestor_mask_ptr,  # [B, W, W] uint8 (bool storage)
    seq_lens_ptr,  # [B] int64: cached prefix length L_b
    block_starts_ptr,  # [B] int64: offset of request b's [W, L_b + W] block in the output
    custom_mask_out,  # [Σ_b W·(L_b + W)] uint8 (bool storage)
    width,
    BLOCK_COLS: tl.constexpr,
):
    """One program per (verify row r, request b): writes row r of request b's [W, L_b + W] block."""
    row = tl.program_id(0).to(tl.int64)
    request = tl.program_id(1).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + request).to(tl.int32)
    out_row = custom_mask_out + tl.load(block_starts_ptr + request) + row * (seq_len + width)
    cols = tl.arange(0, BLOCK_COLS)
    ones = tl.full((BLOCK_COLS,), 1, tl.uint8)
    for start in range(0, seq_len, BLOCK_COLS):
        tl.store(out_row + start + cols, ones, mask=start + cols < seq_len)
    src_row = ancestor_mask_ptr + (request * width + row) * width
    tree_row = out_row + seq_len
    for start in range(0, width, BLOCK_COLS):
        in_row = start + cols < width
        values = tl.load(src_row + start + cols, mask=in_row, other=0)
        tl.store(tree_row + start + cols, values, mask=in_row)


def build_verify_layout(trees: TreeBatch, ctx_lens: torch.Tensor) -> VerifyLayout:
    """Triton `reference.build_verify_layout`: same inputs and outputs, no host sync."""
    batch, width = trees.tokens.shape
    device = trees.tokens.device
    positions = torch.empty((batch, width), dtype=torch.int64, device=device)
    ancestor_mask = torch.zeros((batch, width, width), dtype=torch.bool, device=device)
    first_child = torch.empty((batch, width), dtype=torch.int64, device=device)
    next_sibling = torch.empty((batch, width), dtype=torch.int64, device=device)
    if batch > 0:
        parents = trees.parents.contiguous()
        grid = (triton.cdiv(width, _BLOCK_J), batch)
        _verify_layout_kernel[grid](
            parents,
            trees.depths.contiguous(),
            ctx_lens.contiguous(),
            positions,
            ancestor_mask.view(torch.uint8),
            first_child,
            next_sibling,
            width,
            BLOCK_J=_BLOCK_J,
            BLOCK_K=_BLOCK_K,
        )
    return VerifyLayout(
        positions=positions, ancestor_mask=ancestor_mask, first_child=first_child, next_sibling=next_sibling
    )


def flat_custom_mask(
    ancestor_mask: torch.Tensor, seq_lens: torch.Tensor, *, seq_lens_sum: int | None = None
) -> torch.Tensor:
    """Triton `reference.flat_custom_mask`: same inputs and output.

    Reads Σ seq_lens from the device (one host sync) unless seq_lens_sum is given.
    """
    batch, width, _ = ancestor_mask.shape
    total = reference.custom_mask_size(seq_lens, width, seq_lens_sum)
    out = torch.empty(total, dtype=torch.bool, device=ancestor_mask.device)
    if batch > 0:
        grid = (width, batch)
        _flat_custom_mask_kernel[grid](
            ancestor_mask.contiguous().view(torch.uint8),
            seq_lens.contiguous(),
            reference.block_starts(seq_lens, width),
            out.view(torch.uint8),
            width,
            BLOCK_COLS=_BLOCK_COLS,
        )
    return out
