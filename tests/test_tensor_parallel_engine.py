"""BASTION at `--tp-size 2` in a real `sglang.Engine` on CPU: outputs equal no speculation at `--tp-size 2`.

Two scheduler ranks talk over gloo, one core each (`SGLANG_CPU_OMP_THREADS_BIND=0|1`). The model pair is
engine_support's tiny fp32 Qwen3 (4 query / 2 KV heads, so both split over two ranks; vocabulary 260,
padded to 320 LM-head rows: rank 0 holds ids 0..159, rank 1 ids 160..259 and the padding, so the drafter's
logits exist whole only after the gather of `rank_sync.DraftHead`). The demo target cannot run here: its 9
attention heads do not divide by 2 (README, "Several GPUs").

One reference Engine without speculation at tp 2, then one Engine per configuration; each runs 6 prompts x
48 tokens greedily in one batch and must return the reference's token ids:
- chain with the random drafter (mostly rejected trees);
- fixed:6 with the oracle drafter's decoy variant (tests/oracle_drafter.py): wrong siblings interleave with
  the accepted path in every verify row, so only the same exact ancestor mask on both ranks keeps the ids;
- adaptive with the oracle drafter (long accepted paths, so wide trees are verified) and a
  rank skew (tests/rank_skew.py): TP rank 1 sleeps in every drafter pass, so the two ranks measure
  different step costs and only rank 0's broadcast plan keeps them verifying the same tree
  (tests/test_rank_sync.py shows such a skew makes the ranks' own plans differ).
Each BASTION Engine then answers the same seeded sampling requests, first after the greedy batch: the three
return the same tokens. SGLang's prefill sampler ignores `sampling_seed` (outside its deterministic mode) but
starts from the same RNG state in every Engine (`random_seed` 0, nothing sampled before), and BASTION's
accept walk samples each position with a uniform hashed from the seed and the position, so trees of other
sizes emit the same tokens; a rank that sampled otherwise would corrupt its KV cache and the outputs. Then
one prompt under four seeds gives four outputs in each (engine_support's seed probe).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import sglang
from engine_support import (
    PROMPTS,
    VOCAB_SIZE,
    assert_seeds_sample,
    engine_server_args,
    first_difference,
    make_model_pair,
    seed_probe,
)
from oracle_drafter import write_references
from rank_skew import write_skew

from bastion_sglang.integration.config import BastionConfig
from bastion_sglang.registration import make_config

pytestmark = pytest.mark.slow

TP_SIZE = 2
THREADS_BIND = "0|1"
"""One core per rank: without it SGLang asserts that the ranks fit the NUMA nodes (one here)."""
REQUESTS = PROMPTS[:6]
MAX_NEW_TOKENS = 48
SAMPLED_TOKENS = 16
GREEDY = {"temperature": 0.0, "max_new_tokens": MAX_NEW_TOKENS, "ignore_eos": True}
SAMPLED = {
    "temperature": 0.8,
    "top_p": 0.9,
    "top_k": 50,
    "max_new_tokens": SAMPLED_TOKENS,
    "ignore_eos": True,
    "sampling_seed": 11,
}
SKEW_SECONDS = 0.05  # per drafter pass on TP rank 1


@dataclasses.dataclass(frozen=True)
class Run:
    """What one Engine returned: greedy ids per request, tokens per verify pass, seeded sampled ids and the
    seed probe's outputs (None: not sampled)."""

    greedy: list[list[int]]
    mean_accept: float
    sampled: list[list[int]] | None
    probe: list[list[int]] | None


def _run(server_args: Any, sample: bool) -> Run:
    engine = sglang.Engine(server_args=server_args)
    try:
        greedy = engine.generate(input_ids=REQUESTS, sampling_params=GREEDY)
        sampled = engine.generate(input_ids=REQUESTS[:3], sampling_params=SAMPLED) if sample else None
        probe = seed_probe(engine) if sample else None
    finally:
        engine.shutdown()
    verify_calls = sum(int(out["meta_info"].get("spec_verify_ct") or 0) for out in greedy)
    tokens = sum(int(out["meta_info"]["completion_tokens"]) for out in greedy)
    return Run(
        greedy=[out["output_ids"] for out in greedy],
        mean_accept=tokens / verify_calls if verify_calls else 0.0,
        sampled=None if sampled is None else [out["output_ids"] for out in sampled],
        probe=probe,
    )


CONFIGS = ("chain", "fixed:6-oracle-decoy", "adaptive-oracle-skew")
MIN_ACCEPT = {"chain": 1.0, "fixed:6-oracle-decoy": 2.0, "adaptive-oracle-skew": 3.0}
"""Tokens per verify pass each configuration must reach (the oracle's long paths, or at least the bonus)."""
DECOY_GAP = 0.4  # the reference token ~0.6, its decoy ~0.4 at every draft position


def _config(name: str, reference: Run, folder: Path) -> BastionConfig:
    if name == "chain":
        return make_config(max_budget=8, policy="chain", topk=4)
    if name == "fixed:6-oracle-decoy":
        decoy = write_references(folder / "decoy.json", REQUESTS, reference.greedy, decoy_gap=DECOY_GAP)
        return dataclasses.replace(
            make_config(max_budget=8, policy="fixed:6", topk=2),
            draft_proposer="oracle_drafter:make_oracle",
            draft_proposer_arg=str(decoy),
        )
    oracle = write_references(folder / "reference.json", REQUESTS, reference.greedy)
    skew = write_skew(folder / "skew.json", 1, SKEW_SECONDS, "oracle_drafter:make_oracle", str(oracle))
    return dataclasses.replace(
        make_config(max_budget=12, policy="adaptive", topk=2),
        draft_proposer="rank_skew:make_rank_skew",
        draft_proposer_arg=str(skew),
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    """The reference Engine (no speculation, key "reference"), then one BASTION Engine per configuration."""
    models = make_model_pair(tmp_path_factory.mktemp("bastion_tp"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SGLANG_CPU_OMP_THREADS_BIND", THREADS_BIND)
        reference = _run(engine_server_args(models, None, tp_size=TP_SIZE), sample=False)
        results = {"reference": reference}
        for name in CONFIGS:
            config = _config(name, reference, tmp_path_factory.mktemp(name.replace(":", "-")))
            results[name] = _run(engine_server_args(models, config, tp_size=TP_SIZE), sample=True)
    return results


@pytest.mark.parametrize("name", CONFIGS)
def test_greedy_equals_no_speculation_at_tp2(runs: dict[str, Run], name: str) -> None:
    reference = runs["reference"].greedy
    assert [len(ids) for ids in reference] == [MAX_NEW_TOKENS] * len(REQUESTS)
    for i, (got, want) in enumerate(zip(runs[name].greedy, reference, strict=True)):
        assert got == want, f"{name}: prompt {i} diverges at token {first_difference(got, want)}"


@pytest.mark.parametrize("name", CONFIGS)
def test_speculation_verified_trees(runs: dict[str, Run], name: str) -> None:
    assert runs[name].mean_accept >= MIN_ACCEPT[name], (name, runs[name].mean_accept)


def test_seeded_sampling_is_equal_across_runs_at_tp2(runs: dict[str, Run]) -> None:
    first, *others = (runs[name].sampled for name in CONFIGS)
    assert first is not None and [len(ids) for ids in first] == [SAMPLED_TOKENS] * 3
    assert all(0 <= token < VOCAB_SIZE for ids in first for token in ids)
    greedy_prefixes = [ids[:SAMPLED_TOKENS] for ids in runs["reference"].greedy[:3]]
    assert first != greedy_prefixes, "T = 0.8 must not reproduce the greedy text"
    for name, sampled in zip(CONFIGS[1:], others, strict=True):
        assert sampled == first, name


@pytest.mark.parametrize("name", CONFIGS)
def test_seeds_sample_at_tp2(runs: dict[str, Run], name: str) -> None:
    """One prompt under several seeds gives as many outputs (engine_support.assert_seeds_sample)."""
    probe = runs[name].probe
    assert probe is not None
    assert_seeds_sample(probe)
