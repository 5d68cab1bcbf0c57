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

from bastion_sglang.sglang_adapter import target_sampling_probs

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
