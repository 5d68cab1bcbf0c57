"""Committed regenerated data: the target's greedy answers as token ids only, in compressed chunks.

A token-data folder holds `manifest.json` (`TokenDataManifest`) and chunk files `chunk-NNNNN.npz`
(numpy `savez_compressed`), each with four arrays for the n sequences of its `TokenChunk` entry:
- `prompt_tokens` [sum of prompt lengths] uint16 and `prompt_offsets` [n + 1] int32: prompt i is
  prompt_tokens[prompt_offsets[i]:prompt_offsets[i+1]] (the chat-templated first user turn);
- `response_tokens` [sum of response lengths] uint16 and `response_offsets` [n + 1] int32: the target's
  greedy answer (its final EOS included when it stopped on one).
Features are not stored: training computes the target's hidden states from the ids. The manifest is
rewritten atomically after each chunk, so an interrupted run resumes at the next unfinished chunk.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

MANIFEST_NAME = "manifest.json"
CHUNK_PATTERN = "chunk-{index:05d}.npz"
CHUNK_ARRAYS = ("prompt_tokens", "prompt_offsets", "response_tokens", "response_offsets")
MAX_TOKEN_ID = np.iinfo(np.uint16).max


class TokenGenSettings(BaseModel):
    """What determines the generated tokens; a resumed run must use the same values."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    target_fingerprint: str = Field(description="training.data.target_fingerprint() of the target folder")
    engine: Literal["sglang"] = "sglang"
    sglang_version: str
    dtype: Literal["float32", "bfloat16"]
    max_new_tokens: int = Field(gt=0)
    max_prompt_tokens: int = Field(gt=0, description="prompts longer than this (templated) are skipped")
    temperature: Literal[0.0] = Field(default=0.0, description="greedy")


class TokenChunk(BaseModel):
    """One finished chunk file and the sequences it holds, in order."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    file: str
    sha256: str = Field(description="SHA-256 of the chunk file's bytes")
    prompt_keys: tuple[str, ...] = Field(min_length=1, description="'<set>/<id>' of each sequence")
    prompt_tokens: int = Field(gt=0)
    response_tokens: int = Field(gt=0)
    generation_seconds: float = Field(ge=0, description="wall time of the chunk's generate call")


class TokenDataManifest(BaseModel):
    """manifest.json of a token-data folder."""

    model_config = ConfigDict(extra="forbid")

    format_version: Literal[1] = 1
    target: str = Field(description="name of the target folder the data was generated with")
    settings: TokenGenSettings
    prompt_sets: tuple[str, ...] = Field(min_length=1)
    split: Literal["train"] = Field(default="train", description="held-out prompts are never generated")
    chunk_size: int = Field(
        gt=0,
        description="prompts per chunk in the latest run; a resumed run may change it",
    )
    planned_keys: tuple[str, ...] = Field(description="prompt keys in generation order")
    skipped_keys: tuple[str, ...] = Field(default=(), description="prompts over max_prompt_tokens")
    chunks: list[TokenChunk] = Field(default_factory=list)

    @property
    def done_keys(self) -> list[str]:
        """Keys of the generated sequences, in chunk order."""
        return [key for chunk in self.chunks for key in chunk.prompt_keys]

    @property
    def response_tokens(self) -> int:
        """Response tokens over all finished chunks."""
        return sum(chunk.response_tokens for chunk in self.chunks)

    @property
    def generation_seconds(self) -> float:
        """Wall time of all finished chunks' generate calls."""
        return sum(chunk.generation_seconds for chunk in self.chunks)

    @property
    def todo_keys(self) -> list[str]:
        """Planned, non-skipped keys not yet in a chunk, in generation order."""
        done = set(self.done_keys) | set(self.skipped_keys)
        return [key for key in self.planned_keys if key not in done]


@dataclass(frozen=True)
class TokenSequence:
    """One generated sequence: prompt [P] and response [R] token ids (int64 numpy arrays)."""

    key: str
    prompt: np.ndarray
    response: np.ndarray

    @property
    def source(self) -> str:
        """The prompt set the sequence comes from."""
        return self.key.split("/", 1)[0]


def read_token_manifest(folder: Path) -> TokenDataManifest | None:
    """The manifest of a token-data folder, None if there is none; ValueError naming the file if bad."""
    path = folder / MANIFEST_NAME
    if not path.is_file():
        return None
    try:
        return TokenDataManifest.model_validate_json(path.read_text(encoding="utf-8"))
    except ValidationError as error:
        raise ValueError(f"{path}: not a token-data manifest: {error}") from None


def write_token_manifest(folder: Path, manifest: TokenDataManifest) -> None:
    """Write manifest.json through a temporary file and a rename, so a crash never leaves half a file."""
    tmp = folder / (MANIFEST_NAME + ".tmp")
    tmp.write_text(manifest.model_dump_json(indent=1) + "\n", encoding="utf-8")
    tmp.replace(folder / MANIFEST_NAME)


def _packed(rows: Sequence[Sequence[int]], what: str) -> tuple[np.ndarray, np.ndarray]:
    """(uint16 tokens, int32 offsets) of rows; ValueError if an id does not fit in uint16."""
    lengths = np.array([len(r) for r in rows], dtype=np.int64)
    flat = np.fromiter((t for r in rows for t in r), dtype=np.int64, count=int(lengths.sum()))
    if flat.size and (flat.min() < 0 or flat.max() > MAX_TOKEN_ID):
        raise ValueError(f"{what}: token id outside 0..{MAX_TOKEN_ID} cannot be stored as uint16")
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    return flat.astype(np.uint16), offsets


def write_chunk(path: Path, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]]) -> str:
    """Write one chunk file (module docstring) and return its SHA-256."""
    if len(prompts) != len(responses) or not prompts:
        raise ValueError(
            f"{path}: need as many responses as prompts, at least one ({len(prompts)}, {len(responses)})"
        )
    prompt_tokens, prompt_offsets = _packed(prompts, f"{path} prompts")
    response_tokens, response_offsets = _packed(responses, f"{path} responses")
    tmp = path.with_suffix(".tmp.npz")
    np.savez_compressed(
        tmp,
        prompt_tokens=prompt_tokens,
        prompt_offsets=prompt_offsets,
        response_tokens=response_tokens,
        response_offsets=response_offsets,
    )
    tmp.replace(path)
    return hashlib.sha256(path.read_bytes()).hexdigest()


def read_chunk(folder: Path, chunk: TokenChunk) -> list[TokenSequence]:
    """The sequences of one chunk; ValueError naming the file if it differs from its manifest entry."""
    path = folder / chunk.file
    if not path.is_file():
        raise ValueError(f"{path}: chunk listed in {folder / MANIFEST_NAME} is missing")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != chunk.sha256:
        raise ValueError(f"{path}: SHA-256 {digest} differs from the manifest's {chunk.sha256}")
    with np.load(path) as arrays:
        missing = set(CHUNK_ARRAYS) - set(arrays.files)
        if missing:
            raise ValueError(f"{path}: chunk lacks arrays {sorted(missing)}")
        data = {name: arrays[name].astype(np.int64) for name in CHUNK_ARRAYS}
    count = len(chunk.prompt_keys)
    for name in ("prompt_offsets", "response_offsets"):
        if len(data[name]) != count + 1:
            raise ValueError(f"{path}: {name} has {len(data[name])} entries, expected {count + 1}")
    prompt_total, response_total = int(data["prompt_offsets"][-1]), int(data["response_offsets"][-1])
    if (prompt_total, response_total) != (chunk.prompt_tokens, chunk.response_tokens):
        raise ValueError(
            f"{path}: {prompt_total} prompt and {response_total} response tokens, the manifest says "
            f"{chunk.prompt_tokens} and {chunk.response_tokens}"
        )
    po, ro = data["prompt_offsets"], data["response_offsets"]
    return [
        TokenSequence(
            key=key,
            prompt=data["prompt_tokens"][po[i] : po[i + 1]],
            response=data["response_tokens"][ro[i] : ro[i + 1]],
        )
        for i, key in enumerate(chunk.prompt_keys)
    ]


def load_token_data(folder: Path, max_chunks: int | None = None) -> list[TokenSequence]:
    """All sequences of a token-data folder (its first max_chunks chunks when given), in chunk order."""
    manifest = read_token_manifest(folder)
    if manifest is None:
        raise ValueError(f"{folder}: no {MANIFEST_NAME}; not a token-data folder")
    chunks = manifest.chunks if max_chunks is None else manifest.chunks[:max_chunks]
    return [sequence for chunk in chunks for sequence in read_chunk(folder, chunk)]
