"""BASTION's CPU stand-in for SGLang's Triton `assign_req_to_token_pool` (`cpu_support`): the same writes as
the kernel's per-request slice assignment, in two torch ops at any batch size."""

from __future__ import annotations

import types

import pytest
import torch
from op_counting import counted

from bastion_sglang.integration.cpu_support import assign_req_to_token_pool_torch


def assigned_by_slices(
    rows: torch.Tensor,
    req_to_token: torch.Tensor,
    starts: torch.Tensor,
    ends: torch.Tensor,
    locs: torch.Tensor,
) -> torch.Tensor:
    """What the Triton kernel writes, one request at a time: row rows[i], columns starts[i]:ends[i], the next
    ends[i] - starts[i] entries of locs."""
    out, offset = req_to_token.clone(), 0
    for row, start, end in zip(rows.tolist(), starts.tolist(), ends.tolist(), strict=True):
        out[row, start:end] = locs[offset : offset + end - start].to(out.dtype)
        offset += end - start
    return out


def case(
    seed: int, batch: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A pool of 12 rows x 64 tokens, `batch` distinct rows with spans of 0 to 20 tokens, and slot ids for all
    spans plus 5 entries the call must leave unread."""
    generator = torch.Generator().manual_seed(seed)
    req_to_token = torch.randint(0, 1000, (12, 64), dtype=torch.int32, generator=generator)
    rows = torch.randperm(12, generator=generator)[:batch]
    starts = torch.randint(0, 40, (batch,), generator=generator)
    ends = starts + torch.randint(0, 21, (batch,), generator=generator)
    total = int((ends - starts).sum())
    locs = torch.randint(1000, 5000, (total + 5,), dtype=torch.int64, generator=generator)
    return rows, req_to_token, starts, ends, locs


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_writes_what_the_kernel_writes(seed: int, batch: int) -> None:
    rows, req_to_token, starts, ends, locs = case(seed, batch)
    want = assigned_by_slices(rows, req_to_token, starts, ends, locs)
    padded = torch.cat([rows, torch.tensor([11])])  # entries past batch_size are not read
    assign_req_to_token_pool_torch(padded, req_to_token, starts, ends, locs, batch)
    assert torch.equal(req_to_token, want)


def test_empty_spans_write_nothing() -> None:
    req_to_token = torch.zeros((4, 8), dtype=torch.int32)
    starts = torch.tensor([3, 5])
    assign_req_to_token_pool_torch(torch.tensor([0, 2]), req_to_token, starts, starts, torch.empty(0), 2)
    assert not req_to_token.any()


@pytest.mark.parametrize("batch", [1, 8])
def test_two_ops_at_any_batch_size(batch: int) -> None:
    """One decode step's allocation, one slot per request: the cast and the indexed store, where the slice
    loop issued two ops per request."""
    rows, req_to_token = torch.arange(batch), torch.zeros((batch, 32), dtype=torch.int32)
    starts, ends = torch.full((batch,), 7), torch.full((batch,), 8)
    locs = torch.arange(100, 100 + batch)
    ops = counted(lambda: assign_req_to_token_pool_torch(rows, req_to_token, starts, ends, locs, batch))
    assert ops.ops == 2
    assert req_to_token[:, 7].tolist() == list(range(100, 100 + batch))


# --- the LM head product of a few verify rows ---------------------------------------------------------------


def sglang_lm_head(
    processor: object,
    hidden: torch.Tensor,
    lm_head: torch.nn.Module,
    embedding_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """SGLang's own `LogitsProcessor._compute_lm_head` (the hook's original; not hooked in this process) on
    `processor`, an object with the attributes it reads."""
    from sglang.srt.layers.logits_processor import LogitsProcessor

    return LogitsProcessor._compute_lm_head(processor, hidden, lm_head, embedding_bias)  # type: ignore[arg-type]


@pytest.mark.parametrize("rows", [1, 2, 5, 8, 9, 16])
@pytest.mark.parametrize("verify", [False, True])
def test_a_verify_pass_of_few_rows_takes_the_heads_product_the_other_way_round(
    rows: int, verify: bool
) -> None:
    """A TARGET_VERIFY pass of 2 to 8 rows gets (W @ hᵀ)ᵀ, the same logits as SGLang's h @ Wᵀ to rounding;
    every other pass (and a row count outside 2..8) SGLang's own product, bit for bit."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    import bastion_sglang.integration.cpu_support as cpu

    generator = torch.Generator().manual_seed(rows)
    lm_head = torch.nn.Linear(64, 500, bias=False)
    with torch.no_grad():
        lm_head.weight.copy_(torch.randn(500, 64, generator=generator))
    hidden = torch.randn(rows, 64, generator=generator)
    processor = types.SimpleNamespace(
        use_fp32_lm_head=False, use_fp32_lm_head_output=False, rl_on_policy_target=None
    )
    mode = ForwardMode.TARGET_VERIFY if verify else ForwardMode.DECODE
    metadata = types.SimpleNamespace(forward_mode=mode)

    def get_logits(
        processor: object, hidden: torch.Tensor, lm_head: torch.nn.Module, metadata: object
    ) -> torch.Tensor:
        return cpu.lm_head_product_of_few_rows(sglang_lm_head, processor, hidden, lm_head)

    got = cpu.logits_marking_verify(get_logits, processor, hidden, lm_head, metadata)
    sglang = sglang_lm_head(processor, hidden, lm_head)
    if verify and 2 <= rows <= 8:
        assert torch.equal(got, torch.matmul(lm_head.weight, hidden.T).T)
        torch.testing.assert_close(got, sglang, rtol=1e-5, atol=1e-4)
    else:
        assert torch.equal(got, sglang)
    assert not getattr(cpu._pass, "verify", False)  # the mark ends with the pass
