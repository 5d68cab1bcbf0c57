"""Never slower than plain decoding, in a real `sglang.Engine` on CPU (adaptive policy, fp32, 512 tokens).

Tiny random Qwen3 target and DFlash drafter (tests/engine_support.py) with the test-only oracle drafter
(tests/oracle_drafter.py) in three roles: right (the drafter proposes the target's own continuation),
wrong (it confidently proposes a token that is never the target's), switching (right for 64 emitted tokens,
wrong for the next 64, ...). One BASTION Engine with metrics on, planning on a serving engine's latency
profile weighed as 1e6 passes (tests/calibration_profiles.py: its gate's choices depend on the drafts, not on
this machine's speed), serves, in order: the right prompts, the wrong prompts, one wrong prompt alone
(2 · FLUSH_STEPS + 8 tokens), the switching prompts, then all of them in one batch of 8. After each call
the decode-step counters (`sglang:bastion_decode_steps_total{mode}`) say how its steps went:
- right: every step speculates, with long accepted paths;
- wrong: after the first probes the drafter is skipped (most steps draft nothing);
- one wrong prompt: exactly one step per token after the first, all counted by the time the call returns;
- switching: both speculative and skipped steps (the gate backs off, then resumes);
and every output equals the Engine without speculation, token for token.

Steps that skip the drafter write their tokens' drafter KV late (`draft_context`). The oracle records the
drafter's own logits (before its boost) for the switching prompts, here and in an Engine that drafts at every
step (fixed:16, drafter KV written at once): at every (prompt, tokens emitted) both drafted, they agree.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator
from pathlib import Path

import pytest
import sglang
import torch
from calibration_profiles import serving_plan_flags
from engine_support import PROMPTS, engine_server_args, first_difference, make_model_pair
from oracle_drafter import load_records, write_references

from bastion_sglang.integration.config import BastionConfig
from bastion_sglang.registration import make_config
from bastion_sglang.step.metrics import FLUSH_STEPS

pytestmark = pytest.mark.slow

RIGHT, WRONG, SWITCHING = [0, 1], [2, 3], [4, 5, 6, 7]
MAX_NEW_TOKENS = 512
SWITCH_PERIOD = 64
GREEDY = {"temperature": 0.0, "max_new_tokens": MAX_NEW_TOKENS, "ignore_eos": True}
ONE_REQUEST = {**GREEDY, "max_new_tokens": 2 * FLUSH_STEPS + 8}
"""A single request whose decode steps (max_new_tokens - 1) are not a multiple of FLUSH_STEPS: some of its
steps' metrics are still held when its last step ends."""
STEPS_METRIC = "sglang:bastion_decode_steps"
MODES = ("speculative", "declined", "skipped")
WARMUP_STEPS = 6
"""Plain steps allowed for the right prompts while the gate has no evidence of the drafter yet (the plans
follow the serving profile, not this machine's timings, so their count does not grow with the load)."""
DRAFT_LOGIT_TOL = 1e-3
"""fp32 drafter logits from drafter KV written late vs at once (batches of different shapes)."""


def logit_gap(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """Largest absolute difference of two drafter passes' logits [h1, V] and [h2, V] over the positions both
    scored (the first min(h1, h2))."""
    depth = min(first.shape[0], second.shape[0])
    return (first[:depth] - second[:depth]).abs().max()


def decode_steps(directory: Path) -> dict[str, float]:
    """Decode steps per mode so far, from the Engine's prometheus_client multiprocess directory."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(directory))
    counts = dict.fromkeys(MODES, 0.0)
    for family in registry.collect():
        for sample in family.samples:
            if sample.name == f"{STEPS_METRIC}_total":
                counts[sample.labels["mode"]] += sample.value
    return counts


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return make_model_pair(tmp_path_factory.mktemp("gate_engine"))


@pytest.fixture(scope="module")
def reference(models: tuple[Path, Path]) -> list[list[int]]:
    engine = sglang.Engine(server_args=engine_server_args(models, None))
    try:
        return [out["output_ids"] for out in engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)]
    finally:
        engine.shutdown()


Call = tuple[list[list[int]], dict[str, float]]


def oracle_config(root: Path, reference: list[list[int]], policy: str, records: Path) -> BastionConfig:
    """BASTION with the oracle drafter of the module docstring (`reference`: the outputs without
    speculation), recording the switching prompts' drafter logits into `records`. It plans on a serving
    engine's latency profile weighed as 1e6 passes (tests/calibration_profiles.py, SERVING_FIT), so the
    gate's decisions depend on the drafts alone: with this machine's own timings, a loaded 2-core machine
    can price every tree above plain decoding and decline for hundreds of steps."""
    oracle = write_references(
        root / "oracle.json",
        PROMPTS,
        reference,
        wrong_prompts=[PROMPTS[i] for i in WRONG],
        switch_prompts=[PROMPTS[i] for i in SWITCHING],
        switch_period=SWITCH_PERIOD,
        record_dir=records,
        record_prompts=[PROMPTS[i] for i in SWITCHING],
    )
    return dataclasses.replace(
        make_config(policy=policy, max_budget=16, topk=4, **serving_plan_flags(root)),
        draft_proposer="oracle_drafter:make_oracle",
        draft_proposer_arg=str(oracle),
    )


@pytest.fixture(scope="module")
def gate_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Folder of the adaptive Engine's run: its oracle file, metrics and drafter records."""
    return tmp_path_factory.mktemp("gate_run")


@pytest.fixture(scope="module")
def bastion(
    models: tuple[Path, Path], reference: list[list[int]], gate_root: Path
) -> Iterator[dict[str, Call]]:
    root = gate_root
    records = root / "records"
    records.mkdir()
    config = oracle_config(root, reference, "adaptive", records)
    metrics_dir = root / "metrics"
    metrics_dir.mkdir()
    # prometheus_client's multiprocess mode reads the folder from the environment whenever a series is
    # created, in the Engine's processes and in this one (its tokenizer manager): set while the Engine runs
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PROMETHEUS_MULTIPROC_DIR", str(metrics_dir))
        engine = sglang.Engine(server_args=engine_server_args(models, config, enable_metrics=True))
        calls: dict[str, Call] = {}
        try:
            for name, indices, params in (
                ("right", RIGHT, GREEDY),
                ("wrong", WRONG, GREEDY),
                ("one wrong", WRONG[:1], ONE_REQUEST),
                ("switching", SWITCHING, GREEDY),
                ("all", list(range(len(PROMPTS))), GREEDY),
            ):
                before = decode_steps(metrics_dir)
                outputs = engine.generate(input_ids=[PROMPTS[i] for i in indices], sampling_params=params)
                after = decode_steps(metrics_dir)
                steps = {mode: after[mode] - before[mode] for mode in MODES}
                calls[name] = ([out["output_ids"] for out in outputs], steps)
                if name == "switching":  # the "all" call drafts the same prompts again: keep these apart
                    records.rename(root / "switching_records")
                    records.mkdir()
            yield calls
        finally:
            engine.shutdown()


def _assert_equal(got: list[list[int]], want: list[list[int]], indices: list[int]) -> None:
    for ids, i in zip(got, indices, strict=True):
        assert ids == want[i], f"prompt {i}: first difference at token {first_difference(ids, want[i])}"


@pytest.mark.parametrize(
    ("name", "indices"),
    [("right", RIGHT), ("wrong", WRONG), ("switching", SWITCHING), ("all", list(range(8)))],
)
def test_outputs_equal_no_speculation(
    bastion: dict[str, Call], reference: list[list[int]], name: str, indices: list[int]
) -> None:
    _assert_equal(bastion[name][0], reference, indices)


def test_a_drafter_that_predicts_keeps_speculating(bastion: dict[str, Call]) -> None:
    steps = bastion["right"][1]
    assert steps["skipped"] + steps["declined"] <= WARMUP_STEPS, steps
    # with the oracle, trees of up to 16 nodes accept long paths: far fewer steps than tokens
    assert 0 < steps["speculative"] < MAX_NEW_TOKENS / 4


def test_a_drafter_that_never_matches_is_skipped(bastion: dict[str, Call]) -> None:
    steps = bastion["wrong"][1]
    total = sum(steps.values())
    assert total >= MAX_NEW_TOKENS - 1  # one token per step: nothing is ever accepted
    assert steps["skipped"] > 0.8 * total, steps


def test_a_response_arrives_after_its_steps_are_counted(
    bastion: dict[str, Call], reference: list[list[int]]
) -> None:
    """The metrics held for batching are written before a finished request's output leaves the scheduler:
    right after `generate` returns, the counters hold every decode step of the request (one token per step,
    the wrong drafter is never accepted), not only the FLUSH_STEPS-step blocks written so far."""
    outputs, steps = bastion["one wrong"]
    tokens = ONE_REQUEST["max_new_tokens"]
    assert outputs[0] == reference[WRONG[0]][:tokens]
    assert sum(steps.values()) == tokens - 1, steps


def test_switching_text_moves_between_skipping_and_speculating(bastion: dict[str, Call]) -> None:
    steps = bastion["switching"][1]
    assert steps["skipped"] > 0 and steps["speculative"] > 0, steps


@pytest.fixture(scope="module")
def always_drafting(
    models: tuple[Path, Path], reference: list[list[int]], tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """The switching prompts in an Engine that drafts at every step: the folder of its drafter records."""
    root = tmp_path_factory.mktemp("always_drafting")
    records = root / "records"
    records.mkdir()
    config = oracle_config(root, reference, "fixed:16", records)
    engine = sglang.Engine(server_args=engine_server_args(models, config))
    try:
        outputs = engine.generate(input_ids=[PROMPTS[i] for i in SWITCHING], sampling_params=GREEDY)
    finally:
        engine.shutdown()
    _assert_equal([out["output_ids"] for out in outputs], reference, SWITCHING)
    return records


def test_drafter_context_written_late_equals_written_at_once(
    bastion: dict[str, Call], always_drafting: Path, gate_root: Path
) -> None:
    """At every (prompt, tokens emitted) where both Engines drafted, the drafter's own logits [h, V] agree
    within DRAFT_LOGIT_TOL over the positions both scored (each Engine's draft horizon h); among them are
    passes right after skipped steps (in a wrong stretch, where a drafted step emits one token, a gap of more
    than one token since the last drafter pass), which read drafter KV the skipped steps wrote late."""
    late, at_once = load_records(gate_root / "switching_records"), load_records(always_drafting)
    shared = sorted(late.keys() & at_once.keys())
    after_skips = 0
    for prompt in {prompt for prompt, _ in late}:
        emitted = sorted(count for p, count in late if p == prompt)
        after_skips += sum(
            1
            for previous, count in itertools.pairwise(emitted)
            if count - previous > 1 and (count // SWITCH_PERIOD) % 2 == 1 and (prompt, count) in at_once
        )
    assert after_skips >= len(SWITCHING), (after_skips, len(shared))
    worst = max(float(logit_gap(late[key], at_once[key])) for key in shared)
    assert worst <= DRAFT_LOGIT_TOL, worst
    spread = max(float(logit_gap(late[key], late[shared[0]])) for key in shared)
    assert spread > 100 * DRAFT_LOGIT_TOL  # the logits move from step to step: the check has teeth
