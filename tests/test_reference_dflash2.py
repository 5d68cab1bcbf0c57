"""The reference engine with DFlash2 drafters (lattice drafts): exact token equality with plain decoding in
fp32 for every policy, greedy and seeded sampling with the request parameters the engine takes, on a tiny
random DFlash2 drafter and on an oracle lattice whose paths are accepted far; the chain policy verifies
DFlash2's own greedy walk."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from calibration_profiles import COSTS, SERVING_EMA_ALPHA, SERVING_FIT
from tiny_dflash2 import make_tiny_dflash2_drafter
from tiny_models import EOS_ID, make_tiny_target, make_tokenizer
from transformers import AutoModelForCausalLM, PreTrainedModel

from bastion_sglang.controller.acceptance import AcceptanceCalibration
from bastion_sglang.controller.latency import LatencyModel
from bastion_sglang.controller.lattice_acceptance import LatticeRecord
from bastion_sglang.controller.lattice_tree import build_lattice_tree, lattice_chain, weight_by_candidate_mass
from bastion_sglang.controller.roofline import HardwareSpec
from bastion_sglang.kernels.types import DraftLattice, DraftTopK
from bastion_sglang.reference import DraftInput, ReferenceEngine
from bastion_sglang.reference.lattice_proposer import DFlash2Proposer

CPU = torch.device("cpu")
HARDWARE = HardwareSpec(name="test-cpu", peak_flops=1e11, bandwidth=2e10)
BUCKETS = (2, 4, 8, 16, 32, 64)
POLICIES = ("ar", "chain", "fixed:1", "fixed:8", "fixed:40", "adaptive", "bucketed")
PROMPTS = ("Hello", "The quick brown fox", "def f(x):", "1 + 1 =", "<|bos|>user: hi", "zzz")
NEW_TOKENS = 24
DRAFTER_NEW_TOKENS = 12  # the random drafter is rarely accepted: about one step per token
INIT = 0.4  # weight init std of the tiny target: peaky logits, no near-ties in greedy decoding
SAMPLING = dict(temperature=0.8, top_p=0.95, top_k=40, min_p=0.02, seed=11)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@dataclass(frozen=True)
class Target:
    model: PreTrainedModel
    drafter_path: Path
    prompts: tuple[tuple[int, ...], ...]
    references: tuple[tuple[int, ...], ...]  # greedy continuation of each prompt (NEW_TOKENS tokens)

    def sequences(self) -> tuple[tuple[int, ...], ...]:
        return tuple(p + r for p, r in zip(self.prompts, self.references, strict=True))


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Target:
    folder = tmp_path_factory.mktemp("dflash2")
    path = make_tiny_target(folder / "target", initializer_range=INIT)
    drafter = make_tiny_dflash2_drafter(
        folder / "drafter", path, rank=8, top_k=4, output_multiplier=0.5, final_logit_softcapping=3.0
    )
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tokenizer = make_tokenizer()
    prompts = tuple(tuple(tokenizer(text)["input_ids"]) for text in PROMPTS)
    references = tuple(
        tuple(
            model.generate(
                torch.tensor([p]),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                eos_token_id=EOS_ID,
                pad_token_id=EOS_ID,
            )[0, len(p) :].tolist()
        )
        for p in prompts
    )
    return Target(model, drafter, prompts, references)


@dataclass(frozen=True)
class OracleLattice:
    """A test-only lattice source that knows the target's continuation: slot e's K candidates hold the true
    token at a position that moves with e; a row puts 0.9 on the true token after the true predecessor and
    0.9 on a wrong one after any other, so the lattice's greedy walk is the continuation and a node off it
    leads on to nodes off it."""

    references: tuple[tuple[int, ...], ...]
    vocab_size: int
    depth: int = 15
    width: int = 4

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return ()

    def start(self, capacity: int) -> None:
        """Stateless: nothing to reset."""

    def propose(self, draft_input: DraftInput, k: int) -> DraftLattice:
        committed = tuple(draft_input.committed.tolist())
        truth = next(
            (ref[len(committed) :] for ref in self.references if ref[: len(committed)] == committed), ()
        )
        generator = torch.Generator().manual_seed(len(committed))
        ids = torch.empty((self.depth, self.width), dtype=torch.int64)
        true_at = [(e * 3 + len(committed)) % self.width for e in range(self.depth)]
        for e in range(self.depth):
            ranked = torch.randperm(self.vocab_size, generator=generator)
            if e < len(truth):
                ranked = ranked[ranked != truth[e]]
                ranked = torch.cat([ranked[: true_at[e]], torch.tensor([truth[e]]), ranked[true_at[e] :]])
            ids[e] = ranked[: self.width]
        rows = torch.full((self.depth, self.width, self.width), 0.1 / (self.width - 1))
        for e in range(self.depth):
            for p in range(self.width):
                on_path = e == 0 or p == true_at[e - 1]
                rows[e, p, true_at[e] if on_path else (true_at[e] + 1) % self.width] = 0.9
        unary = torch.full((self.depth, self.width), 1.0 / self.width).log()
        return DraftLattice(DraftTopK(unary[None], ids[None]), rows.log()[None])


def engine_for(target: Target, drafter: object, **options: object) -> ReferenceEngine:
    return ReferenceEngine(
        target.model,
        drafter,  # type: ignore[arg-type]
        device=CPU,
        dtype=torch.float32,
        hardware=HARDWARE,
        width_buckets=BUCKETS,
        max_nodes=63,
        **options,
    )


def oracle_engine_for(target: Target, oracle: OracleLattice) -> ReferenceEngine:
    """An engine that plans on a serving engine's latency and step costs, not on this machine's timings
    (which a loaded machine distorts enough to decline an oracle's trees)."""
    roofline = engine_for(target, oracle).latency.roofline
    latency = LatencyModel(roofline, SERVING_FIT, ema_alpha=SERVING_EMA_ALPHA, width_buckets=BUCKETS)
    return ReferenceEngine(
        target.model,
        oracle,  # type: ignore[arg-type]
        device=CPU,
        dtype=torch.float32,
        latency=latency,
        step_costs=COSTS,
        max_nodes=63,
    )


@pytest.mark.parametrize("policy", POLICIES)
def test_greedy_equals_generate_with_the_dflash2_drafter(target: Target, policy: str) -> None:
    engine = engine_for(target, target.drafter_path)
    assert isinstance(engine.proposer, DFlash2Proposer)
    for prompt, reference in zip(target.prompts, target.references, strict=True):
        result = engine.generate(list(prompt), DRAFTER_NEW_TOKENS, policy=policy)
        assert tuple(result.tokens) == reference[:DRAFTER_NEW_TOKENS], (policy, prompt)
        drafted = [step for step in result.steps if step.lattice is not None]
        assert all(step.draft is None for step in result.steps)
        if policy == "ar":
            assert not drafted
        elif policy in ("chain", "fixed:1", "fixed:8", "fixed:40"):
            assert len(drafted) == len(result.steps)
            nodes = {"chain": 15, "fixed:1": 1, "fixed:8": 8, "fixed:40": 40}[policy]
            assert all(step.nodes == nodes for step in drafted)


@pytest.mark.parametrize("policy", ["ar", "chain", "fixed:8", "adaptive"])
def test_seeded_sampling_equals_plain_decoding(target: Target, policy: str) -> None:
    engine = engine_for(target, target.drafter_path)
    prompts = target.prompts[:3]
    plain = [tuple(engine.generate(list(p), NEW_TOKENS, policy="ar", **SAMPLING).tokens) for p in prompts]
    assert plain != [r[:NEW_TOKENS] for r in target.references[:3]]
    again = [tuple(engine.generate(list(p), NEW_TOKENS, policy=policy, **SAMPLING).tokens) for p in prompts]
    assert again == plain


@pytest.mark.parametrize("policy", ["chain", "fixed:8", "fixed:40", "adaptive", "bucketed"])
def test_long_accepted_lattice_paths_stay_exact(target: Target, policy: str) -> None:
    engine = oracle_engine_for(target, OracleLattice(target.sequences(), target.model.config.vocab_size))
    taus = []
    for prompt, reference in zip(target.prompts, target.references, strict=True):
        result = engine.generate(list(prompt), NEW_TOKENS, policy=policy)
        assert tuple(result.tokens) == reference, (policy, prompt)
        taus.append(result.mean_accept_length)
    assert sum(taus) / len(taus) > 4.0, (policy, taus)


def test_sampled_oracle_lattice_paths_stay_exact(target: Target) -> None:
    engine = engine_for(target, target.drafter_path)
    prompts = target.prompts[:3]
    plain = [tuple(engine.generate(list(p), NEW_TOKENS, policy="ar", **SAMPLING).tokens) for p in prompts]
    sequences = tuple(p + t for p, t in zip(prompts, plain, strict=True))
    oracle = oracle_engine_for(target, OracleLattice(sequences, target.model.config.vocab_size))
    results = [oracle.generate(list(p), NEW_TOKENS, policy="fixed:8", **SAMPLING) for p in prompts]
    assert [tuple(r.tokens) for r in results] == plain
    assert sum(r.mean_accept_length for r in results) / len(results) > 4.0


def test_chain_verifies_dflash2s_greedy_walk(target: Target) -> None:
    """Each chain step's verified path is `lattice_chain` of the step's lattice: the accepted tokens are
    its first ones."""
    oracle = OracleLattice(target.sequences(), target.model.config.vocab_size)
    engine = engine_for(target, oracle)
    prompt = target.prompts[1]
    result = engine.generate(list(prompt), NEW_TOKENS, policy="chain")
    emitted = 1  # the first token comes from the prefill
    for step in result.steps:
        assert step.lattice is not None and step.nodes == 15
        walk = lattice_chain(step.lattice.transitions[0], step.lattice.unary.token_ids[0]).tokens.tolist()
        assert list(result.tokens[emitted : emitted + step.accepted]) == walk[: step.accepted]
        emitted += step.emitted


def test_a_calibrated_dflash2_engine_plans_calibrated_trees_and_stays_exact(target: Target) -> None:
    """With an acceptance calibration a DFlash2 engine builds its trees on the calibrated transitions (deeper
    nodes discounted here, so the first step's 8-node tree and its Â differ from the raw engine's on the
    same lattice) and its greedy output is still plain greedy decoding's."""
    calibration = AcceptanceCalibration(slopes=[1.0, 3.0], offsets=[0.0, -2.0], events=[10, 10])
    raw = engine_for(target, target.drafter_path)
    calibrated = engine_for(target, target.drafter_path, acceptance=calibration)
    assert calibrated.acceptance is calibration
    prompt, reference = target.prompts[1], target.references[1]
    plain = raw.generate(list(prompt), DRAFTER_NEW_TOKENS, policy="fixed:8")
    result = calibrated.generate(list(prompt), DRAFTER_NEW_TOKENS, policy="fixed:8")
    assert tuple(result.tokens) == reference[:DRAFTER_NEW_TOKENS]
    first, first_raw = result.steps[0], plain.steps[0]
    assert first.lattice is not None and first_raw.lattice is not None
    assert torch.equal(first.lattice.transitions, first_raw.lattice.transitions)  # the same drafter pass
    transitions, ids = first.lattice.transitions[0], first.lattice.unary.token_ids[0]
    tree = LatticeRecord(transitions, ids, ()).tree(calibration, 8)
    # without a calibration the engine plans on the transitions weighted by in-candidate mass, ties by raw
    weighted = weight_by_candidate_mass(transitions, first.lattice.unary.logprobs[0])
    raw_tree = build_lattice_tree(weighted, ids, 8, ties=transitions)
    assert not torch.equal(tree.depths, raw_tree.depths)
    assert first.expected_accept == pytest.approx(1.0 + torch.exp(tree.log_scores).sum().item(), rel=1e-5)
    assert first_raw.expected_accept == pytest.approx(
        1.0 + torch.exp(raw_tree.log_scores).sum().item(), rel=1e-5
    )
