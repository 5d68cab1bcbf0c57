"""Test-only hooks for SGLang's DFLASH worker in a CPU Engine (tests/test_dflash_cpu_engine.py).

Each is a marker object put on the Engine's ServerArgs record as a bookkeeping attribute, as the bench's
`dflash_engine.DflashEngineMarker` is: unpickling it in a scheduler process (tests/ is on its sys.path)
installs the hook there before the scheduler builds its models.

- `ForwardLog(path)`: every `ModelRunner.forward` appends one JSON line: whether the runner is the drafter's,
  the forward mode, the batch size and the tokens of the pass. What a decode step costs, counted.
- `DflashOracle(path)`: the draft's greedy head proposes the reference continuation (the JSON file
  {"prompts": [[ids]], "outputs": [[ids]]} of a run without speculation) for requests whose prompt it
  holds, so long blocks are accepted even with a random drafter and long accepted paths are committed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch


class ForwardLog:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return install_forward_log, (self.path,)


def install_forward_log(path: str) -> ForwardLog:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    def logged(original: Any, runner: Any, forward_batch: Any, *args: Any, **kwargs: Any) -> Any:
        record = {
            "draft": bool(runner.is_draft_worker),
            "mode": forward_batch.forward_mode.name,
            "bs": int(forward_batch.batch_size),
            "tokens": int(forward_batch.input_ids.numel()) if forward_batch.input_ids is not None else 0,
        }
        with open(path, "a", encoding="utf-8") as log:
            log.write(json.dumps(record) + "\n")
        return original(runner, forward_batch, *args, **kwargs)

    HookRegistry.register(
        "sglang.srt.model_executor.model_runner.ModelRunner.forward", logged, HookType.AROUND
    )
    HookRegistry.apply_hooks()
    return ForwardLog(path)


def read_forward_log(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


class DflashOracle:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return install_oracle, (self.path,)


def install_oracle(path: str) -> DflashOracle:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    data = json.loads(Path(path).read_text(encoding="utf-8"))
    references = {tuple(p): list(o) for p, o in zip(data["prompts"], data["outputs"], strict=True)}
    state: dict[str, Any] = {"reqs": []}
    worker = "sglang.srt.speculative.dflash_worker_v2.DFlashWorkerV2"

    def keep_reqs(original: Any, self: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
        state["reqs"] = list(batch.reqs or [])
        state["prefix"] = batch.seq_lens.tolist() if batch.seq_lens is not None else []
        return original(self, batch, *args, **kwargs)

    def propose_reference(original: Any, self: Any, **kwargs: Any) -> torch.Tensor:
        tokens = original(self, **kwargs)
        reqs = state["reqs"]
        if not reqs:
            return tokens
        depth = tokens.shape[0] // len(reqs)
        rows = tokens.view(len(reqs), depth)
        for i, req in enumerate(reqs):
            reference = references.get(tuple(req.origin_input_ids))
            if reference is None:
                continue
            root = state["prefix"][i] - len(req.origin_input_ids)  # output index of the block's first token
            for d in range(1, depth + 1):
                if root + d < len(reference):
                    rows[i, d - 1] = reference[root + d]
        return tokens

    HookRegistry.register(f"{worker}.forward_batch_generation", keep_reqs, HookType.AROUND)
    head = f"{worker}._greedy_sample_from_vocab_parallel_head"
    HookRegistry.register(head, propose_reference, HookType.AROUND)
    HookRegistry.apply_hooks()
    return DflashOracle(path)
