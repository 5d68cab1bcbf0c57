"""KV compaction: accepted_kv_moves, window_kv_moves, apply_kv_moves (bastion_sglang.kernels, torch path)."""

from __future__ import annotations

import pytest
import torch

from bastion_sglang.kernels import (
    NO_MOVE,
    KvMoves,
    accepted_kv_moves,
    apply_kv_moves,
    compaction_order,
    reference,
    window_kv_moves,
)

# Accept results on the hand-built 5-node tree (verify positions 0..5, see test_kernels_tree.py):
# request 0 accepted the full path 0 -> 1 -> 3 -> 5, request 1 the mid-branch path 0 -> 1 -> 4,
# request 2 nothing beyond the root.
ACCEPT_INDEX = torch.tensor([[0, 1, 3, 5, -1, -1], [0, 1, 4, -1, -1, -1], [0, -1, -1, -1, -1, -1]])
ACCEPT_LENGTH = torch.tensor([3, 2, 0])
TREE_BASE = torch.tensor([100, 200, 300])


def test_accepted_kv_moves_hand_tree():
    moves = accepted_kv_moves(ACCEPT_INDEX, ACCEPT_LENGTH, TREE_BASE)
    x = NO_MOVE
    # Request 0: 103 -> 102 and 105 -> 103 (row 103 is a source and a destination); 100, 101 stay.
    assert moves.src.tolist() == [
        [x, x, 103, 105, x, x],
        [x, x, 204, x, x, x],
        [x, x, x, x, x, x],
    ]
    assert moves.dst.tolist() == [
        [x, x, 102, 103, x, x],
        [x, x, 202, x, x, x],
        [x, x, x, x, x, x],
    ]
    assert moves.keep.tolist() == [4, 3, 1]


def numbered_cache(rows: int) -> torch.Tensor:
    """[rows, 2, 3] bfloat16 cache whose row r holds r * 8 + (0..5): every row is distinct."""
    return (torch.arange(rows)[:, None] * 8 + torch.arange(6)).reshape(rows, 2, 3).to(torch.bfloat16)


def test_apply_kv_moves_overlapping_rows():
    cache = numbered_cache(310)
    before = cache.clone()
    apply_kv_moves(cache, accepted_kv_moves(ACCEPT_INDEX, ACCEPT_LENGTH, TREE_BASE))
    expected = before.clone()
    expected[102] = before[103]  # read before row 103 is overwritten by row 105
    expected[103] = before[105]
    expected[202] = before[204]
    assert torch.equal(cache, expected)
    # The compacted prefix of each request is its accepted path in order.
    for b, base in enumerate(TREE_BASE.tolist()):
        path = [j for j in ACCEPT_INDEX[b].tolist() if j >= 0]
        assert torch.equal(cache[base : base + len(path)], before[[base + j for j in path]])


def test_apply_kv_moves_gathers_all_sources_first():
    """A swap and a rotation: every destination receives its source's value from before the call."""
    cache = torch.arange(10, dtype=torch.float32)[:, None].repeat(1, 4)
    moves = KvMoves(
        src=torch.tensor([[1, 0, -1], [5, 6, 7]]),
        dst=torch.tensor([[0, 1, -1], [6, 7, 5]]),
        keep=torch.tensor([2, 3]),
    )
    reference.apply_kv_moves(cache, moves)
    assert cache[:, 0].tolist() == [1, 0, 2, 3, 4, 7, 5, 6, 8, 9]


def test_apply_kv_moves_without_moves_leaves_cache_unchanged():
    cache = numbered_cache(8)
    before = cache.clone()
    moves = accepted_kv_moves(torch.tensor([[0, -1, -1]]), torch.tensor([0]), torch.tensor([2]))
    assert moves.src.tolist() == [[NO_MOVE] * 3]
    apply_kv_moves(cache, moves)
    assert torch.equal(cache, before)


def test_kv_moves_reject_bad_inputs():
    with pytest.raises(ValueError, match=r"accept_index must be \[B, W\], got shape \(6,\)"):
        accepted_kv_moves(ACCEPT_INDEX[0], ACCEPT_LENGTH, TREE_BASE)
    with pytest.raises(ValueError, match=r"accept_length must be \[B\] = \(3,\), got shape \(2,\)"):
        accepted_kv_moves(ACCEPT_INDEX, ACCEPT_LENGTH[:2], TREE_BASE)
    with pytest.raises(ValueError, match=r"accept_index must have width W >= 1"):
        accepted_kv_moves(ACCEPT_INDEX[:, :0], ACCEPT_LENGTH, TREE_BASE)
    with pytest.raises(ValueError, match=r"tree_base must be int64, got torch\.int32"):
        accepted_kv_moves(ACCEPT_INDEX, ACCEPT_LENGTH, TREE_BASE.int())
    moves = accepted_kv_moves(ACCEPT_INDEX, ACCEPT_LENGTH, TREE_BASE)
    with pytest.raises(ValueError, match=r"cache must be \[S, ...\] with rank >= 1, got shape \(\)"):
        apply_kv_moves(torch.tensor(1.0), moves)
    with pytest.raises(ValueError, match="cache must be contiguous"):
        apply_kv_moves(numbered_cache(310).transpose(0, 1), moves)
    with pytest.raises(
        ValueError, match=r"moves.dst must be \[B, W\] like moves.src = \(3, 6\), got shape \(3, 5\)"
    ):
        apply_kv_moves(numbered_cache(310), KvMoves(moves.src, moves.dst[:, :5], moves.keep))
    with pytest.raises(ValueError, match="moves must be KvMoves, got tuple"):
        apply_kv_moves(numbered_cache(310), (moves.src, moves.dst, moves.keep))


# Verify windows of 6 columns in pages of 4 slots: request 0's window starts 2 slots into page 25 (slots
# 100..103) and continues on page 7; request 1's window fills page 50 and starts page 3; request 2's sits in
# pages 75 and 76.
WINDOW_SLOTS = torch.tensor(
    [[102, 103, 28, 29, 30, 31], [200, 201, 202, 203, 12, 13], [300, 301, 302, 303, 304, 305]]
)


def _order_and_keep() -> tuple[torch.Tensor, torch.Tensor]:
    return compaction_order(ACCEPT_INDEX, ACCEPT_LENGTH), ACCEPT_LENGTH + 1


def test_window_kv_moves_hand_tree_across_pages():
    order, keep = _order_and_keep()
    moves = window_kv_moves(order, keep, WINDOW_SLOTS)
    x = NO_MOVE
    # Request 0 (path 0 -> 1 -> 3 -> 5): column 2 takes column 3's slot 29, column 3 takes column 5's slot 31.
    assert moves.src.tolist() == [[x, x, 29, 31, x, x], [x, x, 12, x, x, x], [x] * 6]
    assert moves.dst.tolist() == [[x, x, 28, 29, x, x], [x, x, 202, x, x, x], [x] * 6]
    assert moves.keep.tolist() == [4, 3, 1]


def test_window_kv_moves_on_contiguous_windows_equal_accepted_kv_moves():
    order, keep = _order_and_keep()
    width = ACCEPT_INDEX.shape[1]
    slots = TREE_BASE[:, None] + torch.arange(width)
    window = window_kv_moves(order, keep, slots)
    tree = accepted_kv_moves(ACCEPT_INDEX, ACCEPT_LENGTH, TREE_BASE)
    assert torch.equal(window.src, tree.src)
    assert torch.equal(window.dst, tree.dst)
    assert torch.equal(window.keep, tree.keep)


def _apply_in_column_order(cache: torch.Tensor, moves: KvMoves) -> None:
    """One move at a time, requests in order and columns increasing (SGLang's host stand-in's order)."""
    for src_row, dst_row in zip(moves.src.tolist(), moves.dst.tolist(), strict=True):
        for src, dst in zip(src_row, dst_row, strict=True):
            if src != NO_MOVE:
                cache[dst] = cache[src]


@pytest.mark.parametrize("apply", [apply_kv_moves, _apply_in_column_order])
def test_window_kv_moves_put_each_path_at_its_window_front(apply) -> None:
    """Gathered first or applied one by one in column order, the moves leave column k of each window holding
    the KV of the path's depth-k node, and every slot outside the moves' destinations unchanged."""
    order, keep = _order_and_keep()
    cache = numbered_cache(310)
    before = cache.clone()
    moves = window_kv_moves(order, keep, WINDOW_SLOTS)
    apply(cache, moves)
    for b in range(len(WINDOW_SLOTS)):
        path = [j for j in ACCEPT_INDEX[b].tolist() if j >= 0]
        slots = WINDOW_SLOTS[b]
        assert torch.equal(cache[slots[: len(path)]], before[slots[path]])
    written = moves.dst[moves.dst != NO_MOVE]
    untouched = torch.ones(310, dtype=torch.bool)
    untouched[written] = False
    assert torch.equal(cache[untouched], before[untouched])


def test_window_kv_moves_on_random_trees_match_the_gathered_path():
    """Random best-first trees and accept walks, windows of shuffled slots: the moved cache holds each
    accepted path in order at its window's front, whichever order the moves are applied in."""
    generator = torch.Generator().manual_seed(0)
    batch, width, rows = 16, 9, 400
    parents = torch.full((batch, width), -1, dtype=torch.int64)
    for j in range(1, width):
        parents[:, j] = torch.randint(0, j, (batch,), generator=generator)
    accept_index = torch.full((batch, width), -1, dtype=torch.int64)
    accept_length = torch.zeros(batch, dtype=torch.int64)
    for b in range(batch):  # walk down: each step picks a random child, stopping at random
        path = [0]
        while torch.rand((), generator=generator) < 0.8:
            children = [j for j in range(width) if parents[b, j] == path[-1]]
            if not children:
                break
            path.append(children[int(torch.randint(0, len(children), (), generator=generator))])
        accept_index[b, : len(path)] = torch.tensor(path)
        accept_length[b] = len(path) - 1
    slots = torch.randperm(rows, generator=generator)[: batch * width].view(batch, width)
    order = compaction_order(accept_index, accept_length)
    moves = window_kv_moves(order, accept_length + 1, slots)
    for apply in (apply_kv_moves, _apply_in_column_order):
        cache = numbered_cache(rows)
        before = cache.clone()
        apply(cache, moves)
        for b in range(batch):
            path = accept_index[b, : int(accept_length[b]) + 1]
            assert torch.equal(cache[slots[b, : len(path)]], before[slots[b, path]])


def test_window_kv_moves_reject_bad_inputs():
    order, keep = _order_and_keep()
    with pytest.raises(ValueError, match=r"order must be \[B, W\], got shape \(6,\)"):
        window_kv_moves(order[0], keep, WINDOW_SLOTS)
    with pytest.raises(ValueError, match=r"keep must be \[B\] = \(3,\), got shape \(2,\)"):
        window_kv_moves(order, keep[:2], WINDOW_SLOTS)
    with pytest.raises(ValueError, match=r"keep must be int64, got torch\.int32"):
        window_kv_moves(order, keep.int(), WINDOW_SLOTS)
    with pytest.raises(ValueError, match=r"slots must be \[B, W\] like order = \(3, 6\), got shape \(3, 5\)"):
        window_kv_moves(order, keep, WINDOW_SLOTS[:, :5])
    with pytest.raises(ValueError, match=r"order must have width W >= 1"):
        window_kv_moves(order[:, :0], keep, WINDOW_SLOTS[:, :0])
