"""BASTION in a real `sglang.Engine` on CPU: outputs equal the same Engine without speculation.

Tiny random fp32 Qwen3 target and z-lab-format DFlash drafter (tests/tiny_models.py). One reference Engine
without speculation, then one Engine per BASTION configuration (module-scoped: Engines are slow to start
on two cores); each runs the same requests once and the tests compare what came back:
- T = 0, 8 prompts sent as one batch: token ids identical to the reference for the adaptive and fixed:6
  policies with a random drafter (rejected trees), and for the adaptive, fixed:12 and chain policies with the
  test-only oracle drafter (tests/oracle_drafter.py, through `BastionConfig.draft_proposer`), whose long
  accepted paths must reach a floor of tokens per verify pass per policy (MIN_MEAN_ACCEPT; the oracle's
  adaptive policy plans on a serving engine's latency profile weighed as 1e6 passes,
  tests/calibration_profiles.py, so its trees do not depend on this machine's load); fixed:12's oracle
  interleaves decoy siblings with the accepted path in the verify row, so only an exact ancestor mask keeps
  the outputs equal;
- stop strings, stop token ids (the EOS rule) and max_new_tokens 1, 2, 3 truncate exactly as without
  speculation, also when the stop falls inside an accepted path;
- T > 0 with a seed completes with valid tokens, and one prompt under four seeds gives four outputs.
"""

from __future__ import annotations

import dataclasses
import string
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sglang
from calibration_profiles import serving_plan_flags
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

from bastion_sglang.registration import make_config

pytestmark = pytest.mark.slow

MAX_NEW_TOKENS = 32
GREEDY = {"temperature": 0.0, "max_new_tokens": MAX_NEW_TOKENS, "ignore_eos": True}
SHORT_LENGTHS = (1, 2, 3)
STOP_CASES = 2  # requests with a stop string cut from their reference text
SAMPLED = {
    "temperature": 0.8,
    "top_p": 0.9,
    "top_k": 50,
    "min_p": 0.02,
    "max_new_tokens": MAX_NEW_TOKENS,
    "ignore_eos": True,
    "sampling_seed": 7,
}


@dataclasses.dataclass(frozen=True)
class Run:
    """What one Engine returned for the shared request set (ids per request; text for stop requests)."""

    greedy: list[list[int]]
    short: list[list[int]]
    stop: list[tuple[list[int], str]]
    stop_token: list[list[int]]
    verify_calls: int
    completion_tokens: int
    sampled: list[list[int]] | None
    probe: list[list[int]] | None


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return make_model_pair(tmp_path_factory.mktemp("bastion_engine"))


def _stops_from(greedy: list[dict[str, Any]]) -> list[tuple[int, str]]:
    """(prompt index, stop string) for the first STOP_CASES reference texts holding a pair of printable
    ASCII characters after their first quarter: the stop then lands inside a run, on text the
    detokenizer emits as is."""
    printable = set(string.ascii_letters + string.digits + string.punctuation)
    cases = []
    for i, out in enumerate(greedy):
        text = out["text"]
        pairs = [
            text[j : j + 2] for j in range(len(text) // 4, len(text) - 1) if set(text[j : j + 2]) <= printable
        ]
        if pairs:
            cases.append((i, pairs[0]))
    assert len(cases) >= STOP_CASES, f"too few printable reference texts for stop strings: {cases}"
    return cases[:STOP_CASES]


@dataclasses.dataclass(frozen=True)
class Stops:
    """Requests that must end early: (prompt index, stop string) and (prompt index, stop token id)."""

    strings: list[tuple[int, str]]
    tokens: list[tuple[int, int]]


def _stop_tokens_from(greedy: list[dict[str, Any]]) -> list[tuple[int, int]]:
    """(prompt index, token id): for the first prompts, the first token of the reference output's second
    half that does not occur before it, so the request ends there as at an EOS."""
    cases = []
    for i, out in enumerate(greedy):
        ids = out["output_ids"]
        half = len(ids) // 2
        fresh = [token for token in ids[half:] if token not in ids[:half]]
        if fresh:
            cases.append((i, fresh[0]))
    assert len(cases) >= STOP_CASES, f"too few reference outputs for stop tokens: {cases}"
    return cases[:STOP_CASES]


def _run(server_args: Any, stops: Stops | None, sample: bool) -> tuple[Run, Stops]:
    """Send the shared request set to one Engine; stops None: derive them from this run's outputs."""
    engine = sglang.Engine(server_args=server_args)
    try:
        greedy = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        if stops is None:
            stops = Stops(strings=_stops_from(greedy), tokens=_stop_tokens_from(greedy))
        short = engine.generate(
            input_ids=PROMPTS[: len(SHORT_LENGTHS)],
            sampling_params=[
                {"temperature": 0.0, "max_new_tokens": n, "ignore_eos": True} for n in SHORT_LENGTHS
            ],
        )
        stop = engine.generate(
            input_ids=[PROMPTS[i] for i, _ in stops.strings],
            sampling_params=[dict(GREEDY, stop=[stop]) for _, stop in stops.strings],
        )
        stop_token = engine.generate(
            input_ids=[PROMPTS[i] for i, _ in stops.tokens],
            sampling_params=[dict(GREEDY, ignore_eos=False, stop_token_ids=[t]) for _, t in stops.tokens],
        )
        sampled = engine.generate(input_ids=PROMPTS[:4], sampling_params=SAMPLED) if sample else None
        probe = seed_probe(engine) if sample else None
    finally:
        engine.shutdown()
    run = Run(
        greedy=[out["output_ids"] for out in greedy],
        short=[out["output_ids"] for out in short],
        stop=[(out["output_ids"], out["text"]) for out in stop],
        stop_token=[out["output_ids"] for out in stop_token],
        verify_calls=sum(int(out["meta_info"].get("spec_verify_ct") or 0) for out in greedy),
        completion_tokens=sum(int(out["meta_info"]["completion_tokens"]) for out in greedy),
        sampled=None if sampled is None else [out["output_ids"] for out in sampled],
        probe=probe,
    )
    return run, stops


@pytest.fixture(scope="module")
def reference_run(models: tuple[Path, Path]) -> tuple[Run, Stops]:
    """The Engine without speculation, and the stop strings cut from its texts."""
    return _run(engine_server_args(models, None), None, sample=False)


@pytest.fixture(scope="module")
def reference(reference_run: tuple[Run, Stops]) -> Run:
    return reference_run[0]


CONFIGS = ("adaptive", "fixed:6", "oracle", "oracle-decoy", "oracle-chain")
ORACLE_POLICIES = {"oracle": "adaptive", "oracle-decoy": "fixed:12", "oracle-chain": "chain"}
DECOY_GAP = 0.4  # the reference token ~0.6, its decoy ~0.4 at every draft position
MIN_MEAN_ACCEPT = {"adaptive": 1.0, "fixed:6": 1.0, "oracle": 4.0, "oracle-decoy": 3.0, "oracle-chain": 6.0}
"""Tokens per verify pass (completion tokens / spec_verify_ct). Each policy's floor that a drafter which never
lands or an accept walk that accepts nothing (1.03 here) would miss is its oracle configuration's (adaptive:
oracle, measured 8.0; fixed: oracle-decoy, 4.49; chain: oracle-chain, 10.67). The random drafter's
configurations are the rejection controls: their drafter almost never lands (in one run 8 requests x 32
tokens took 245 verify passes under fixed:6, and 248, the most there can be, under chain), so no floor above
one token per pass holds for them."""


@pytest.fixture(scope="module", params=CONFIGS)
def bastion(
    request: pytest.FixtureRequest,
    models: tuple[Path, Path],
    reference_run: tuple[Run, Stops],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[str, Run]]:
    """One BASTION Engine per configuration: (name, what it returned)."""
    name = request.param
    reference, stops = reference_run
    if name in ORACLE_POLICIES:
        decoy = name == "oracle-decoy"
        references = write_references(
            tmp_path_factory.mktemp(name) / "reference.json",
            PROMPTS,
            reference.greedy,
            decoy_gap=DECOY_GAP if decoy else None,
        )
        policy = ORACLE_POLICIES[name]
        planned = serving_plan_flags(tmp_path_factory.mktemp("profile")) if policy == "adaptive" else {}
        config = dataclasses.replace(
            make_config(max_budget=12, policy=policy, topk=2, **planned),
            draft_proposer="oracle_drafter:make_oracle",
            draft_proposer_arg=str(references),
        )
    else:
        config = make_config(max_budget=8, policy=name, topk=4)
    yield name, _run(engine_server_args(models, config), stops, sample=True)[0]


def test_greedy_batch_equals_no_speculation(bastion: tuple[str, Run], reference: Run) -> None:
    name, run = bastion
    for i, (got, want) in enumerate(zip(run.greedy, reference.greedy, strict=True)):
        assert got == want, f"{name}: prompt {i} diverges at token {first_difference(got, want)}"


def test_speculation_ran(bastion: tuple[str, Run]) -> None:
    name, run = bastion
    assert run.completion_tokens == len(PROMPTS) * MAX_NEW_TOKENS
    # every decode step commits at least one token; each request's first token comes from its prefill
    assert 0 < run.verify_calls <= run.completion_tokens - len(PROMPTS), name


def test_mean_accept_length(bastion: tuple[str, Run]) -> None:
    name, run = bastion
    mean_accept = run.completion_tokens / run.verify_calls
    assert mean_accept >= MIN_MEAN_ACCEPT[name], f"{name}: {mean_accept:.2f} tokens per verify pass"


def test_short_max_new_tokens_equal_no_speculation(bastion: tuple[str, Run], reference: Run) -> None:
    name, run = bastion
    assert [len(ids) for ids in run.short] == list(SHORT_LENGTHS)
    assert run.short == reference.short, name


def test_stop_strings_truncate_as_without_speculation(bastion: tuple[str, Run], reference: Run) -> None:
    name, run = bastion
    assert run.stop == reference.stop, name
    assert all(len(ids) < MAX_NEW_TOKENS for ids, _ in reference.stop), "the stop strings must cut the runs"


def test_stop_tokens_end_runs_as_without_speculation(bastion: tuple[str, Run], reference: Run) -> None:
    name, run = bastion
    assert run.stop_token == reference.stop_token, name
    assert all(len(ids) < MAX_NEW_TOKENS for ids in reference.stop_token), "the stop tokens must end the runs"


def test_sampling_with_seed_completes(bastion: tuple[str, Run]) -> None:
    _, run = bastion
    assert run.sampled is not None
    assert [len(ids) for ids in run.sampled] == [MAX_NEW_TOKENS] * 4
    assert all(0 <= token < VOCAB_SIZE for ids in run.sampled for token in ids)


def test_sampling_samples(bastion: tuple[str, Run]) -> None:
    """One prompt under several seeds gives as many outputs (engine_support.assert_seeds_sample)."""
    _, run = bastion
    assert run.probe is not None
    assert_seeds_sample(run.probe)
