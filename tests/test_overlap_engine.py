"""BASTION under SGLang's overlap scheduler, in a real `sglang.Engine` on CPU (fp32, tiny models).

Under overlap scheduling SGLang launches step k+1 before it processes step k's result: the committed lengths
of step k reach step k+1 through its future map (the worker publishes them), the requests' own output lags a
step, and a request that finished in step k still runs in step k+1. These tests check that BASTION's output
does not notice:
- greedy, a batch of 8 requests with different prompt lengths and different max_new_tokens (they finish at
  different times), sent one after another with pauses (they join a running batch at different steps): token
  ids equal to the Engine without speculation, for the adaptive policy and for fixed:8. The drafter is the
  test-only oracle (tests/oracle_drafter.py): right for half the prompts, switching between right and wrong
  every 16 tokens for the others, so accepted paths vary from none to the whole tree from step to step, and
  the adaptive policy both speculates and skips the drafter (when this machine is not busy: its plans follow
  measured timings);
- the fixed:8 Engine really drafted (accepted paths of more than three tokens on average);
- seeded sampling (T = 0.8): token ids equal to BASTION without overlap scheduling (the walk's uniforms are a
  hash of the seed and the position, so a committed length off by one step would change them), and one prompt
  under four seeds gives four outputs under overlap scheduling (engine_support's seed probe);
- greedy requests with output penalties (repetition, frequency, presence, min_new_tokens): token ids equal to
  BASTION without overlap scheduling. Their `output_ids` lag a step at each launch, so the worker fills in
  the tokens it committed in the forward before (`request_penalties.RecentOutputs`); penalties on the lagging
  `output_ids` alone change these outputs.
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import pytest
import sglang
from engine_support import (
    PROMPTS,
    assert_seeds_sample,
    engine_server_args,
    first_difference,
    make_model_pair,
    seed_probe,
)
from oracle_drafter import write_references

from bastion_sglang.integration.config import BastionConfig
from bastion_sglang.registration import make_config

pytestmark = pytest.mark.slow

MAX_NEW_TOKENS = [40, 72, 24, 96, 56, 33, 80, 48]
"""Per prompt: the requests finish at different steps."""
ARRIVAL_GAP_S = 0.15
"""Pause between two requests' arrivals: later ones join a batch that is already decoding."""
SWITCHING = [PROMPTS[i] for i in (1, 3, 5, 7)]
SWITCH_PERIOD = 16
SAMPLED = {"temperature": 0.8, "top_p": 0.95, "max_new_tokens": 48, "ignore_eos": True, "sampling_seed": 11}
SAMPLED_PROMPTS = PROMPTS[:4]
PENALISED = [
    {"temperature": 0.0, "max_new_tokens": 48, "ignore_eos": True, **penalty}
    for penalty in (
        {"repetition_penalty": 1.3},
        {"frequency_penalty": 0.6},
        {"presence_penalty": 0.8},
        {"min_new_tokens": 40, "ignore_eos": False},
    )
]
"""One penalty per request: SGLang applies its penalizers in an order that changes from process to process,
so combinations whose order matters differ between any two Engines (tests/test_request_params_engine.py)."""
PENALISED_PROMPTS = PROMPTS[:4]


def greedy_params() -> list[dict[str, Any]]:
    return [{"temperature": 0.0, "max_new_tokens": n, "ignore_eos": True} for n in MAX_NEW_TOKENS]


async def _staggered(engine: Any, prompts: list[list[int]], params: list[dict[str, Any]]) -> list[dict]:
    async def one(i: int) -> dict:
        await asyncio.sleep(i * ARRIVAL_GAP_S)
        return await engine.async_generate(input_ids=prompts[i], sampling_params=params[i])

    return list(await asyncio.gather(*(one(i) for i in range(len(prompts)))))


def staggered_generate(engine: Any, prompts: list[list[int]], params: list[dict[str, Any]]) -> list[dict]:
    """Send request i after i x ARRIVAL_GAP_S seconds; outputs in prompt order."""
    return engine.loop.run_until_complete(_staggered(engine, prompts, params))


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return make_model_pair(tmp_path_factory.mktemp("overlap_engine"))


@pytest.fixture(scope="module")
def reference(models: tuple[Path, Path]) -> list[list[int]]:
    """Greedy outputs without speculation (one batch)."""
    engine = sglang.Engine(server_args=engine_server_args(models, None))
    try:
        outputs = engine.generate(input_ids=PROMPTS, sampling_params=greedy_params())
        return [out["output_ids"] for out in outputs]
    finally:
        engine.shutdown()


def oracle_config(root: Path, reference: list[list[int]], policy: str, overlap: bool) -> BastionConfig:
    """BASTION with the oracle drafter of the module docstring."""
    oracle = write_references(
        root / f"oracle-{policy.replace(':', '')}.json",
        PROMPTS,
        reference,
        switch_prompts=SWITCHING,
        switch_period=SWITCH_PERIOD,
    )
    return dataclasses.replace(
        make_config(policy=policy, max_budget=8, topk=4, overlap=overlap),
        draft_proposer="oracle_drafter:make_oracle",
        draft_proposer_arg=str(oracle),
    )


@dataclasses.dataclass(frozen=True)
class Run:
    """What one BASTION Engine returned: greedy ids, sampled ids, verify passes, penalised greedy ids, the
    seed probe's outputs."""

    policy: str
    greedy: list[list[int]]
    sampled: list[list[int]]
    verify_calls: int
    completion_tokens: int
    penalised: list[list[int]]
    probe: list[list[int]]


def _run(policy: str, server_args: Any, greedy: bool) -> Run:
    """Seeded sampling first (the prefill sampler's RNG is fresh in every Engine), then greedy (staggered),
    then requests with output penalties, then the seed probe."""
    engine = sglang.Engine(server_args=server_args)
    try:
        sampled = engine.generate(input_ids=SAMPLED_PROMPTS, sampling_params=SAMPLED)
        outputs = staggered_generate(engine, PROMPTS, greedy_params()) if greedy else []
        penalised = engine.generate(input_ids=PENALISED_PROMPTS, sampling_params=PENALISED)
        probe = seed_probe(engine)
    finally:
        engine.shutdown()
    meta = [out["meta_info"] for out in outputs]
    return Run(
        policy=policy,
        greedy=[out["output_ids"] for out in outputs],
        sampled=[out["output_ids"] for out in sampled],
        verify_calls=sum(int(m.get("spec_verify_ct", 0)) for m in meta),
        completion_tokens=sum(int(m["completion_tokens"]) for m in meta),
        penalised=[out["output_ids"] for out in penalised],
        probe=probe,
    )


@pytest.fixture(scope="module", params=["adaptive", "fixed:8"])
def overlapped(
    request: pytest.FixtureRequest,
    models: tuple[Path, Path],
    reference: list[list[int]],
    tmp_path_factory: pytest.TempPathFactory,
) -> Run:
    root = tmp_path_factory.mktemp("overlap_run")
    config = oracle_config(root, reference, request.param, overlap=True)
    return _run(
        request.param, engine_server_args(models, config, disable_overlap_schedule=False), greedy=True
    )


@pytest.fixture(scope="module")
def synchronous(
    models: tuple[Path, Path], reference: list[list[int]], tmp_path_factory: pytest.TempPathFactory
) -> Run:
    """BASTION (adaptive) without overlap scheduling: the sampled reference."""
    config = oracle_config(tmp_path_factory.mktemp("sync_run"), reference, "adaptive", overlap=False)
    return _run("adaptive", engine_server_args(models, config), greedy=False)


def assert_same_outputs(got: list[list[int]], want: list[list[int]]) -> None:
    """Token ids equal prompt by prompt; the message names the prompt and the first differing token."""
    for i, (ids, wanted) in enumerate(zip(got, want, strict=True)):
        assert ids == wanted, f"prompt {i}: first difference at token {first_difference(ids, wanted)}"


def test_greedy_equals_no_speculation(overlapped: Run, reference: list[list[int]]) -> None:
    assert len(overlapped.greedy) == len(reference)
    assert_same_outputs(overlapped.greedy, reference)


def test_overlap_engine_speculated(overlapped: Run) -> None:
    """fixed:8 drafts at every step whatever the machine's timings (the adaptive policy declines trees while
    this machine is busy, so its accepted lengths depend on the load)."""
    assert overlapped.verify_calls > 0
    if overlapped.policy == "fixed:8":
        assert overlapped.completion_tokens / overlapped.verify_calls > 3.0, overlapped


def test_sampled_equals_without_overlap(overlapped: Run, synchronous: Run) -> None:
    assert_same_outputs(overlapped.sampled, synchronous.sampled)
    assert len({tuple(ids) for ids in synchronous.sampled}) > 1  # sampled text, not one repeated output


def test_seeds_sample_under_overlap(overlapped: Run) -> None:
    """One prompt under several seeds gives as many outputs (engine_support.assert_seeds_sample)."""
    assert_seeds_sample(overlapped.probe)


def test_penalised_outputs_equal_without_overlap(overlapped: Run, synchronous: Run) -> None:
    assert_same_outputs(overlapped.penalised, synchronous.penalised)
