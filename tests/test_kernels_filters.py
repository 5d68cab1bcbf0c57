"""`kernels.processed_probs`: the distribution SGLang's own sampler draws from, filter order included.

JOINT is compared bit for bit with SGLang's pytorch-backend filter
(`top_k_top_p_min_p_sampling_from_probs_torch` with return_filtered_probs, fed the softmax the sampler
computes); SEQUENTIAL (flashinfer with min-p) with a row-by-row float64 transcription of
`top_k_renorm_prob`, `top_p_renorm_prob` and min-p; both on random rows mixing min-p with top-k and top-p,
where the two rules do differ.
"""

from __future__ import annotations

import pytest
import torch
from sglang.srt.layers import sampler
from sglang.srt.sampling.sampling_params import TOP_K_ALL

from bastion_sglang import kernels
from bastion_sglang.kernels.sampling import TOP_CANDIDATES

ROWS, VOCAB = 64, 40


def random_params(seed: int) -> tuple[torch.Tensor, ...]:
    """logits [M, V], temperatures, top_ks, top_ps, min_ps [M] (every row sets min-p and top-k or top-p)."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn((ROWS, VOCAB), generator=generator) * 2
    temperatures = torch.rand(ROWS, generator=generator) * 1.5 + 0.3
    top_ks = torch.randint(1, VOCAB + 1, (ROWS,), generator=generator)
    top_ks[::4] = TOP_K_ALL
    top_ps = torch.rand(ROWS, generator=generator) * 0.9 + 0.1
    top_ps[1::4] = 1.0
    min_ps = torch.rand(ROWS, generator=generator) * 0.3
    return logits, temperatures, top_ks, top_ps, min_ps


def sglang_joint_filter(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    top_ks: torch.Tensor,
    top_ps: torch.Tensor,
    min_ps: torch.Tensor,
) -> torch.Tensor:
    """[M, V] weights SGLang's pytorch-backend filter keeps, fed the softmax its sampler computes."""
    probs = torch.softmax(logits / temperatures[:, None], dim=-1)
    _, kept, order, _ = sampler.top_k_top_p_min_p_sampling_from_probs_torch(
        probs.clone(),
        top_ks.to(torch.int32),
        top_ps,
        min_ps,
        True,
        None,
        torch.zeros(probs.shape[0], dtype=torch.int64),
        return_filtered_probs=True,
    )
    return torch.zeros_like(probs).scatter_(1, order.to(torch.int64), kept)


@pytest.mark.parametrize("seed", range(3))
def test_joint_equals_sglangs_pytorch_sampler(seed: int) -> None:
    params = random_params(seed)
    got = kernels.processed_probs(*params, kernels.FilterRule.JOINT)
    assert torch.equal(got, sglang_joint_filter(*params))


@pytest.mark.parametrize("seed", range(3))
def test_joint_over_a_large_vocabulary_equals_sglangs_sampler(seed: int) -> None:
    """Past TOP_CANDIDATES tokens the JOINT rule ranks the candidates first and sorts only rows that keep them
    all: the same weights, bit for bit, in a batch mixing both kinds of row."""
    vocab = 4 * TOP_CANDIDATES
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn((ROWS, vocab), generator=generator) * 3
    temperatures = torch.rand(ROWS, generator=generator) * 1.5 + 0.3
    top_ks = torch.randint(1, vocab + 1, (ROWS,), generator=generator)
    top_ks[::3] = TOP_K_ALL
    top_ks[1::6] = TOP_CANDIDATES
    top_ps = torch.rand(ROWS, generator=generator) * 0.9 + 0.1
    top_ps[::4] = 1.0
    min_ps = torch.rand(ROWS, generator=generator) * 0.05
    min_ps[::2] = 0.0
    got = kernels.processed_probs(logits, temperatures, top_ks, top_ps, min_ps, kernels.FilterRule.JOINT)
    want = sglang_joint_filter(logits, temperatures, top_ks, top_ps, min_ps)
    assert torch.equal(got, want)
    support = (want > 0).sum(dim=-1)
    assert (support < TOP_CANDIDATES).any() and (support > TOP_CANDIDATES).any(), "both kinds of row"


def flashinfer_rule(probs: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """One row [V] through flashinfer's top_k_renorm_prob -> top_p_renorm_prob -> min-p, in float64."""
    probs = probs.double()
    order = probs.argsort(descending=True)
    kept = torch.zeros_like(probs)
    kept[order[: min(top_k, VOCAB)]] = probs[order[: min(top_k, VOCAB)]]
    kept /= kept.sum()
    mass = 0.0
    top_p_kept = torch.zeros_like(kept)
    for token in order.tolist():
        if kept[token] > 0 and mass <= top_p:
            top_p_kept[token] = kept[token]
        mass += float(kept[token])
    top_p_kept /= top_p_kept.sum()
    kept = top_p_kept * (top_p_kept >= min_p * top_p_kept.max())
    return kept / kept.sum()


@pytest.mark.parametrize("seed", range(3))
def test_sequential_equals_flashiners_renormalising_filters(seed: int) -> None:
    logits, temperatures, top_ks, top_ps, min_ps = random_params(seed)
    got = kernels.processed_probs(logits, temperatures, top_ks, top_ps, min_ps, kernels.FilterRule.SEQUENTIAL)
    joint = kernels.processed_probs(logits, temperatures, top_ks, top_ps, min_ps, kernels.FilterRule.JOINT)
    probs = torch.softmax(logits / temperatures[:, None], dim=-1)
    for row in range(ROWS):
        want = flashinfer_rule(probs[row], int(top_ks[row]), float(top_ps[row]), float(min_ps[row]))
        assert torch.equal(got[row] > 0, want > 0), row
        assert torch.allclose((got[row] / got[row].sum()).double(), want, atol=1e-6), row
    assert not torch.equal(got > 0, joint > 0), "the rules must differ on these rows"


def test_no_filter_is_the_tempered_softmax() -> None:
    logits, temperatures, top_ks, top_ps, min_ps = random_params(0)
    got = kernels.processed_probs(logits, temperatures, top_ks, top_ps, min_ps, kernels.FilterRule.NONE)
    assert torch.equal(got, torch.softmax(logits / temperatures[:, None], dim=-1))


def test_rule_follows_sglangs_backend_and_flags() -> None:
    assert kernels.filter_rule("pytorch", True, True) is kernels.FilterRule.JOINT
    assert kernels.filter_rule("flashinfer", True, False) is kernels.FilterRule.JOINT
    assert kernels.filter_rule("flashinfer", False, True) is kernels.FilterRule.SEQUENTIAL
    assert kernels.filter_rule("flashinfer", False, False) is kernels.FilterRule.NONE
    with pytest.raises(ValueError, match="ascend"):
        kernels.filter_rule("ascend", True, False)
