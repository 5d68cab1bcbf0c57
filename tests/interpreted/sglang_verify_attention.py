"""SGLang's Triton kernels of a BASTION TARGET_VERIFY pass, under Triton's interpreter on CPU tensors.

Run by `tests/test_sglang_triton_attention_interpreter.py` (the interpreter lane, `interpreter_lane.py`).
What SGLang 0.5.23's `triton` attention backend runs for a verify pass of the tree BASTION lays out:

- `create_flashinfer_kv_indices_triton`: each request's cached prefix slots, gathered from `req_to_token`
  into the flat `kv_indices` stream (`TritonAttnBackend._fill_kv_indptr_and_indices`);
- `extend_attention_fwd` (`_fwd_kernel`): the verify tokens' attention over the prefix and over the verify
  rows the flat custom mask allows, with SGLang's metadata (`qo_indptr` = b·W_v, `mask_indptr` = Σ
  W_v·(L + W_v), `max_len_extend` = W_v, causal as for a decoder layer) and the page size it passes;
- with pages of several tokens, the commit's KV copy (`copy_all_layer_kv_cache_tiled`, SGLang's
  `move_kv_cache`) of `kernels.window_kv_moves`.

Trees come from the planner (`build_tree`), laid out and padded to a width bucket as the worker does
(`triton_tree.build_verify_layout`, `graph_buckets.pad_verify_rows`, `triton_tree.flat_custom_mask`, all
interpreted too). The attention equals a dense masked attention computed in float64 from the padded
ancestor mask and the prefix slots read straight from `req_to_token`, with and without
`skip_prefix_custom_mask` (SGLang passes its default, True: the prefix columns of the mask are not read),
at page sizes 1 and 16, and with the tile sizes SGLang picks on the CPU (64 x 64) and on a Hopper GPU
(128 x 64).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import pytest
import torch
from interpreter_lane import require_interpreted
from sglang.kernels.ops.attention import extend_attention
from sglang.kernels.ops.attention.kv_indices import create_flashinfer_kv_indices_triton
from sglang.kernels.ops.kvcache.cache_move import copy_all_layer_kv_cache_tiled
from verify_trees import best_first_trees, biased_targets

from bastion_sglang import kernels
from bastion_sglang.kernels import reference, triton_accept, triton_tree
from bastion_sglang.step.graph_buckets import pad_verify_rows

require_interpreted(
    extend_attention._fwd_kernel,
    create_flashinfer_kv_indices_triton,
    copy_all_layer_kv_cache_tiled,
    triton_tree._verify_layout_kernel,
    triton_tree._flat_custom_mask_kernel,
    triton_accept._accept_walk_kernel,
)

Q_HEADS = 4
KV_HEADS = 2  # grouped-query: two query heads per KV head
HEAD_DIM = 64
PADDING_PAGE = 0  # SGLang never hands out slots [0, page_size) (its padding page)

# (batch, real width W, width bucket W_v, cached prefix lengths L_b, page size): ragged prefixes on both
# sides of the kernel's 64-token blocks; padded and unpadded passes; the widest default bucket (65 = N_max
# 64 + 1); batch 1 and 32; pages of 1 and 16 tokens.
CASES = [
    (1, 1, 2, (37,), 1),
    (1, 1, 2, (37,), 16),
    (2, 6, 8, (1, 130), 1),
    (2, 6, 8, (1, 130), 16),
    (3, 13, 16, (64, 200, 5), 1),
    (3, 13, 16, (64, 200, 5), 16),
    (1, 65, 65, (300,), 1),
    (1, 65, 65, (300,), 16),
    (32, 3, 4, tuple(range(3, 99, 3)), 16),
]


@dataclass(frozen=True)
class VerifyBatch:
    """One verify pass's attention inputs, as SGLang's triton backend holds them (one layer)."""

    q: torch.Tensor  # [B * W_v, Q_HEADS, HEAD_DIM]: the verify tokens' queries, batch-major
    k_extend: torch.Tensor  # [B * W_v, KV_HEADS, HEAD_DIM]: the verify tokens' keys
    v_extend: torch.Tensor  # [B * W_v, KV_HEADS, HEAD_DIM]
    k_buffer: torch.Tensor  # [S, KV_HEADS, HEAD_DIM]: the KV pool, prefixes at their req_to_token slots
    v_buffer: torch.Tensor  # [S, KV_HEADS, HEAD_DIM]
    req_to_token: torch.Tensor  # [R, C] int32: slot of each request row's position
    req_pool_indices: torch.Tensor  # [B] int64: the requests' rows of req_to_token
    prefix: torch.Tensor  # [B] int64: cached prefix length L_b
    ancestor_mask: torch.Tensor  # [B, W_v, W_v] bool: the padded verify rows' mask (graph_buckets)

    @property
    def width(self) -> int:
        return int(self.ancestor_mask.shape[1])


def paged_req_to_token(gen: torch.Generator, lengths: list[int], page_size: int, rows: int) -> torch.Tensor:
    """[rows, C] int32 req_to_token over a shuffled pool: request b (row 2b + 1) holds positions
    0..lengths[b]-1, each page of `page_size` positions at consecutive slots of one page (SGLang's page
    invariant), pages in random order, page 0 (the padding page) never used."""
    pages_per_request = [math.ceil(n / page_size) for n in lengths]
    order = (
        torch.randperm(sum(pages_per_request), generator=gen) + 1
    )  # page ids from 1: skip the padding page
    width = max(pages_per_request) * page_size
    table = torch.zeros(rows, width, dtype=torch.int32)
    start = 0
    for b, count in enumerate(pages_per_request):
        pages = order[start : start + count]
        start += count
        slots = (pages[:, None] * page_size + torch.arange(page_size)).reshape(-1)
        table[2 * b + 1, : slots.numel()] = slots.to(torch.int32)
    return table


def verify_batch(
    gen: torch.Generator, batch: int, width: int, bucket: int, prefix: tuple[int, ...], page_size: int
) -> VerifyBatch:
    """Planner trees of `width` positions padded to `bucket`, random q/k/v, prefixes in a paged pool."""
    rows = best_first_trees(gen, batch, width)
    lens = torch.tensor(prefix, dtype=torch.int64)
    layout = triton_tree.build_verify_layout(rows, lens)
    padded = pad_verify_rows(rows, layout, bucket)
    req_to_token = paged_req_to_token(gen, [n + bucket for n in prefix], page_size, 2 * batch + 1)
    slots = int(req_to_token.max()) + page_size
    tokens = batch * bucket
    return VerifyBatch(
        q=torch.randn(tokens, Q_HEADS, HEAD_DIM, generator=gen),
        k_extend=torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=gen),
        v_extend=torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=gen),
        k_buffer=torch.randn(slots, KV_HEADS, HEAD_DIM, generator=gen),
        v_buffer=torch.randn(slots, KV_HEADS, HEAD_DIM, generator=gen),
        req_to_token=req_to_token,
        req_pool_indices=torch.arange(batch, dtype=torch.int64) * 2 + 1,
        prefix=lens,
        ancestor_mask=padded.ancestor_mask,
    )


def sglang_verify_attention(
    inputs: VerifyBatch, custom_mask: torch.Tensor, *, skip_prefix_custom_mask: bool, page_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """SGLang's triton backend on one layer of a TARGET_VERIFY pass: the KV index stream
    (`create_flashinfer_kv_indices_triton`) and the metadata `init_forward_metadata` builds, then
    `extend_attention_fwd`. Returns (output [B * W_v, Q_HEADS, HEAD_DIM], kv_indices [Σ L_b] int64)."""
    batch, width = int(inputs.prefix.numel()), inputs.width
    kv_indptr = torch.zeros(batch + 1, dtype=torch.int32)
    kv_indptr[1:] = torch.cumsum(inputs.prefix, dim=0)
    kv_indices = torch.empty(int(inputs.prefix.sum()), dtype=torch.int64)
    create_flashinfer_kv_indices_triton[(batch, 1)](
        inputs.req_to_token,
        inputs.req_pool_indices,
        inputs.prefix,
        kv_indptr,
        None,
        kv_indices,
        inputs.req_to_token.stride(0),
    )
    qo_indptr = torch.arange(0, (batch + 1) * width, width, dtype=torch.int64)
    mask_indptr = torch.zeros(batch + 1, dtype=torch.int64)
    mask_indptr[1:] = torch.cumsum(width * (inputs.prefix + width), dim=0)
    out = torch.empty_like(inputs.q)
    extend_attention.extend_attention_fwd(
        inputs.q,
        inputs.k_extend,
        inputs.v_extend,
        out,
        inputs.k_buffer,
        inputs.v_buffer,
        qo_indptr,
        kv_indptr,
        kv_indices,
        custom_mask,
        True,  # is_causal: a decoder layer (RadixAttention's default)
        mask_indptr,
        width,
        1.0,
        1.0,
        1.0 / math.sqrt(HEAD_DIM),
        skip_prefix_custom_mask=skip_prefix_custom_mask,
        page_size=page_size,
    )
    return out, kv_indices


def prefix_slots(inputs: VerifyBatch) -> list[torch.Tensor]:
    """Each request's cached prefix slots, read from req_to_token with torch indexing."""
    return [
        inputs.req_to_token[row, :length].long()
        for row, length in zip(inputs.req_pool_indices.tolist(), inputs.prefix.tolist(), strict=True)
    ]


def dense_verify_attention(inputs: VerifyBatch, ancestor_mask: torch.Tensor) -> torch.Tensor:
    """[B * W_v, Q_HEADS, HEAD_DIM] float64: each verify token attends to its request's whole prefix and to
    the verify rows `ancestor_mask` [B, W_v, W_v] allows; a dense softmax per request and head."""
    width = inputs.width
    group = Q_HEADS // KV_HEADS
    outputs = []
    for b, slots in enumerate(prefix_slots(inputs)):
        rows = slice(b * width, (b + 1) * width)
        keys = torch.cat([inputs.k_buffer[slots], inputs.k_extend[rows]]).double().repeat_interleave(group, 1)
        values = (
            torch.cat([inputs.v_buffer[slots], inputs.v_extend[rows]]).double().repeat_interleave(group, 1)
        )
        allowed = torch.cat([torch.ones(width, slots.numel(), dtype=torch.bool), ancestor_mask[b]], dim=1)
        scores = torch.einsum("thd,shd->hts", inputs.q[rows].double(), keys) / math.sqrt(HEAD_DIM)
        weights = scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1)
        outputs.append(torch.einsum("hts,shd->thd", weights, values))
    return torch.cat(outputs)


def flat_mask(inputs: VerifyBatch, ancestor_mask: torch.Tensor) -> torch.Tensor:
    """The custom mask BASTION hands SGLang: `triton_tree.flat_custom_mask` with the host's Σ L_b."""
    return triton_tree.flat_custom_mask(ancestor_mask, inputs.prefix, seq_lens_sum=int(inputs.prefix.sum()))


@pytest.mark.parametrize(("batch", "width", "bucket", "prefix", "page_size"), CASES)
def test_verify_attention_equals_dense_masked_attention(
    batch: int, width: int, bucket: int, prefix: tuple[int, ...], page_size: int
) -> None:
    gen = torch.Generator().manual_seed(batch * 1009 + width * 31 + page_size)
    inputs = verify_batch(gen, batch, width, bucket, prefix, page_size)
    expected = dense_verify_attention(inputs, inputs.ancestor_mask)
    mask = flat_mask(inputs, inputs.ancestor_mask)
    for skip in (True, False):
        out, kv_indices = sglang_verify_attention(
            inputs, mask, skip_prefix_custom_mask=skip, page_size=page_size
        )
        assert torch.equal(kv_indices, torch.cat(prefix_slots(inputs)))
        torch.testing.assert_close(
            out.double(), expected, rtol=0, atol=2e-5, msg=f"skip_prefix_custom_mask={skip}"
        )


@pytest.mark.parametrize(("batch", "width", "bucket", "prefix", "page_size"), [CASES[3], CASES[7]])
def test_verify_attention_with_hopper_tiles(
    monkeypatch: pytest.MonkeyPatch,
    batch: int,
    width: int,
    bucket: int,
    prefix: tuple[int, ...],
    page_size: int,
) -> None:
    """The tile sizes SGLang picks on an H100/H200 (BLOCK_M 128, BLOCK_N 64 at head dim 64)."""
    monkeypatch.setattr(extend_attention, "_is_cuda", True)
    monkeypatch.setattr(extend_attention, "CUDA_CAPABILITY", (9, 0), raising=False)
    assert extend_attention._get_block_sizes_for_extend_attention(HEAD_DIM, HEAD_DIM)[3:5] == (128, 64)
    gen = torch.Generator().manual_seed(width)
    inputs = verify_batch(gen, batch, width, bucket, prefix, page_size)
    out, _ = sglang_verify_attention(
        inputs, flat_mask(inputs, inputs.ancestor_mask), skip_prefix_custom_mask=True, page_size=page_size
    )
    torch.testing.assert_close(
        out.double(), dense_verify_attention(inputs, inputs.ancestor_mask), rtol=0, atol=2e-5
    )


def test_fp16_verify_attention_is_close_to_dense() -> None:
    """Half-precision queries, keys, values and pool. fp16, not the bf16 of GPU servers: the interpreter's
    `tl.dot` multiplies bf16 operands' bit patterns (triton-lang/triton#11584, unsupported there)."""
    gen = torch.Generator().manual_seed(3)
    fp32 = verify_batch(gen, 2, 6, 8, (1, 130), 1)
    half = {
        name: getattr(fp32, name).half() for name in ("q", "k_extend", "v_extend", "k_buffer", "v_buffer")
    }
    inputs = dataclasses.replace(fp32, **half)
    out, _ = sglang_verify_attention(
        inputs, flat_mask(inputs, inputs.ancestor_mask), skip_prefix_custom_mask=True, page_size=1
    )
    assert out.dtype == torch.float16
    torch.testing.assert_close(
        out.double(), dense_verify_attention(inputs, inputs.ancestor_mask), rtol=0, atol=5e-3
    )


def test_a_mask_showing_a_row_one_more_node_moves_that_row_only() -> None:
    """The comparison above can fail: a mask row that also shows a node not on its path (one flipped bit,
    e.g. an off-by-one in the layout) changes that row's output and no other."""
    gen = torch.Generator().manual_seed(11)
    inputs = verify_batch(gen, 2, 6, 8, (1, 130), 1)
    row = 5  # a node of depth >= 2 sees the root, its parent chain and itself, not position row - 1 ...
    leaky = inputs.ancestor_mask.clone()
    hidden = (~leaky[1, row, :row]).nonzero()
    assert hidden.numel() > 0, "the tree of request 1 shows row 5 every earlier position"
    leaky[1, row, int(hidden[0])] = True
    out, _ = sglang_verify_attention(
        inputs, flat_mask(inputs, leaky), skip_prefix_custom_mask=True, page_size=1
    )
    expected = dense_verify_attention(inputs, inputs.ancestor_mask)
    moved = (out.double() - expected).abs().amax(dim=(1, 2)) > 1e-3
    assert moved.nonzero().flatten().tolist() == [inputs.width + row]
    torch.testing.assert_close(out.double(), dense_verify_attention(inputs, leaky), rtol=0, atol=2e-5)


def test_paged_commit_copy_puts_the_accepted_paths_first() -> None:
    """Pages of 16 tokens: the commit copies each accepted path's KV to the front of its verify window
    (`kernels.window_kv_moves`, SGLang's `move_kv_cache` with NO_MOVE sent to the padding slot), over every
    layer's K and V buffer at once; equal to `reference.apply_kv_moves` on each buffer."""
    gen = torch.Generator().manual_seed(7)
    batch, width, page_size, layers = 3, 17, 16, 2
    rows = best_first_trees(gen, batch, width)
    prefix = [5, 16, 40]
    req_to_token = paged_req_to_token(gen, [n + width for n in prefix], page_size, 2 * batch + 1)
    window = torch.stack([req_to_token[2 * b + 1, n : n + width] for b, n in enumerate(prefix)]).long()
    accept = triton_accept.accept_walk(rows, biased_targets(gen, rows, 1.0))  # down to a leaf
    order = kernels.compaction_order(accept.accept_index, accept.accept_length)
    moves = kernels.window_kv_moves(order, accept.accept_length + 1, window)
    slots = int(req_to_token.max()) + page_size
    buffers = [
        torch.randn(slots, KV_HEADS, HEAD_DIM, generator=gen).to(torch.bfloat16) for _ in range(2 * layers)
    ]
    before = [buffer.clone() for buffer in buffers]
    expected = [buffer.clone() for buffer in buffers]
    for buffer in expected:
        reference.apply_kv_moves(buffer, moves)

    data_ptrs = torch.tensor([buffer.data_ptr() for buffer in buffers], dtype=torch.uint64)
    strides = torch.tensor([buffer.stride(0) * buffer.element_size() for buffer in buffers])
    tgt = moves.dst.reshape(-1).clamp(min=PADDING_PAGE)
    src = moves.src.reshape(-1).clamp(min=PADDING_PAGE)
    bytes_per_tile = 128  # SGLang's tile below 4096-byte rows
    row_bytes = KV_HEADS * HEAD_DIM * 2
    copy_all_layer_kv_cache_tiled[(len(buffers), math.ceil(row_bytes / bytes_per_tile))](
        data_ptrs, strides, tgt, src, tgt.numel(), 64, BYTES_PER_TILE=bytes_per_tile
    )
    for buffer, want, old in zip(buffers, expected, before, strict=True):
        assert torch.equal(buffer.view(torch.int16), want.view(torch.int16))
        for b in range(batch):
            keep = int(accept.accept_length[b]) + 1
            path = window[b].gather(0, order[b, :keep])
            assert torch.equal(buffer[window[b, :keep]], old[path])
    assert int(accept.accept_length.min()) >= 1
