"""Triton versions of `accepted_kv_moves` and `apply_kv_moves` (CUDA only; same signatures as reference)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bastion_sglang.kernels.types import NO_MOVE, KvMoves

_NO_MOVE = tl.constexpr(NO_MOVE)
"""NO_MOVE as a compile-time constant for the kernels."""

_BLOCK_W = 128
"""Move slots handled by one program of the move-index kernel."""

_BLOCK_ROW = 1024
"""Cache row elements copied per program of the copy kernel (at least one per thread: no replication)."""


# NOTE: `width` is the verify width of this step and changes from step to step; not specialised to
# avoid one compilation per value.
@triton.jit(do_not_specialize=["width"])
def _kv_moves_kernel(
    accept_index_ptr,  # [B, W] int64: accepted positions, root first, NO_NODE padded
    accept_length_ptr,  # [B] int64
    tree_base_ptr,  # [B] int64: cache row of position 0 of each request
    src_out,  # [B, W] int64
    dst_out,  # [B, W] int64
    keep_out,  # [B] int64
    width,
    BLOCK_W: tl.constexpr,
):
    """One program per (block of BLOCK_W slots, request)."""
    block = tl.program_id(0)
    request = tl.program_id(1).to(tl.int64)
    slot = block * BLOCK_W + tl.arange(0, BLOCK_W)
    valid = slot < width
    accept_length = tl.load(accept_length_ptr + request)
    tree_base = tl.load(tree_base_ptr + request)
    position = tl.load(accept_index_ptr + request * width + slot, mask=valid, other=0)
    src = tree_base + position
    dst = tree_base + slot
    moving = (slot <= accept_length) & (src != dst)
    tl.store(src_out + request * width + slot, tl.where(moving, src, _NO_MOVE), mask=valid)
    tl.store(dst_out + request * width + slot, tl.where(moving, dst, _NO_MOVE), mask=valid)
    if block == 0:
        tl.store(keep_out + request, accept_length + 1)


# NOTE: `width` changes from step to step (see above); not specialised.
@triton.jit(do_not_specialize=["width"])
def _apply_kv_moves_kernel(
    cache_ptr,  # [S, row_elems] raw integer view of the cache rows
    src_ptr,  # [B, W] int64: source row, or NO_MOVE
    dst_ptr,  # [B, W] int64: destination row, or NO_MOVE
    keep_ptr,  # [B] int64: slots >= keep move nothing
    width,
    row_elems,
    BLOCK_ROW: tl.constexpr,
):
    """One program per (chunk of BLOCK_ROW row elements, request); slots are copied in increasing order.

    In increasing slot order no source is overwritten before it is read, because a move's source row is
    never the destination of an earlier slot of the same request (sources lie at or after their
    destinations along the accepted path, and destinations increase with the slot).
    """
    chunk = tl.program_id(0)
    request = tl.program_id(1).to(tl.int64)
    cols = chunk * BLOCK_ROW + tl.arange(0, BLOCK_ROW)
    in_row = cols < row_elems
    keep = tl.minimum(tl.load(keep_ptr + request).to(tl.int32), width)
    for slot in range(0, keep):
        src = tl.load(src_ptr + request * width + slot)
        dst = tl.load(dst_ptr + request * width + slot)
        if src >= 0:
            values = tl.load(cache_ptr + src * row_elems + cols, mask=in_row)
            tl.store(cache_ptr + dst * row_elems + cols, values, mask=in_row)
        # Order this slot's reads and writes before the next slot's, across the program's threads.
        tl.debug_barrier()


def accepted_kv_moves(
    accept_index: torch.Tensor, accept_length: torch.Tensor, tree_base: torch.Tensor
) -> KvMoves:
    """Triton `reference.accepted_kv_moves`: same inputs and outputs, no host sync."""
    batch, width = accept_index.shape
    device = accept_index.device
    src = torch.empty((batch, width), dtype=torch.int64, device=device)
    dst = torch.empty((batch, width), dtype=torch.int64, device=device)
    keep = torch.empty(batch, dtype=torch.int64, device=device)
    if batch > 0:
        grid = (triton.cdiv(width, _BLOCK_W), batch)
        _kv_moves_kernel[grid](
            accept_index.contiguous(),
            accept_length.contiguous(),
            tree_base.contiguous(),
            src,
            dst,
            keep,
            width,
            BLOCK_W=_BLOCK_W,
        )
    return KvMoves(src=src, dst=dst, keep=keep)


def _raw_rows(cache: torch.Tensor) -> torch.Tensor:
    """The contiguous cache [S, ...] as [S, row_elems] of the widest integer type its row bytes allow."""
    rows = cache.reshape(cache.shape[0], -1).view(torch.uint8)
    offset_bytes = cache.storage_offset() * cache.element_size()
    for dtype in (torch.int64, torch.int32, torch.int16):
        size = dtype.itemsize
        if rows.shape[1] % size == 0 and offset_bytes % size == 0:
            return rows.view(dtype)
    return rows


def apply_kv_moves(cache: torch.Tensor, moves: KvMoves) -> None:
    """Triton `reference.apply_kv_moves` for moves from `accepted_kv_moves`; no host sync.

    Within a request, a slot's source row must not be the destination of an earlier slot (true of
    `accepted_kv_moves`), and only slots < keep may move; then the result equals gathering all sources
    before writing any destination.
    """
    batch, width = moves.src.shape
    if batch == 0 or width == 0 or cache.numel() == 0:
        return
    rows = _raw_rows(cache)
    row_elems = rows.shape[1]
    grid = (triton.cdiv(row_elems, _BLOCK_ROW), batch)
    _apply_kv_moves_kernel[grid](
        rows,
        moves.src.contiguous(),
        moves.dst.contiguous(),
        moves.keep.contiguous(),
        width,
        row_elems,
        BLOCK_ROW=_BLOCK_ROW,
    )
