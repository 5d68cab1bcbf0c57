"""What a tree step's commit costs on the CPU with paged KV: `TreeCommit` at page size 1 (slot ids permuted)
against page size N (the accepted path's KV copied), on a KV pool shaped like a model's.

    python benchmarks/paged_commit.py --model-path DIR [--page-size 16] [--batches 1 8] [--width 13]
        [--accepted 1 3 6] [--repeats 200] [--out paged_commit.json]

The pool is SGLang's MHATokenToKVPool with the model's layers, KV heads and head size in fp32 (the CPU
exactness dtype), its all-layer copy BASTION's CPU stand-in, installed as in a serving process
(`cpu_support.install_bastion_stand_ins`). Each case commits B requests whose verify rows of W positions
accepted a path of `a` nodes on every other row position (0, 2, 4, ...: not a prefix of the row, as the
decoy oracle's trees; a copy moves all a nodes) into windows that cross a page boundary. The drafter KV append
is left out: it writes the same rows at every page size. Each case is warmed up, then timed `repeats` times
(`timing.time_op`); prints the median µs per commit at both page sizes and their difference (what the copy
adds to a step), and `commit.kv_copy_seconds_per_token` at W slots (what the planner adds per verify token).
Nothing is asserted: the figures are for reading.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from bastion_sglang import kernels
from bastion_sglang.integration.cpu_support import install_bastion_stand_ins
from bastion_sglang.step.commit import TreeCommit, kv_copy_seconds_per_token
from bastion_sglang.step.timing import time_op

POOL_SLOTS = 8192
"""Slots of the benchmark's KV pool (the exactness tests' --max-total-tokens)."""
CONTEXT = 200
"""Committed tokens before each request's window: the window starts 200 % page size slots into a page."""
HIDDEN = 64
"""Width of the stand-in hidden states the commit gathers (the drafter append that reads them is left out)."""
WARMUP = 10


def kv_pool(config: dict[str, Any], page_size: int) -> Any:
    """SGLang's fp32 MHA pool of POOL_SLOTS slots with the model's KV shape."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    heads = int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    return MHATokenToKVPool(
        size=POOL_SLOTS,
        page_size=page_size,
        dtype=torch.float32,
        head_num=int(config.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        layer_num=int(config["num_hidden_layers"]),
        device="cpu",
        enable_memory_saver=False,
        enable_kv_cache_copy=True,
    )


def commit_seconds(
    pool: Any, page_size: int, batch: int, width: int, accepted: int, repeats: int
) -> list[float]:
    """Seconds of each timed `TreeCommit.commit` of the case (module docstring)."""
    columns = CONTEXT + width
    req_to_token = torch.arange(batch * columns, dtype=torch.int32).view(batch, columns) + page_size
    worker = SimpleNamespace(
        model_runner=SimpleNamespace(
            req_to_token_pool=SimpleNamespace(req_to_token=req_to_token), token_to_kv_pool=pool
        ),
        device="cpu",
        _append_target_hidden_to_draft_kv_by_loc=lambda **kwargs: None,
    )
    accept_index = torch.full((batch, width), kernels.NO_NODE, dtype=torch.int64)
    accept_index[:, : accepted + 1] = torch.arange(0, 2 * accepted + 1, 2)
    accept_length = torch.full((batch,), accepted, dtype=torch.int64)
    order = kernels.compaction_order(accept_index, accept_length)
    rows_index = torch.arange(batch)[:, None]
    window = torch.full((batch, 1), CONTEXT) + torch.arange(width)
    slots = req_to_token[rows_index, window].to(torch.int64)
    hidden = torch.zeros(batch, width, HIDDEN)
    commit_lens = (accept_length + 1).to(torch.int32)
    commit = TreeCommit(worker, page_size)
    return time_op(
        lambda: commit.commit(rows_index, slots, window, order, hidden, commit_lens),
        torch.device("cpu"),
        WARMUP,
        repeats,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", type=Path, required=True, help="a folder holding config.json")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--width", type=int, default=13, help="verify width W (fixed:12 verifies 13)")
    parser.add_argument("--accepted", type=int, nargs="+", default=[1, 3, 6])
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if any(2 * a + 1 > args.width for a in args.accepted):
        parser.error(f"--accepted needs 2 a + 1 <= --width {args.width}")
    install_bastion_stand_ins()
    config = json.loads((args.model_path / "config.json").read_text())
    pools = {size: kv_pool(config, size) for size in (1, args.page_size)}
    rows = []
    for batch in args.batches:
        for accepted in args.accepted:
            medians = {
                size: statistics.median(commit_seconds(pool, size, batch, args.width, accepted, args.repeats))
                for size, pool in pools.items()
            }
            rows.append(
                {
                    "batch": batch,
                    "width": args.width,
                    "accepted": accepted,
                    "permute_us": medians[1] * 1e6,
                    "copy_us": medians[args.page_size] * 1e6,
                    "added_us": (medians[args.page_size] - medians[1]) * 1e6,
                }
            )
            row = rows[-1]
            print(
                f"B {batch:2d}  W {args.width}  a {accepted:2d}: page 1 {row['permute_us']:8.1f} µs, "
                f"page {args.page_size} {row['copy_us']:8.1f} µs, copy adds {row['added_us']:8.1f} µs"
            )
    runner = SimpleNamespace(token_to_kv_pool=pools[args.page_size])
    per_token = kv_copy_seconds_per_token(SimpleNamespace(device="cpu", model_runner=runner), args.width)
    print(f"priced per verify token (copy of {args.width} slots): {per_token * 1e6:.2f} µs")
    if args.out is not None:
        report = {"model": str(args.model_path), "page_size": args.page_size, "rows": rows}
        report["priced_us_per_token"] = per_token * 1e6
        args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
