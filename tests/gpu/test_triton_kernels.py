"""Every Triton op of bastion_sglang.kernels equals its torch reference on CUDA, exactly.

Trees: best-first trees from the controller's heap, uniformly random parents, a single chain (depth
W - 1) and a star (every node a child of the root); batch 1..64, width 1..1025.
"""

from __future__ import annotations

import pytest
import torch

from bastion_sglang import kernels
from bastion_sglang.controller.batched import DraftTreeBatch
from bastion_sglang.controller.tree import build_tree
from bastion_sglang.kernels import (
    NO_NODE,
    AcceptResult,
    TreeBatch,
    reference,
    triton_accept,
    triton_kv,
    triton_tree,
)

VOCAB = 4096

CASES = [
    (1, 1, "chain"),
    (1, 2, "best_first"),
    (2, 5, "star"),
    (3, 17, "random"),
    (8, 64, "best_first"),
    (64, 129, "random"),
    (16, 257, "chain"),
    (5, 300, "star"),
    (64, 1025, "random"),
    (4, 1025, "best_first"),
    (2, 1025, "chain"),
]


def best_first_trees(gen: torch.Generator, batch: int, width: int) -> TreeBatch:
    """Verify rows from `build_tree` on random drafter outputs (16 depths, top-8)."""
    rows = []
    for _ in range(batch):
        top = torch.log_softmax(torch.randn(16, VOCAB, generator=gen).double() * 3, dim=-1).topk(8, dim=-1)
        token_ids = torch.stack([torch.randperm(VOCAB, generator=gen)[:8] for _ in range(16)])
        rows.append(build_tree(top.values, token_ids, width - 1))
    fields = ("tokens", "parents", "depths", "log_scores")
    draft = DraftTreeBatch(*(torch.stack([getattr(t, f) for t in rows]) for f in fields))
    bonus = torch.randint(0, VOCAB, (batch,), generator=gen)
    return reference.flatten_trees(draft, bonus, width)


def shaped_trees(gen: torch.Generator, batch: int, width: int, kind: str) -> TreeBatch:
    """Verify rows with random ("random"), chain or star parents; tokens distinct within a row."""
    position = torch.arange(width)
    if kind == "random":
        parents = (torch.rand(batch, width, generator=gen) * position).long()
    elif kind == "chain":
        parents = (position - 1).expand(batch, width).clone()
    else:
        parents = torch.zeros(batch, width, dtype=torch.int64)
    parents[:, 0] = NO_NODE
    depths = torch.zeros(batch, width, dtype=torch.int64)
    for j in range(1, width):
        depths[:, j] = depths.gather(1, parents[:, j : j + 1])[:, 0] + 1
    tokens = torch.stack([torch.randperm(VOCAB, generator=gen)[:width] for _ in range(batch)])
    return TreeBatch(tokens=tokens, parents=parents, depths=depths)


def make_trees(gen: torch.Generator, batch: int, width: int, kind: str, device: torch.device) -> TreeBatch:
    trees = (
        best_first_trees(gen, batch, width) if kind == "best_first" else shaped_trees(gen, batch, width, kind)
    )
    return TreeBatch(*(getattr(trees, f).to(device) for f in ("tokens", "parents", "depths")))


def biased_targets(gen: torch.Generator, trees: TreeBatch, hit: float) -> torch.Tensor:
    """[B, W] target tokens on the trees' device: with probability `hit` the token of a random child."""
    tokens, parents = trees.tokens.cpu(), trees.parents.cpu()
    batch, width = tokens.shape
    priority = torch.rand(batch, width, generator=gen)
    slot = torch.where(parents >= 0, parents, width)
    best = torch.full((batch, width + 1), -1.0).scatter_reduce(1, slot, priority, reduce="amax")
    chosen = (parents >= 0) & (priority == best.gather(1, slot))
    child_token = torch.full((batch, width + 1), -1, dtype=torch.int64)
    child_token.scatter_(1, torch.where(chosen, slot, width), torch.where(chosen, tokens, -1))
    child_token = child_token[:, :width]
    targets = torch.randint(0, VOCAB, (batch, width), generator=gen)
    take = (child_token >= 0) & (torch.rand(batch, width, generator=gen) < hit)
    return torch.where(take, child_token, targets).to(trees.tokens.device)


def assert_same_accept(actual: AcceptResult, expected: AcceptResult) -> None:
    assert torch.equal(actual.accept_index, expected.accept_index)
    assert torch.equal(actual.accept_length, expected.accept_length)
    assert torch.equal(actual.bonus_tokens, expected.bonus_tokens)


def hand_tree(device: torch.device) -> TreeBatch:
    """The 5-node tree of tests/test_kernels_tree.py as a verify row (bonus 5)."""
    return TreeBatch(
        tokens=torch.tensor([[5, 10, 11, 20, 21, 30]], device=device),
        parents=torch.tensor([[NO_NODE, 0, 0, 1, 1, 3]], device=device),
        depths=torch.tensor([[0, 1, 1, 2, 2, 3]], device=device),
    )


def test_hand_tree_layout_mask_and_walk(device: torch.device) -> None:
    trees = hand_tree(device)
    layout = triton_tree.build_verify_layout(trees, torch.tensor([2], device=device))
    assert layout.positions.tolist() == [[2, 3, 3, 4, 4, 5]]
    assert layout.first_child.tolist() == [[1, 3, NO_NODE, 5, NO_NODE, NO_NODE]]
    assert layout.next_sibling.tolist() == [[NO_NODE, 2, NO_NODE, 4, NO_NODE, NO_NODE]]
    mask = triton_tree.flat_custom_mask(layout.ancestor_mask, torch.tensor([2], device=device))
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
    result = triton_accept.accept_walk(batch, targets.to(device))
    assert result.accept_index.tolist() == [
        [0, 1, 3, 5, NO_NODE, NO_NODE],
        [0, 1, 4, NO_NODE, NO_NODE, NO_NODE],
        [0, NO_NODE, NO_NODE, NO_NODE, NO_NODE, NO_NODE],
    ]
    assert result.accept_length.tolist() == [3, 2, 0]
    assert result.bonus_tokens.tolist() == [42, 77, 99]
    moves = triton_kv.accepted_kv_moves(
        result.accept_index, result.accept_length, torch.tensor([100, 200, 300], device=device)
    )
    assert moves.src.tolist()[:2] == [[-1, -1, 103, 105, -1, -1], [-1, -1, 204, -1, -1, -1]]
    assert moves.dst.tolist()[:2] == [[-1, -1, 102, 103, -1, -1], [-1, -1, 202, -1, -1, -1]]
    assert moves.keep.tolist() == [4, 3, 1]
    cache = torch.arange(310 * 6, device=device, dtype=torch.float32).view(310, 6)
    before = cache.clone()
    triton_kv.apply_kv_moves(cache, moves)
    assert torch.equal(cache[100:104], before[[100, 101, 103, 105]])
    assert torch.equal(cache[200:203], before[[200, 201, 204]])
    assert torch.equal(cache[104:200], before[104:200])


@pytest.mark.parametrize(("batch", "width", "kind"), CASES)
def test_verify_layout_and_custom_mask_match_reference(
    batch: int, width: int, kind: str, device: torch.device
) -> None:
    gen = torch.Generator().manual_seed(batch * 7919 + width)
    trees = make_trees(gen, batch, width, kind, device)
    ctx_lens = torch.randint(0, 3000, (batch,), generator=gen).to(device)
    actual = triton_tree.build_verify_layout(trees, ctx_lens)
    expected = reference.build_verify_layout(trees, ctx_lens)
    for field in ("positions", "ancestor_mask", "first_child", "next_sibling"):
        assert torch.equal(getattr(actual, field), getattr(expected, field)), field
    seq_lens = torch.randint(0, 2000, (batch,), generator=gen)
    seq_lens[0] = 0
    seq_lens = seq_lens.to(device)
    expected_mask = reference.flat_custom_mask(expected.ancestor_mask, seq_lens)
    assert torch.equal(triton_tree.flat_custom_mask(actual.ancestor_mask, seq_lens), expected_mask)
    seq_lens_sum = int(seq_lens.sum())  # host copy, as SGLang holds it
    with_sum = triton_tree.flat_custom_mask(actual.ancestor_mask, seq_lens, seq_lens_sum=seq_lens_sum)
    assert torch.equal(with_sum, expected_mask)


@pytest.mark.parametrize(("batch", "width", "kind"), CASES)
@pytest.mark.parametrize("hit", [0.6, 1.0])
def test_accept_walk_and_kv_moves_match_reference(
    batch: int, width: int, kind: str, hit: float, device: torch.device
) -> None:
    gen = torch.Generator().manual_seed(batch * 104729 + width + int(hit * 10))
    trees = make_trees(gen, batch, width, kind, device)
    targets = biased_targets(gen, trees, hit)
    expected = reference.accept_walk(trees, targets)
    actual = triton_accept.accept_walk(trees, targets)
    assert_same_accept(actual, expected)
    if hit == 1.0 and kind == "chain":
        assert actual.accept_length.tolist() == [width - 1] * batch

    # Disjoint tree blocks at random offsets.
    gaps = torch.randint(0, 5, (batch,), generator=gen)
    tree_base = (torch.arange(batch) * width + torch.cumsum(gaps, dim=0)).to(device)
    expected_moves = reference.accepted_kv_moves(expected.accept_index, expected.accept_length, tree_base)
    moves = triton_kv.accepted_kv_moves(actual.accept_index, actual.accept_length, tree_base)
    for field in ("src", "dst", "keep"):
        assert torch.equal(getattr(moves, field), getattr(expected_moves, field)), field

    rows = int(tree_base[-1]) + width + 3  # host copy of the last block's end
    layouts = (
        ((8, 128), torch.bfloat16),
        ((3,), torch.float32),
        ((5,), torch.uint8),
        ((16,), torch.float8_e4m3fn),
    )
    for shape, dtype in layouts:
        row_bytes = shape[0] * (shape[1] if len(shape) > 1 else 1) * dtype.itemsize
        raw = torch.randint(0, 256, (rows, row_bytes), generator=gen, dtype=torch.uint8)
        cache = raw.view(dtype).view(rows, *shape).to(device)
        expected_cache = cache.clone()
        reference.apply_kv_moves(expected_cache, expected_moves)
        triton_kv.apply_kv_moves(cache, moves)
        assert torch.equal(cache.view(torch.uint8), expected_cache.view(torch.uint8)), dtype


def test_public_ops_dispatch_to_triton_on_cuda(device: torch.device) -> None:
    gen = torch.Generator().manual_seed(5)
    trees = make_trees(gen, 6, 40, "random", device)
    assert kernels.uses_triton(trees.tokens)
    ctx_lens = torch.randint(0, 100, (6,), generator=gen).to(device)
    layout = kernels.build_verify_layout(trees, ctx_lens)
    assert torch.equal(layout.ancestor_mask, reference.build_verify_layout(trees, ctx_lens).ancestor_mask)
    targets = biased_targets(gen, trees, 0.8)
    result = kernels.accept_walk(trees, targets)
    assert_same_accept(result, reference.accept_walk(trees, targets))
    logits = torch.randn(6, 40, 50, generator=gen).to(device)
    assert_same_accept(kernels.accept_greedy(trees, logits), reference.accept_walk(trees, logits.argmax(-1)))
    probs = torch.softmax(logits, dim=-1)
    uniforms = torch.rand(6, 40, generator=gen).to(device)
    samples = reference.sample_tokens(probs.view(-1, 50), uniforms.view(-1)).view(6, 40)
    assert_same_accept(kernels.accept_sampling(trees, probs, uniforms), reference.accept_walk(trees, samples))


def test_position_uniforms_on_cuda_equal_the_cpu_bit_for_bit(device: torch.device) -> None:
    """The hash wraps int64 arithmetic the same way on both devices: a seeded request samples the same
    tokens on a GPU server as on a CPU one."""
    gen = torch.Generator().manual_seed(9)
    seeds = torch.randint(-(2**63), 2**63 - 1, (64,), generator=gen, dtype=torch.int64)
    positions = torch.randint(0, 2**40, (64, 300), generator=gen, dtype=torch.int64)
    on_cpu = kernels.position_uniforms(seeds, positions)
    on_cuda = kernels.position_uniforms(seeds.to(device), positions.to(device))
    assert on_cuda.device.type == "cuda"
    assert torch.equal(on_cuda.cpu(), on_cpu)


def test_sample_tokens_on_cuda_equal_the_cpu_where_sums_are_exact(device: torch.device) -> None:
    """The CUDA path (running maximum over positive tokens, then the binary search) draws what the CPU
    draws where both scans sum exactly (integer weights, dyadic uniforms), and never a zero-weight token."""
    gen = torch.Generator().manual_seed(13)
    weights = torch.randint(0, 8, (512, 3000), generator=gen).float()
    weights[torch.rand(512, 3000, generator=gen) < 0.8] = 0.0
    weights[:, 1500] += 1  # every row has positive mass
    uniforms = torch.randint(0, 1024, (512,), generator=gen).float() / 1024
    uniforms[:32] = 1.0 - 2.0**-24
    on_cpu = kernels.sample_tokens(weights, uniforms)
    on_cuda = kernels.sample_tokens(weights.to(device), uniforms.to(device))
    assert torch.equal(on_cuda.cpu(), on_cpu)
    probs = torch.softmax(torch.randn(512, 49152, generator=gen) * 12, dim=-1).to(device)
    drawn = kernels.sample_tokens(probs, torch.rand(512, generator=gen).to(device))
    assert bool((probs.gather(1, drawn[:, None]) > 0).all())
