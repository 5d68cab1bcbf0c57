"""BastionConfig asks its policy whether it can run with the budget and buckets."""

from __future__ import annotations

import pytest

from bastion_sglang.controller import BucketedAdaptivePolicy, ChainPolicy, FixedPolicy
from bastion_sglang.integration.config import BastionConfig


def test_policy_checks_the_budget_and_buckets() -> None:
    buckets = (2, 4, 8, 16, 33)
    assert BastionConfig(max_budget=32, policy=FixedPolicy(32), width_buckets=buckets).policy.nodes == 32
    BastionConfig(max_budget=32, policy=BucketedAdaptivePolicy(buckets), width_buckets=buckets)
    BastionConfig(max_budget=32, policy=ChainPolicy(), width_buckets=buckets)
    with pytest.raises(ValueError, match="policy fixed:40 verifies more nodes than max_budget 32"):
        BastionConfig(max_budget=32, policy=FixedPolicy(40), width_buckets=buckets)
    with pytest.raises(ValueError, match="the bucketed policy's buckets"):
        BastionConfig(max_budget=32, policy=BucketedAdaptivePolicy((2, 4)), width_buckets=buckets)
    with pytest.raises(ValueError, match="policy must be a BudgetPolicy"):
        BastionConfig(policy="adaptive")  # type: ignore[arg-type]
