"""SGLang's own DFLASH worker in a CPU `sglang.Engine`, as `bastion bench --policies dflash` runs it.

Tiny random fp32 Qwen3 target and DFlash drafter (block 16, tests/tiny_models.py); the bench's stand-ins
(`bastion_sglang.bench.dflash_cpu`) and, under synthetic acceptance, its seam (`bench.dflash_synthetic`), each
installed through the marker `bench.dflash_engine.mark_dflash_engine` puts on the ServerArgs record. Engines:
one without speculation, DFLASH with a test-only oracle drafter (tests/dflash_test_hooks.py: long accepted
blocks), DFLASH under a synthetic profile, and BASTION's `chain` under the same profile.

- T = 0: DFLASH's tokens equal SGLang's without speculation, with blocks accepted far past one token; and
  with a DFlash2 drafter (SGLang's own DFlash2 chain: its candidate selector picks the block's path), on the
  successor pair of tests/test_dflash2_engine.py whose lattice paths the target accepts.
- Synthetic acceptance: the profile's rows sum to 1, so whether draft position d is accepted depends on the
  request's keyed uniform at that position alone (`truth_uniforms`: rank 0, the drafted token, below q[d, 0]).
  Every request's verify count equals the count replayed from the uniforms, for DFLASH and for BASTION's
  `chain`: the same seeds meet the same draws in both Engines.
- The seam keeps DFLASH's costs: every decode step of both DFLASH Engines is one drafter pass and one
  TARGET_VERIFY pass of block-size tokens per request, nothing else, and the verify passes add up to the
  requests' verify counts plus at most one step each request runs past its last under the overlap
  scheduler.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import sglang
import torch
from dflash_test_hooks import DflashOracle, ForwardLog, read_forward_log
from engine_support import PROMPTS, engine_server_args, make_model_pair
from test_dflash2_engine import make_successor_pair

from bastion_sglang import kernels
from bastion_sglang.bench.dflash_engine import mark_dflash_engine, prepare_bench_process
from bastion_sglang.registration import make_config
from bastion_sglang.step.synthetic_acceptance import truth_uniforms
from bastion_sglang.step.synthetic_profile import SyntheticAcceptanceProfile

pytestmark = pytest.mark.slow

BLOCK = 16
MAX_NEW_TOKENS = 40
GREEDY = {"temperature": 0.0, "max_new_tokens": MAX_NEW_TOKENS, "ignore_eos": True}
SEEDS = [1000 + i for i in range(len(PROMPTS))]
PROFILE = SyntheticAcceptanceProfile(
    name="test: rank 0 from 0.9 down by 0.04 a position, rank 1 the rest",
    source="tests/test_dflash_cpu_engine.py",
    published_chain_tau=4.0,
    rank_probs=tuple((0.9 - 0.04 * d, 0.1 + 0.04 * d) for d in range(BLOCK - 1)),
)
MEM = {"mem_fraction_static": 0.2}


@dataclasses.dataclass(frozen=True)
class Run:
    outputs: list[list[int]]
    verify_counts: list[int]
    forwards: list[dict[str, Any]]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return make_model_pair(tmp_path_factory.mktemp("dflash_cpu"))


def _run(server_args: Any, params: list[dict[str, Any]], log: Path | None = None) -> Run:
    engine = sglang.Engine(server_args=server_args)
    try:
        outs = engine.generate(input_ids=PROMPTS, sampling_params=params)
    finally:
        engine.shutdown()
    return Run(
        outputs=[out["output_ids"] for out in outs],
        verify_counts=[int(out["meta_info"].get("spec_verify_ct", 0)) for out in outs],
        forwards=read_forward_log(log) if log is not None else [],
    )


def _dflash_args(models: tuple[Path, Path], synthetic: Path | None, log: Path) -> Any:
    prepare_bench_process(cpu=True)
    args = engine_server_args(
        models, None, speculative_algorithm="DFLASH", speculative_draft_model_path=str(models[1]), **MEM
    )
    mark_dflash_engine(args, cpu=True, synthetic_acceptance=None if synthetic is None else str(synthetic))
    args._test_forward_log = ForwardLog(str(log))
    return args


@pytest.fixture(scope="module")
def reference(models: tuple[Path, Path]) -> Run:
    return _run(engine_server_args(models, None, **MEM), [GREEDY] * len(PROMPTS))


@pytest.fixture(scope="module")
def oracle_run(models: tuple[Path, Path], reference: Run, tmp_path_factory: pytest.TempPathFactory) -> Run:
    folder = tmp_path_factory.mktemp("dflash_oracle")
    (folder / "oracle.json").write_text(json.dumps({"prompts": PROMPTS, "outputs": reference.outputs}))
    args = _dflash_args(models, None, folder / "forwards.jsonl")
    args._test_oracle = DflashOracle(str(folder / "oracle.json"))
    return _run(args, [GREEDY] * len(PROMPTS), folder / "forwards.jsonl")


@pytest.fixture(scope="module")
def profile_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("dflash_profile") / "profile.json"
    path.write_text(PROFILE.model_dump_json())
    return path


def _seeded() -> list[dict[str, Any]]:
    return [GREEDY | {"sampling_seed": seed} for seed in SEEDS]


@pytest.fixture(scope="module")
def synthetic_run(models: tuple[Path, Path], profile_file: Path) -> Run:
    log = profile_file.parent / "forwards.jsonl"
    return _run(_dflash_args(models, profile_file, log), _seeded(), log)


@pytest.fixture(scope="module")
def chain_run(models: tuple[Path, Path], profile_file: Path) -> Run:
    config = make_config(policy="chain", startup_calibration="off", synthetic_acceptance=str(profile_file))
    return _run(engine_server_args(models, config, **MEM), _seeded())


def replayed_verify_counts() -> list[int]:
    """Per request, the decode steps a chain of BLOCK - 1 drafts takes to MAX_NEW_TOKENS when draft position d
    is accepted exactly where the request's keyed uniform falls below PROFILE's q[d, 0] (the prefill emits the
    first token; a step emits its accepted drafts and one more)."""
    q = PROFILE.probs(BLOCK - 1)
    counts = []
    for prompt, seed in zip(PROMPTS, SEEDS, strict=True):
        key = kernels.seed_keys(torch.tensor([seed], dtype=torch.int64))
        prefix, emitted, steps = len(prompt), 1, 0
        while emitted < MAX_NEW_TOKENS:
            uniforms = truth_uniforms(key, torch.tensor([prefix]), BLOCK - 1)[0]
            ranks = (uniforms[:, None] >= q.cumsum(-1)).sum(-1)
            accepted = int(torch.cumprod(ranks == 0, 0).sum())
            prefix, emitted, steps = prefix + accepted + 1, emitted + accepted + 1, steps + 1
        counts.append(steps)
    return counts


def test_dflash_on_cpu_equals_no_speculation(reference: Run, oracle_run: Run) -> None:
    assert oracle_run.outputs == reference.outputs
    tokens = sum(len(out) for out in oracle_run.outputs)
    assert sum(oracle_run.verify_counts) * 4 < tokens  # blocks accepted far past one token per verify


@pytest.fixture(scope="module")
def successor_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    pair, _ = make_successor_pair(tmp_path_factory.mktemp("dflash2_successor"))
    return pair


def test_dflash2_on_cpu_equals_no_speculation(successor_pair: tuple[Path, Path], tmp_path: Path) -> None:
    reference = _run(engine_server_args(successor_pair, None, **MEM), [GREEDY] * len(PROMPTS))
    dflash2 = _run(_dflash_args(successor_pair, None, tmp_path / "forwards.jsonl"), [GREEDY] * len(PROMPTS))
    assert dflash2.outputs == reference.outputs
    assert sum(dflash2.verify_counts) * 4 < sum(len(out) for out in dflash2.outputs)


def test_synthetic_dflash_accepts_by_the_keyed_draws(synthetic_run: Run) -> None:
    assert [len(out) for out in synthetic_run.outputs] == [MAX_NEW_TOKENS] * len(PROMPTS)
    assert synthetic_run.verify_counts == replayed_verify_counts()


def test_bastion_chain_meets_the_same_draws(chain_run: Run, synthetic_run: Run) -> None:
    assert chain_run.verify_counts == synthetic_run.verify_counts == replayed_verify_counts()


def _decode_passes(run: Run) -> list[tuple[bool, str, int]]:
    """(drafter's runner, mode, tokens per request) of every pass after the prefills."""
    return [
        (f["draft"], f["mode"], f["tokens"] // f["bs"])
        for f in run.forwards
        if f["mode"] not in ("EXTEND", "MIXED", "IDLE") and f["bs"] > 0
    ]


@pytest.mark.parametrize("name", ["oracle_run", "synthetic_run"])
def test_synthetic_seam_keeps_dflash_costs(name: str, request: pytest.FixtureRequest) -> None:
    run: Run = request.getfixturevalue(name)
    passes = _decode_passes(run)
    kinds = sorted(set(passes))
    assert kinds == [(False, "TARGET_VERIFY", BLOCK), (True, "TARGET_VERIFY", BLOCK)], kinds
    verifies = [f["bs"] for f in run.forwards if f["mode"] == "TARGET_VERIFY" and not f["draft"]]
    drafts = [f["bs"] for f in run.forwards if f["mode"] == "TARGET_VERIFY" and f["draft"]]
    assert verifies == drafts  # one drafter pass per verify pass, same batch
    # every request's counted verifies, and at most one pass more: SGLang's overlap scheduler launches a step
    # before it processes the previous one's result, so a request may run once past its last counted step
    assert sum(run.verify_counts) <= sum(verifies) <= sum(run.verify_counts) + len(PROMPTS)
