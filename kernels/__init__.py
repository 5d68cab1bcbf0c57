"""Device ops of one speculative step: top-k, verify layout, tree mask, accept walks, KV compaction.

Every public function validates its arguments (shapes, ranks, dtypes, devices; never values, which
would sync with the host) and raises ValueError naming the bad one. Ops with a Triton version run it
when their inputs are CUDA tensors and `triton` is installed, and the torch reference in
`reference.py` otherwise; the choice is made once per call from the device. Triton is imported only
on that path, so importing this package never needs a GPU driver.

Step order: `topk_logprobs` (drafter) -> controller builds trees -> `flatten_trees` ->
`build_verify_layout` -> `flat_custom_mask` (SGLang triton backend) -> target verify -> the SGLang worker's
`accept_paths` on the target's argmax or `sample_tokens` (uniforms from `keyed_uniforms` of each request's
`seed_keys`, i.e. `position_uniforms`): the accepted paths, their compaction order and output rows in one op
of fixed shape (it permutes KV slots by that order with pages of one token, and copies the slots of
`window_kv_moves` with larger pages); the reference engine's `accept_greedy` / `accept_sampling` ->
`accepted_kv_moves` -> `apply_kv_moves` (it copies KV rows).
`compaction_order` and `committed_tokens` compute `accept_paths`' order and rows from an `accept_walk`.
"""

from __future__ import annotations

import functools
import importlib.util

import torch

from bastion_sglang.kernels import checks, paths, reference
from bastion_sglang.kernels.paths import AcceptedPaths
from bastion_sglang.kernels.penalties import OutputPenalties, Penalty, apply_tree_penalties
from bastion_sglang.kernels.sampling import FilterRule, filter_rule, processed_probs
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

__all__ = [
    "NO_MOVE",
    "NO_NODE",
    "AcceptResult",
    "AcceptedPaths",
    "DraftTopK",
    "DraftTreeRows",
    "FilterRule",
    "KvMoves",
    "OutputPenalties",
    "Penalty",
    "TreeBatch",
    "VerifyLayout",
    "accept_greedy",
    "accept_paths",
    "accept_roots",
    "accept_sampling",
    "accept_walk",
    "accepted_kv_moves",
    "apply_kv_moves",
    "apply_tree_penalties",
    "build_verify_layout",
    "committed_tokens",
    "compaction_order",
    "filter_rule",
    "flat_custom_mask",
    "flatten_trees",
    "keyed_uniforms",
    "position_uniforms",
    "processed_probs",
    "root_rows",
    "sample_tokens",
    "seed_keys",
    "topk_logprobs",
    "tree_attention",
    "uses_triton",
    "window_kv_moves",
]


@functools.cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


CPU_TOPK_BLOCK_ROWS = 32
"""Positions per block of `topk_logprobs` on a CPU (`reference.topk_logprobs_in_blocks`): 16 to 64 took the
same time at B = 32 on the 2-core CPU, 128 nearly the unblocked time."""


def uses_triton(tensor: torch.Tensor) -> bool:
    """Whether ops with a Triton version run it on `tensor`'s device (a CUDA device, triton installed)."""
    return tensor.is_cuda and _triton_installed()


def topk_logprobs(logits: torch.Tensor, k: int) -> DraftTopK:
    """Top-k log-probabilities of the drafter per position (log_softmax in float32, then torch.topk).

    logits: [B, D, V] floating. k: 1..V. Returns DraftTopK: logprobs [B, D, k] float32, each row sorted
    descending; token_ids [B, D, k] int64.
    """
    checks.check_topk_logprobs(logits, k)
    if logits.device.type == "cpu":
        return reference.topk_logprobs_in_blocks(logits, k, CPU_TOPK_BLOCK_ROWS)
    return reference.topk_logprobs(logits, k)


def flatten_trees(trees: DraftTreeRows, bonus_tokens: torch.Tensor, width: int) -> TreeBatch:
    """Verify rows of width W: position 0 = the bonus token (root), positions 1..W-1 = draft nodes 0..W-2.

    trees: the controller's DraftTreeBatch (reads tokens / parents / depths, each [B, N] int64, parents
    -1 = root, best-first so any prefix is a tree). bonus_tokens: [B] int64. width: W, 1 <= W <= N + 1.
    Returns TreeBatch: tokens [B, W] (column 0 = bonus), parents [B, W] (column 0 = NO_NODE, node parent
    p -> position p + 1), depths [B, W] (0 for the root).
    """
    checks.check_flatten_trees(trees, bonus_tokens, width)
    return reference.flatten_trees(trees, bonus_tokens, width)


def root_rows(bonus_tokens: torch.Tensor) -> TreeBatch:
    """Verify rows of width 1, the roots alone (a plain step): what `flatten_trees` makes of trees without a
    node at W = 1, without building them. bonus_tokens: [B] int64. Returns TreeBatch [B, 1]: tokens =
    bonus_tokens, parents NO_NODE, depths 0. No host sync."""
    checks.check_root_rows(bonus_tokens)
    return reference.root_rows(bonus_tokens)


def build_verify_layout(trees: TreeBatch, ctx_lens: torch.Tensor) -> VerifyLayout:
    """Positions, ancestor mask and child/sibling pointers of the verify rows.

    trees: TreeBatch [B, W]. ctx_lens: [B] int64, tokens already cached per request.
    Returns VerifyLayout: positions [B, W] int64 = ctx_len + depth; ancestor_mask [B, W, W] bool, row j
    True at j and at every ancestor of j (root included); first_child, next_sibling [B, W] int64 in
    increasing position order, NO_NODE where none. No host sync.
    """
    checks.check_build_verify_layout(trees, ctx_lens)
    if uses_triton(ctx_lens):
        from bastion_sglang.kernels import triton_tree

        return triton_tree.build_verify_layout(trees, ctx_lens)
    return reference.build_verify_layout(trees, ctx_lens)


def flat_custom_mask(
    ancestor_mask: torch.Tensor, seq_lens: torch.Tensor, *, seq_lens_sum: int | None = None
) -> torch.Tensor:
    """The `custom_mask` of SGLang's triton attention backend for a TARGET_VERIFY pass.

    ancestor_mask: [B, W, W] bool (VerifyLayout.ancestor_mask). seq_lens: [B] int64, cached prefix
    length L_b per request. seq_lens_sum: Σ L_b when the caller holds it on the host (SGLang's
    ForwardBatch.seq_lens_sum); it must equal seq_lens.sum() (not checked). Without it the output size
    is read from the device (one host sync).
    Returns [Σ_b W·(L_b + W)] bool: per request a row-major [W, L_b + W] block (prefix columns True,
    then the ancestor block), blocks in batch order.
    """
    checks.check_flat_custom_mask(ancestor_mask, seq_lens, seq_lens_sum)
    if uses_triton(ancestor_mask):
        from bastion_sglang.kernels import triton_tree

        return triton_tree.flat_custom_mask(ancestor_mask, seq_lens, seq_lens_sum=seq_lens_sum)
    return reference.flat_custom_mask(ancestor_mask, seq_lens, seq_lens_sum=seq_lens_sum)


def _accept_walk_unchecked(trees: TreeBatch, target_tokens: torch.Tensor) -> AcceptResult:
    if uses_triton(target_tokens):
        from bastion_sglang.kernels import triton_accept

        return triton_accept.accept_walk(trees, target_tokens)
    return reference.accept_walk(trees, target_tokens)


def accept_walk(trees: TreeBatch, target_tokens: torch.Tensor) -> AcceptResult:
    """Accept walk over the verify rows.

    trees: TreeBatch [B, W] (sibling tokens distinct). target_tokens: [B, W] int64, the token the target
    emits after each position. Start at the root; while the current node has a child whose token equals
    target_tokens[b, current], move to it. Returns AcceptResult: accept_index [B, W] (accepted positions,
    root first, NO_NODE padded), accept_length [B] (accepted draft nodes), bonus_tokens [B] (the target
    token at the last accepted node). The step emits the accepted draft tokens, then the bonus. No host sync.
    """
    checks.check_accept_walk(trees, target_tokens)
    return _accept_walk_unchecked(trees, target_tokens)


def accept_greedy(trees: TreeBatch, target_logits: torch.Tensor) -> AcceptResult:
    """Greedy (T = 0) acceptance: `accept_walk` with target_tokens = argmax of target_logits.

    trees: TreeBatch [B, W]. target_logits: [B, W, V] floating (ties go to the smallest token id).
    """
    checks.check_accept_greedy(trees, target_logits)
    return _accept_walk_unchecked(trees, torch.argmax(target_logits, dim=-1))


def accept_paths(trees: TreeBatch, ancestors: torch.Tensor, target_tokens: torch.Tensor) -> AcceptedPaths:
    """What a tree step commits, in one op of fixed shape: `accept_walk`, `compaction_order`,
    `committed_tokens` and the tokens emitted, from the acceptance of each node.

    trees: TreeBatch [B, W] (sibling tokens distinct). ancestors: [B, W, W] bool, the rows'
    `VerifyLayout.ancestor_mask`. target_tokens: [B, W] int64, the token the target emits after each position
    (its argmax, or `sample_tokens` of its distribution). Returns AcceptedPaths: order [B, W] (the accepted
    path root first, then the other positions ascending), out_tokens [B, W] (accepted draft tokens, the
    bonus, zeros), commit_lens [B] int32 (accepted nodes + 1), bonus_tokens [B]: what `accept_walk` followed
    by `compaction_order` and `committed_tokens` gives. Thirteen torch ops whatever the rows hold, each of
    shape [B, W] or [B, W, W], on every device; no host sync.
    """
    checks.check_accept_paths(trees, ancestors, target_tokens)
    return paths.accept_paths(trees, ancestors, target_tokens)


def accept_roots(target_tokens: torch.Tensor) -> AcceptResult:
    """The accept walk's result for verify rows that hold only their roots (W = 1, a plain step): no draft
    node to walk, so each request emits the target's token after its root.

    target_tokens: [B] int64. Returns AcceptResult (accept_index [B, 1] zeros, accept_length [B] zeros,
    bonus_tokens = target_tokens): what `accept_walk` returns for such rows. No host sync.
    """
    checks.check_accept_roots(target_tokens)
    zeros = torch.zeros_like(target_tokens)
    return AcceptResult(accept_index=zeros[:, None], accept_length=zeros, bonus_tokens=target_tokens)


def position_uniforms(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The sampling walk's uniforms: [B, W] float32 in [0, 1), a hash of (seeds[b], positions[b, j]).

    seeds: [B] int64, one per request. positions: [B, W] int64, the sequence position of the token each
    tree position samples (ctx_len + 1 + depth). Nodes at one depth share their uniform; the walk visits
    one node per depth, so the tokens it emits use distinct positions' independent uniforms, and the
    token emitted at a position is the inverse-CDF sample of the target's distribution there with that
    position's uniform: the same whatever tree, budget or batch produced it (seeded runs are
    batch-invariant). Plain elementwise torch on every device. Equal to `keyed_uniforms` of
    `seed_keys(seeds)`, the form a decode step uses (its requests' keys are hashed once, at prefill).
    """
    checks.check_position_uniforms(seeds, positions)
    return reference.position_uniforms(seeds, positions)


def seed_keys(seeds: torch.Tensor) -> torch.Tensor:
    """[B] int64: the walk key of each request's seed (seeds: [B] int64), the first half of
    `position_uniforms`' hash, so that a step hashes only its positions (`keyed_uniforms`)."""
    checks.check_seeds(seeds)
    return reference.seed_keys(seeds)


def keyed_uniforms(keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """`position_uniforms` from the requests' `seed_keys`: keys [B] int64, positions [B, W] int64; returns
    [B, W] float32 in [0, 1), bit for bit `position_uniforms(seeds, positions)`."""
    checks.check_position_uniforms(keys, positions, "keys")
    return reference.keyed_uniforms(keys, positions)


def sample_tokens(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: per row, the first positive token whose cumulative probability exceeds u·total.

    probs: [M, V] non-negative weights (rows need not be normalised but need positive mass).
    uniforms: [M] in [0, 1). Returns [M] int64. A token of zero probability is never returned. A pure
    function of its inputs, row by row: seeded uniforms reproduce a run and a batch samples exactly as
    its rows would one at a time.
    """
    checks.check_sample_tokens(probs, uniforms)
    return reference.sample_tokens(probs, uniforms)


def accept_sampling(trees: TreeBatch, target_probs: torch.Tensor, uniforms: torch.Tensor) -> AcceptResult:
    """Lossless acceptance at any temperature: sample the target at every position, then `accept_walk`.

    trees: TreeBatch [B, W]. target_probs: [B, W, V], the target's processed distribution (temperature,
    top-p/top-k/min-p applied) after each position. uniforms: [B, W] in [0, 1), one per position.
    Every emitted token is the target's own sample after the tokens emitted before it in the step, so
    the output is distributed exactly as the target's.
    """
    checks.check_accept_sampling(trees, target_probs, uniforms)
    batch, width, vocab = target_probs.shape
    samples = reference.sample_tokens(target_probs.reshape(batch * width, vocab), uniforms.reshape(-1))
    return _accept_walk_unchecked(trees, samples.view(batch, width))


def accepted_kv_moves(
    accept_index: torch.Tensor, accept_length: torch.Tensor, tree_base: torch.Tensor
) -> KvMoves:
    """Cache row copies that move each request's accepted path to the front of its tree block.

    accept_index: [B, W] int64 and accept_length: [B] int64 from the accept walk. tree_base: [B] int64,
    the cache row of position 0 of each verify row (rows tree_base[b] .. + W - 1; blocks must not
    overlap). Returns KvMoves: src, dst [B, W] (tree_base + accept_index[b, k] -> tree_base + k for
    k <= accept_length[b], NO_MOVE where nothing moves), keep [B] = accept_length + 1. No host sync.
    """
    checks.check_accepted_kv_moves(accept_index, accept_length, tree_base)
    if uses_triton(accept_index):
        from bastion_sglang.kernels import triton_kv

        return triton_kv.accepted_kv_moves(accept_index, accept_length, tree_base)
    return reference.accepted_kv_moves(accept_index, accept_length, tree_base)


def window_kv_moves(order: torch.Tensor, keep: torch.Tensor, slots: torch.Tensor) -> KvMoves:
    """Slot copies that put each request's accepted path at the front of its verify window (pages of several
    tokens, where slot ids cannot be permuted).

    order: [B, W] int64 `compaction_order`; keep: [B] int64 columns of the accepted path (accepted nodes + 1,
    root included); slots: [B, W] int64 the window's KV slots (column k at position L_b + k). Returns KvMoves:
    src, dst [B, W] (slots[b, order[b, k]] -> slots[b, k] for k < keep[b] where the two differ, NO_MOVE
    elsewhere), keep. Applied in increasing column order (or all sources gathered first) the moves never
    overwrite an unread source. Elementwise torch on every device; no host sync.
    """
    checks.check_window_kv_moves(order, keep, slots)
    return reference.window_kv_moves(order, keep, slots)


def compaction_order(accept_index: torch.Tensor, accept_length: torch.Tensor) -> torch.Tensor:
    """Permutation of each verify row that puts the accepted path first, root to deepest.

    accept_index: [B, W] int64 accepted positions (root first, NO_NODE padded); accept_length: [B] int64.
    Returns order [B, W] int64: order[b, k] = accept_index[b, k] for k <= accept_length[b], then the other
    positions ascending; applied to the row's KV slots, hidden states and logits. No host sync.
    """
    checks.check_compaction_order(accept_index, accept_length)
    return reference.compaction_order(accept_index, accept_length)


def committed_tokens(tokens: torch.Tensor, order: torch.Tensor, accept: AcceptResult) -> torch.Tensor:
    """[B, W] int64 output rows: the accepted draft tokens (depths 1..a), the bonus at column a, zeros after.

    tokens: [B, W] int64 verify-row tokens; order: `compaction_order` of `accept`; accept: the accept walk's
    result. No host sync.
    """
    checks.check_committed_tokens(tokens, order, accept)
    return reference.committed_tokens(tokens, order, accept)


def apply_kv_moves(cache: torch.Tensor, moves: KvMoves) -> None:
    """Copy the moved rows of `cache` in place (all sources read before any destination is written).

    cache: [S, ...] contiguous, any dtype. moves: KvMoves from `accepted_kv_moves`.
    """
    checks.check_apply_kv_moves(cache, moves)
    if uses_triton(cache):
        from bastion_sglang.kernels import triton_kv

        triton_kv.apply_kv_moves(cache, moves)
        return
    reference.apply_kv_moves(cache, moves)


def tree_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """Masked attention with grouped-query heads, for verify passes on the CPU.

    q: [T, Hq, Dh]; k, v: [S, Hkv, Dh], Hq a multiple of Hkv; mask: [T, S] bool, True = may attend
    (each row needs one True); scale: factor on q·k. Returns [T, Hq, Dh] in q's dtype.
    """
    checks.check_tree_attention(q, k, v, mask, scale)
    return reference.tree_attention(q, k, v, mask, scale)
