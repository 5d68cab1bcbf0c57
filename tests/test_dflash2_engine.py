"""DFlash2 drafters in BASTION's SGLang worker: a real `sglang.Engine` on CPU (fp32, torch_native) drafting
SGLang's candidate lattice (`drafter_forward.DrafterForward`, planned by `lattice_plan.plan_draft`).

Two pairs, each served by one BASTION Engine per policy (fixed:16 and chain, which verify a tree or DFlash2's
own greedy walk every step; module-scoped, since Engines are slow to start on two cores):
- the tiny random pair (`engine_support.make_model_pair`'s target) with a random DFlash2 drafter
  (tests/tiny_dflash2.py, output multiplier 0.5 and softcap 3.0, so SGLang's unary transform matters): one
  mixed batch of greedy requests, greedy requests with a frequency, presence or repetition penalty, a regex
  request and seeded sampled requests (one with a repetition penalty). Every greedy request equals SGLang
  without speculation (overlap off: SGLang's overlap scheduler applies penalties a step late). Seeded
  requests cannot equal SGLang's own sampler (BASTION's walk draws each position's uniform from the seed and
  the position), so they equal each other across the two policies, whose trees differ; after the batch,
  one prompt under four seeds gives four outputs (engine_support's seed probe).
- the successor pair (drafter blocks of 8 tokens; the random pair's are 16): a target whose next token is a
  fixed permutation σ of the current one (its layers add nothing to the residual stream; its LM head row
  σ(t) is a multiple of the final-norm state of t), and a DFlash2 drafter whose backbone knows nothing
  (every slot's state is the MASK token's, so its candidates are the whole vocabulary in one fixed order
  with softcapped, flat unary logits) while its selector knows σ (the transition score from candidate p to
  candidate c is ALPHA when c = σ(p), and slot 0 reads the root). Only a lattice anchored at the root whose
  transitions read the predecessor is accepted far, so the mean accepted length (completion tokens per
  verify pass) of greedy requests catches a broken lattice; greedy outputs must be σ's orbit of the last
  prompt token (the target's own argmax), and seeded outputs equal across policies.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import sglang
import torch
from engine_support import (
    PROMPTS,
    assert_seeds_sample,
    engine_server_args,
    first_difference,
    make_model_pair,
    seed_probe,
)
from safetensors.torch import load_file, save_file
from tiny_dflash2 import make_tiny_dflash2_drafter
from tiny_models import MASK_ID

from bastion_sglang.registration import make_config

pytestmark = pytest.mark.slow

MAX_NEW_TOKENS = 32
VOCAB = 260
GREEDY = {"temperature": 0.0, "max_new_tokens": MAX_NEW_TOKENS, "ignore_eos": True}
SEEDED = {"temperature": 0.8, "top_p": 0.9, "top_k": 50, "max_new_tokens": MAX_NEW_TOKENS, "ignore_eos": True}
REGEX = r"(yes|no) [a-z]{3,12}\.( [a-z]{1,8}){2,4}"
MIXED: list[tuple[list[int], dict[str, Any]]] = [
    (PROMPTS[0], GREEDY),
    (PROMPTS[7], GREEDY),
    (PROMPTS[1], dict(GREEDY, frequency_penalty=0.6)),
    (PROMPTS[3], dict(GREEDY, presence_penalty=0.8)),
    (PROMPTS[5], dict(GREEDY, repetition_penalty=1.3)),
    (PROMPTS[2], dict(GREEDY, ignore_eos=False, regex=REGEX)),
    (PROMPTS[4], dict(SEEDED, sampling_seed=7)),
    (PROMPTS[6], dict(SEEDED, sampling_seed=11, repetition_penalty=1.2)),
]
"""The random pair's batch: (prompt ids, sampling params); the last two are seeded."""
SUCCESSOR_GREEDY = PROMPTS[:4]
SUCCESSOR_SEEDED = [(PROMPTS[4], dict(SEEDED, sampling_seed=3)), (PROMPTS[5], dict(SEEDED, sampling_seed=5))]
POLICIES = ("fixed:16", "chain")
BETA = 0.15  # the successor target's head scale: σ(t)'s logit 64·BETA, the others about N(0, (8·BETA)²)
ALPHA = 16.0  # the successor drafter's transition score to σ(p), against unary logits within (-2, 2)
SUCCESSOR_BLOCK = 8
"""The successor drafter's block size (the random one's is 16): DFlash2 blocks of 8 and 16 both served."""
MIN_SUCCESSOR_ACCEPT = 4.0  # greedy tokens per verify pass; a broken anchor or transition gives about 1


@dataclasses.dataclass(frozen=True)
class Run:
    """What one Engine returned: output ids per request, greedy completion tokens and verify passes, and the
    seed probe's outputs (engine_support.seed_probe; None: not sent)."""

    outputs: list[list[int]]
    completion_tokens: int
    verify_calls: int
    probe: list[list[int]] | None = None


def _generate(server_args: Any, requests: list[tuple[list[int], dict[str, Any]]], probe: bool = False) -> Run:
    """One Engine, one batch of `requests` (then the seed probe if `probe`); counts over the greedy
    (temperature 0) requests."""
    engine = sglang.Engine(server_args=server_args)
    try:
        outs = engine.generate(
            input_ids=[ids for ids, _ in requests], sampling_params=[p for _, p in requests]
        )
        probed = seed_probe(engine) if probe else None
    finally:
        engine.shutdown()
    greedy = [out for out, (_, params) in zip(outs, requests, strict=True) if params["temperature"] == 0.0]
    return Run(
        outputs=[out["output_ids"] for out in outs],
        completion_tokens=sum(int(out["meta_info"]["completion_tokens"]) for out in greedy),
        verify_calls=sum(int(out["meta_info"].get("spec_verify_ct") or 0) for out in greedy),
        probe=probed,
    )


def _bastion_args(models: tuple[Path, Path], policy: str) -> Any:
    return engine_server_args(models, make_config(max_budget=16, policy=policy, topk=4))


def _read_layer_ids(drafter: Path) -> None:
    """Read target layers 0 and 2 (the tiny target's default spread reads layer 1 twice, which SGLang
    captures once)."""
    config = json.loads((drafter / "config.json").read_text())
    config["dflash_config"]["target_layer_ids"] = [0, 2]
    (drafter / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def _edit_weights(folder: Path, name: str, edit: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Replace tensors of the safetensors file `name` in `folder`; returns the file's tensors as they were."""
    weights = load_file(str(folder / name))
    save_file({k: v.contiguous() for k, v in (weights | edit).items()}, str(folder / name))
    return weights


def _rms_normed(x: torch.Tensor) -> torch.Tensor:
    """RMSNorm with unit weight over the last dim (eps 1e-6, the tiny models')."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def _silent_layers(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Zero every attention output and MLP down projection: each layer adds nothing to the residual stream."""
    return {
        k: torch.zeros_like(v)
        for k, v in weights.items()
        if k.endswith(("o_proj.weight", "down_proj.weight"))
    }


def make_successor_pair(root: Path) -> tuple[tuple[Path, Path], torch.Tensor]:
    """((target, drafter) folders, σ [V] int64) of the successor pair (module docstring)."""
    target, _ = make_model_pair(root)
    sigma = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(5))
    weights = load_file(str(target / "model.safetensors"))
    embed = weights["model.embed_tokens.weight"]
    head = torch.empty_like(weights["lm_head.weight"])
    head[sigma] = BETA * _rms_normed(embed)  # row σ(t) scores the final-norm state of t
    _edit_weights(target, "model.safetensors", _silent_layers(weights) | {"lm_head.weight": head})
    drafter = make_tiny_dflash2_drafter(
        root / "successor_drafter",
        target,
        rank=VOCAB,
        top_k=VOCAB,
        final_logit_softcapping=2.0,
        block_size=SUCCESSOR_BLOCK,
    )
    _read_layer_ids(drafter)
    draft_weights = load_file(str(drafter / "model.safetensors"))
    state = _rms_normed(embed[MASK_ID])  # every slot's final state: the MASK embedding, normed
    _edit_weights(
        drafter,
        "model.safetensors",
        _silent_layers(draft_weights)
        | {
            "norm.weight": torch.ones_like(draft_weights["norm.weight"]),
            # P h = 1 in every component, so score[p, c] = unary[c] + <A[p], B[c]>
            "candidate_selector.hidden_projection.weight": (state / state.dot(state)).expand(VOCAB, -1),
            "candidate_selector.predecessor_codebook": ALPHA * torch.eye(VOCAB)[sigma],
            "candidate_selector.successor_codebook": torch.eye(VOCAB),
        },
    )
    return (target, drafter), sigma


def _orbit(sigma: torch.Tensor, start: int, length: int) -> list[int]:
    """σ(start), σ²(start), ...: `length` tokens."""
    out, token = [], start
    for _ in range(length):
        token = int(sigma[token])
        out.append(token)
    return out


@pytest.fixture(scope="module")
def random_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("dflash2_random")
    target, _ = make_model_pair(root)
    drafter = make_tiny_dflash2_drafter(
        root / "dflash2", target, output_multiplier=0.5, final_logit_softcapping=3.0
    )
    _read_layer_ids(drafter)
    return target, drafter


@pytest.fixture(scope="module")
def random_reference(random_pair: tuple[Path, Path]) -> Run:
    """SGLang without speculation or overlap scheduling, on the mixed batch."""
    return _generate(engine_server_args(random_pair, None, disable_overlap_schedule=True), MIXED)


@pytest.fixture(scope="module")
def random_runs(random_pair: tuple[Path, Path]) -> dict[str, Run]:
    return {policy: _generate(_bastion_args(random_pair, policy), MIXED, probe=True) for policy in POLICIES}


@pytest.fixture(scope="module")
def successor(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.Tensor, dict[str, Run]]:
    """σ and, per policy, the successor pair's run of its greedy prompts then its seeded ones."""
    models, sigma = make_successor_pair(tmp_path_factory.mktemp("dflash2_successor"))
    requests = [(ids, GREEDY) for ids in SUCCESSOR_GREEDY] + SUCCESSOR_SEEDED
    return sigma, {policy: _generate(_bastion_args(models, policy), requests) for policy in POLICIES}


@pytest.mark.parametrize("policy", POLICIES)
def test_mixed_batch_equals_no_speculation(
    random_runs: dict[str, Run], random_reference: Run, policy: str
) -> None:
    run = random_runs[policy]
    for i, ((_, params), got, want) in enumerate(
        zip(MIXED, run.outputs, random_reference.outputs, strict=True)
    ):
        if params["temperature"] == 0.0:
            assert got == want, f"{policy}: request {i} diverges at token {first_difference(got, want)}"


def test_seeded_requests_equal_across_policies(random_runs: dict[str, Run]) -> None:
    runs = [random_runs[policy].outputs for policy in POLICIES]
    for i, (_, params) in enumerate(MIXED):
        if params["temperature"] > 0.0:
            assert len(runs[0][i]) == MAX_NEW_TOKENS
            assert all(run[i] == runs[0][i] for run in runs), f"seeded request {i} differs between policies"


@pytest.mark.parametrize("policy", POLICIES)
def test_sampling_samples(random_runs: dict[str, Run], policy: str) -> None:
    """One prompt under several seeds gives as many outputs (engine_support.assert_seeds_sample)."""
    probe = random_runs[policy].probe
    assert probe is not None
    assert_seeds_sample(probe)


@pytest.mark.parametrize("policy", POLICIES)
def test_speculative_steps_ran(random_runs: dict[str, Run], policy: str) -> None:
    run = random_runs[policy]
    greedy = sum(params["temperature"] == 0.0 for _, params in MIXED)
    # every decode step commits at least one token; each request's first token comes from its prefill (the
    # floor a broken lattice or accept walk would miss is the successor pair's, MIN_SUCCESSOR_ACCEPT)
    assert 0 < run.verify_calls <= run.completion_tokens - greedy, policy


@pytest.mark.parametrize("policy", POLICIES)
def test_successor_lattice_paths_are_accepted_far(
    successor: tuple[torch.Tensor, dict[str, Run]], policy: str
) -> None:
    sigma, runs = successor
    run = runs[policy]
    for i, ids in enumerate(SUCCESSOR_GREEDY):
        assert run.outputs[i] == _orbit(sigma, ids[-1], MAX_NEW_TOKENS), f"{policy}: greedy request {i}"
    mean_accept = run.completion_tokens / run.verify_calls
    assert mean_accept >= MIN_SUCCESSOR_ACCEPT, f"{policy}: {mean_accept:.2f} tokens per verify pass"


def test_successor_seeded_requests_equal_across_policies(
    successor: tuple[torch.Tensor, dict[str, Run]],
) -> None:
    _, runs = successor
    seeded = [runs[policy].outputs[len(SUCCESSOR_GREEDY) :] for policy in POLICIES]
    assert all(len(ids) == MAX_NEW_TOKENS for ids in seeded[0])
    assert all(other == seeded[0] for other in seeded[1:])
