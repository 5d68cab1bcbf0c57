"""The draft vocabulary: its file, the draft head over it, `bastion draft-vocab`, and servers drafting over
one (real `sglang.Engine` on the tiny fp32 pair, CPU): output stays the target's, and a vocabulary of every
id drafts exactly what the whole vocabulary does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from engine_support import PROMPTS, VOCAB_SIZE, engine_server_args, generate_once, make_model_pair

from bastion_sglang.calibration.store import STORE_ENV, ProfileStore
from bastion_sglang.cli import main as bastion_main
from bastion_sglang.integration.config import STARTUP_CALIBRATION_ENV
from bastion_sglang.integration.draft_vocab import (
    DRAFT_VOCAB_FILE,
    DraftVocabulary,
    read_draft_vocabulary,
    resolve_draft_vocabulary,
    write_draft_vocabulary,
)
from bastion_sglang.kernels import topk_logprobs
from bastion_sglang.registration import make_config
from bastion_sglang.step.rank_sync import DraftHead
from bastion_sglang.training.token_data import (
    TokenChunk,
    TokenDataManifest,
    TokenGenSettings,
    write_chunk,
    write_token_manifest,
)

NEW_TOKENS = 16


def vocabulary(ids: list[int], vocab_size: int = VOCAB_SIZE) -> DraftVocabulary:
    return DraftVocabulary(
        target_vocab_size=vocab_size, source="test", counted_tokens=100, coverage=0.5, token_ids=ids
    )


# --- the file -----------------------------------------------------------------------------------------------


def test_a_vocabulary_round_trips_through_its_file(tmp_path: Path) -> None:
    path = tmp_path / DRAFT_VOCAB_FILE
    written = vocabulary([5, 3, 200, 0])
    write_draft_vocabulary(path, written)
    assert read_draft_vocabulary(path) == written


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"token_ids": [4, 7, 4]}, r"token_ids: .*\[4\] appear more than once"),
        ({"token_ids": [3, -1]}, r"token_ids: .*token id -1 is negative"),
        ({"token_ids": [3, 260]}, r"token id 260 is outside target_vocab_size 260"),
        ({"token_ids": []}, r"token_ids: .*at least 1"),
        ({"coverage": 1.5}, r"coverage: .*less than or equal to 1"),
        ({"token_ids": [1, "2"]}, r"token_ids\.1: .*integer"),
        ({"extra": 1}, r"extra: .*not permitted"),
    ],
)
def test_a_malformed_vocabulary_is_refused_naming_the_file_and_field(
    tmp_path: Path, fields: dict[str, object], message: str
) -> None:
    path = tmp_path / "vocab.json"
    path.write_text(json.dumps(vocabulary([1, 2]).model_dump() | fields))
    with pytest.raises(ValueError, match=rf"draft vocabulary {path}: .*{message}"):
        read_draft_vocabulary(path)


def test_unreadable_and_non_json_files_are_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"missing\.json: cannot be read"):
        read_draft_vocabulary(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"bad\.json: not JSON"):
        read_draft_vocabulary(tmp_path / "bad.json")


def test_resolution_picks_the_drafters_file_or_the_named_one_and_checks_it_fits(tmp_path: Path) -> None:
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    assert resolve_draft_vocabulary("auto", drafter, VOCAB_SIZE, 4) == (None, None)  # no file: every token
    write_draft_vocabulary(drafter / DRAFT_VOCAB_FILE, vocabulary([9, 8, 7, 6, 5]))
    found, path = resolve_draft_vocabulary("auto", drafter, VOCAB_SIZE, 4)
    assert path == drafter / DRAFT_VOCAB_FILE and found is not None and found.token_ids == [9, 8, 7, 6, 5]
    assert resolve_draft_vocabulary("full", drafter, VOCAB_SIZE, 4) == (None, None)
    assert resolve_draft_vocabulary("auto", drafter, VOCAB_SIZE, 4, lattice_drafter=True) == (None, None)
    other = tmp_path / "other.json"
    write_draft_vocabulary(other, vocabulary([1, 2, 3, 4]))
    assert resolve_draft_vocabulary(other, drafter, VOCAB_SIZE, 4)[1] == other

    with pytest.raises(ValueError, match=r"other\.json: 4 token ids, fewer than --bastion-topk 5"):
        resolve_draft_vocabulary(other, drafter, VOCAB_SIZE, 5)
    with pytest.raises(
        ValueError, match=r"target_vocab_size 260 does not match the target's vocabulary of 512"
    ):
        resolve_draft_vocabulary(other, drafter, 512, 4)
    with pytest.raises(ValueError, match=r"DFlash2 drafter's candidate selector scores the whole vocabulary"):
        resolve_draft_vocabulary(other, drafter, VOCAB_SIZE, 4, lattice_drafter=True)


# --- the draft head -----------------------------------------------------------------------------------------


def test_the_head_over_a_vocabulary_is_the_whole_head_restricted_to_it() -> None:
    """Brute force: the top-K over the vocabulary's logits, mapped to the target's ids, is the top-K of the
    whole head's logits with every other token at -inf; `__call__` gives exactly those [B, h, V] logits."""
    generator = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(16, VOCAB_SIZE, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(VOCAB_SIZE, 16, generator=generator))
    hidden = torch.randn(2, 5, 16, generator=generator)
    ids = torch.randperm(VOCAB_SIZE, generator=generator)[:40].tolist()
    full_logits = hidden @ head.weight.T
    masked = torch.full_like(full_logits, float("-inf"))
    masked[..., ids] = full_logits[..., ids]

    subset = DraftHead.of(head, VOCAB_SIZE, None, ids)
    torch.testing.assert_close(subset(hidden), masked, rtol=1e-6, atol=1e-5)
    got, want = subset.top_k(hidden, 6), topk_logprobs(masked, 6)
    assert torch.equal(got.token_ids, want.token_ids)
    torch.testing.assert_close(got.logprobs, want.logprobs, rtol=1e-5, atol=1e-5)
    assert set(got.token_ids.flatten().tolist()) <= set(ids)

    whole = DraftHead.of(head, VOCAB_SIZE, None)
    everything = DraftHead.of(
        head, VOCAB_SIZE, None, torch.randperm(VOCAB_SIZE, generator=generator).tolist()
    )
    assert torch.equal(everything.top_k(hidden, 6).token_ids, whole.top_k(hidden, 6).token_ids)


# --- bastion draft-vocab ------------------------------------------------------------------------------------


def write_tokens(folder: Path, responses: list[list[int]]) -> None:
    """A token-data folder of one chunk holding `responses` (prompts of one token)."""
    folder.mkdir(parents=True)
    prompts = [[1] for _ in responses]
    keys = tuple(f"tiny/{i}" for i in range(len(responses)))
    manifest = TokenDataManifest(
        target="target",
        settings=TokenGenSettings(
            target_fingerprint="test",
            sglang_version="test",
            dtype="float32",
            max_new_tokens=8,
            max_prompt_tokens=8,
        ),
        prompt_sets=("tiny",),
        chunk_size=len(responses),
        planned_keys=keys,
        chunks=[
            TokenChunk(
                file="chunk-00000.npz",
                sha256=write_chunk(folder / "chunk-00000.npz", prompts, responses),
                prompt_keys=keys,
                prompt_tokens=len(prompts),
                response_tokens=sum(map(len, responses)),
                generation_seconds=0.0,
            )
        ],
    )
    write_token_manifest(folder, manifest)


def test_draft_vocab_keeps_the_most_frequent_response_tokens(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"vocab_size": 50}))
    write_tokens(tmp_path / "data", [[7, 7, 7, 3, 3, 9], [9, 12, 3, 7, 40]])  # 7: 4, 3: 3, 9: 2, 12 and 40: 1
    out = tmp_path / "drafter" / DRAFT_VOCAB_FILE
    args = ["draft-vocab", "--token-data", str(tmp_path / "data"), "--target", str(target), "--out", str(out)]

    assert bastion_main([*args, "--size", "4"]) == 0
    written = read_draft_vocabulary(out)
    assert written.token_ids == [7, 3, 9, 12]  # 12 before 40: ties by id
    assert written.counted_tokens == 11 and written.coverage == pytest.approx(10 / 11)
    assert written.target_vocab_size == 50 and "tiny" in written.source
    assert "4 of 50 token ids, covering 90.91 % of 11" in capsys.readouterr().out

    assert bastion_main([*args, "--size", "30"]) == 0  # only five tokens occur
    assert read_draft_vocabulary(out).token_ids == [7, 3, 9, 12, 40]

    (target / "config.json").write_text(json.dumps({"vocab_size": 40}))
    with pytest.raises(ValueError, match=r"response token id 40 is outside the target's vocabulary of 40"):
        bastion_main([*args, "--size", "4"])


# --- servers ------------------------------------------------------------------------------------------------


def serve(
    models: tuple[Path, Path], policy: str, draft_vocab: str | None, startup: str = "off"
) -> tuple[list[list[int]], list[int | None]]:
    """Greedy outputs and verify passes of the first four prompts on an Engine (policy plain: none)."""
    config = (
        None
        if policy == "plain"
        else make_config(
            max_budget=8,
            policy=policy,
            topk=4,
            startup_calibration=startup,
            draft_vocab=draft_vocab,  # type: ignore[arg-type]
        )
    )
    outputs = generate_once(
        models,
        config,
        PROMPTS[:4],
        {"temperature": 0.0, "max_new_tokens": NEW_TOKENS},
        max_total_tokens=4096,
    )
    return [o["output_ids"] for o in outputs], [o["meta_info"].get("spec_verify_ct") for o in outputs]


@pytest.mark.slow
def test_drafting_over_a_vocabulary_keeps_the_targets_output_and_every_id_drafts_as_the_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(STARTUP_CALIBRATION_ENV, "off")
    models = make_model_pair(tmp_path / "pair")
    generator = torch.Generator().manual_seed(1)
    every = tmp_path / "every.json"
    write_draft_vocabulary(every, vocabulary(torch.randperm(VOCAB_SIZE, generator=generator).tolist()))
    some = tmp_path / "some.json"
    write_draft_vocabulary(some, vocabulary(torch.randperm(VOCAB_SIZE, generator=generator)[:24].tolist()))

    plain, _ = serve(models, "plain", None)
    whole, whole_passes = serve(models, "fixed:4", "full")
    permuted, permuted_passes = serve(models, "fixed:4", str(every))
    subset, subset_passes = serve(models, "fixed:4", str(some))
    assert whole == permuted == subset == plain
    assert permuted_passes == whole_passes  # the same drafts, so the same verify passes
    assert all(passes is not None and passes > 0 for passes in subset_passes)


@pytest.mark.slow
def test_a_server_with_a_vocabulary_calibrates_at_start_up_over_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default (auto) finds the drafter folder's file; start-up calibration times and records the draft
    over it, and the output is the target's."""
    store = ProfileStore(tmp_path / "store")
    monkeypatch.setenv(STORE_ENV, str(store.root))
    models = make_model_pair(tmp_path / "pair")
    write_draft_vocabulary(models[1] / DRAFT_VOCAB_FILE, vocabulary(list(range(100, 160))))
    plain, _ = serve(models, "plain", None)
    calibrated, _ = serve(models, "adaptive", None, startup="quick")
    assert calibrated == plain
    (entry,) = store.list_profiles()
    assert entry.profile is not None and entry.profile.step_costs.t_draft > 0
    assert entry.profile.metadata.settings is not None
    assert entry.profile.metadata.settings.draft_vocab_size == 60  # its T_draft is the vocabulary's


def test_a_bad_vocabulary_stops_the_server_at_start_up_naming_the_file(tmp_path: Path) -> None:
    import sglang

    models = make_model_pair(tmp_path / "pair")
    (models[1] / DRAFT_VOCAB_FILE).write_text(
        json.dumps(vocabulary([1, 2, 3, 4]).model_dump() | {"coverage": 0})
    )
    config = make_config(max_budget=8, policy="fixed:4", topk=4, startup_calibration="off")
    with pytest.raises(ValueError, match=rf"draft vocabulary {models[1] / DRAFT_VOCAB_FILE}: coverage"):
        sglang.Engine(server_args=engine_server_args(models, config))
