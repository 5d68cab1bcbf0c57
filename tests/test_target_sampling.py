"""`sglang_adapter.target_sampling_probs`: the distribution the sampling walk draws each verify position from.

It must be what SGLang's own sampler draws from for the same `SamplingBatchInfo`: the softmax of
logits / temperature, filtered by top-k, top-p and min-p on the descending sort when a request sets them, and
the bare softmax when none does (SGLang's simple sampling case, which skips the sort).
"""

from __future__ import annotations

import pytest
import torch
from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo
from sglang.srt.sampling.sampling_params import TOP_K_ALL

from bastion_sglang import kernels
from bastion_sglang.integration.sglang_adapter import target_sampling_probs
from bastion_sglang.step.step_anatomy import OUTSIDE, StepAnatomy, StepCounts

BATCH, WIDTH, VOCAB = 2, 3, 50


def sampling_info(temperatures: list[float], top_ks: list[int], top_ps: list[float]) -> SamplingBatchInfo:
    """A CPU SamplingBatchInfo whose need_* flags follow the parameters, as SGLang sets them."""
    return SamplingBatchInfo(
        temperatures=torch.tensor(temperatures, dtype=torch.float32)[:, None],
        top_ps=torch.tensor(top_ps, dtype=torch.float32),
        top_ks=torch.tensor(top_ks, dtype=torch.int32),
        min_ps=torch.zeros(len(temperatures), dtype=torch.float32),
        is_all_greedy=False,
        is_any_greedy=False,
        need_top_p_sampling=any(p != 1.0 for p in top_ps),
        need_top_k_sampling=any(k != TOP_K_ALL for k in top_ks),
        need_min_p_sampling=False,
        vocab_size=VOCAB,
        device="cpu",
    )


@pytest.fixture
def logits() -> torch.Tensor:
    return torch.randn(BATCH * WIDTH, VOCAB, generator=torch.Generator().manual_seed(7))


def test_without_filters_it_is_the_tempered_softmax(logits: torch.Tensor) -> None:
    info = sampling_info([0.7, 1.3], [TOP_K_ALL, TOP_K_ALL], [1.0, 1.0])
    probs = target_sampling_probs(logits, info, WIDTH, "pytorch")
    temperatures = torch.tensor([0.7, 1.3]).repeat_interleave(WIDTH)[:, None]
    expected = torch.softmax(logits / temperatures, dim=-1).view(BATCH, WIDTH, VOCAB)
    assert probs.shape == (BATCH, WIDTH, VOCAB)
    assert torch.equal(probs, expected)
    # the filtering path with filters that keep everything gives the same distribution
    info.need_top_k_sampling = True
    filtered = target_sampling_probs(logits, info, WIDTH, "pytorch")
    assert torch.allclose(filtered, expected, rtol=0, atol=1e-7)


def test_top_k_and_top_p_keep_what_sglang_keeps(logits: torch.Tensor) -> None:
    info = sampling_info([1.0, 0.8], [5, TOP_K_ALL], [1.0, 0.8])
    probs = target_sampling_probs(logits, info, WIDTH, "pytorch")
    softmax = torch.softmax(logits / torch.tensor([1.0, 0.8]).repeat_interleave(WIDTH)[:, None], dim=-1)
    softmax = softmax.view(BATCH, WIDTH, VOCAB)
    for position in range(WIDTH):
        kept = probs[0, position] > 0
        assert torch.equal(
            kept.nonzero().flatten().sort().values, softmax[0, position].topk(5).indices.sort().values
        )
        ordered, order = softmax[1, position].sort(descending=True)
        before = torch.cumsum(ordered, 0) - ordered  # mass of the tokens ranked above each token
        assert torch.equal(probs[1, position][order] > 0, before <= 0.8)
        assert torch.equal(
            probs[:, position][probs[:, position] > 0], softmax[:, position][probs[:, position] > 0]
        )


def per_position_probs(
    logits: torch.Tensor, info: SamplingBatchInfo, width: int, backend: str
) -> torch.Tensor:
    """`target_sampling_probs` as it was computed with one copy of each request's parameters per position
    (`repeat_interleave`), the reference of the broadcast form."""
    batch = logits.shape[0] // width

    def per_position(values: torch.Tensor) -> torch.Tensor:
        return torch.repeat_interleave(values.reshape(batch, -1)[:, 0], width)

    rule = kernels.filter_rule(
        backend, info.need_top_k_sampling or info.need_top_p_sampling, info.need_min_p_sampling
    )
    params = (info.temperatures, info.top_ks, info.top_ps, info.min_ps)
    probs = kernels.processed_probs(logits, *(per_position(value) for value in params), rule)
    return probs.view(batch, width, -1)


@pytest.mark.parametrize("backend", ["pytorch", "flashinfer"])
@pytest.mark.parametrize("vocab", [VOCAB, 700])  # 700 > TOP_CANDIDATES: the JOINT rule's candidate path
@pytest.mark.parametrize("width", [1, 5])
def test_broadcast_parameters_give_the_per_position_result_bit_for_bit(
    backend: str, vocab: int, width: int
) -> None:
    """Requests with no filter (kept whole: the JOINT rule sorts their rows), top-k, top-p and min-p, each
    parameter broadcast over the request's positions instead of copied."""
    batch = 4
    logits = torch.randn(batch * width, vocab, generator=torch.Generator().manual_seed(vocab + width)) * 3
    info = sampling_info([0.7, 1.3, 1.0, 0.9], [TOP_K_ALL, 7, TOP_K_ALL, TOP_K_ALL], [1.0, 1.0, 0.85, 1.0])
    info.min_ps = torch.tensor([0.0, 0.0, 0.0, 0.05])
    info.need_min_p_sampling = True
    for need_filters in (True, False):
        info.need_top_k_sampling = info.need_top_p_sampling = info.need_min_p_sampling = need_filters
        got = target_sampling_probs(logits, info, width, backend)
        expected = per_position_probs(logits, info, width, backend)
        assert got.shape == (batch, width, vocab) and got.dtype == expected.dtype
        assert torch.equal(got, expected)


def test_the_parameters_are_not_copied_per_position(logits: torch.Tensor) -> None:
    """The ops are those of the distribution alone: a no-filter batch is the division and the softmax."""
    info = sampling_info([0.7, 1.3], [TOP_K_ALL, TOP_K_ALL], [1.0, 1.0])
    records: list[StepCounts] = []
    anatomy = StepAnatomy(True, records.append)
    anatomy.open_step(1, ("r0",))
    anatomy.set_kind("speculative")
    target_sampling_probs(logits, info, WIDTH, "pytorch")
    record = anatomy.close_step()
    assert record is not None
    counts = record.stages[OUTSIDE]
    assert counts.ops == 2 and counts.syncs == {}, counts.sites
