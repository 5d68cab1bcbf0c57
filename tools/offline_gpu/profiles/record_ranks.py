"""Record the rank histogram of the demo pair (SmolLM2-135M-Instruct and its DFlash drafter) on the CPU.

    python tools/offline_gpu/profiles/record_ranks.py --target "$(bastion demo setup --print-path)" \
        [--prompts 30 --max-new-tokens 64 --threads 1 \
         --out tools/offline_gpu/profiles/smollm2-135m-dflash-ranks.json]

The reference engine decodes training-split prompts (never the held-out split) of MT-Bench, HumanEval and
ShareGPT, interleaved, greedily with a fixed tree of 16 draft nodes (`calibration.acceptance_run`); every
drafter pass's top-8 and the target's tokens after its root are counted by position and rank
(`calibration.rank_histogram`). The file holds the counts and what produced them, so that
`fit_acceptance.py` fits the shaped profiles from it without running the drafter again.
"""

from __future__ import annotations

import argparse
import hashlib
import shlex
import subprocess
import sys
from pathlib import Path

import torch

from bastion_sglang.assets.prompt_sets import PromptSet, chat_prompt_ids, interleave_prompts
from bastion_sglang.calibration.acceptance_fit import AcceptanceSettings
from bastion_sglang.calibration.acceptance_run import decode_passes
from bastion_sglang.calibration.identity import dtype_name
from bastion_sglang.calibration.rank_histogram import RankHistogram, count_ranks

REPOSITORY = Path(__file__).resolve().parents[3]
DRAFTER = Path("models/smollm2-135m-instruct-dflash")
PROMPT_SETS: tuple[PromptSet, ...] = ("mtbench", "humaneval", "sharegpt")
DEPTH = 15
"""Draft positions of the drafter's block of 16."""
RANKS = 8
DECODE_BUDGET = 16
MAX_PROMPT_TOKENS = 512


def weights_sha256(folder: Path) -> str:
    """SHA-256 of `folder`/model.safetensors; ValueError naming the file when it is missing."""
    path = folder / "model.safetensors"
    if not path.is_file():
        raise ValueError(f"{path}: no such file (the model's weights)")
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()


def head_commit() -> str:
    """The repository's HEAD commit."""
    done = subprocess.run(
        ["git", "-C", str(REPOSITORY), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
    )
    return done.stdout.strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--target", type=Path, required=True, help="the demo target's folder")
    parser.add_argument("--drafter", type=Path, default=DRAFTER)
    parser.add_argument("--prompts", type=int, default=30, help="training-split prompts decoded")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (the machine is shared)")
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).resolve().parent / "smollm2-135m-dflash-ranks.json"
    )
    args = parser.parse_args(argv)
    commit = head_commit()  # the code that runs: read before the decode, which takes a while
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(args.target))
    keys, prompts = [], []
    for prompt in interleave_prompts(PROMPT_SETS, "train"):
        ids = chat_prompt_ids(tokenizer, prompt)
        if len(ids) <= MAX_PROMPT_TOKENS:
            keys.append(prompt.key)
            prompts.append(ids)
        if len(prompts) == args.prompts:
            break
    dtype = torch.float32
    settings = AcceptanceSettings(
        num_prompts=args.prompts, max_new_tokens=args.max_new_tokens, topk=RANKS, decode_budget=DECODE_BUDGET
    )
    per_prompt = decode_passes(
        args.target, args.drafter, prompts, device=torch.device("cpu"), dtype=dtype, settings=settings
    )
    passes = [record for records in per_prompt for record in records]
    histogram = RankHistogram(
        drafter=str(args.drafter),
        drafter_sha256=weights_sha256(args.drafter),
        target=args.target.name,
        target_sha256=weights_sha256(args.target),
        dtype=dtype_name(dtype),
        prompt_sets=PROMPT_SETS,
        prompt_keys=tuple(keys),
        max_new_tokens=args.max_new_tokens,
        decode_budget=DECODE_BUDGET,
        commit=commit,
        command=shlex.join(["python", "tools/offline_gpu/profiles/record_ranks.py", *sys.argv[1:]]),
        counts=count_ranks(passes, DEPTH, RANKS),
    )
    args.out.write_text(histogram.model_dump_json(indent=2) + "\n", encoding="utf-8")
    print(
        f"{args.out}: {len(passes)} drafter passes of {len(prompts)} prompts; "
        f"passes per position {histogram.passes()}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
