"""Target-regenerated training data with captured features.

Prompts come from `bastion_sglang.assets.prompt_sets` (the training split of each set). The target answers
each training prompt (chat template, greedy), and the outputs of its layers `target_layer_ids` (HF
`hidden_states[l + 1]`) are captured by forward hooks in the same generation pass (no second forward). Each
batch becomes one shard file; the manifest (`RegeneratedManifest`, rewritten after every shard) lists the
finished shards, so an interrupted run resumes at the next unfinished batch.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from bastion_sglang.assets import sha256_file
from bastion_sglang.assets.prompt_sets import Prompt, chat_prompt_ids

logger = logging.getLogger(__name__)

MANIFEST_NAME = "manifest.json"
SHARD_PATTERN = "shard-{index:05d}.safetensors"


class GenerationSettings(BaseModel):
    """What determines the regenerated data; a resumed run must use the same values."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    target_fingerprint: str = Field(description="target_fingerprint() of the target folder")
    target_layer_ids: tuple[int, ...] = Field(min_length=1, description="captured layers, 0-based")
    max_new_tokens: int = Field(gt=0)
    max_prompt_tokens: int = Field(gt=0, description="prompts longer than this (templated) are skipped")
    dtype: Literal["float32", "bfloat16"] = Field(description="target dtype during generation")
    greedy: Literal[True] = True


class ShardEntry(BaseModel):
    """One finished shard: a batch of sequences (prompt + response) with their features."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    file: str
    prompt_keys: tuple[str, ...] = Field(min_length=1)
    num_tokens: int = Field(gt=0)
    num_response_tokens: int = Field(gt=0)


class RegeneratedManifest(BaseModel):
    """manifest.json of a regenerated data folder; rewritten (atomically) after each shard."""

    model_config = ConfigDict(extra="forbid")

    format_version: Literal[1] = 1
    target: str = Field(description="target folder the data was generated with")
    settings: GenerationSettings
    planned_keys: tuple[str, ...] = Field(description="prompt keys in generation order")
    skipped_keys: tuple[str, ...] = Field(default=(), description="prompts over max_prompt_tokens")
    shards: list[ShardEntry] = Field(default_factory=list)
    generation_seconds: float = Field(default=0.0, ge=0, description="wall time spent generating, summed")

    @property
    def done_keys(self) -> set[str]:
        """Keys of the prompts whose sequences are in finished shards."""
        return {key for shard in self.shards for key in shard.prompt_keys}

    @property
    def complete(self) -> bool:
        """True when every planned, non-skipped prompt is in a finished shard."""
        return len(self.done_keys) + len(self.skipped_keys) >= len(self.planned_keys)


def target_fingerprint(target: Path) -> str:
    """SHA-256 over config.json and every *.safetensors file of a target folder (names and contents)."""
    digest = hashlib.sha256()
    files = [target / "config.json", *sorted(target.glob("*.safetensors"))]
    for path in files:
        if not path.is_file():
            raise ValueError(f"{path}: missing; a target folder needs config.json and safetensors weights")
        digest.update(f"{path.name} {sha256_file(path)}\n".encode())
    return digest.hexdigest()


def read_manifest(folder: Path) -> RegeneratedManifest | None:
    """The manifest of a regenerated data folder, None if there is none yet; ValueError if it is bad."""
    path = folder / MANIFEST_NAME
    if not path.is_file():
        return None
    try:
        return RegeneratedManifest.model_validate_json(path.read_text(encoding="utf-8"))
    except ValidationError as error:
        raise ValueError(f"{path}: not a regenerated-data manifest: {error}") from None


def _write_manifest(folder: Path, manifest: RegeneratedManifest) -> None:
    """Write manifest.json through a temporary file and a rename, so a crash never leaves half a file."""
    tmp = folder / (MANIFEST_NAME + ".tmp")
    tmp.write_text(manifest.model_dump_json(indent=1) + "\n", encoding="utf-8")
    tmp.replace(folder / MANIFEST_NAME)


def regenerate(
    target: Path,
    prompts: Sequence[Prompt],
    out: Path,
    *,
    target_layer_ids: Sequence[int],
    max_new_tokens: int = 256,
    max_prompt_tokens: int = 512,
    batch_size: int = 32,
    dtype: Literal["float32", "bfloat16"] = "bfloat16",
    device: str = "cpu",
) -> RegeneratedManifest:
    """Have the target answer `prompts` greedily and store tokens and captured features in `out`.

    Resumes from `out`'s manifest when it exists (same settings and prompt plan required, else ValueError
    naming the differing field). Prompts are generated in order of templated length (less padding);
    those longer than max_prompt_tokens are skipped and listed. Returns the final manifest.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target)
    prompt_ids = {p.key: chat_prompt_ids(tokenizer, p) for p in prompts}
    if len(prompt_ids) != len(prompts):
        raise ValueError("prompt keys must be unique; two prompts share a '<source>/<id>' key")
    settings = GenerationSettings(
        target_fingerprint=target_fingerprint(target),
        target_layer_ids=tuple(target_layer_ids),
        max_new_tokens=max_new_tokens,
        max_prompt_tokens=max_prompt_tokens,
        dtype=dtype,
    )
    planned = tuple(sorted(prompt_ids, key=lambda key: len(prompt_ids[key])))
    skipped = tuple(key for key in planned if len(prompt_ids[key]) > max_prompt_tokens)
    out.mkdir(parents=True, exist_ok=True)
    manifest = read_manifest(out)
    if manifest is None:
        manifest = RegeneratedManifest(
            target=str(target), settings=settings, planned_keys=planned, skipped_keys=skipped
        )
        _write_manifest(out, manifest)
    else:
        _check_resumable(out, manifest, settings, planned)
    todo = [key for key in planned if key not in manifest.done_keys and key not in skipped]
    if not todo:
        logger.info("%s: all %d sequences already generated", out, len(manifest.done_keys))
        return manifest
    logger.info(
        "%s: generating %d sequences (%d done, %d skipped as longer than %d tokens), batch %d, %s on %s",
        out,
        len(todo),
        len(manifest.done_keys),
        len(skipped),
        max_prompt_tokens,
        batch_size,
        dtype,
        device,
    )
    model = AutoModelForCausalLM.from_pretrained(target, dtype=getattr(torch, dtype)).to(device).eval()
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos_ids = _eos_ids(model)
    with tqdm(total=len(todo), desc="regenerate", unit="seq") as bar:
        for start in range(0, len(todo), batch_size):
            keys = todo[start : start + batch_size]
            began = time.perf_counter()
            batch = generate_with_features(
                model, [prompt_ids[k] for k in keys], target_layer_ids, max_new_tokens, pad_id, eos_ids
            )
            index = len(manifest.shards)
            file = SHARD_PATTERN.format(index=index)
            save_file(batch.to_tensors(), str(out / file))
            manifest.shards.append(
                ShardEntry(
                    file=file,
                    prompt_keys=tuple(keys),
                    num_tokens=int(batch.offsets[-1]),
                    num_response_tokens=int(batch.response_tokens()),
                )
            )
            manifest.generation_seconds += time.perf_counter() - began
            _write_manifest(out, manifest)
            bar.update(len(keys))
            bar.set_postfix(tokens=sum(s.num_response_tokens for s in manifest.shards))
    logger.info(
        "%s: %d sequences, %d response tokens, %.0f s of generation",
        out,
        len(manifest.done_keys),
        sum(s.num_response_tokens for s in manifest.shards),
        manifest.generation_seconds,
    )
    return manifest


def _check_resumable(
    out: Path, manifest: RegeneratedManifest, settings: GenerationSettings, planned: tuple[str, ...]
) -> None:
    """Raise ValueError naming the first setting that differs from the stored run's."""
    stored = manifest.settings.model_dump()
    for field, value in settings.model_dump().items():
        if stored[field] != value:
            raise ValueError(
                f"{out / MANIFEST_NAME}: settings.{field} is {stored[field]!r} but this run asks for "
                f"{value!r}; use another --data-dir or the stored setting"
            )
    if manifest.planned_keys != planned:
        raise ValueError(
            f"{out / MANIFEST_NAME}: the stored prompt plan ({len(manifest.planned_keys)} prompts) differs "
            f"from this run's ({len(planned)}); use another --data-dir or the same prompt options"
        )


def _eos_ids(model: torch.nn.Module) -> set[int]:
    """The generation config's end-of-sequence ids as a set."""
    eos = model.generation_config.eos_token_id
    if eos is None:
        raise ValueError("the target's generation_config has no eos_token_id")
    return {int(eos)} if isinstance(eos, int) else {int(i) for i in eos}


@dataclass(frozen=True)
class SequenceBatch:
    """Sequences (prompt + response) packed end to end, with the target features of every position.

    tokens: [total] int64; offsets: [n + 1] int64, sequence i is tokens[offsets[i]:offsets[i+1]];
    prompt_lengths: [n] int64; features: [total, F·h] (F captured layers in target_layer_ids order);
    the row of each sequence's last token is zero: that token was never fed to the target.
    """

    tokens: torch.Tensor
    offsets: torch.Tensor
    prompt_lengths: torch.Tensor
    features: torch.Tensor

    def response_tokens(self) -> int:
        """Response tokens over all sequences."""
        return int((self.offsets[1:] - self.offsets[:-1] - self.prompt_lengths).sum())

    def to_tensors(self) -> dict[str, torch.Tensor]:
        """The shard file's tensors (features stored in bfloat16)."""
        return {
            "tokens": self.tokens.to(torch.int32).contiguous(),
            "offsets": self.offsets.contiguous(),
            "prompt_lengths": self.prompt_lengths.to(torch.int32).contiguous(),
            "features": self.features.to(torch.bfloat16).contiguous(),
        }

    @classmethod
    def from_file(cls, path: Path) -> SequenceBatch:
        """Read a shard written by `to_tensors`; ValueError naming the file if a tensor is missing."""
        tensors = load_file(str(path))
        missing = {"tokens", "offsets", "prompt_lengths", "features"} - set(tensors)
        if missing:
            raise ValueError(f"{path}: shard lacks tensors {sorted(missing)}")
        return cls(
            tokens=tensors["tokens"].long(),
            offsets=tensors["offsets"].long(),
            prompt_lengths=tensors["prompt_lengths"].long(),
            features=tensors["features"],
        )


@torch.no_grad()
def generate_with_features(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    target_layer_ids: Sequence[int],
    max_new_tokens: int,
    pad_id: int,
    eos_ids: set[int],
) -> SequenceBatch:
    """Greedy-generate a left-padded batch and capture the outputs of layers `target_layer_ids`.

    Hooks on the decoder layers record each forward's output ([b, t, h] per call: the prefill, then one
    position per decode step); their concatenation holds the features of every fed position. A response
    ends after its first EOS or at max_new_tokens.
    """
    layers = model.model.layers
    bad = [i for i in target_layer_ids if not 0 <= i < len(layers)]
    if bad:
        raise ValueError(f"target_layer_ids {bad} outside 0..{len(layers) - 1} of the target's layers")
    captured: dict[int, list[torch.Tensor]] = {i: [] for i in target_layer_ids}

    def hook(index: int):
        def record(_module: torch.nn.Module, _inputs: object, output: object) -> None:
            hidden = output[0] if isinstance(output, tuple) else output
            captured[index].append(hidden.detach().to(torch.bfloat16))

        return record

    handles = [layers[i].register_forward_hook(hook(i)) for i in target_layer_ids]
    device = next(model.parameters()).device
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, ids in enumerate(prompts):
        input_ids[row, width - len(ids) :] = torch.tensor(ids)
        attention_mask[row, width - len(ids) :] = 1
    try:
        output = model.generate(
            input_ids=input_ids.to(device),
            attention_mask=attention_mask.to(device),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=pad_id,
        ).cpu()
    finally:
        for handle in handles:
            handle.remove()
    features = torch.cat(
        [torch.cat(captured[i], dim=1).cpu() for i in target_layer_ids], dim=-1
    )  # [b, width + generated - 1, F·h]
    generated = output[:, width:]
    tokens, feature_rows, prompt_lengths, offsets = [], [], [], [0]
    for row, ids in enumerate(prompts):
        ends = [j for j, token in enumerate(generated[row].tolist()) if token in eos_ids]
        length = ends[0] + 1 if ends else generated.shape[1]
        sequence = torch.cat([torch.tensor(ids), generated[row, :length]])
        rows = features[row, width - len(ids) : width + length - 1]
        tokens.append(sequence)
        feature_rows.append(torch.cat([rows, rows.new_zeros(1, rows.shape[1])]))
        prompt_lengths.append(len(ids))
        offsets.append(offsets[-1] + len(sequence))
    return SequenceBatch(
        tokens=torch.cat(tokens),
        offsets=torch.tensor(offsets, dtype=torch.long),
        prompt_lengths=torch.tensor(prompt_lengths, dtype=torch.long),
        features=torch.cat(feature_rows),
    )


@dataclass(frozen=True)
class TrainingSequence:
    """One regenerated sequence: tokens [T] int64, features [T, F·h] (bf16 view into its shard), P.

    key: the prompt's key ('<source>/<id>'); prompt_length: P, the templated prompt's tokens.
    """

    key: str
    tokens: torch.Tensor
    features: torch.Tensor
    prompt_length: int
    # [T, h] float32: the target's last hidden states (after its final norm), whose LM-head rows are its
    # next-token distributions (`train.TrainConfig.distill`); None where the run does not distil
    teacher_hidden: torch.Tensor | None = None

    @property
    def source(self) -> str:
        """The prompt set (or prompt file name) the sequence comes from."""
        return self.key.split("/", 1)[0]  # a source name never holds '/': sets, or a file's name

    @property
    def anchor_range(self) -> range:
        """Response positions with at least one later token: P..T-2 (the anchors of training blocks)."""
        return range(self.prompt_length, int(self.tokens.shape[0]) - 1)


def load_training_sequences(folder: Path) -> list[TrainingSequence]:
    """The sequences of every finished shard whose response has >= 2 tokens; ValueError if no manifest."""
    manifest = read_manifest(folder)
    if manifest is None:
        raise ValueError(f"{folder}: no {MANIFEST_NAME}; run the regeneration first")
    sequences = []
    for shard in manifest.shards:
        batch = SequenceBatch.from_file(folder / shard.file)
        if int(batch.offsets.shape[0]) - 1 != len(shard.prompt_keys):
            raise ValueError(
                f"{folder / shard.file}: holds another number of sequences than the manifest lists"
            )
        for i, key in enumerate(shard.prompt_keys):
            start, end = int(batch.offsets[i]), int(batch.offsets[i + 1])
            sequence = TrainingSequence(
                key, batch.tokens[start:end], batch.features[start:end], int(batch.prompt_lengths[i])
            )
            if len(sequence.anchor_range) > 0:
                sequences.append(sequence)
    return sequences
