"""BASTION's Triton kernels under Triton's interpreter on CPU tensors equal their torch references, exactly.

Run by `tests/test_triton_interpreter.py` (the interpreter lane, `tests/interpreter_lane.py`); the ops are
called directly, since `bastion_sglang.kernels` dispatches to Triton on CUDA only. The cases are those of
`tests/gpu/test_triton_kernels.py` cut to what the interpreter runs in seconds, plus the edges: width 1,
the widest default width bucket (65) and past the kernels' block sizes (129: `_BLOCK_J` 32, `_BLOCK_K` 64,
`_BLOCK_W` 128), batch 1 and 32, ragged context lengths (0 included), and the deepest tree of a width (a
chain). `tests/interpreted/sglang_verify_attention.py` covers the paged (page size 16) commit copy.
"""

from __future__ import annotations

import pytest
import torch
from interpreter_lane import require_interpreted
from verify_trees import biased_targets, hand_tree, make_trees

from bastion_sglang.kernels import (
    NO_NODE,
    AcceptResult,
    TreeBatch,
    reference,
    triton_accept,
    triton_kv,
    triton_tree,
)

require_interpreted(
    triton_tree._verify_layout_kernel,
    triton_tree._flat_custom_mask_kernel,
    triton_accept._accept_walk_kernel,
    triton_kv._kv_moves_kernel,
    triton_kv._apply_kv_moves_kernel,
)

CASES = [
    (1, 1, "chain"),  # width 1: the root alone
    (1, 2, "best_first"),
    (2, 5, "star"),
    (3, 17, "random"),
    (32, 8, "best_first"),  # batch 32
    (32, 3, "chain"),
    (2, 65, "best_first"),  # the widest default bucket (N_max 64)
    (1, 65, "chain"),  # its deepest tree: depth 64
    (2, 129, "random"),  # two blocks of every kernel
    (1, 129, "chain"),  # depth 128, across the accept walk's block of 128
]


def assert_same_accept(actual: AcceptResult, expected: AcceptResult) -> None:
    assert torch.equal(actual.accept_index, expected.accept_index)
    assert torch.equal(actual.accept_length, expected.accept_length)
    assert torch.equal(actual.bonus_tokens, expected.bonus_tokens)


def test_hand_tree_layout_mask_walk_and_moves() -> None:
    trees = hand_tree()
    layout = triton_tree.build_verify_layout(trees, torch.tensor([2]))
    assert layout.positions.tolist() == [[2, 3, 3, 4, 4, 5]]
    assert layout.first_child.tolist() == [[1, 3, NO_NODE, 5, NO_NODE, NO_NODE]]
    assert layout.next_sibling.tolist() == [[NO_NODE, 2, NO_NODE, 4, NO_NODE, NO_NODE]]
    mask = triton_tree.flat_custom_mask(layout.ancestor_mask, torch.tensor([2]))
    assert mask.view(6, 8).int().tolist() == [
        [1, 1, 1, 0, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 1, 0, 0, 0],
        [1, 1, 1, 1, 0, 1, 0, 0],
        [1, 1, 1, 1, 0, 0, 1, 0],
        [1, 1, 1, 1, 0, 1, 0, 1],
    ]
    targets = torch.tensor([[10, 20, 30, 30, 30, 42], [10, 21, 30, 30, 77, 10], [99, 20, 30, 30, 30, 10]])
    batch = TreeBatch(*(getattr(trees, f).expand(3, 6).contiguous() for f in ("tokens", "parents", "depths")))
    result = triton_accept.accept_walk(batch, targets)
    assert result.accept_index.tolist() == [
        [0, 1, 3, 5, NO_NODE, NO_NODE],
        [0, 1, 4, NO_NODE, NO_NODE, NO_NODE],
        [0, NO_NODE, NO_NODE, NO_NODE, NO_NODE, NO_NODE],
    ]
    assert result.accept_length.tolist() == [3, 2, 0]
    assert result.bonus_tokens.tolist() == [42, 77, 99]
    moves = triton_kv.accepted_kv_moves(
        result.accept_index, result.accept_length, torch.tensor([100, 200, 300])
    )
    assert moves.src.tolist() == [[-1, -1, 103, 105, -1, -1], [-1, -1, 204, -1, -1, -1], [-1] * 6]
    assert moves.dst.tolist() == [[-1, -1, 102, 103, -1, -1], [-1, -1, 202, -1, -1, -1], [-1] * 6]
    assert moves.keep.tolist() == [4, 3, 1]
    cache = torch.arange(310 * 6, dtype=torch.float32).view(310, 6)
    before = cache.clone()
    triton_kv.apply_kv_moves(cache, moves)
    assert torch.equal(cache[100:104], before[[100, 101, 103, 105]])
    assert torch.equal(cache[200:203], before[[200, 201, 204]])
    assert torch.equal(cache[104:200], before[104:200])
    assert torch.equal(cache[203:], before[203:])


@pytest.mark.parametrize(("batch", "width", "kind"), CASES)
def test_verify_layout_and_custom_mask_match_reference(batch: int, width: int, kind: str) -> None:
    gen = torch.Generator().manual_seed(batch * 7919 + width)
    trees = make_trees(gen, batch, width, kind)
    ctx_lens = torch.randint(0, 3000, (batch,), generator=gen)
    actual = triton_tree.build_verify_layout(trees, ctx_lens)
    expected = reference.build_verify_layout(trees, ctx_lens)
    for field in ("positions", "ancestor_mask", "first_child", "next_sibling"):
        assert torch.equal(getattr(actual, field), getattr(expected, field)), field
    # Ragged prefixes: none, shorter and longer than the mask kernel's 1024-column block.
    seq_lens = torch.randint(1, 2100, (batch,), generator=gen)
    seq_lens[0] = 0
    expected_mask = reference.flat_custom_mask(expected.ancestor_mask, seq_lens)
    assert torch.equal(triton_tree.flat_custom_mask(actual.ancestor_mask, seq_lens), expected_mask)
    with_sum = triton_tree.flat_custom_mask(actual.ancestor_mask, seq_lens, seq_lens_sum=int(seq_lens.sum()))
    assert torch.equal(with_sum, expected_mask)


@pytest.mark.parametrize(("batch", "width", "kind"), CASES)
@pytest.mark.parametrize("hit", [0.6, 1.0])
def test_accept_walk_and_kv_moves_match_reference(batch: int, width: int, kind: str, hit: float) -> None:
    gen = torch.Generator().manual_seed(batch * 104729 + width + int(hit * 10))
    trees = make_trees(gen, batch, width, kind)
    targets = biased_targets(gen, trees, hit)
    expected = reference.accept_walk(trees, targets)
    actual = triton_accept.accept_walk(trees, targets)
    assert_same_accept(actual, expected)
    if hit == 1.0 and kind == "chain":
        assert actual.accept_length.tolist() == [width - 1] * batch

    # Disjoint tree blocks at random offsets.
    gaps = torch.randint(0, 5, (batch,), generator=gen)
    tree_base = torch.arange(batch) * width + torch.cumsum(gaps, dim=0)
    expected_moves = reference.accepted_kv_moves(expected.accept_index, expected.accept_length, tree_base)
    moves = triton_kv.accepted_kv_moves(actual.accept_index, actual.accept_length, tree_base)
    for field in ("src", "dst", "keep"):
        assert torch.equal(getattr(moves, field), getattr(expected_moves, field)), field

    rows = int(tree_base[-1]) + width + 3
    layouts = (
        ((2, 16), torch.bfloat16),
        ((3,), torch.float32),
        ((5,), torch.uint8),
        ((16,), torch.float8_e4m3fn),
    )
    for shape, dtype in layouts:
        row_bytes = torch.Size(shape).numel() * dtype.itemsize
        raw = torch.randint(0, 256, (rows, row_bytes), generator=gen, dtype=torch.uint8)
        cache = raw.view(dtype).view(rows, *shape)
        expected_cache = cache.clone()
        reference.apply_kv_moves(expected_cache, expected_moves)
        triton_kv.apply_kv_moves(cache, moves)
        assert torch.equal(cache.view(torch.uint8), expected_cache.view(torch.uint8)), dtype
