"""DFlash2 selector training on a frozen DFlash backbone: the backbone's blocks, the reachable rows, the loss
against the selector's own lattice, the held-out chains, the exported drafter against the reference
engine's DFlash2 proposer, and `bastion train-drafter --arch dflash2` end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from stop_signals import sigterm_after_step, sigterm_recorded
from tiny_models import make_tiny_drafter, make_tiny_target

from bastion_sglang.assets.prompt_sets import load_prompts
from bastion_sglang.cli import main
from bastion_sglang.controller.lattice_tree import lattice_chain, selector_logprobs
from bastion_sglang.reference import DFlashDrafter
from bastion_sglang.reference.lattice_proposer import DFlash2Proposer
from bastion_sglang.step.draft_protocols import DraftInput
from bastion_sglang.training.card import read_card_metadata
from bastion_sglang.training.data import load_training_sequences, regenerate
from bastion_sglang.training.selector import (
    DraftBlocks,
    SelectorRows,
    SelectorTrainConfig,
    SelectorTrainer,
    draft_blocks,
    lattice_acceptance,
    lattice_scores,
    row_loss,
    stride_anchors,
)
from bastion_sglang.training.train import FrozenTarget, load_frozen_target

LAYER_IDS = [1, 2]
BLOCK = 8
TOP_K = 128  # of 512: the random backbone ranks the target's token this high often enough
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_target(tmp_path_factory.mktemp("target"), arch="llama", initializer_range=0.2)


@pytest.fixture(scope="module")
def backbone_path(target: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_drafter(
        tmp_path_factory.mktemp("backbone") / "dflash", target, num_layers=1, block_size=BLOCK,
        target_layer_ids=LAYER_IDS, weight_std=0.2,
    )  # fmt: skip


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "tiny.jsonl"
    lines = [json.dumps({"id": i, "prompt": f"say {i} then {2 * i} " * (1 + i % 3)}) for i in range(12)]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def sequences(target: Path, prompt_file: Path, tmp_path_factory: pytest.TempPathFactory) -> list:
    out = tmp_path_factory.mktemp("data")
    prompts = load_prompts(prompt_file, "all")
    regenerate(
        target, prompts, out, target_layer_ids=LAYER_IDS, max_new_tokens=24, batch_size=6, dtype="float32"
    )
    return load_training_sequences(out)


@pytest.fixture(scope="module")
def frozen(target: Path) -> FrozenTarget:
    return load_frozen_target(target, torch.device("cpu"))


def config(backbone_path: Path, **changes: object) -> SelectorTrainConfig:
    values = dict(
        init_from_drafter=str(backbone_path), rank=4, top_k=TOP_K, steps=60, batch_rows=256, lr=3e-2
    )
    return SelectorTrainConfig(**(values | changes))


def trainer(backbone_path: Path, frozen: FrozenTarget, sequences: list, state_dir: Path, **changes: object):
    run = config(backbone_path, **changes)
    backbone = DFlashDrafter.from_pretrained(backbone_path)
    drafter_config = backbone.config.model_copy(update={"selector": run.selector()})
    return SelectorTrainer(backbone, drafter_config, run, frozen, sequences, state_dir)


def test_blocks_hold_the_backbones_states_and_head_top_k(
    backbone_path: Path, frozen: FrozenTarget, sequences: list
) -> None:
    backbone = DFlashDrafter.from_pretrained(backbone_path)
    sequence = sequences[0]
    anchor = sequence.prompt_length + 2
    blocks = draft_blocks(backbone, frozen, [sequence], [[anchor]], config(backbone_path).selector())
    cache = backbone.new_cache(64)
    backbone.append_context(cache, sequence.features[:anchor].float())
    noise = torch.tensor([int(sequence.tokens[anchor])] + [backbone.config.mask_token_id] * (BLOCK - 1))
    states = backbone(frozen.embed(noise), cache)[1:]  # [D, h]
    torch.testing.assert_close(blocks.hidden[0], states, rtol=1e-4, atol=1e-5)
    assert torch.equal(blocks.candidates[0], torch.topk(blocks.hidden[0] @ frozen.lm_head.T, TOP_K).indices)
    assert blocks.anchors.tolist() == [int(sequence.tokens[anchor])]
    assert blocks.labels[0].tolist() == sequence.tokens[anchor + 1 : anchor + BLOCK].tolist()


def test_reachable_rows_stop_at_the_first_slot_without_the_true_token() -> None:
    candidates = torch.tensor([[[5, 6], [7, 8], [9, 10]]])  # one block, D = 3, K = 2
    blocks = DraftBlocks(
        hidden=torch.arange(6.0).view(1, 3, 2),
        candidates=candidates,
        unary=torch.zeros(1, 3, 2),
        anchors=torch.tensor([4]),
        labels=torch.tensor([[6, 1, 10]]),  # slot 1's token is no candidate: slot 2 is unreachable
        sources=("a",),
    )
    assert blocks.true_candidates().tolist() == [[1, -1, 1]]
    rows = SelectorRows.of(blocks)
    assert rows.count == 1 and rows.targets.tolist() == [1] and rows.predecessors.tolist() == [4]
    assert rows.slots.tolist() == [0] and rows.candidates.tolist() == [[5, 6]]


def test_the_loss_reads_the_lattice_row_after_the_true_token(
    backbone_path: Path, frozen: FrozenTarget, sequences: list, tmp_path: Path
) -> None:
    run = trainer(backbone_path, frozen, sequences, tmp_path / "run")
    with torch.no_grad():
        run.selector.successor_codebook.normal_(generator=torch.Generator().manual_seed(1))
    anchors = stride_anchors(sequences[:3], BLOCK, 2)
    blocks = draft_blocks(run.backbone, frozen, sequences[:3], anchors, run.config.selector())
    rows = SelectorRows.of(blocks)
    assert rows.count > 0
    logprobs = selector_logprobs(lattice_scores(run.selector, blocks))  # [n, D, K, K]
    truth = blocks.true_candidates()
    block_of = torch.arange(blocks.count)[:, None].expand_as(truth)
    reachable = torch.cumprod((truth >= 0).long(), 1).bool()
    previous = torch.cat([torch.zeros_like(truth[:, :1]), truth[:, :-1]], 1)  # slot 0: row 0 (all equal)
    expected = logprobs[block_of, torch.arange(truth.shape[1]), previous][reachable]  # [M, K]
    weights = torch.ones(BLOCK - 1)
    nll = -expected.gather(1, rows.targets[:, None]).mean()
    with torch.no_grad():
        torch.testing.assert_close(row_loss(run.selector, rows, weights).loss, nll, rtol=1e-5, atol=1e-6)


def test_training_lowers_the_loss_and_a_fresh_selector_walks_the_dflash_chain(
    backbone_path: Path, frozen: FrozenTarget, sequences: list, tmp_path: Path
) -> None:
    run = trainer(backbone_path, frozen, sequences, tmp_path / "run")
    heldout = draft_blocks(
        run.backbone, frozen, sequences, stride_anchors(sequences, BLOCK, 2), run.config.selector()
    )
    fresh = lattice_acceptance(run.selector, heldout)
    assert fresh.dflash2 == fresh.dflash  # scores = unary logits: the walk takes each slot's top-1
    state = run.run(checkpoint_seconds=1e9, log_every=10)
    assert state.step == 60 and state.rows == run.rows().count > 0
    assert state.history[-1].loss < state.history[0].loss
    trained = lattice_acceptance(run.selector, heldout)
    assert trained.dflash == fresh.dflash and trained.dflash2.blocks == fresh.dflash.blocks
    assert (tmp_path / "run" / "state.json").is_file() and (tmp_path / "run" / "selector-rows.pt").is_file()


def test_sigterm_ends_the_selector_run_after_its_step_with_a_checkpoint(
    backbone_path: Path, frozen: FrozenTarget, sequences: list, tmp_path: Path
) -> None:
    run = trainer(backbone_path, frozen, sequences, tmp_path / "run", steps=20)
    sigterm_after_step(run, 2)
    with sigterm_recorded() as received:
        state = run.run(checkpoint_seconds=1e9)
    assert received == [] and state.step == 3
    assert json.loads((tmp_path / "run" / "state.json").read_text())["step"] == 3


def test_the_exported_drafter_proposes_the_lattice_it_was_measured_on(
    backbone_path: Path, target: Path, frozen: FrozenTarget, sequences: list, tmp_path: Path
) -> None:
    run = trainer(backbone_path, frozen, sequences, tmp_path / "run", steps=20)
    run.run(checkpoint_seconds=1e9)
    saved = run.drafter().save_pretrained(tmp_path / "dflash2")
    drafter = DFlashDrafter.from_pretrained(saved)
    assert drafter.config.selector == run.config.selector()
    sequence = sequences[1]
    anchor = sequence.prompt_length + 1
    blocks = draft_blocks(run.backbone, frozen, [sequence], [[anchor]], run.config.selector())
    head = torch.nn.Linear(frozen.lm_head.shape[1], frozen.lm_head.shape[0], bias=False)
    head.weight.data = frozen.lm_head
    proposer = DFlash2Proposer(drafter, frozen.embed, head)
    proposer.start(64)
    committed = sequence.tokens[: anchor + 1]
    lattice = proposer.propose(DraftInput(committed, sequence.features[:anchor].float()), TOP_K)
    assert torch.equal(lattice.unary.token_ids[0], blocks.candidates[0])
    expected = selector_logprobs(lattice_scores(run.selector, blocks))
    torch.testing.assert_close(lattice.transitions, expected, rtol=1e-4, atol=1e-5)
    walk = lattice_chain(lattice.transitions[0], lattice.unary.token_ids[0]).tokens
    measured = lattice_chain(expected[0], blocks.candidates[0]).tokens
    assert torch.equal(walk, measured)


def test_train_drafter_dflash2_end_to_end(
    target: Path, backbone_path: Path, prompt_file: Path, tmp_path: Path
) -> None:
    argv = [
        "train-drafter", "--arch", "dflash2",
        "--target", str(target),
        "--out", str(tmp_path / "out"),
        "--data-dir", str(tmp_path / "data"),
        "--init-from-drafter", str(backbone_path),
        "--prompt-sets", str(prompt_file),
        "--steps", "5",
        "--selector-rank", "4",
        "--selector-top-k", str(TOP_K),
        "--batch-rows", "64",
        "--max-new-tokens", "16",
        "--gen-batch-size", "6",
        "--gen-dtype", "float32",
        "--anchors", "4",
        "--warmup-steps", "1",
        "--eval-stride", "2",
    ]  # fmt: skip
    assert main(argv) == 0
    summary = read_card_metadata(tmp_path / "out" / "README.md").bastion_training
    assert isinstance(summary.config, SelectorTrainConfig) and summary.steps_done == 5
    assert summary.acceptance is not None and summary.backbone_acceptance is not None
    assert summary.acceptance.blocks == summary.backbone_acceptance.blocks
    assert summary.initialised_from is not None and summary.initialised_from.name == "dflash"
    card = (tmp_path / "out" / "README.md").read_text()
    assert "| set | DFlash2 chain | DFlash chain |" in card and "dflash2" in card
    exported = DFlashDrafter.from_pretrained(tmp_path / "out")
    assert exported.config.selector is not None and exported.config.selector.rank == 4
    assert exported.fc.weight.dtype == torch.float32  # loaded as fp32 from the bf16 file
    assert main([*argv, "--resume"]) == 0
    with pytest.raises(SystemExit, match="pass --resume"):
        main(argv)
    with pytest.raises(SystemExit, match="--sample-positions samples the DFlash loss"):
        main([*argv, "--sample-positions"])
    with pytest.raises(SystemExit, match="--distill weighs the DFlash loss"):
        main([*argv, "--distill", "0.5"])
    without = [a for a in argv if a not in ("--init-from-drafter", str(backbone_path))]
    with pytest.raises(SystemExit, match="pass --init-from-drafter"):
        main(without)
    with pytest.raises(SystemExit, match="must be a plain DFlash drafter; it has a selector"):
        main(
            [
                {
                    str(tmp_path / "out"): str(tmp_path / "again"),
                    str(backbone_path): str(tmp_path / "out"),
                }.get(a, a)
                for a in argv
            ]
        )
