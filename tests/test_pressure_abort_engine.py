"""BASTION in a real `sglang.Engine` on CPU under KV-pool pressure and an abort storm: survivors stay exact.

The tiny random fp32 pair (tests/engine_support.py) with the test-only decoy oracle on the greedy prompts
(tests/oracle_drafter.py: fixed trees of 12 nodes, 2 candidates per position, so accepted paths are long and
each verify pass writes up to 13 KV slots), one BASTION Engine with a KV pool of POOL_TOKENS and SGLang's
strict memory checks (pool accounting after every step, leaks raising when the scheduler idles, KV page
invariants; a failed check kills the scheduler and with it the run). In order:

1. seeded, alone: each seeded request by itself (no retraction: `num_retractions` 0);
2. pressure: the greedy and seeded requests in one batch, more than the pool holds, so SGLang retracts
   requests ("KV cache pool is full. Retract requests") and runs them again from a prefill of prompt +
   output so far; SGLang's retraction test hook also retracts a request every RETRACT_INTERVAL forwards, so
   every phase of two or more requests retracts whatever the timing; asserted through
   `meta_info["num_retractions"]` (SGLang's per-request count), so the test cannot pass without retraction;
3. abort storm under pressure: the same requests again, beside VICTIMS streaming requests that are aborted
   (`TokenizerManager.abort_request`) once each has streamed CHUNKS_BEFORE_ABORT chunks;
4. a check request after an idle second (SGLang's idle leak check runs), then shutdown.

Checked: every greedy survivor (phases 2 and 3) equals the non-speculative greedy output (Hugging Face's
greedy continuation on the same fp32 weights, `sglang_server.hf_greedy`, what SGLang without speculation
returns, tests/test_sglang_server.py); every victim ends with finish_reason abort short of its cap.

Seeded sampling. SGLang without speculation honours `sampling_seed` only under
`--enable-deterministic-inference`, which needs a GPU attention backend: on CPU there is no seeded
non-speculative output to equal. BASTION's own promise is that a seeded request returns the same tokens
whatever batch it shares, retracted or not; the reference is therefore phase 1. The first token of a BASTION
request comes from SGLang's prefill sampler (unseeded outside deterministic mode); the seeded requests carry a
regex whose first character is fixed (SEEDED_REGEX: the byte tokenizer makes it one token), so it is the same
in every phase. After a retraction the re-prefill's token is BASTION's seeded draw
(`bastion_sglang.step.prefill_redraw`), so every seeded survivor, retracted or not, must equal phase 1 token
for token; the test asserts that at least one seeded request was retracted, so it cannot pass without a
redraw. After the storm, one prompt under four seeds gives four outputs (engine_support's seed probe).
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import time
from collections.abc import Iterator
from typing import Any

import pytest
import sglang
from engine_support import (
    assert_seeds_sample,
    engine_server_args,
    first_difference,
    make_model_pair,
    seed_probe,
)
from oracle_drafter import write_references
from sglang_server import hf_greedy

from bastion_sglang.registration import make_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

GREEDY_PROMPTS = [
    list(text.encode())
    for text in (
        "pressure on the pool",
        "retract and run again",
        "a request that survives",
        "the scheduler queues it",
        "0123456789 abcdef",
        "KV slots are scarce here",
        "long accepted paths",
        "one more greedy prompt",
    )
]
SEEDED_PROMPTS = [list(f"seeded request number {i}: ".encode()) for i in range(8)]
VICTIM_PROMPTS = [list(f"victim {i} is aborted mid-generation".encode()) for i in range(12)]
CHECK_PROMPT = list(b"after the storm")
GREEDY_NEW_TOKENS = 64
SEEDED_NEW_TOKENS = 48
SEEDED_REGEX = "x[a-z]{47}"
"""48 one-byte tokens: the first fixed ('x', so SGLang's unseeded prefill sampler has one choice), then 47
letters sampled at T = 0.8 (the tiny target spreads its mass over many tokens there)."""
VICTIM_NEW_TOKENS = 160
CHUNKS_BEFORE_ABORT = 3
CONTEXT_LENGTH = 256
POOL_TOKENS = 640
"""KV tokens: one request (prompt + output + a step's reserve of 2 x 16 slots) fits; the 16 of a phase
(~1,700 tokens with their reserves) do not."""
CONSERVATIVENESS = 0.3
"""SGLang admits requests by their expected KV need times a ratio that rises after each retraction; a low
conservativeness keeps admitting past what the pool holds, so the abort storm retracts too."""
GREEDY = {"temperature": 0.0, "max_new_tokens": GREEDY_NEW_TOKENS, "ignore_eos": True}
DECOY_GAP = 0.4
RETRACT_INTERVAL = 7
"""SGLang's retraction test hook (SGLANG_TEST_RETRACT) retracts at least one request of every running batch
of two or more at each RETRACT_INTERVAL-th forward, besides the retractions the full pool triggers: whether
the pool alone fills in a phase depends on how the scheduler's steps and the victims' aborts interleave."""
SCHEDULER_ENV = {
    "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY": "1",
    "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "1",
    "SGLANG_CHECK_KV_PAGE_INVARIANTS": "1",
    "SGLANG_TEST_RETRACT": "1",
    "SGLANG_TEST_RETRACT_INTERVAL": str(RETRACT_INTERVAL),
}
IDLE_CHECK_SECONDS = 1.0


def _seeded(i: int) -> dict[str, Any]:
    return {
        "temperature": 0.8,
        "max_new_tokens": SEEDED_NEW_TOKENS,
        "regex": SEEDED_REGEX,
        "sampling_seed": 100 + i,
    }


@dataclasses.dataclass(frozen=True)
class Phase:
    """The greedy and seeded outputs of one phase, with each request's retraction count."""

    greedy: list[list[int]]
    seeded: list[list[int]]
    greedy_retractions: list[int]
    seeded_retractions: list[int]

    @classmethod
    def of(cls, outputs: list[dict[str, Any]]) -> Phase:
        n = len(GREEDY_PROMPTS)
        ids = [out["output_ids"] for out in outputs]
        retractions = [int(out["meta_info"]["num_retractions"]) for out in outputs]
        return cls(ids[:n], ids[n:], retractions[:n], retractions[n:])

    @property
    def retractions(self) -> int:
        return sum(self.greedy_retractions) + sum(self.seeded_retractions)


@dataclasses.dataclass(frozen=True)
class Runs:
    reference: list[list[int]]  # non-speculative greedy output per greedy prompt
    check_reference: list[int]
    alone: list[list[int]]  # phase 1: seeded outputs, one request at a time
    alone_retractions: list[int]
    pressure: Phase
    storm: Phase
    victims: list[dict[str, Any]]  # the last streamed chunk of each victim
    check: list[int]
    probe: list[list[int]]  # the seed probe's outputs, after the storm


async def _victim(engine: Any, prompt: list[int], rid: str) -> dict[str, Any]:
    """Stream one request and abort it after CHUNKS_BEFORE_ABORT chunks; return its last chunk. (SGLang's
    abort_request matches rids by prefix: the victims' rids have one width.)"""
    stream = await engine.async_generate(
        input_ids=prompt,
        sampling_params={"temperature": 0.0, "max_new_tokens": VICTIM_NEW_TOKENS, "ignore_eos": True},
        stream=True,
        rid=rid,
    )
    chunks, last = 0, None
    async for chunk in stream:
        chunks, last = chunks + 1, chunk
        if chunks == CHUNKS_BEFORE_ABORT:
            engine.tokenizer_manager.abort_request(rid=rid)
    assert last is not None
    return last


async def _storm(engine: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    survivors = [
        engine.async_generate(input_ids=prompt, sampling_params=params)
        for prompt, params in zip(
            [*GREEDY_PROMPTS, *SEEDED_PROMPTS],
            [GREEDY] * len(GREEDY_PROMPTS) + [_seeded(i) for i in range(len(SEEDED_PROMPTS))],
            strict=True,
        )
    ]
    victims = [_victim(engine, prompt, f"victim-{i:02d}") for i, prompt in enumerate(VICTIM_PROMPTS)]
    results = await asyncio.gather(*victims, *survivors)
    return list(results[len(victims) :]), list(results[: len(victims)])


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Runs]:
    root = tmp_path_factory.mktemp("pressure_abort")
    models = make_model_pair(root)
    reference = hf_greedy(models[0], [*GREEDY_PROMPTS, CHECK_PROMPT], GREEDY_NEW_TOKENS)
    references = write_references(root / "greedy.json", GREEDY_PROMPTS, reference[:-1], DECOY_GAP)
    config = dataclasses.replace(
        make_config(max_budget=12, policy="fixed:12", topk=2),
        draft_proposer="oracle_drafter:make_oracle",
        draft_proposer_arg=str(references),
    )
    server_args = engine_server_args(
        models,
        config,
        max_total_tokens=POOL_TOKENS,
        context_length=CONTEXT_LENGTH,
        schedule_conservativeness=CONSERVATIVENESS,
    )
    with pytest.MonkeyPatch.context() as env:
        for name, value in SCHEDULER_ENV.items():
            env.setenv(name, value)
        engine = sglang.Engine(server_args=server_args)
    try:
        alone = [
            engine.generate(input_ids=prompt, sampling_params=_seeded(i))
            for i, prompt in enumerate(SEEDED_PROMPTS)
        ]
        both = dict(
            input_ids=[*GREEDY_PROMPTS, *SEEDED_PROMPTS],
            sampling_params=[GREEDY] * len(GREEDY_PROMPTS) + [_seeded(i) for i in range(len(SEEDED_PROMPTS))],
        )
        pressure = Phase.of(engine.generate(**both))
        survivors, victims = engine.loop.run_until_complete(_storm(engine))
        time.sleep(IDLE_CHECK_SECONDS)
        check = engine.generate(input_ids=CHECK_PROMPT, sampling_params=GREEDY)
        probe = seed_probe(engine)
    finally:
        engine.shutdown()
    storm = Phase.of(survivors)
    print(
        f"retractions: pressure {pressure.greedy_retractions} greedy, {pressure.seeded_retractions} seeded;"
        f" storm {storm.greedy_retractions} greedy, {storm.seeded_retractions} seeded"
    )
    yield Runs(
        reference=reference[:-1],
        check_reference=reference[-1],
        alone=[out["output_ids"] for out in alone],
        alone_retractions=[int(out["meta_info"]["num_retractions"]) for out in alone],
        pressure=pressure,
        storm=storm,
        victims=victims,
        check=check["output_ids"],
        probe=probe,
    )


def test_pressure_retracts_requests(runs: Runs) -> None:
    assert runs.alone_retractions == [0] * len(SEEDED_PROMPTS)
    assert runs.pressure.retractions > 0, "no request was retracted: the pool was not under pressure"
    assert runs.storm.retractions > 0, "no request was retracted during the abort storm"
    seeded = sum(runs.pressure.seeded_retractions) + sum(runs.storm.seeded_retractions)
    assert seeded > 0, "no seeded request was retracted: the re-prefill's draw went unchecked"


@pytest.mark.parametrize("phase", ["pressure", "storm"])
def test_greedy_survivors_equal_no_speculation(runs: Runs, phase: str) -> None:
    outputs: Phase = getattr(runs, phase)
    for i, (got, want) in enumerate(zip(outputs.greedy, runs.reference, strict=True)):
        assert got == want, (
            f"{phase}: greedy prompt {i} (retracted {outputs.greedy_retractions[i]} times) diverges at"
            f" token {first_difference(got, want)}"
        )


@pytest.mark.parametrize("phase", ["pressure", "storm"])
def test_seeded_survivors_equal_their_run_alone(runs: Runs, phase: str) -> None:
    outputs: Phase = getattr(runs, phase)
    letters = re.compile(SEEDED_REGEX.encode())
    for i, (got, want) in enumerate(zip(outputs.seeded, runs.alone, strict=True)):
        assert len(got) == SEEDED_NEW_TOKENS and letters.fullmatch(bytes(got)), f"{phase}: seeded {i}: {got}"
        assert got == want, (
            f"{phase}: seeded prompt {i} (retracted {outputs.seeded_retractions[i]} times) diverges at"
            f" token {first_difference(got, want)}"
        )


def test_victims_were_aborted_mid_generation(runs: Runs) -> None:
    for i, last in enumerate(runs.victims):
        reason = last["meta_info"]["finish_reason"]
        assert reason is not None and reason["type"] == "abort", f"victim {i}: {reason}"
        tokens = last["meta_info"]["completion_tokens"]
        assert 0 < tokens < VICTIM_NEW_TOKENS, f"victim {i}: {tokens} tokens, not aborted mid-generation"


def test_engine_serves_exactly_after_the_storm(runs: Runs) -> None:
    assert runs.check == runs.check_reference


def test_seeds_sample_after_the_storm(runs: Runs) -> None:
    """One prompt under several seeds gives as many outputs (engine_support.assert_seeds_sample); the seeded
    requests above differ by prompt as well as by seed."""
    assert_seeds_sample(runs.probe)
