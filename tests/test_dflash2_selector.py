"""The reference DFlash2 selector against SGLang 0.5.23's own code on CPU, with random weights: the unary
transform, `_score_edges`, `CandidateSelector.build_lattice`, and a checkpoint saved here loaded by SGLang's
`DFlash2DraftModel` whose lattice (`_selector_lattice`: candidates from the target head, transform, scores)
equals the reference proposer's."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import sglang.srt.models.dflash as sglang_dflash
import sglang.srt.speculative.dflash_worker_v2 as sglang_worker
import torch
from safetensors.torch import load_file
from tiny_dflash2 import make_tiny_dflash2_drafter
from tiny_models import make_tiny_target
from transformers import AutoModelForCausalLM

from bastion_sglang.controller.lattice_tree import lattice_chain, selector_logprobs
from bastion_sglang.integration.drafter_config import SelectorConfig
from bastion_sglang.reference import DFlashDrafter, DFlashProposer
from bastion_sglang.reference.lattice_proposer import DFlash2Proposer
from bastion_sglang.reference.selector import (
    CandidateSelector,
    candidate_topk,
    score_edges,
    transform_unary_logits,
)
from bastion_sglang.step.draft_protocols import DraftInput

pytestmark = pytest.mark.usefixtures("one_torch_thread")
SINGLE_RANK = dict(tp_size=1, tp_rank=0, attn_tp_size=1, attn_tp_rank=0, pp_size=1, pp_rank=0)
"""SGLang's parallel layers read these; one process is one rank."""


@pytest.fixture
def eager_score_edges(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """SGLang's `_score_edges` without its torch.compile wrapper (the same function, run eagerly)."""
    monkeypatch.setattr(sglang_dflash, "_score_edges", sglang_dflash._score_edges._torchdynamo_orig_callable)
    yield


@pytest.mark.parametrize(
    ("multiplier", "softcap"), [(1.0, None), (0.19611613513818404, None), (1.0, 20.0), (2.5, 30.0)]
)
def test_unary_transform_is_sglangs(multiplier: float, softcap: float | None) -> None:
    logits = torch.randn(5, 7, generator=torch.Generator().manual_seed(0)) * 40
    selector = SelectorConfig(rank=4, top_k=7, output_multiplier=multiplier, final_logit_softcapping=softcap)
    model = SimpleNamespace(draft_config=selector_config_of(selector))
    for raw in (logits, logits.bfloat16()):
        expected = sglang_dflash.DFlash2DraftModel._transform_unary_logits(model, raw.clone())
        assert torch.equal(transform_unary_logits(raw, selector), expected)


def selector_config_of(selector: SelectorConfig) -> SimpleNamespace:
    """The fields SGLang's DFlashDraftConfig holds for the transform."""
    return SimpleNamespace(
        output_multiplier=selector.output_multiplier, final_logit_softcapping=selector.final_logit_softcapping
    )


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_score_edges_is_sglangs(seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    batch, slots, k, rank, vocab = 3, 6, 5, 4, 50
    arguments = dict(
        predecessor_table=torch.randn(vocab, rank, generator=generator),
        successor_table=torch.randn(vocab, rank, generator=generator),
        candidate_ids=torch.randint(0, vocab, (batch, slots, k), generator=generator),
        unary_logits=torch.randn(batch, slots, k, generator=generator),
        hidden=torch.randn(batch, slots, rank, generator=generator),
        anchor_token_ids=torch.randint(0, vocab, (batch,), generator=generator),
        top_k=k,
    )
    scores = score_edges(**arguments)
    assert torch.equal(scores, sglang_dflash._score_edges._torchdynamo_orig_callable(**arguments))
    assert scores.shape == (batch, slots, k, k)
    assert torch.equal(scores[:, 0, 0], scores[:, 0, k - 1])  # slot 0: one row, the anchor's


@pytest.mark.usefixtures("eager_score_edges")
def test_candidate_selector_has_sglangs_parameters_and_lattice() -> None:
    generator = torch.Generator().manual_seed(3)
    mine = CandidateSelector(hidden_size=16, vocab_size=40, rank=6, top_k=4)
    mine.reset_for_training(generator)
    with torch.no_grad():
        mine.successor_codebook.normal_(generator=generator)
    theirs = sglang_dflash.CandidateSelector(hidden_size=16, vocab_size=40, state_rank=6, top_k=4)
    assert {n: p.shape for n, p in mine.named_parameters()} == {
        n: p.shape for n, p in theirs.named_parameters()
    }
    theirs.load_state_dict(mine.state_dict())
    inputs = dict(
        candidate_ids=torch.randint(0, 40, (2, 5, 4), generator=generator),
        unary_logits=torch.randn(2, 5, 4, generator=generator),
        hidden_states=torch.randn(2, 5, 16, generator=generator),
        anchor_token_ids=torch.randint(0, 40, (2,), generator=generator),
    )
    with torch.no_grad():
        assert torch.equal(mine.build_lattice(**inputs), theirs.build_lattice(**inputs))


def test_a_fresh_training_selector_scores_the_unary_logits() -> None:
    selector = CandidateSelector(hidden_size=8, vocab_size=20, rank=3, top_k=4)
    selector.reset_for_training(torch.Generator().manual_seed(0))
    unary = torch.randn(1, 3, 4)
    scores = selector.build_lattice(
        candidate_ids=torch.randint(0, 20, (1, 3, 4)),
        unary_logits=unary,
        hidden_states=torch.randn(1, 3, 8),
        anchor_token_ids=torch.tensor([5]),
    )
    assert torch.equal(scores, unary[:, :, None].expand(-1, -1, 4, -1))
    assert selector.predecessor_codebook.abs().sum() > 0 and selector.hidden_projection.weight.abs().sum() > 0


def test_candidates_are_the_heads_top_k() -> None:
    generator = torch.Generator().manual_seed(4)
    hidden, weight = torch.randn(3, 8, generator=generator), torch.randn(30, 8, generator=generator)
    candidates = candidate_topk(hidden, weight, 5)
    assert torch.equal(candidates.logits, hidden @ weight.T)
    assert torch.equal(candidates.ids, torch.topk(hidden @ weight.T, 5).indices)
    assert torch.equal(candidates.raw, torch.topk(hidden @ weight.T, 5).values)
    with pytest.raises(ValueError, match="hidden must be"):
        candidate_topk(hidden, weight[:, :4], 5)


@pytest.mark.usefixtures("eager_score_edges")
@pytest.mark.parametrize(("multiplier", "softcap"), [(1.0, None), (0.5, 3.0)])
def test_sglangs_dflash2_model_loads_a_reference_checkpoint_and_builds_its_lattice(
    tmp_path: Path, multiplier: float, softcap: float | None
) -> None:
    from sglang.srt.runtime_context import get_parallel
    from sglang.srt.utils.hf_transformers_utils import get_config

    target_path = make_tiny_target(tmp_path / "target")
    source = make_tiny_dflash2_drafter(
        tmp_path / "source", target_path, output_multiplier=multiplier, final_logit_softcapping=softcap
    )
    saved = DFlashDrafter.from_pretrained(source).save_pretrained(tmp_path / "saved")
    weights = load_file(str(saved / "model.safetensors"))
    with get_parallel().override(**SINGLE_RANK):
        model = sglang_dflash.DFlash2DraftModel(get_config(str(saved), trust_remote_code=False))
        model.load_weights(weights.items())
        params = dict(model.named_parameters())
        for name in (
            "candidate_selector.predecessor_codebook",
            "candidate_selector.successor_codebook",
            "candidate_selector.hidden_projection.weight",
            "fc.weight",
            "hidden_norm.weight",
            "norm.weight",
            "layers.1.mlp.down_proj.weight",
        ):
            assert torch.equal(params[name], weights[name]), name

        target = AutoModelForCausalLM.from_pretrained(target_path).eval()
        head = target.get_output_embeddings()
        model.lm_head = SimpleNamespace(weight=head.weight.detach(), org_vocab_size=head.weight.shape[0])
        drafter = DFlashDrafter.from_pretrained(saved)
        embed = target.get_input_embeddings()
        proposer = DFlash2Proposer(drafter, embed, head)
        proposer.start(32)
        features = torch.randn(6, drafter.fc.in_features, generator=torch.Generator().manual_seed(5))
        committed = torch.tensor([1, 2, 3, 4, 5, 6, 7])
        cache = drafter.new_cache(32)
        with torch.no_grad():
            lattice = proposer.propose(DraftInput(committed, features), 4)
            drafter.append_context(cache, features)
            block = torch.tensor([7] + [drafter.config.mask_token_id] * 15)
            hidden = drafter(embed(block), cache)[1:]  # [D, h]: the states the proposer read
            ids, scores = sglang_worker._selector_lattice(model, hidden[None], committed[-1:])
    assert torch.equal(lattice.unary.token_ids, ids)
    assert torch.equal(lattice.transitions, selector_logprobs(scores, 1.0))
    transitions = lattice.transitions[0]
    assert not torch.equal(transitions[1, 0], transitions[1, 1])  # rows differ by predecessor
    walk = sglang_greedy_path(model, ids, scores)
    assert lattice_chain(transitions, ids[0]).tokens.tolist() == walk


def sglang_greedy_path(model: object, ids: torch.Tensor, scores: torch.Tensor) -> list[int]:
    """SGLang's greedy walk over its own lattice (`CandidateSelector.sample_path`, CPU path)."""
    tokens, _ = model.candidate_selector.sample_path(
        candidate_ids=ids,
        scores=scores,
        uniforms=torch.zeros(1, ids.shape[1]),
        temperatures=torch.ones(1),
        greedy_mask=torch.ones(1, dtype=torch.bool),
    )
    return tokens[0].tolist()


def test_dflash_and_dflash2_proposers_refuse_each_others_drafters(tmp_path: Path) -> None:
    target_path = make_tiny_target(tmp_path / "target")
    target = AutoModelForCausalLM.from_pretrained(target_path)
    parts = (target.get_input_embeddings(), target.get_output_embeddings())
    dflash2 = DFlashDrafter.from_pretrained(make_tiny_dflash2_drafter(tmp_path / "d2", target_path))
    with pytest.raises(ValueError, match="has a DFlash2 candidate selector"):
        DFlashProposer(dflash2, *parts)
    from tiny_models import make_tiny_drafter

    dflash = DFlashDrafter.from_pretrained(make_tiny_drafter(tmp_path / "d", target_path))
    with pytest.raises(ValueError, match="this one is plain DFlash"):
        DFlash2Proposer(dflash, *parts)
