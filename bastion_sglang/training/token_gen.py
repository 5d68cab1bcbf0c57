"""Generate a token-data folder (`training.token_data`) with `sglang.Engine`: many requests at once.

The target answers the training split of each prompt set greedily through an in-process `sglang.Engine`
(no speculation), one `generate` call per chunk of `chunk_size` prompts, so the scheduler batches up to
`max_running_requests` of them per forward. Each finished chunk is written and the manifest rewritten
before the next starts; a rerun with the same settings resumes at the next unfinished chunk (ValueError
naming the differing field otherwise; the chunk size may change). The held-out split is never generated.

    python -m bastion_sglang.training.token_gen --target $(bastion demo setup --print-path) \
        --out data/demo-regenerated

Run with OMP_NUM_THREADS=1 to keep the job on one core (SGLang's CPU scheduler uses torch's threads).
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from bastion_sglang.assets.prompt_sets import PROMPT_SETS, chat_prompt_ids, interleave_prompts
from bastion_sglang.training.data import target_fingerprint
from bastion_sglang.training.token_data import (
    CHUNK_PATTERN,
    TokenChunk,
    TokenDataManifest,
    TokenGenSettings,
    read_token_manifest,
    write_chunk,
    write_token_manifest,
)

logger = logging.getLogger(__name__)

DEFAULT_CHUNK_SIZE = 256
DEFAULT_MAX_NEW_TOKENS = 128
DEFAULT_MAX_PROMPT_TOKENS = 512


def plan_manifest(
    target: Path,
    sets: Sequence[str],
    *,
    dtype: Literal["float32", "bfloat16"],
    max_new_tokens: int,
    max_prompt_tokens: int,
    chunk_size: int,
) -> tuple[TokenDataManifest, dict[str, list[int]]]:
    """(a new manifest with no chunks, prompt key -> templated prompt ids) for the training split of
    `sets`, interleaved set by set so that the first chunks mix the sets."""
    import sglang
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target)
    prompts = interleave_prompts(list(sets), "train")  # type: ignore[arg-type]
    prompt_ids = {p.key: chat_prompt_ids(tokenizer, p) for p in prompts}
    if len(prompt_ids) != len(prompts):
        raise ValueError("prompt keys must be unique; two prompts share a '<set>/<id>' key")
    planned = tuple(p.key for p in prompts)
    manifest = TokenDataManifest(
        target=target.name,
        settings=TokenGenSettings(
            target_fingerprint=target_fingerprint(target),
            sglang_version=sglang.__version__,
            dtype=dtype,
            max_new_tokens=max_new_tokens,
            max_prompt_tokens=max_prompt_tokens,
        ),
        prompt_sets=tuple(sets),
        chunk_size=chunk_size,
        planned_keys=planned,
        skipped_keys=tuple(k for k in planned if len(prompt_ids[k]) > max_prompt_tokens),
    )
    return manifest, prompt_ids


def check_resumable(out: Path, stored: TokenDataManifest, planned: TokenDataManifest) -> None:
    """Raise ValueError naming the first field of `planned` that differs from the stored manifest's."""
    for field in ("target", "settings", "prompt_sets", "split", "planned_keys", "skipped_keys"):
        if getattr(stored, field) != getattr(planned, field):
            raise ValueError(
                f"{out}/manifest.json: {field} differs from this run's ({getattr(stored, field)!r:.200} "
                f"vs {getattr(planned, field)!r:.200}); use another --out or the stored settings"
            )


def start_engine(target: Path, dtype: str, max_running_requests: int, max_total_tokens: int):
    """An in-process `sglang.Engine` for plain greedy generation on the CPU (token ids in and out)."""
    from sglang.srt.entrypoints.engine import Engine
    from sglang.srt.server_args import ServerArgs

    return Engine(
        server_args=ServerArgs(
            model_path=str(target),
            device="cpu",
            attention_backend="torch_native",
            disable_cuda_graph=True,
            dtype=dtype,
            max_running_requests=max_running_requests,
            max_total_tokens=max_total_tokens,
            mem_fraction_static=0.2,
            skip_tokenizer_init=True,
            random_seed=0,
            log_level="error",
        )
    )


def generate(
    target: Path,
    out: Path,
    sets: Sequence[str] = PROMPT_SETS,
    *,
    dtype: Literal["float32", "bfloat16"] = "float32",
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    max_prompt_tokens: int = DEFAULT_MAX_PROMPT_TOKENS,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    max_running_requests: int = 128,
    max_total_tokens: int = 65536,
    max_chunks: int | None = None,
) -> TokenDataManifest:
    """Generate (or resume) the token-data folder `out`; at most `max_chunks` new chunks when given."""
    planned, prompt_ids = plan_manifest(
        target,
        sets,
        dtype=dtype,
        max_new_tokens=max_new_tokens,
        max_prompt_tokens=max_prompt_tokens,
        chunk_size=chunk_size,
    )
    out.mkdir(parents=True, exist_ok=True)
    manifest = read_token_manifest(out)
    if manifest is None:
        manifest = planned
        write_token_manifest(out, manifest)
    else:
        check_resumable(out, manifest, planned)
        manifest.chunk_size = chunk_size
    todo = manifest.todo_keys
    batches = [todo[i : i + chunk_size] for i in range(0, len(todo), chunk_size)][:max_chunks]
    logger.info("%s: %d prompts to generate in %d chunks", out, len(todo), len(batches))
    if not batches:
        return manifest
    engine = start_engine(target, dtype, max_running_requests, max_total_tokens)
    try:
        for keys in batches:
            began = time.perf_counter()
            outputs = engine.generate(
                input_ids=[prompt_ids[k] for k in keys],
                sampling_params={"temperature": 0.0, "max_new_tokens": max_new_tokens},
            )
            seconds = time.perf_counter() - began
            responses = [list(o["output_ids"]) for o in outputs]
            file = CHUNK_PATTERN.format(index=len(manifest.chunks))
            digest = write_chunk(out / file, [prompt_ids[k] for k in keys], responses)
            manifest.chunks.append(
                TokenChunk(
                    file=file,
                    sha256=digest,
                    prompt_keys=tuple(keys),
                    prompt_tokens=sum(len(prompt_ids[k]) for k in keys),
                    response_tokens=sum(map(len, responses)),
                    generation_seconds=seconds,
                )
            )
            write_token_manifest(out, manifest)
            chunk = manifest.chunks[-1]
            logger.info(
                "%s: %d sequences, %d response tokens in %.0f s (%.1f tokens/s); %d of %d done",
                file,
                len(keys),
                chunk.response_tokens,
                seconds,
                chunk.response_tokens / seconds,
                len(manifest.done_keys),
                len(manifest.planned_keys) - len(manifest.skipped_keys),
            )
    finally:
        engine.shutdown()
    return manifest


def main(argv: Sequence[str] | None = None) -> int:
    """Command line of the module (module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=Path, required=True, help="target model folder (Hugging Face)")
    parser.add_argument("--out", type=Path, required=True, help="token-data folder to write or resume")
    parser.add_argument("--prompt-sets", type=lambda t: t.split(","), default=list(PROMPT_SETS))
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS)
    parser.add_argument("--max-prompt-tokens", type=int, default=DEFAULT_MAX_PROMPT_TOKENS)
    parser.add_argument("--chunk-size", type=int, default=DEFAULT_CHUNK_SIZE, help="prompts per chunk")
    parser.add_argument("--max-running-requests", type=int, default=128)
    parser.add_argument("--max-total-tokens", type=int, default=65536, help="KV cache tokens")
    parser.add_argument("--max-chunks", type=int, default=None, help="stop after this many new chunks")
    args = parser.parse_args(argv)
    handler = logging.StreamHandler()  # its own handler: the Engine sets the root logger to its log level
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    logger.info("torch threads: OMP_NUM_THREADS=%s", os.environ.get("OMP_NUM_THREADS", "unset"))
    manifest = generate(
        args.target.resolve(),
        args.out,
        args.prompt_sets,
        dtype=args.dtype,
        max_new_tokens=args.max_new_tokens,
        max_prompt_tokens=args.max_prompt_tokens,
        chunk_size=args.chunk_size,
        max_running_requests=args.max_running_requests,
        max_total_tokens=args.max_total_tokens,
        max_chunks=args.max_chunks,
    )
    print(
        f"{args.out}: {len(manifest.done_keys)} sequences, {manifest.response_tokens} response tokens, "
        f"{manifest.generation_seconds:.0f} s of generation"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
