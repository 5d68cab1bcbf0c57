"""KV compaction: accepted_kv_moves and apply_kv_moves (bastion_sglang.kernels, torch path)."""

from __future__ import annotations

import pytest
import torch

from bastion_sglang.kernels import NO_MOVE, KvMoves, accepted_kv_moves, apply_kv_moves, reference

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
