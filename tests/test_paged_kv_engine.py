"""BASTION with `--page-size` 1, 16 and 64 in a real `sglang.Engine` on CPU, SGLang's strict memory checks on.

With pages of several tokens a tree commit copies the accepted path's KV into the request's pages instead of
permuting slot ids (`bastion_sglang.step.commit`), and the CPU verify path reads keys page by page as paged
CUDA kernels do (`cpu_support.paged_slots`), so a commit that broke SGLang's page invariant would change these
outputs. Two pairs, each in fp32: the tiny random pair (tests/engine_support.py) and the demo pair (the
SmolLM2-135M-Instruct target of the `demo_target` plugin, `models/smollm2-135m-instruct-dflash`). Per pair:
1. the greedy reference of the greedy prompts: Hugging Face's greedy continuation on the same fp32 weights
   (`sglang_server.hf_greedy`: what SGLang without speculation returns, as tests/test_sglang_server.py checks;
   for the demo prompts it was checked once against SGLang's Engine), which spares an Engine per pair;
2. BASTION at page size 1 as it ran before pages were served: greedy with the test-only oracle drafter and
   its decoys (tests/oracle_drafter.py: the accepted path interleaves with wrong siblings in the verify row,
   so it is not a prefix of the row), and seeded sampling (T = 0.8) with the pair's own drafter, whose
   outputs are the seeded reference (each token the target's own sample at its position,
   `kernels.position_uniforms`, whatever trees verified it);
3. BASTION at page sizes 16 and 64, the oracle with decoys on both request sets (the seeded reference as the
   seeded prompts' continuation).
Every BASTION Engine runs with SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY (pool accounting after every
step), SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE (leaks raise when the scheduler idles; it does before each
Engine stops) and SGLANG_CHECK_KV_PAGE_INVARIANTS (no page both owned and free, none freed twice): a failed
check kills the scheduler, and with it the run. Checked: greedy outputs equal the reference at every page
size, seeded outputs at 16 and 64 equal page 1's, the decoy runs emitted at least MIN_MEAN_ACCEPT tokens
per verify pass, and on the tiny pair (whose byte tokens spell the probe's pattern) one prompt under four
seeds gives four outputs at every page size (engine_support's seed probe).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

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
from sglang_server import hf_greedy
from transformers import AutoTokenizer

from bastion_sglang.assets.prompt_sets import chat_prompt_ids, load_prompts
from bastion_sglang.integration.config import BastionConfig
from bastion_sglang.registration import make_config

if TYPE_CHECKING:
    from demo_target import DemoTarget

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]
pytest_plugins = ["demo_target"]

DEMO_DRAFTER = Path(__file__).resolve().parents[1] / "models" / "smollm2-135m-instruct-dflash"
PAGE_SIZES = (1, 16, 64)
MAX_NEW_TOKENS = 32
GREEDY = {"temperature": 0.0, "max_new_tokens": MAX_NEW_TOKENS, "ignore_eos": True}
SEEDED_NEW_TOKENS = 16
"""Fewer than greedy: page size 1 samples them with the pair's own drafter, which accepts little."""
SAMPLED = {"temperature": 0.8, "max_new_tokens": SEEDED_NEW_TOKENS, "ignore_eos": True, "sampling_seed": 5}
DECOY_GAP = 0.4  # as tests/test_sglang_engine.py: the reference token ~0.6, its decoy ~0.4
MIN_MEAN_ACCEPT = 3.0
"""Tokens per verify pass of a decoy run: two accepted nodes per pass on average, so paths reached depth 2,
whose node the decoy at depth 1 precedes in the verify row (accepted paths off the row's prefix)."""
STRICT_MEM_ENV = {
    "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY": "1",
    "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "1",
    "SGLANG_CHECK_KV_PAGE_INVARIANTS": "1",
}
SEEDED_TINY_PROMPT = list(b"a seeded request whose window crosses the first page")
"""52 tokens: its verify windows cross position 64, a page boundary at page sizes 16 and 64 (so do those of
the tiny pair's greedy prompt of 22 tokens; the demo pair's prompts have 53, 120 and 138 tokens)."""
IDLE_CHECK_SECONDS = 1.0
"""Wait before an Engine stops, so its scheduler idles and runs the idle leak check once."""


@dataclasses.dataclass(frozen=True)
class Pair:
    """A target and drafter with the requests sent to them."""

    models: tuple[Path, Path]
    greedy_prompts: list[list[int]]
    sampled_prompts: list[list[int]]
    overrides: dict[str, Any]  # more ServerArgs fields of its Engines
    probes: bool = False  # whether its Engines answer the seed probe (a byte-token pair)


@dataclasses.dataclass(frozen=True)
class Outputs:
    """What one Engine returned: output ids per request, completion tokens / verify passes per set, and
    the seed probe's outputs (None: not sent)."""

    greedy: list[list[int]]
    sampled: list[list[int]]
    greedy_tau: float
    sampled_tau: float
    probe: list[list[int]] | None


def _tau(outputs: list[dict[str, Any]]) -> float:
    completion = sum(int(out["meta_info"]["completion_tokens"]) for out in outputs)
    passes = sum(int(out["meta_info"].get("spec_verify_ct") or 0) for out in outputs)
    return completion / max(passes, 1)


def _run(pair: Pair, config: BastionConfig, page_size: int) -> Outputs:
    """One BASTION Engine over the pair's greedy and seeded requests, stopped after an idle check."""
    server_args = engine_server_args(pair.models, config, page_size=page_size, **pair.overrides)
    engine = sglang.Engine(server_args=server_args)
    try:
        greedy = engine.generate(input_ids=pair.greedy_prompts, sampling_params=GREEDY)
        sampled = engine.generate(input_ids=pair.sampled_prompts, sampling_params=SAMPLED)
        probe = seed_probe(engine) if pair.probes else None
        time.sleep(IDLE_CHECK_SECONDS)
    finally:
        engine.shutdown()
    return Outputs(
        greedy=[out["output_ids"] for out in greedy],
        sampled=[out["output_ids"] for out in sampled],
        greedy_tau=_tau(greedy),
        sampled_tau=_tau(sampled),
        probe=probe,
    )


def _oracle(references: Path) -> BastionConfig:
    """Fixed trees of 12 nodes, 2 candidates per position, proposed by the decoy oracle of `references`."""
    return dataclasses.replace(
        make_config(max_budget=12, policy="fixed:12", topk=2),
        draft_proposer="oracle_drafter:make_oracle",
        draft_proposer_arg=str(references),
    )


@dataclasses.dataclass(frozen=True)
class PairRuns:
    """The greedy reference and one BASTION run per page size."""

    reference: list[list[int]]
    paged: dict[int, Outputs]


def _runs(pair: Pair, root: Path) -> PairRuns:
    """The greedy reference and one BASTION run per page size (module docstring)."""
    reference = hf_greedy(pair.models[0], pair.greedy_prompts, MAX_NEW_TOKENS)
    runs: dict[int, Outputs] = {}
    with pytest.MonkeyPatch.context() as env:
        for name, value in STRICT_MEM_ENV.items():
            env.setenv(name, value)
        greedy_only = write_references(root / "greedy.json", pair.greedy_prompts, reference, DECOY_GAP)
        runs[1] = _run(pair, _oracle(greedy_only), 1)
        prompts = [*pair.greedy_prompts, *pair.sampled_prompts]
        both = write_references(root / "both.json", prompts, [*reference, *runs[1].sampled], DECOY_GAP)
        for page_size in PAGE_SIZES[1:]:
            runs[page_size] = _run(pair, _oracle(both), page_size)
    for page_size, run in runs.items():
        print(f"page size {page_size}: tau greedy {run.greedy_tau:.2f}, seeded {run.sampled_tau:.2f}")
    return PairRuns(reference, runs)


@pytest.fixture(scope="module")
def tiny_runs(tmp_path_factory: pytest.TempPathFactory) -> PairRuns:
    root = tmp_path_factory.mktemp("paged_tiny")
    pair = Pair(make_model_pair(root), [PROMPTS[i] for i in (0, 3, 7)], [SEEDED_TINY_PROMPT], {}, probes=True)
    return _runs(pair, root)


@pytest.fixture(scope="module")
def demo_runs(demo_target: DemoTarget, tmp_path_factory: pytest.TempPathFactory) -> PairRuns:
    tokenizer = AutoTokenizer.from_pretrained(demo_target.path)
    prompts = [chat_prompt_ids(tokenizer, p) for p in load_prompts("mtbench", "heldout")[:3]]
    pair = Pair((demo_target.path, DEMO_DRAFTER), prompts[1:], prompts[:1], {"mem_fraction_static": 0.2})
    return _runs(pair, tmp_path_factory.mktemp("paged_demo"))


@pytest.fixture(params=["tiny", "demo"])
def runs(request: pytest.FixtureRequest) -> Iterator[PairRuns]:
    yield request.getfixturevalue(f"{request.param}_runs")


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_greedy_equals_no_speculation(runs: PairRuns, page_size: int) -> None:
    for i, (got, want) in enumerate(zip(runs.paged[page_size].greedy, runs.reference, strict=True)):
        assert got == want, (
            f"page size {page_size}: prompt {i} diverges at token {first_difference(got, want)}"
        )


@pytest.mark.parametrize("page_size", PAGE_SIZES[1:])
def test_seeded_sampling_equals_page_size_one(runs: PairRuns, page_size: int) -> None:
    got = runs.paged[page_size].sampled
    for i, (ids, want) in enumerate(zip(got, runs.paged[1].sampled, strict=True)):
        assert ids == want, (
            f"page size {page_size}: prompt {i} diverges at token {first_difference(ids, want)}"
        )
    assert all(len(ids) == SEEDED_NEW_TOKENS for ids in got)


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_decoy_trees_accepted_paths_off_the_row_prefix(runs: PairRuns, page_size: int) -> None:
    """Page size 1 runs its seeded requests with the pair's own drafter, so only its greedy ones count."""
    run = runs.paged[page_size]
    assert run.greedy_tau >= MIN_MEAN_ACCEPT, f"greedy: {run.greedy_tau:.2f} tokens per verify pass"
    if page_size > 1:
        assert run.sampled_tau >= MIN_MEAN_ACCEPT, f"seeded: {run.sampled_tau:.2f} tokens per verify pass"


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_seeds_sample_at_every_page_size(tiny_runs: PairRuns, page_size: int) -> None:
    """One prompt under several seeds gives as many outputs (engine_support.assert_seeds_sample)."""
    probe = tiny_runs.paged[page_size].probe
    assert probe is not None
    assert_seeds_sample(probe)
