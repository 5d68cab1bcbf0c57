"""The draft vocabulary: the token ids the draft step scores, a subset of the target's vocabulary.

The draft step turns the drafter's hidden states into logits with the target's LM head, [V, H]. Where that
product is bound by reading the head (a CPU, or a GPU with a large vocabulary), scoring only the Vd most
frequent tokens of the target's answers costs Vd / V of it: on the 2-core CPU the demo pair's head over 15
positions took 22.7 ms for V = 49,152 and 2.6 ms for Vd = 8,192 (fp32). The draft then proposes only tokens
of the vocabulary, each with the drafter's probability renormalised over it. Output stays exactly the
target's: the target verifies every proposal and emits its own token where none matches, so a token outside
the vocabulary costs acceptance (the drafter can never guess it), never correctness.

A drafter folder may carry one as `draft_vocab.json` (`DraftVocabulary`, written by `bastion draft-vocab`
from the target's answers). `--bastion-draft-vocab auto` (the default) uses it when present; `full` scores
the whole vocabulary; a path names another file. A vocabulary is read with the tokenizer's ids, so it
fits every target of the same tokenizer: only the vocabulary size is checked against the target.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

DRAFT_VOCAB_FILE = "draft_vocab.json"
"""The file name a drafter folder's draft vocabulary has."""
DraftVocabChoice = Literal["auto", "full"] | Path
"""`--bastion-draft-vocab`: auto (the drafter folder's file, else the whole vocabulary), full, or a file."""


class DraftVocabulary(BaseModel):
    """`draft_vocab.json`: token ids of the target's tokenizer, the most frequent first.

    target_vocab_size: V, the vocabulary size of the target it was counted for. source: what was counted
    (the token-data folder and its prompt sets and split). counted_tokens: tokens counted; coverage: the
    share of them whose id is in `token_ids`.
    """

    model_config = ConfigDict(frozen=True, strict=True, extra="forbid")

    schema_version: Literal[1] = 1
    target_vocab_size: int = Field(ge=1)
    source: str = Field(min_length=1)
    counted_tokens: int = Field(ge=1)
    coverage: float = Field(gt=0.0, le=1.0)
    token_ids: list[int] = Field(min_length=1)

    @field_validator("token_ids")
    @classmethod
    def _distinct_ids(cls, ids: list[int]) -> list[int]:
        repeated = sorted(token for token, count in Counter(ids).items() if count > 1)
        if repeated:
            raise ValueError(f"token ids {repeated[:5]} appear more than once")
        if min(ids) < 0:
            raise ValueError(f"token id {min(ids)} is negative")
        return ids

    @model_validator(mode="after")
    def _ids_in_vocabulary(self) -> DraftVocabulary:
        if max(self.token_ids) >= self.target_vocab_size:
            raise ValueError(
                f"token id {max(self.token_ids)} is outside target_vocab_size {self.target_vocab_size}"
            )
        return self


def read_draft_vocabulary(path: Path) -> DraftVocabulary:
    """The draft vocabulary in `path`. ValueError naming the file and what is wrong with it."""
    try:
        text = path.read_text()
    except OSError as error:
        raise ValueError(f"draft vocabulary {path}: cannot be read ({error.strerror or error})") from error
    try:
        return DraftVocabulary.model_validate(json.loads(text))
    except json.JSONDecodeError as error:
        raise ValueError(f"draft vocabulary {path}: not JSON ({error})") from error
    except ValidationError as error:
        problems = "; ".join(
            f"{'.'.join(str(part) for part in problem['loc']) or 'file'}: {problem['msg']}"
            for problem in error.errors()
        )
        raise ValueError(f"draft vocabulary {path}: {problems}") from error


def write_draft_vocabulary(path: Path, vocabulary: DraftVocabulary) -> None:
    """Write `vocabulary` to `path` (the ids on one line: the file stays a few tens of kB)."""
    path.write_text(vocabulary.model_dump_json() + "\n")


def resolve_draft_vocabulary(
    choice: DraftVocabChoice,
    draft_model_path: str | Path | None,
    vocab_size: int,
    topk: int,
    lattice_drafter: bool = False,
) -> tuple[DraftVocabulary | None, Path | None]:
    """The draft vocabulary a server with `--bastion-draft-vocab choice` drafts over, and its file (None,
    None: the whole vocabulary). draft_model_path: the drafter's folder (auto looks for `DRAFT_VOCAB_FILE`
    there; a hub id or no folder: none). vocab_size: the target's V; topk: K, which the vocabulary must reach.
    lattice_drafter: whether the drafter is a DFlash2 drafter, whose candidate selector scores the whole
    vocabulary: auto then gives none.

    ValueError naming the file: unreadable or malformed, counted for another vocabulary size, fewer ids
    than K, or named for a DFlash2 drafter.
    """
    if choice == "full" or (choice == "auto" and lattice_drafter):
        return None, None
    if lattice_drafter:
        raise ValueError(
            f"--bastion-draft-vocab {choice}: a DFlash2 drafter's candidate selector scores the whole "
            "vocabulary; a draft vocabulary applies to DFlash drafters (pass --bastion-draft-vocab full)"
        )
    if choice == "auto":
        folder = None if draft_model_path is None else Path(draft_model_path)
        if folder is None or not (folder / DRAFT_VOCAB_FILE).is_file():
            return None, None
        path = folder / DRAFT_VOCAB_FILE
    else:
        path = Path(choice)
    vocabulary = read_draft_vocabulary(path)
    if vocabulary.target_vocab_size != vocab_size:
        raise ValueError(
            f"draft vocabulary {path}: target_vocab_size {vocabulary.target_vocab_size} does not match the "
            f"target's vocabulary of {vocab_size} tokens (it was counted for another tokenizer); "
            "pass --bastion-draft-vocab full to score the whole vocabulary"
        )
    if len(vocabulary.token_ids) < topk:
        raise ValueError(
            f"draft vocabulary {path}: {len(vocabulary.token_ids)} token ids, "
            f"fewer than --bastion-topk {topk}"
        )
    return vocabulary, path
