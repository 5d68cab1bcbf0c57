"""Tree-masked attention (CPU verify path) and the drafter's top-k (bastion_sglang.kernels)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from bastion_sglang.kernels import TreeBatch, build_verify_layout, reference, topk_logprobs, tree_attention


def random_tree(gen: torch.Generator, width: int) -> TreeBatch:
    """One verify row with random parents (parents[j] uniform in [0, j)) and consistent depths."""
    parents, depths = [-1], [0]
    for j in range(1, width):
        parent = int(torch.randint(0, j, (), generator=gen))
        parents.append(parent)
        depths.append(depths[parent] + 1)
    tokens = torch.arange(width)[None, :]
    return TreeBatch(tokens=tokens, parents=torch.tensor([parents]), depths=torch.tensor([depths]))


def chain_of(parents: list[int], node: int) -> list[int]:
    """Positions from the root down to `node`."""
    chain = [node]
    while parents[chain[-1]] >= 0:
        chain.append(parents[chain[-1]])
    return chain[::-1]


@pytest.mark.parametrize(
    ("prefix", "width", "q_heads", "kv_heads"), [(5, 12, 4, 2), (0, 9, 3, 3), (17, 30, 8, 1)]
)
def test_tree_attention_equals_causal_attention_over_each_ancestor_chain(prefix, width, q_heads, kv_heads):
    gen = torch.Generator().manual_seed(prefix * 100 + width)
    head_dim, scale = 8, 0.3
    trees = random_tree(gen, width)
    layout = build_verify_layout(trees, torch.tensor([prefix]))
    q = torch.randn(width, q_heads, head_dim, generator=gen, dtype=torch.float64)
    k = torch.randn(prefix + width, kv_heads, head_dim, generator=gen, dtype=torch.float64)
    v = torch.randn(prefix + width, kv_heads, head_dim, generator=gen, dtype=torch.float64)
    mask = torch.cat([torch.ones(width, prefix, dtype=torch.bool), layout.ancestor_mask[0]], dim=1)
    out = tree_attention(q, k, v, mask, scale)
    assert out.shape == (width, q_heads, head_dim)
    assert out.dtype == torch.float64

    parents = trees.parents[0].tolist()
    for node in range(width):
        chain = chain_of(parents, node)
        rows = list(range(prefix)) + [prefix + j for j in chain]
        # Plain causal attention of the chain's queries over prefix + chain (heads first for SDPA).
        causal = torch.ones(len(chain), len(rows), dtype=torch.bool).tril(diagonal=prefix)
        expected = F.scaled_dot_product_attention(
            q[chain].transpose(0, 1),
            k[rows].transpose(0, 1),
            v[rows].transpose(0, 1),
            attn_mask=causal,
            scale=scale,
            enable_gqa=True,
        ).transpose(0, 1)
        torch.testing.assert_close(out[node], expected[-1], rtol=0, atol=1e-12)
    # Negative control: attending to every tree position changes the output of a deep node.
    deep = max(range(width), key=lambda j: len(chain_of(parents, j)))
    full = tree_attention(q, k, v, torch.ones_like(mask), scale)
    assert not torch.allclose(full[deep], out[deep])


def test_tree_attention_keeps_input_dtype():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(3, 2, 4, generator=gen).to(torch.bfloat16)
    kv = torch.randn(5, 1, 4, generator=gen).to(torch.bfloat16)
    mask = torch.ones(3, 5, dtype=torch.bool).tril(diagonal=2)
    out = tree_attention(q, kv, kv, mask, 0.5)
    assert out.dtype == torch.bfloat16
    expected = tree_attention(q.float(), kv.float(), kv.float(), mask, 0.5)
    torch.testing.assert_close(out.float(), expected, rtol=0, atol=1e-2)


def test_tree_attention_rejects_bad_inputs():
    q, kv, mask = torch.zeros(3, 4, 8), torch.zeros(5, 2, 8), torch.ones(3, 5, dtype=torch.bool)
    with pytest.raises(ValueError, match="q heads Hq = 4 must be a positive multiple of kv heads Hkv = 3"):
        tree_attention(q, torch.zeros(5, 3, 8), torch.zeros(5, 3, 8), mask, 1.0)
    with pytest.raises(ValueError, match=r"mask must be \[T, S\] = \(3, 5\), got shape \(3, 4\)"):
        tree_attention(q, kv, kv, mask[:, :4], 1.0)
    with pytest.raises(ValueError, match=r"mask must be bool, got torch\.float32"):
        tree_attention(q, kv, kv, mask.float(), 1.0)
    with pytest.raises(
        ValueError, match=r"k must be \[S, Hkv, Dh\] with Dh of q = \(5, 2, 8\), got shape \(5, 2, 7\)"
    ):
        tree_attention(q, torch.zeros(5, 2, 7), kv, mask, 1.0)
    with pytest.raises(
        ValueError, match=r"v must be \[S, Hkv, Dh\] like k = \(5, 2, 8\), got shape \(4, 2, 8\)"
    ):
        tree_attention(q, kv, torch.zeros(4, 2, 8), mask, 1.0)
    with pytest.raises(ValueError, match=r"q must be \[T, Hq, Dh\], got shape \(3, 32\)"):
        tree_attention(q.reshape(3, 32), kv, kv, mask, 1.0)
    with pytest.raises(ValueError, match="scale must be a finite float, got nan"):
        tree_attention(q, kv, kv, mask, float("nan"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_topk_logprobs_in_blocks_is_the_one_call_bit_for_bit(dtype: torch.dtype):
    gen = torch.Generator().manual_seed(11)
    logits = (torch.randn(5, 7, 300, generator=gen) * 4).to(dtype)
    logits[1, 2, :40] = 3.0  # ties across the top-k's boundary
    logits[3] = logits[3, 0]  # whole rows alike
    one_call = reference.topk_logprobs(logits, 9)
    for block_rows in (1, 4, 32, 35, 64):  # 35 rows in all: partial, exact and single blocks
        blocked = reference.topk_logprobs_in_blocks(logits, 9, block_rows)
        assert torch.equal(blocked.logprobs, one_call.logprobs)
        assert torch.equal(blocked.token_ids, one_call.token_ids)
    assert torch.equal(topk_logprobs(logits, 300).token_ids, reference.topk_logprobs(logits, 300).token_ids)


def test_topk_logprobs_matches_log_softmax_topk():
    gen = torch.Generator().manual_seed(4)
    logits = (torch.randn(2, 3, 50, generator=gen) * 5).to(torch.bfloat16)
    top = topk_logprobs(logits, 6)
    assert top.logprobs.dtype == torch.float32
    assert top.token_ids.dtype == torch.int64
    assert top.logprobs.shape == top.token_ids.shape == (2, 3, 6)
    full = torch.log_softmax(logits.float(), dim=-1)
    assert torch.equal(top.logprobs, full.gather(-1, top.token_ids))
    assert bool((top.logprobs[..., 1:] <= top.logprobs[..., :-1]).all())
    assert torch.equal(top.logprobs[..., 0], full.max(dim=-1).values)
    # No token outside the top 6 beats the 6th.
    outside = full.scatter(-1, top.token_ids, float("-inf"))
    assert bool((outside.max(dim=-1).values <= top.logprobs[..., -1]).all())


def test_topk_logprobs_rejects_bad_inputs():
    with pytest.raises(ValueError, match="k = 51 exceeds the vocabulary size V = 50"):
        topk_logprobs(torch.zeros(1, 2, 50), 51)
    with pytest.raises(ValueError, match="k must be >= 1, got 0"):
        topk_logprobs(torch.zeros(1, 2, 50), 0)
    with pytest.raises(ValueError, match=r"logits must be \[B, D, V\], got shape \(2, 50\)"):
        topk_logprobs(torch.zeros(2, 50), 3)
    with pytest.raises(ValueError, match=r"logits must be a floating tensor, got torch\.int64"):
        topk_logprobs(torch.zeros(1, 2, 50, dtype=torch.int64), 3)
