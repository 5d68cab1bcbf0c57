"""Training sequences from a committed token-data folder, with the validation sequences set apart.

`bastion train-drafter --token-data DIR` trains on the token ids of `DIR` (`training.token_data`): every
finished chunk at the time the run starts (a resumed run picks up the chunks written since). The
validation sequences are kept out of training to choose settings on (never the held-out split): every
`VALIDATION_STRIDE`-th of the first `VALIDATION_STRIDE · n` sequences in chunk order, which the
generator interleaves set by set, so they mix the sets and stay the same as chunks are added.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from bastion_sglang.training.data import TrainingSequence
from bastion_sglang.training.target_features import training_sequence
from bastion_sglang.training.token_data import TokenDataManifest, load_token_data, read_token_manifest

VALIDATION_STRIDE = 4


@dataclass(frozen=True)
class TokenTrainingData:
    """train / validation: sequences without features (`target_features.training_sequence`), each with
    at least one anchor; manifest: the folder's manifest when they were read."""

    train: list[TrainingSequence]
    validation: list[TrainingSequence]
    manifest: TokenDataManifest

    @property
    def train_response_tokens(self) -> int:
        """Response tokens of the training sequences."""
        return sum(int(s.tokens.shape[0]) - s.prompt_length for s in self.train)


def validation_keys(done_keys: list[str], count: int) -> set[str]:
    """Keys of the validation sequences: done_keys[0 : stride · count : stride]; ValueError when there
    are fewer than stride · count sequences."""
    if count < 0:
        raise ValueError(f"validation sequences must be >= 0, got {count}")
    if len(done_keys) < VALIDATION_STRIDE * count:
        raise ValueError(
            f"{count} validation sequences need {VALIDATION_STRIDE * count} generated sequences, the token "
            f"data has {len(done_keys)}; generate more chunks or ask for fewer"
        )
    return set(done_keys[0 : VALIDATION_STRIDE * count : VALIDATION_STRIDE])


def load_token_training(folder: Path, validation_sequences: int) -> TokenTrainingData:
    """The training and validation sequences of a token-data folder (ValueError if it has none)."""
    manifest = read_token_manifest(folder)
    if manifest is None or not manifest.chunks:
        raise ValueError(f"{folder}: no generated chunk yet; run python -m bastion_sglang.training.token_gen")
    held = validation_keys(manifest.done_keys, validation_sequences)
    sequences = [training_sequence(s) for s in load_token_data(folder)]
    usable = [s for s in sequences if len(s.anchor_range) > 0]
    return TokenTrainingData(
        train=[s for s in usable if s.key not in held],
        validation=[s for s in usable if s.key in held],
        manifest=manifest,
    )
