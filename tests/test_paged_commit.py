"""The commit stage with KV pages of one and of several tokens (`bastion_sglang.step.commit.TreeCommit`), on a
real SGLang KV pool on the CPU whose all-layer copy is BASTION's host stand-in, and the CPU verify path's
paged read (`cpu_support.paged_slots`).

The hand-built tree of tests/test_kernels_kv.py: request 0 accepts the path 0 -> 1 -> 3 -> 5 (not a prefix of
its verify row), request 1 the path 0 -> 1 -> 4, request 2 its root only. Pages hold 4 slots; each request's
verify window starts inside a page and crosses into another that is not adjacent.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from bastion_sglang.integration.cpu_support import copy_all_layer_kv_cache_host, paged_slots
from bastion_sglang.kernels import compaction_order
from bastion_sglang.step.commit import PADDING_SLOT, TreeCommit, kv_copy_seconds_per_token

PAGE = 4
ACCEPT_INDEX = torch.tensor([[0, 1, 3, 5, -1, -1], [0, 1, 4, -1, -1, -1], [0, -1, -1, -1, -1, -1]])
ACCEPT_LENGTH = torch.tensor([3, 2, 0])
ORDER = compaction_order(ACCEPT_INDEX, ACCEPT_LENGTH)
COMMIT_LENS = (ACCEPT_LENGTH + 1).to(torch.int32)
PREFIX = torch.tensor([6, 8, 1])  # L_b: the windows start at position 6, 8 and 1
ROWS = torch.tensor([[2], [0], [1]])  # each request's req_to_token row
WIDTH, HIDDEN, LAYERS = 6, 3, 3


def _pool(page_size: int, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A 256-slot fp32 MHA pool of LAYERS layers whose all-layer copy is BASTION's CPU stand-in (what
    `cpu_support.install_bastion_stand_ins` hooks in a serving process), each slot's K and V numbered."""
    import sglang.srt.mem_cache.memory_pool as memory_pool

    monkeypatch.setattr(memory_pool, "copy_all_layer_kv_cache_func", copy_all_layer_kv_cache_host)
    pool = memory_pool.MHATokenToKVPool(
        size=256,
        page_size=page_size,
        dtype=torch.float32,
        head_num=2,
        head_dim=4,
        layer_num=LAYERS,
        device="cpu",
        enable_memory_saver=False,
        enable_kv_cache_copy=True,
    )
    for layer, (k, v) in enumerate(zip(pool.k_buffer, pool.v_buffer, strict=True)):
        slots = torch.arange(k.shape[0], dtype=torch.float32)[:, None, None]
        k.copy_(slots * 10 + layer + torch.zeros_like(k))
        v.copy_(-(slots * 10 + layer) + torch.zeros_like(v))
    return pool


def _paged_table() -> torch.Tensor:
    """req_to_token [3, 16] in pages of PAGE slots (each row's pages chosen apart, none adjacent)."""
    pages = torch.tensor([[9, 20, 3, 14], [30, 5, 26, 11], [17, 40, 7, 33]])
    return (pages[:, :, None] * PAGE + torch.arange(PAGE)).reshape(3, -1)


def _worker(pool: Any, req_to_token: torch.Tensor) -> tuple[Any, list[dict[str, torch.Tensor]]]:
    appended: list[dict[str, torch.Tensor]] = []
    runner = SimpleNamespace(
        req_to_token_pool=SimpleNamespace(req_to_token=req_to_token), token_to_kv_pool=pool
    )
    worker = SimpleNamespace(
        model_runner=runner,
        device="cpu",
        _append_target_hidden_to_draft_kv_by_loc=lambda **kwargs: appended.append(kwargs),
    )
    return worker, appended


def _commit(page_size: int, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, torch.Tensor, Any, torch.Tensor]:
    """Run one paged or unpaged commit of the hand-built step; returns (pool, req_to_token after, the
    drafter append's arguments, the window slots)."""
    pool = _pool(page_size, monkeypatch)
    req_to_token = _paged_table()
    worker, appended = _worker(pool, req_to_token)
    window = PREFIX[:, None] + torch.arange(WIDTH)
    slots = req_to_token[ROWS, window].clone()
    hidden = torch.arange(3 * WIDTH * HIDDEN, dtype=torch.float32).view(3, WIDTH, HIDDEN)
    TreeCommit(worker, page_size).commit(ROWS, slots, window, ORDER, hidden, COMMIT_LENS)
    (call,) = appended
    path_hidden = hidden.gather(1, ORDER[:, :, None].expand(-1, -1, HIDDEN)).reshape(-1, HIDDEN)
    assert torch.equal(call["target_hidden"], path_hidden)
    assert torch.equal(call["positions"], window.reshape(-1))
    assert call["commit_lens"] is COMMIT_LENS
    return pool, req_to_token, call, slots


def test_pages_of_one_token_permute_slot_ids_and_copy_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    pool, req_to_token, call, slots = _commit(1, monkeypatch)
    before = _pool(1, monkeypatch)
    window = PREFIX[:, None] + torch.arange(WIDTH)
    assert torch.equal(req_to_token[ROWS, window], slots.gather(1, ORDER))
    assert torch.equal(call["cache_loc_2d"], slots.gather(1, ORDER))
    for k, k_before in zip(pool.k_buffer, before.k_buffer, strict=True):
        assert torch.equal(k, k_before)


@pytest.mark.parametrize("page_size", [PAGE, 2 * PAGE])
def test_larger_pages_copy_the_paths_kv_and_keep_the_page_invariant(
    page_size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every layer's K and V of the path's depth-k node lands at window column k's slot; req_to_token, every
    slot off the path's destinations and the padding slot keep their contents; the drafter KV goes to the
    window's own slots."""
    pool, req_to_token, call, slots = _commit(page_size, monkeypatch)
    before = _pool(page_size, monkeypatch)
    assert torch.equal(req_to_token, _paged_table())
    assert torch.equal(call["cache_loc_2d"], slots)
    written = torch.zeros(before.k_buffer[0].shape[0], dtype=torch.bool)
    for b in range(3):
        path = ACCEPT_INDEX[b, : int(ACCEPT_LENGTH[b]) + 1]
        written[slots[b, : len(path)]] = True
        for buffers, buffers_before in ((pool.k_buffer, before.k_buffer), (pool.v_buffer, before.v_buffer)):
            for layer, layer_before in zip(buffers, buffers_before, strict=True):
                assert torch.equal(layer[slots[b, : len(path)]], layer_before[slots[b, path]])
    for layer, layer_before in zip(pool.k_buffer, before.k_buffer, strict=True):
        assert torch.equal(layer[~written], layer_before[~written])
        assert torch.equal(layer[PADDING_SLOT], layer_before[PADDING_SLOT])


def test_host_copy_stand_in_copies_pairs_in_order_and_skips_padding() -> None:
    """Two buffers of 6 rows; a chain of moves 2 -> 1, 4 -> 2 applied in order reads row 2 before it is
    overwritten; the padding pair 0 -> 0 changes nothing."""
    buffers = [torch.arange(6, dtype=torch.float64)[:, None].repeat(1, 2) + 100 * i for i in range(2)]
    data_ptrs = torch.tensor([t.data_ptr() for t in buffers], dtype=torch.int64)
    strides = torch.tensor([t.stride(0) * t.element_size() for t in buffers], dtype=torch.int64)
    copy_all_layer_kv_cache_host(
        data_ptrs, strides, torch.tensor([1, 2, 0]), torch.tensor([2, 4, 0]), num_locs=3
    )
    for i, buffer in enumerate(buffers):
        assert buffer[:, 0].tolist() == [100 * i + r for r in (0, 2, 4, 3, 4, 5)]


def test_copy_seconds_per_token_times_the_pools_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    pool = _pool(PAGE, monkeypatch)
    worker, _ = _worker(pool, _paged_table())
    seconds = kv_copy_seconds_per_token(worker, 16)
    assert 0 < seconds < 0.01
    with pytest.raises(ValueError, match="cannot time a copy of 200 slots in a KV pool of 256 slots"):
        kv_copy_seconds_per_token(worker, 200)


@pytest.mark.parametrize("page_size", [1, 4])
def test_paged_slots_read_a_row_through_each_pages_first_slot(page_size: int) -> None:
    row = _paged_table()[0]
    assert torch.equal(paged_slots(row, 11, page_size), row[:11])
    permuted = row.clone()
    permuted[[5, 6]] = permuted[[6, 5]]  # slot ids swapped inside a page: what a paged kernel never sees
    expected = row[:11] if page_size > 1 else permuted[:11]
    assert torch.equal(paged_slots(permuted, 11, page_size), expected)
