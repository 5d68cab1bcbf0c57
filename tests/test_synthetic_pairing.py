"""Synthetic acceptance's keyed draws and its drafter that is not an oracle (`step.synthetic_acceptance`).

The true continuation at a sequence position is a function of the request's seed and the position alone, so
two policies that verify different trees over the same text meet the same truth; the drafter states
probabilities sharper than the truth by default, and states the truth at temperature 1.
"""

from __future__ import annotations

import pytest
import torch

from bastion_sglang import kernels
from bastion_sglang.bench.measure import sampling_params
from bastion_sglang.step.synthetic_acceptance import true_tokens, truth_uniforms
from bastion_sglang.step.synthetic_profile import DEFAULT_DRAFTER_TEMPERATURE, SyntheticAcceptanceProfile


def _profile(rows: list[list[float]], **fields: float) -> SyntheticAcceptanceProfile:
    return SyntheticAcceptanceProfile(
        name="test", source="test", published_chain_tau=2.0, rank_probs=tuple(map(tuple, rows)), **fields
    )


def _keys(*seeds: int) -> torch.Tensor:
    return kernels.seed_keys(torch.tensor(seeds, dtype=torch.int64))


def test_a_positions_uniform_does_not_depend_on_the_step_that_drafts_it() -> None:
    """Positions 13..15 drafted from a prefix of 10 (draft positions 3..5) and from a prefix of 12 (1..3)."""
    keys = _keys(7, 7)
    early = truth_uniforms(keys[:1], torch.tensor([10]), 5)
    late = truth_uniforms(keys[:1], torch.tensor([12]), 3)
    assert torch.equal(early[0, 2:], late[0])
    both = truth_uniforms(keys, torch.tensor([10, 12]), 3)  # one batch: each row by its own positions
    assert torch.equal(both[0], early[0, :3]) and torch.equal(both[1], late[0])


def test_seeds_draw_different_continuations_and_the_walks_stream_is_apart() -> None:
    uniforms = truth_uniforms(_keys(1, 2), torch.tensor([0, 0]), 64)
    assert not torch.equal(uniforms[0], uniforms[1])
    walk = kernels.keyed_uniforms(_keys(1), torch.arange(1, 65)[None]).double()
    assert not torch.equal(uniforms[:1], walk)
    assert 0.35 < float(uniforms.mean()) < 0.65 and float(uniforms.max()) < 1.0


def test_two_policies_meet_the_same_truth_at_the_same_positions() -> None:
    """One request drafting from prefix 20 with horizon 6 (a deep tree's step) and from prefix 20 with
    horizon 2 (a shallow one), over the same candidates: the true tokens of the shared positions agree, and
    the keyed draw follows q (rank 0 at q0, none of the candidates at 1 - Σ q)."""
    q = torch.tensor([[0.6, 0.3]] * 6, dtype=torch.float64)
    candidates = torch.tensor([[[10 * d, 10 * d + 1] for d in range(6)]])
    keys = _keys(3)
    deep = true_tokens(candidates, q, truth_uniforms(keys, torch.tensor([20]), 6))
    shallow = true_tokens(candidates[:, :2], q[:2], truth_uniforms(keys, torch.tensor([20]), 2))
    assert torch.equal(deep[:, :2], shallow)
    many = true_tokens(
        torch.zeros((4000, 1, 2), dtype=torch.int64) + torch.tensor([5, 6]),
        q[:1],
        truth_uniforms(_keys(*range(4000)), torch.zeros(4000, dtype=torch.int64), 1),
    )
    assert float((many == 5).double().mean()) == pytest.approx(0.6, abs=0.03)
    assert float((many == 0).double().mean()) == pytest.approx(0.1, abs=0.02)  # the first id no candidate


def test_the_drafter_is_over_confident_by_default_and_an_oracle_at_temperature_one() -> None:
    rows = [[0.7, 0.2], [0.5, 0.1]]
    stated, rest = _profile(rows).stated_probs(2)
    assert _profile(rows).drafter_temperature == DEFAULT_DRAFTER_TEMPERATURE < 1
    assert torch.allclose(stated.sum(-1, keepdim=True) + rest, torch.ones(2, 1, dtype=torch.float64))
    assert bool((stated[:, 0] > torch.tensor([0.7, 0.5], dtype=torch.float64)).all())
    truth, truth_rest = _profile(rows, drafter_temperature=1.0).stated_probs(2)
    assert torch.allclose(truth, torch.tensor(rows, dtype=torch.float64))
    assert torch.allclose(truth_rest, torch.tensor([[0.1], [0.4]], dtype=torch.float64))
    assert _profile(rows, drafter_temperature=1.0).stated_chain_accept(2) == pytest.approx(1 + 0.7 + 0.35)


def test_bench_requests_are_seeded_per_repeat_under_synthetic_acceptance() -> None:
    """Seeds key the truth's draws: the same in every policy of a repeat, new in the next repeat."""

    class Settings:
        seed, num_prompts, max_new_tokens, ignore_eos = 100, 3, 8, True
        synthetic_acceptance: str | None = "profile.json"

    first = [r["sampling_seed"] for r in sampling_params(Settings(), 0.0, 1)]  # type: ignore[arg-type]
    second = [r["sampling_seed"] for r in sampling_params(Settings(), 0.0, 2)]  # type: ignore[arg-type]
    assert (first, second) == ([103, 104, 105], [106, 107, 108])
    Settings.synthetic_acceptance = None
    assert "sampling_seed" not in sampling_params(Settings(), 0.0, 1)[0]  # type: ignore[arg-type]
