"""Token-id training data: chunk files and manifest, generation through `sglang.Engine`, the target's
features computed from ids, the validation split, and `bastion train-drafter --token-data` end to end.

Runs on a tiny random Llama target (tests/tiny_models.py); one test starts a real `sglang.Engine` on it.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from tiny_models import MASK_ID, make_tiny_target

from bastion_sglang.assets.prompt_sets import chat_prompt_ids, load_prompts
from bastion_sglang.cli import main
from bastion_sglang.integration.draft_vocab import DraftVocabulary, write_draft_vocabulary
from bastion_sglang.integration.drafter_config import DrafterConfig
from bastion_sglang.reference.drafter import DFlashDrafter
from bastion_sglang.training.card import read_card_metadata
from bastion_sglang.training.cli import build_drafter_config
from bastion_sglang.training.compare_cli import DrafterComparison
from bastion_sglang.training.data import target_fingerprint
from bastion_sglang.training.target_features import TargetFeatures, training_sequence
from bastion_sglang.training.token_data import (
    TokenChunk,
    TokenDataManifest,
    TokenGenSettings,
    TokenSequence,
    load_token_data,
    read_chunk,
    read_token_manifest,
    write_chunk,
    write_token_manifest,
)
from bastion_sglang.training.token_train import VALIDATION_STRIDE, load_token_training, validation_keys
from bastion_sglang.training.train import (
    TrainConfig,
    TrainingState,
    block_loss,
    chain_acceptance,
    drafter_forward,
    load_frozen_target,
    make_blocks,
    position_weights,
    step_sequences,
)

LAYER_IDS = (1, 2)
MAX_NEW_TOKENS = 12


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_target(
        tmp_path_factory.mktemp("target"), arch="llama", num_layers=4, initializer_range=0.2, seed=0
    )


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "tiny.jsonl"
    lines = [json.dumps({"id": i, "prompt": f"say {i} then {3 * i} " * (1 + i % 3)}) for i in range(20)]
    path.write_text("\n".join(lines) + "\n")
    return path


def greedy(target: Path, prompt_ids: list[int], max_new_tokens: int = MAX_NEW_TOKENS) -> list[int]:
    """The HF target's greedy answer (its EOS included when it stops on one)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(prompt_ids) :].tolist()


def write_token_folder(target: Path, prompt_file: Path, out: Path, chunk_size: int = 6) -> TokenDataManifest:
    """A token-data folder of the prompt file's training split, answered by the HF target greedily."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target)
    prompts = load_prompts(prompt_file, "train")
    out.mkdir(parents=True)
    manifest = TokenDataManifest(
        target=target.name,
        settings=TokenGenSettings(
            target_fingerprint=target_fingerprint(target),
            sglang_version="test",
            dtype="float32",
            max_new_tokens=MAX_NEW_TOKENS,
            max_prompt_tokens=512,
        ),
        prompt_sets=(str(prompt_file),),
        chunk_size=chunk_size,
        planned_keys=tuple(p.key for p in prompts),
    )
    for start in range(0, len(prompts), chunk_size):
        group = prompts[start : start + chunk_size]
        ids = [chat_prompt_ids(tokenizer, p) for p in group]
        answers = [greedy(target, i) for i in ids]
        file = f"chunk-{len(manifest.chunks):05d}.npz"
        manifest.chunks.append(
            TokenChunk(
                file=file,
                sha256=write_chunk(out / file, ids, answers),
                prompt_keys=tuple(p.key for p in group),
                prompt_tokens=sum(map(len, ids)),
                response_tokens=sum(map(len, answers)),
                generation_seconds=0.0,
            )
        )
    write_token_manifest(out, manifest)
    return manifest


def one_layer_drafter_config(target: Path, block: int = 8) -> DrafterConfig:
    """A one-layer drafter's config for `target`, reading LAYER_IDS, blocks of `block`."""
    return build_drafter_config(
        json.loads((target / "config.json").read_text()),
        layers=1,
        block_size=block,
        layer_ids=list(LAYER_IDS),
        mask_token_id=MASK_ID,
    )


@pytest.fixture(scope="module")
def token_dir(target: Path, prompt_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tokens") / "data"
    write_token_folder(target, prompt_file, out)
    return out


# --- chunk files and manifest -------------------------------------------------------------------------------


def test_chunk_round_trip_keeps_every_id(tmp_path: Path) -> None:
    prompts, responses = [[1, 2, 3], [65535, 0]], [[7, 8], [9]]
    digest = write_chunk(tmp_path / "c.npz", prompts, responses)
    chunk = TokenChunk(
        file="c.npz",
        sha256=digest,
        prompt_keys=("a/1", "b/2"),
        prompt_tokens=5,
        response_tokens=3,
        generation_seconds=1.0,
    )
    sequences = read_chunk(tmp_path, chunk)
    assert [s.key for s in sequences] == ["a/1", "b/2"]
    assert [s.prompt.tolist() for s in sequences] == prompts
    assert [s.response.tolist() for s in sequences] == responses
    assert [s.source for s in sequences] == ["a", "b"]
    with np.load(tmp_path / "c.npz") as arrays:
        assert arrays["prompt_tokens"].dtype == np.uint16


def test_chunk_errors_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"c\.npz prompts: token id outside 0\.\.65535"):
        write_chunk(tmp_path / "c.npz", [[65536]], [[1]])
    digest = write_chunk(tmp_path / "c.npz", [[1, 2]], [[3]])
    good = dict(file="c.npz", sha256=digest, prompt_keys=("a/1",), generation_seconds=0.0)
    with pytest.raises(
        ValueError, match=r"c\.npz: 2 prompt and 1 response tokens, the manifest says 2 and 4"
    ):
        read_chunk(tmp_path, TokenChunk(**good, prompt_tokens=2, response_tokens=4))
    with pytest.raises(ValueError, match=r"c\.npz: prompt_offsets has 2 entries, expected 3"):
        read_chunk(
            tmp_path,
            TokenChunk(**(good | {"prompt_keys": ("a/1", "a/2")}), prompt_tokens=2, response_tokens=1),
        )
    with pytest.raises(ValueError, match=r"c\.npz: SHA-256 .* differs from the manifest's"):
        read_chunk(tmp_path, TokenChunk(**(good | {"sha256": "0" * 64}), prompt_tokens=2, response_tokens=1))
    with pytest.raises(ValueError, match=r"d\.npz: chunk listed in .* is missing"):
        read_chunk(tmp_path, TokenChunk(**(good | {"file": "d.npz"}), prompt_tokens=2, response_tokens=1))


def test_manifest_errors_name_the_file(tmp_path: Path) -> None:
    assert read_token_manifest(tmp_path) is None
    (tmp_path / "manifest.json").write_text('{"format_version": 1}')
    with pytest.raises(ValueError, match=r"manifest\.json: not a token-data manifest"):
        read_token_manifest(tmp_path)
    with pytest.raises(ValueError, match=r"no manifest\.json; not a token-data folder"):
        load_token_data(tmp_path / "nothing")


def test_token_folder_holds_the_targets_greedy_answers(
    target: Path, prompt_file: Path, token_dir: Path
) -> None:
    manifest = read_token_manifest(token_dir)
    assert manifest is not None and manifest.todo_keys == []
    sequences = load_token_data(token_dir)
    assert [s.key for s in sequences] == list(manifest.planned_keys) == manifest.done_keys
    assert len(load_token_data(token_dir, max_chunks=1)) == manifest.chunk_size
    assert manifest.response_tokens == sum(len(s.response) for s in sequences)


# --- generation through sglang.Engine -----------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_engine_generation_is_greedy_resumes_by_chunk_and_rejects_other_settings(
    target: Path, prompt_file: Path, tmp_path: Path
) -> None:
    from transformers import AutoTokenizer

    from bastion_sglang.training.token_gen import generate

    out = tmp_path / "gen"
    options = dict(max_new_tokens=MAX_NEW_TOKENS, chunk_size=4, max_running_requests=8, max_total_tokens=4096)
    first = generate(target, out, [str(prompt_file)], max_chunks=2, **options)
    assert len(first.chunks) == 2 and len(first.todo_keys) == 18 - 8  # 20 prompts, 2 held out
    final = generate(target, out, [str(prompt_file)], **(options | {"chunk_size": 5}))
    assert [c.file for c in final.chunks[:2]] == [c.file for c in first.chunks]  # resumed, not redone
    assert [len(c.prompt_keys) for c in final.chunks] == [4, 4, 5, 5]  # the chunk size may change
    tokenizer = AutoTokenizer.from_pretrained(target)
    prompts = {p.key: p for p in load_prompts(prompt_file, "train")}
    assert set(final.done_keys) == set(prompts)
    for sequence in load_token_data(out)[:6]:
        ids = chat_prompt_ids(tokenizer, prompts[sequence.key])
        assert sequence.prompt.tolist() == ids
        assert sequence.response.tolist() == greedy(target, ids)
    with pytest.raises(ValueError, match=r"manifest\.json: settings differs from this run's"):
        generate(target, out, [str(prompt_file)], **(options | {"max_new_tokens": 5}))


# --- features from ids, validation split --------------------------------------------------------------------


def test_features_from_ids_equal_the_targets_hidden_states(target: Path, token_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    sequences = [training_sequence(s) for s in load_token_data(token_dir)[:3]]
    assert all(s.features.numel() == 0 for s in sequences)
    filled = TargetFeatures(target, LAYER_IDS, torch.device("cpu")).fill(sequences)
    alone = TargetFeatures(target, LAYER_IDS, torch.device("cpu")).fill(sequences[2:])[0]
    for sequence in filled:
        with torch.no_grad():
            hidden = model(sequence.tokens[None], output_hidden_states=True).hidden_states
        expected = torch.cat([hidden[i + 1][0] for i in LAYER_IDS], dim=-1)
        assert sequence.features.shape == expected.shape and sequence.features.dtype == torch.bfloat16
        torch.testing.assert_close(
            sequence.features.float(), expected, atol=0.02 * float(expected.abs().max()), rtol=0.01
        )
    torch.testing.assert_close(alone.features, filled[2].features)  # padding in the batch changes nothing
    with pytest.raises(ValueError, match=r"target_layer_ids \[4\] outside 0\.\.3"):
        TargetFeatures(target, (1, 4), torch.device("cpu"))


def test_teacher_hidden_states_give_the_targets_logits(target: Path, token_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    sequences = [training_sequence(s) for s in load_token_data(token_dir)[:3]]
    plain = TargetFeatures(target, LAYER_IDS, torch.device("cpu")).fill(sequences)
    taught = TargetFeatures(target, LAYER_IDS, torch.device("cpu"), teacher=True).fill(sequences)
    assert all(s.teacher_hidden is None for s in plain)
    lm_head = load_frozen_target(target, torch.device("cpu")).lm_head
    for with_teacher, without in zip(taught, plain, strict=True):
        torch.testing.assert_close(with_teacher.features, without.features)
        assert with_teacher.teacher_hidden is not None
        with torch.no_grad():
            logits = model(with_teacher.tokens[None]).logits[0]
        torch.testing.assert_close(
            torch.nn.functional.linear(with_teacher.teacher_hidden, lm_head), logits, atol=1e-4, rtol=1e-4
        )


def test_distilled_loss_mixes_the_targets_token_and_distribution_position_by_position(
    target: Path, token_dir: Path
) -> None:
    from transformers import AutoModelForCausalLM

    block = 6
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    frozen = load_frozen_target(target, torch.device("cpu"))
    config = one_layer_drafter_config(target, block)
    torch.manual_seed(0)
    drafter = DFlashDrafter(config).eval()
    features = TargetFeatures(target, LAYER_IDS, torch.device("cpu"), teacher=True)
    sequences = features.fill([training_sequence(s) for s in load_token_data(token_dir)[:2]])
    anchors = [[s.anchor_range[0], s.anchor_range[-1]] for s in sequences]  # a full block and a cut one
    batch = make_blocks(sequences, anchors, block, MASK_ID)
    weights = position_weights(block, 2.0)
    alpha = 0.3
    with torch.no_grad():
        mixed = block_loss(drafter, frozen.embed, frozen.lm_head, batch, weights, distill=alpha).loss
        hidden = drafter_forward(drafter, frozen.embed, batch).view(2, 2, block, -1)
        total, weight_sum = 0.0, 0.0
        for s, sequence in enumerate(sequences):
            teacher = torch.log_softmax(model(sequence.tokens[None]).logits[0], dim=-1)  # [T, V]
            for j, anchor in enumerate(anchors[s]):
                for k in range(1, block):
                    if anchor + k >= sequence.tokens.shape[0]:
                        continue
                    drafted = torch.log_softmax(hidden[s, j, k] @ frozen.lm_head.T, dim=-1)
                    hard = -drafted[sequence.tokens[anchor + k]]
                    soft = -(teacher[anchor + k - 1].exp() * drafted).sum()
                    total += float(weights[k - 1] * ((1 - alpha) * hard + alpha * soft))
                    weight_sum += float(weights[k - 1])
        hard_only = block_loss(drafter, frozen.embed, frozen.lm_head, batch, weights).loss
    assert float(mixed) == pytest.approx(total / weight_sum, rel=1e-4)
    assert abs(float(mixed) - float(hard_only)) > 1e-3  # the target's distribution is not one-hot
    bare = make_blocks(
        [dataclasses.replace(s, teacher_hidden=None) for s in sequences], anchors, block, MASK_ID
    )
    assert bare.teacher_hidden is None
    with pytest.raises(ValueError, match="needs the target's last hidden states"):
        block_loss(drafter, frozen.embed, frozen.lm_head, bare, weights, distill=alpha)


def test_validation_sequences_are_every_fourth_of_the_first_and_never_trained(token_dir: Path) -> None:
    keys = [f"s/{i}" for i in range(10)]
    assert validation_keys(keys, 2) == {"s/0", "s/4"}
    assert validation_keys(keys, 0) == set()
    with pytest.raises(
        ValueError, match="3 validation sequences need 12 generated sequences, the token data has 10"
    ):
        validation_keys(keys, 3)
    data = load_token_training(token_dir, 2)
    manifest = read_token_manifest(token_dir)
    assert manifest is not None
    assert [s.key for s in data.validation] == manifest.done_keys[
        0 : 2 * VALIDATION_STRIDE : VALIDATION_STRIDE
    ]
    assert not {s.key for s in data.train} & {s.key for s in data.validation}
    assert len(data.train) + len(data.validation) == len(manifest.done_keys)
    with pytest.raises(ValueError, match="no generated chunk yet"):
        load_token_training(token_dir.parent / "absent", 2)


# --- train-drafter --token-data -----------------------------------------------------------------------------


def test_train_drafter_on_token_data_end_to_end(
    target: Path, prompt_file: Path, token_dir: Path, tmp_path: Path
) -> None:
    argv = [
        "train-drafter",
        "--target", str(target),
        "--out", str(tmp_path / "out"),
        "--data-dir", str(tmp_path / "data"),
        "--prompt-sets", str(prompt_file),
        "--token-data", str(token_dir),
        "--validation-sequences", "2",
        "--steps", "3",
        "--layers", "1",
        "--block-size", "8",
        "--target-layer-ids", ",".join(map(str, LAYER_IDS)),
        "--mask-token-id", str(MASK_ID),
        "--max-new-tokens", str(MAX_NEW_TOKENS),
        "--gen-batch-size", "6",
        "--gen-dtype", "float32",
        "--anchors", "4",
        "--warmup-steps", "1",
        "--eval-stride", "2",
    ]  # fmt: skip
    assert main(argv) == 0
    summary = read_card_metadata(tmp_path / "out" / "README.md").bastion_training
    assert summary.steps_done == 3
    assert summary.data.token_data == str(token_dir)
    assert (summary.data.train_sequences, summary.data.validation_sequences) == (16, 2)
    assert summary.data.heldout_sequences == 2  # the held-out split, regenerated for measurement only
    assert summary.validation is not None and 1.0 <= summary.validation.mean <= 8
    assert summary.acceptance is not None
    state = json.loads((tmp_path / "data" / "runs" / "out" / "state.json").read_text())
    assert [p["step"] for p in state["validation"]] == [3]
    assert (
        "of them were kept out of training to choose settings on"
        in (tmp_path / "out" / "README.md").read_text()
    )
    assert main([*argv, "--resume"]) == 0
    follow = [*argv[:4], str(tmp_path / "follow"), *argv[5:], "--init-from-drafter", str(tmp_path / "out")]
    assert main([*follow, "--distill", "0.5"]) == 0
    assert read_card_metadata(tmp_path / "follow" / "README.md").bastion_training.config.distill == 0.5
    assert (
        "0.5 × the cross-entropy to the target's next-token distribution"
        in (tmp_path / "follow" / "README.md").read_text()
    )
    state = json.loads((tmp_path / "data" / "runs" / "follow" / "state.json").read_text())
    assert [p["step"] for p in state["acceptance"]] == [0, 3]  # the starting drafter, measured first
    assert [p["step"] for p in state["validation"]] == [0, 3]
    other = make_tiny_target(tmp_path / "other", arch="llama", num_layers=4, initializer_range=0.2, seed=1)
    with pytest.raises(SystemExit, match="was generated with another target"):
        main([*argv[:2], str(other), *argv[3:4], str(tmp_path / "o2"), *argv[5:]])
    with pytest.raises(SystemExit, match=r"--distill is a weight in \[0, 1\], got 1.5"):
        main([*argv, "--distill", "1.5"])
    token_flag = argv.index("--token-data")
    without_tokens = argv[:token_flag] + argv[token_flag + 2 :]
    with pytest.raises(SystemExit, match="--distill needs --token-data"):
        main([*without_tokens, "--distill", "0.5"])


def test_token_sequence_source_is_the_set() -> None:
    sequence = TokenSequence("sharegpt/abc_0", np.array([1]), np.array([2, 3]))
    assert sequence.source == "sharegpt"


# --- compare-drafters ---------------------------------------------------------------------------------------


def test_compare_drafters_measures_every_drafter_on_the_same_sequences_none_of_them_saw(
    target: Path, token_dir: Path, prompt_file: Path, tmp_path: Path
) -> None:
    config = one_layer_drafter_config(target)
    drafters = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        drafters.append(DFlashDrafter(config).save_pretrained(tmp_path / f"drafter-{seed}"))
    run = tmp_path / "run"
    run.mkdir()
    run_config = TrainConfig(steps=9, batch_sequences=2)
    state = TrainingState(
        config=run_config, drafter_config=config, step=2, seconds=1.0, supervised_positions=10
    )
    (run / "state.json").write_text(state.model_dump_json())
    train = load_token_training(token_dir, 2).train
    drawn = {s.key for step in range(2) for s in step_sequences(train, run_config, step)}
    first = {p.key for p in load_prompts(prompt_file, "train")[:3]}
    manifest = read_token_manifest(token_dir)
    assert manifest is not None
    expected = [key for key in manifest.done_keys if key not in drawn | first]  # every unseen one
    argv = [
        "compare-drafters",
        "--target", str(target),
        "--token-data", str(token_dir),
        "--drafter", str(drafters[0]),
        "--drafter", str(drafters[1]),
        "--skip-first-per-set", "3",
        "--unseen-by", str(run),
        "--validation-sequences", "2",
        "--sequences", str(len(expected)),
        "--stride", "2",
        "--out", str(tmp_path / "comparison.json"),
    ]  # fmt: skip
    assert main(argv) == 0
    comparison = DrafterComparison.model_validate_json((tmp_path / "comparison.json").read_text())
    assert comparison.sequence_keys == expected and len(drawn) == 4
    by_key = {
        s.key: s
        for s in load_token_training(token_dir, 2).train + load_token_training(token_dir, 2).validation
    }
    measured = TargetFeatures(target, LAYER_IDS, torch.device("cpu")).fill([by_key[k] for k in expected])
    frozen = load_frozen_target(target, torch.device("cpu"))
    for path, score in zip(drafters, comparison.scores, strict=True):
        drafter = DFlashDrafter.from_pretrained(path).eval()
        direct = chain_acceptance(drafter, frozen, measured, stride=2, precision="fp32")
        assert score.drafter == str(path) and score.acceptance == direct

    with pytest.raises(
        SystemExit, match=f"are unseen by every drafter, fewer than --sequences {len(expected) + 1}"
    ):
        main([*argv[:-6], "--sequences", str(len(expected) + 1)])
    with pytest.raises(SystemExit, match=r"state\.json: no training state; --unseen-by takes a run folder"):
        main([*argv[:-10], "--unseen-by", str(tmp_path), *argv[-8:]])


def test_chain_acceptance_over_a_draft_vocabulary_drafts_only_its_tokens(
    target: Path, token_dir: Path, tmp_path: Path
) -> None:
    """Over every id (permuted) the chain is the whole vocabulary's; over the answers' tokens alone it
    accepts at least as much; over a vocabulary without any of them, nothing; compare-drafters --draft-vocab
    reports both rows."""
    config = one_layer_drafter_config(target)
    torch.manual_seed(0)
    path = DFlashDrafter(config).save_pretrained(tmp_path / "drafter")
    drafter = DFlashDrafter.from_pretrained(path).eval()
    sequences = load_token_training(token_dir, 2).train[:6]
    measured = TargetFeatures(target, LAYER_IDS, torch.device("cpu")).fill(sequences)
    frozen = load_frozen_target(target, torch.device("cpu"))
    vocab = int(frozen.lm_head.shape[0])
    whole = chain_acceptance(drafter, frozen, measured, stride=2, precision="fp32")
    every = torch.randperm(vocab, generator=torch.Generator().manual_seed(0))
    assert chain_acceptance(drafter, frozen, measured, stride=2, precision="fp32", draft_vocab=every) == whole
    answered = {int(t) for s in sequences for t in s.tokens[s.prompt_length :]}
    only = chain_acceptance(
        drafter, frozen, measured, stride=2, precision="fp32", draft_vocab=torch.tensor(sorted(answered))
    )
    assert only.mean > 1.0 and only.mean >= whole.mean  # an argmax the answers hold stays theirs
    elsewhere = torch.tensor([t for t in range(vocab) if t not in answered])
    none = chain_acceptance(drafter, frozen, measured, stride=2, precision="fp32", draft_vocab=elsewhere)
    assert none.mean == 1.0 and none.blocks == whole.blocks

    vocab_file = tmp_path / "draft_vocab.json"
    write_draft_vocabulary(
        vocab_file,
        DraftVocabulary(
            target_vocab_size=vocab,
            source="test",
            counted_tokens=1,
            coverage=1.0,
            token_ids=elsewhere.tolist(),
        ),
    )
    argv = [
        "compare-drafters",
        "--target",
        str(target),
        "--token-data",
        str(token_dir),
        "--drafter",
        str(path),
        "--validation-sequences",
        "2",
    ]
    out = tmp_path / "comparison.json"
    assert (
        main(
            [*argv, "--sequences", "4", "--stride", "2", "--draft-vocab", str(vocab_file), "--out", str(out)]
        )
        == 0
    )
    rows = DrafterComparison.model_validate_json(out.read_text()).scores
    assert [row.draft_vocab for row in rows] == [None, str(vocab_file)]
    assert rows[0].acceptance.mean >= rows[1].acceptance.mean == 1.0
