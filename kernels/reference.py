"""Torch reference implementations of the device ops of one speculative step.

These run on any device and are the CPU path of `bastion_sglang.kernels`; the Triton versions in
`triton_*.py` have the same signatures and are tested against them. Inputs are assumed to have passed
the checks in `checks.py` (the public entry points in `bastion_sglang.kernels` run them).

Trees here are verify rows (see `types.py`): position 0 is the root and parents[j] < j for j >= 1.
Ancestor relations are computed by pointer doubling, so the only loops run ceil(log2 W) rounds, never
over requests or positions, and nothing syncs with the host unless its docstring says so.
"""

from __future__ import annotations

import math

import torch

from bastion_sglang.kernels.types import (
    NO_MOVE,
    NO_NODE,
    AcceptResult,
    DraftTopK,
    DraftTreeRows,
    KvMoves,
    TreeBatch,
    VerifyLayout,
)


def doubling_rounds(width: int) -> int:
    """ceil(log2(width)): pointer-doubling rounds after which every ancestor chain of a W-row is covered.

    After r rounds a node has combined the ancestors at distances 0 .. 2^r - 1; depths are at most W - 1.
    """
    return (width - 1).bit_length()


def flatten_trees(trees: DraftTreeRows, bonus_tokens: torch.Tensor, width: int) -> TreeBatch:
    """Verify rows from best-first draft trees: the root, then the first `width - 1` nodes of each tree.

    trees: tokens / parents / depths [B, N] int64 (node parents -1 = root); only these fields are read.
    bonus_tokens: [B] int64, the known token at the root. width: W, with W - 1 <= N.
    Returns TreeBatch [B, W]: draft node i moves to position i + 1, so parent p becomes p + 1 (root -> 0).
    """
    drafted = width - 1
    batch = bonus_tokens.shape[0]
    device = bonus_tokens.device
    root_parent = torch.full((batch, 1), NO_NODE, dtype=torch.int64, device=device)
    root_depth = torch.zeros((batch, 1), dtype=torch.int64, device=device)
    return TreeBatch(
        tokens=torch.cat([bonus_tokens[:, None], trees.tokens[:, :drafted]], dim=1),
        parents=torch.cat([root_parent, trees.parents[:, :drafted] + 1], dim=1),
        depths=torch.cat([root_depth, trees.depths[:, :drafted]], dim=1),
    )


def root_rows(bonus_tokens: torch.Tensor) -> TreeBatch:
    """Verify rows that hold only their roots (W = 1): `flatten_trees` of trees without a node at width 1.
    bonus_tokens: [B] int64. Returns TreeBatch [B, 1]."""
    column = bonus_tokens[:, None]
    return TreeBatch(
        tokens=column,
        parents=torch.full_like(column, NO_NODE),
        depths=torch.zeros_like(column),
    )


def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """[B, W] int64 parents (root NO_NODE) -> [B, W, W] bool, [b, j, k] True iff k is j or an ancestor of j.

    Pointer doubling: mask starts as the identity and `jump` as the parent (the root jumps to itself,
    harmless since the root is an ancestor of every node); each round ORs in the mask row of the node
    `jump` points at and squares the jump.
    """
    batch, width = parents.shape
    rows = torch.arange(batch, device=parents.device)[:, None]
    jump = parents.clamp(min=0)
    mask = torch.eye(width, dtype=torch.bool, device=parents.device).expand(batch, width, width).clone()
    for _ in range(doubling_rounds(width)):
        mask |= mask[rows, jump]
        jump = jump.gather(1, jump)
    return mask


def child_links(parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, W] parents -> (first_child [B, W], next_sibling [B, W]) int64, NO_NODE where there is none.

    Children and siblings are taken in increasing position order.
    """
    batch, width = parents.shape
    device = parents.device
    position = torch.arange(width, device=device).expand(batch, width)
    # The root has no parent: it reduces into a spare column `width` that is dropped afterwards.
    slot = torch.where(parents >= 0, parents, width)
    first = torch.full((batch, width + 1), width, dtype=torch.int64, device=device)
    first.scatter_reduce_(1, slot, position, reduce="amin", include_self=True)
    first_child = torch.where(first[:, :width] == width, NO_NODE, first[:, :width])
    # A stable sort by parent groups siblings together, each group in increasing position order.
    order = torch.sort(parents, dim=1, stable=True).indices
    sorted_parents = parents.gather(1, order)
    following = torch.where(sorted_parents[:, 1:] == sorted_parents[:, :-1], order[:, 1:], NO_NODE)
    next_sibling = torch.full((batch, width), NO_NODE, dtype=torch.int64, device=device)
    next_sibling.scatter_(1, order[:, :-1], following)
    return first_child, next_sibling


def build_verify_layout(trees: TreeBatch, ctx_lens: torch.Tensor) -> VerifyLayout:
    """Positions, ancestor mask and child/sibling pointers of the verify rows.

    trees: TreeBatch [B, W]. ctx_lens: [B] int64, tokens already in each request's cache (the root's
    position is ctx_len). Returns VerifyLayout: positions [B, W] = ctx_len + depth, ancestor_mask
    [B, W, W] bool, first_child / next_sibling [B, W] int64. No host synchronisation.
    """
    first_child, next_sibling = child_links(trees.parents)
    return VerifyLayout(
        positions=ctx_lens[:, None] + trees.depths,
        ancestor_mask=ancestor_mask(trees.parents),
        first_child=first_child,
        next_sibling=next_sibling,
    )


def custom_mask_size(seq_lens: torch.Tensor, width: int, seq_lens_sum: int | None) -> int:
    """Number of entries of the flat custom mask: Σ_b W·(L_b + W).

    Uses the caller's host-side seq_lens_sum when given; otherwise reads the sum from the device.
    """
    if seq_lens_sum is not None:
        return width * (seq_lens_sum + width * int(seq_lens.shape[0]))
    return int((width * (seq_lens + width)).sum().item())  # host sync: the output size depends on seq_lens


def block_starts(seq_lens: torch.Tensor, width: int) -> torch.Tensor:
    """[B] int64 offset of request b's [W, L_b + W] block in the flat custom mask (exclusive prefix sum)."""
    block = width * (seq_lens + width)
    return torch.cumsum(block, dim=0) - block


def flat_custom_mask(
    ancestor_mask: torch.Tensor, seq_lens: torch.Tensor, *, seq_lens_sum: int | None = None
) -> torch.Tensor:
    """SGLang's triton-backend `custom_mask` for a TARGET_VERIFY pass over the verify rows.

    ancestor_mask: [B, W, W] bool. seq_lens: [B] int64, L_b = cached tokens of request b (prefix).
    seq_lens_sum: Σ L_b if the caller holds it on the host (saves one device->host sync); it must
    equal seq_lens.sum() and is not checked against it.
    Returns [Σ_b W·(L_b + W)] bool: per request a row-major [W, L_b + W] block, prefix columns all True,
    then the ancestor block; blocks concatenated in batch order.
    """
    width = ancestor_mask.shape[1]
    device = ancestor_mask.device
    out = torch.ones(custom_mask_size(seq_lens, width, seq_lens_sum), dtype=torch.bool, device=device)
    row_len = (seq_lens + width)[:, None, None]
    col = torch.arange(width, device=device)
    index = (
        block_starts(seq_lens, width)[:, None, None]
        + col[None, :, None] * row_len
        + seq_lens[:, None, None]
        + col[None, None, :]
    )
    out.scatter_(0, index.reshape(-1), ancestor_mask.reshape(-1))
    return out


def accept_walk(trees: TreeBatch, target_tokens: torch.Tensor) -> AcceptResult:
    """Longest path of draft nodes the target agrees with, from the root (sibling tokens distinct).

    trees: TreeBatch [B, W]. target_tokens: [B, W] int64, the target's token after each position.
    The walk: start at the root; while the current node has a child whose token equals
    target_tokens[b, current], move to it. Equivalently, node j is accepted iff every node on its chain
    (root excluded) carries the target's token after its parent; that AND is taken by pointer doubling.
    Returns AcceptResult (accept_index [B, W], accept_length [B], bonus_tokens [B]). No host sync.
    """
    batch, width = trees.tokens.shape
    device = trees.tokens.device
    jump = trees.parents.clamp(min=0)
    accepted = trees.tokens == target_tokens.gather(1, jump)
    accepted[:, 0] = True
    for _ in range(doubling_rounds(width)):
        accepted = accepted & accepted.gather(1, jump)
        jump = jump.gather(1, jump)
    # Accepted nodes form a path with one node per depth: slot = depth (others go to a spare column).
    slot = torch.where(accepted, trees.depths, width)
    position = torch.arange(width, device=device).expand(batch, width)
    accept_index = torch.full((batch, width + 1), NO_NODE, dtype=torch.int64, device=device)
    accept_index.scatter_(1, slot, position)
    accept_index = accept_index[:, :width]
    accept_length = accepted.sum(dim=1) - 1
    deepest = accept_index.gather(1, accept_length[:, None])
    return AcceptResult(
        accept_index=accept_index,
        accept_length=accept_length,
        bonus_tokens=target_tokens.gather(1, deepest)[:, 0],
    )


def accepted_kv_moves(
    accept_index: torch.Tensor, accept_length: torch.Tensor, tree_base: torch.Tensor
) -> KvMoves:
    """Cache row copies that compact each request's accepted path to the front of its tree block.

    accept_index: [B, W] int64 (AcceptResult.accept_index). accept_length: [B] int64.
    tree_base: [B] int64, cache row of position 0 of each request's verify row (rows tree_base[b] ..
    tree_base[b] + W - 1 hold the tree; blocks of different requests must not overlap).
    Slot k <= accept_length[b] moves tree_base[b] + accept_index[b, k] -> tree_base[b] + k; slots already
    in place or beyond the path hold NO_MOVE. Since accept_index[b, k] >= k, every source row lies at or
    after its destination. Returns KvMoves (src, dst [B, W], keep [B] = accept_length + 1).
    """
    width = accept_index.shape[1]
    slot = torch.arange(width, device=accept_index.device)[None, :]
    src = tree_base[:, None] + accept_index
    dst = tree_base[:, None] + slot
    moving = (slot <= accept_length[:, None]) & (src != dst)
    return KvMoves(
        src=torch.where(moving, src, NO_MOVE),
        dst=torch.where(moving, dst, NO_MOVE),
        keep=accept_length + 1,
    )


def window_kv_moves(order: torch.Tensor, keep: torch.Tensor, slots: torch.Tensor) -> KvMoves:
    """Slot copies that put each request's accepted path at the front of its verify window, in place of
    permuting slot ids (which pages of several tokens forbid).

    order: [B, W] int64 (`compaction_order`; order[b, k] for k < keep[b] is the path's position at depth k,
    increasing in k, since a verify row lists parents before children). keep: [B] int64, the path's columns
    (accepted nodes + 1, root included). slots: [B, W] int64, the window's KV slots, column k at position
    L_b + k. Column k < keep[b] moves slots[b, order[b, k]] -> slots[b, k]; columns already in place or past
    the path hold NO_MOVE. Every source column lies at or after its destination column, so applying the moves
    in increasing column order never overwrites a source before it is read (the same result as gathering all
    sources first). Returns KvMoves (src, dst [B, W], keep).
    """
    width = order.shape[1]
    column = torch.arange(width, device=order.device)[None, :]
    moving = (column < keep[:, None]) & (order != column)
    return KvMoves(
        src=torch.where(moving, slots.gather(1, order), NO_MOVE),
        dst=torch.where(moving, slots, NO_MOVE),
        keep=keep,
    )


def apply_kv_moves(cache: torch.Tensor, moves: KvMoves) -> None:
    """Copy cache rows in place: cache[dst] = cache[src] for every slot that moves.

    cache: [S, ...] contiguous, any dtype (rows are copied as raw bytes). moves: KvMoves with distinct
    destination rows. All sources are gathered before any destination is written, so a source may be
    another move's destination.
    """
    rows = cache.view(cache.shape[0], math.prod(cache.shape[1:])).view(torch.uint8)
    moving = moves.src >= 0
    # Boolean selection syncs with the host (its size depends on values); this is the CPU path.
    src = moves.src[moving]
    dst = moves.dst[moving]
    rows[dst] = rows[src]


def topk_logprobs(logits: torch.Tensor, k: int) -> DraftTopK:
    """Top-k log-probabilities per drafted position: log_softmax in float32, then torch.topk.

    logits: [B, D, V] floating. Returns DraftTopK: logprobs [B, D, k] float32 sorted descending,
    token_ids [B, D, k] int64.
    """
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    top = torch.topk(logprobs, k, dim=-1, largest=True, sorted=True)
    return DraftTopK(logprobs=top.values, token_ids=top.indices)


def topk_logprobs_in_blocks(logits: torch.Tensor, k: int, block_rows: int) -> DraftTopK:
    """`topk_logprobs` a block of `block_rows` positions at a time: the same values and ids, bit for bit
    (log_softmax and topk are per row), without writing the whole [B, D, V] log-softmax.

    On a CPU a block's log-softmax stays in cache for its top-k: at B = 32, D = 15, V = 49,152 (fp32, 2 cores)
    the two ops took 23 ms in blocks of 32 rows where one call over the 94 MB tensor took 48. On a GPU the
    loop would only add launches, so `kernels.topk_logprobs` uses this on the CPU alone.
    logits: [B, D, V] floating. block_rows: >= 1. Returns DraftTopK [B, D, k] as `topk_logprobs`.
    """
    rows = logits.reshape(-1, logits.shape[-1])
    blocks = [
        topk_logprobs(rows[start : start + block_rows], k) for start in range(0, rows.shape[0], block_rows)
    ]
    shape = (*logits.shape[:-1], k)
    return DraftTopK(
        logprobs=torch.cat([block.logprobs for block in blocks]).view(shape),
        token_ids=torch.cat([block.token_ids for block in blocks]).view(shape),
    )


def sample_tokens(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: the first positive-probability token whose cumulative mass exceeds u·total.

    probs: [M, V] non-negative weights (need not sum to 1; each row needs positive total mass).
    uniforms: [M] in [0, 1). Returns [M] int64. Cumulative sums are taken in at least float32; total is a
    row's largest one. A token with zero weight is never returned: where no cumulative mass exceeds
    u·total (u >= 1, or rounding) the threshold drops to the float just below total, so the row returns
    the first positive token whose cumulative mass is total. A pure function of its inputs, row by row.

    One cumulative sum and one binary search per row (`torch.searchsorted`, which needs non-decreasing
    sums): torch's CPU cumsum adds in sequence, so its sums of non-negative weights never decrease and a
    zero-weight token repeats the sum before it, which is therefore never the first to exceed a threshold.
    A parallel scan (any other device) may round a later sum below an earlier one, so there the sums are
    replaced by their running maximum over the positive tokens, which has both properties by construction.
    """
    compute = torch.promote_types(probs.dtype, torch.float32)
    weights = probs.to(compute)
    cdf = torch.cumsum(weights, dim=-1)
    if cdf.device.type != "cpu":
        cdf = positive_running_max(weights, cdf)
    return search_cdf(cdf, uniforms.to(compute))


def search_cdf(cdf: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """[M] int64: per row, the first index whose value exceeds u·total, the threshold capped at the float
    just below total (total = the row's last value). cdf: [M, V] non-decreasing rows of positive total;
    uniforms: [M] in cdf's dtype."""
    total = cdf[:, -1:]  # [M, 1]
    below_total = torch.nextafter(total, torch.zeros_like(total))
    threshold = torch.minimum(uniforms[:, None] * total, below_total)
    return torch.searchsorted(cdf, threshold, right=True).squeeze(-1)


def positive_running_max(weights: torch.Tensor, cdf: torch.Tensor) -> torch.Tensor:
    """[M, V] the running maximum of the cumulative sums `cdf` taken at positive `weights` only (0 before
    the first): non-decreasing, and unchanged at every zero-weight token, whatever rounding made cdf."""
    return (
        torch.where(weights > 0, cdf, torch.zeros((), dtype=cdf.dtype, device=cdf.device))
        .cummax(dim=-1)
        .values
    )


_GOLDEN_GAMMA = 0x9E3779B97F4A7C15 - (1 << 64)  # splitmix64 constants as two's-complement int64
_MIX_1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MIX_2 = 0x94D049BB133111EB - (1 << 64)


def _shift_right_logical(x: torch.Tensor, bits: int) -> torch.Tensor:
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 (wrapping arithmetic): a bijection of the 64-bit words."""
    x = (x ^ _shift_right_logical(x, 30)) * _MIX_1
    x = (x ^ _shift_right_logical(x, 27)) * _MIX_2
    return x ^ _shift_right_logical(x, 31)


def seed_keys(seeds: torch.Tensor) -> torch.Tensor:
    """[B] int64: each seed's walk key, splitmix64 of seed + the golden gamma (a bijection of the words)."""
    return _mix64(seeds + _GOLDEN_GAMMA)


def keyed_uniforms(keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """[B, W] float32 multiples of 2^-24 in [0, 1): the top 24 bits of splitmix64(keys[b] ^ positions[b, j]).

    keys: [B] int64 (`seed_keys`); positions: [B, W] int64 (any values).
    """
    keyed = _mix64(keys[:, None] ^ positions)
    return _shift_right_logical(keyed, 40).to(torch.float32) * (1.0 / (1 << 24))


def position_uniforms(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Counter-based uniforms: u[b, j] = hash(seeds[b], positions[b, j]) in [0, 1), float32.

    seeds: [B] int64. positions: [B, W] int64 (any values). Returns [B, W] float32 multiples of 2^-24.
    splitmix64 of the seed, xor the position, splitmix64 again; the top 24 bits are the uniform
    (`keyed_uniforms` of `seed_keys`). For one seed, distinct positions hash distinct words (both steps are
    bijections), so a stream never repeats a draw; equal (seed, position) give equal uniforms on every
    device and in every batch.
    """
    return keyed_uniforms(seed_keys(seeds), positions)


def tree_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """Masked scaled-dot-product attention with grouped-query heads (the CPU verify path).

    q: [T, Hq, Dh]; k, v: [S, Hkv, Dh] with Hq a multiple of Hkv (query head h reads kv head
    h // (Hq / Hkv)); mask: [T, S] bool, True = may attend (every row needs at least one True).
    scale: factor on q·k. Computes in at least float32; returns [T, Hq, Dh] in q's dtype.
    One fused `scaled_dot_product_attention` call (grouped heads read in place, no repeated K/V): the
    torch_native backend attends plain decode steps the same way, so a verify pass and a decode step
    round alike.
    """
    compute = torch.promote_types(q.dtype, torch.float32)
    out = torch.nn.functional.scaled_dot_product_attention(
        q.to(compute).transpose(0, 1)[None],
        k.to(compute).transpose(0, 1)[None],
        v.to(compute).transpose(0, 1)[None],
        attn_mask=mask,
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return out[0].transpose(0, 1).to(q.dtype)


def compaction_order(accept_index: torch.Tensor, accept_length: torch.Tensor) -> torch.Tensor:
    """Permutation of each verify row that puts the accepted path first, root to deepest.

    accept_index: [B, W] int64 accepted positions (root first, NO_NODE padded); accept_length: [B].
    Returns order [B, W] int64: order[b, k] = accept_index[b, k] for k <= accept_length[b], then the other
    positions ascending. Applied to the row's slots, hidden states and logits.
    """
    batch, width = accept_index.shape
    slot = torch.arange(width, device=accept_index.device).expand(batch, width)
    on_path = slot <= accept_length[:, None]
    keys = torch.cat([width + slot, slot.new_zeros((batch, 1))], dim=1)  # spare column for padding
    target = torch.where(on_path, accept_index, width)
    keys.scatter_(1, target, torch.where(on_path, slot, 0))
    return torch.argsort(keys[:, :width], dim=1, stable=True)


def committed_tokens(tokens: torch.Tensor, order: torch.Tensor, accept: AcceptResult) -> torch.Tensor:
    """[B, W] output row: the accepted draft tokens (depth 1..a), the bonus at column a, zeros after.

    tokens: [B, W] verify-row tokens; order: `compaction_order`; accept: the accept walk's result.
    """
    width = tokens.shape[1]
    path = tokens.gather(1, order)  # column k = token at depth k on the accepted path (k <= a)
    out = torch.cat([path[:, 1:], path.new_zeros((path.shape[0], 1))], dim=1)
    column = torch.arange(width, device=tokens.device)[None, :]
    out = torch.where(column < accept.accept_length[:, None], out, 0)
    return out.scatter_(1, accept.accept_length[:, None], accept.bonus_tokens[:, None])
