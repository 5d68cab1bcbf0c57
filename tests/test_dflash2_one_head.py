"""The DFlash2 draft stage applies the target's LM head once (`DrafterForward._lattice`): SGLang's lattice on
the head logits it computed (`sglang_adapter.lattice_of_head_logits`) equals SGLang's `_selector_lattice`,
which applies the head itself, bit for bit, and the draft's unary log-probs are those of a second head pass.
SGLang's `DFlash2DraftModel` is built on CPU from a tiny random checkpoint, as in `test_dflash2_selector`."""

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

from bastion_sglang.controller.lattice_tree import selector_logprobs
from bastion_sglang.integration import sglang_adapter as sgl
from bastion_sglang.reference import DFlashDrafter
from bastion_sglang.step.drafter_forward import DrafterForward
from bastion_sglang.step.rank_sync import DraftHead
from bastion_sglang.step.step_anatomy import OUTSIDE, StepAnatomy, StepCounts

pytestmark = pytest.mark.usefixtures("one_torch_thread")
SINGLE_RANK = dict(tp_size=1, tp_rank=0, attn_tp_size=1, attn_tp_rank=0, pp_size=1, pp_rank=0)


@pytest.fixture
def eager_score_edges(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """SGLang's `_score_edges` without its torch.compile wrapper (the same function, run eagerly), in a
    process that is one rank (SGLang's parallel layers and `candidate_topk` read it)."""
    from sglang.srt.runtime_context import get_parallel

    monkeypatch.setattr(sglang_dflash, "_score_edges", sglang_dflash._score_edges._torchdynamo_orig_callable)
    with get_parallel().override(**SINGLE_RANK):
        yield


def sglang_dflash2(
    tmp_path: Path, multiplier: float, softcap: float | None, tied: bool
) -> tuple[object, DraftHead]:
    """SGLang's DFlash2 drafter over a tiny random checkpoint, its `lm_head` the target's (as
    `attach_selector_head` points it), and the draft head over the same weight. tied: rows 3 and 5 of the
    head equal rows 0 and 1, so candidates tie exactly."""
    from sglang.srt.utils.hf_transformers_utils import get_config

    target_path = make_tiny_target(tmp_path / "target")
    source = make_tiny_dflash2_drafter(
        tmp_path / "source", target_path, output_multiplier=multiplier, final_logit_softcapping=softcap
    )
    saved = DFlashDrafter.from_pretrained(source).save_pretrained(tmp_path / "saved")
    model = sglang_dflash.DFlash2DraftModel(get_config(str(saved), trust_remote_code=False))
    model.load_weights(load_file(str(saved / "model.safetensors")).items())
    weight = AutoModelForCausalLM.from_pretrained(target_path).get_output_embeddings().weight.detach().clone()
    if tied:
        weight[3], weight[5] = weight[0], weight[1]
    model.lm_head = SimpleNamespace(weight=weight, org_vocab_size=weight.shape[0])
    return model, DraftHead(weight, int(weight.shape[0]), None)


def drafter_forward(model: object, head: DraftHead) -> DrafterForward:
    """The draft stage's lattice path alone: `DrafterForward` over a stand-in worker holding `model`."""
    forward = DrafterForward.__new__(DrafterForward)
    forward._worker = SimpleNamespace(draft_model=model)
    forward._draft_head = head
    return forward


def states(batch: int, slots: int, width: int, seed: int) -> torch.Tensor:
    """[B, D, H] drafter states as the worker slices them: positions 1..D of [B, D + 1, H] (not contiguous
    for B > 1)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(batch, slots + 1, width, generator=generator)[:, 1:]


@pytest.mark.usefixtures("eager_score_edges")
@pytest.mark.parametrize(("multiplier", "softcap", "tied"), [(1.0, None, False), (0.5, 3.0, True)])
def test_the_lattice_of_one_head_pass_is_sglangs(
    tmp_path: Path, multiplier: float, softcap: float | None, tied: bool
) -> None:
    model, head = sglang_dflash2(tmp_path, multiplier, softcap, tied)
    forward = drafter_forward(model, head)
    for batch in (1, 3):
        hidden = states(batch, 15, head.weight.shape[1], seed=batch)
        if tied:  # a state whose logits tie at their top: candidate 0 and 3 (and 1 and 5) score alike
            hidden[:, 2] = head.weight[0] + head.weight[3]
        roots = torch.arange(7, 7 + batch)
        with torch.no_grad():
            want_ids, want_scores = sglang_worker._selector_lattice(model, hidden, roots)
            logits = head(hidden)
            kept = logits.clone()
            ids, scores = sgl.lattice_of_head_logits(model, logits, hidden, roots)
            lattice = forward._lattice(hidden, roots)
            # what the stage computed before: SGLang's lattice, then the head again for the unary log-probs
            unary = torch.log_softmax(sgl.transform_unary_logits(model, head(hidden)), dim=-1)
        assert torch.equal(logits, kept)  # the adapter leaves the caller's logits as they were
        assert torch.equal(ids, want_ids) and torch.equal(scores, want_scores)
        assert torch.equal(lattice.unary.token_ids, want_ids)
        assert torch.equal(lattice.unary.logprobs, unary.gather(-1, want_ids))
        assert torch.equal(lattice.transitions, selector_logprobs(want_scores, 1.0))
        if tied:
            assert set(want_ids[0, 2, :2].tolist()) in ({0, 3}, {1, 5})


PRODUCTS = ("matmul", "mm", "bmm", "addmm", "linear")
"""Aten ops that may carry the head's matrix product (matmul decomposes outside inference mode)."""
HEAD_SITES = ("bastion_sglang/step/rank_sync.py:", " _project_candidate_logits")
"""Where the head's product is issued: the draft head (`DraftHead.__call__`), SGLang's projection."""


def head_products(run: object) -> int:
    """The LM-head matrix products `run()` issues, counted by the step anatomy with their call sites."""
    records: list[StepCounts] = []
    anatomy = StepAnatomy(True, records.append, sites=True)
    anatomy.open_step(1, ("r",))
    anatomy.set_kind("speculative")
    try:
        run()  # type: ignore[operator]
    finally:
        anatomy.close_step()
    sites = records[0].stages[OUTSIDE].sites
    products = {f"op {name} @ " for name in PRODUCTS}
    return sum(
        n
        for site, n in sites.items()
        if any(site.startswith(p) for p in products) and any(where in site for where in HEAD_SITES)
    )


@pytest.mark.usefixtures("eager_score_edges")
def test_the_draft_stage_applies_the_head_once(tmp_path: Path) -> None:
    model, head = sglang_dflash2(tmp_path, 0.5, 3.0, tied=False)
    forward = drafter_forward(model, head)
    hidden, roots = states(2, 15, head.weight.shape[1], seed=0), torch.tensor([7, 8])
    for mode in (torch.no_grad, torch.inference_mode):  # the worker drafts in inference mode
        with mode():
            assert head_products(lambda: forward._lattice(hidden, roots)) == 1
            # SGLang's own path applies the head in compute_candidates (with the unary pass, two)
            assert head_products(lambda: sgl.selector_lattice(model, hidden, roots)) == 1
