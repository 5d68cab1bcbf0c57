"""SGLang's DFLASH worker under synthetic acceptance (`bastion bench --policies dflash` with it).

BASTION's accept stage under a synthetic profile (`step.synthetic_acceptance`) replaces the target's tokens of
a verify pass by each request's true continuation: at draft position d (sequence position prefix + d) the
drafter's rank-k candidate with the profile's probability q[d, k], none of them with the rest, the rank drawn
from a uniform keyed by the request's seed and the position (`truth_uniforms`, `true_tokens`,
`synthetic_targets`). This seam does the same inside `DFlashWorkerV2`, so the same request seeds meet the same
draws in a `dflash` Engine as in BASTION's, and changes nothing else: DFLASH drafts its block as always,
verifies it at block size, accepts the longest prefix of its chain that matches the target's tokens and
commits as always. Three wraps, installed in the scheduler process (`install`):

- `forward_batch_generation`: before a decode step, the walk key of each request of the batch
  (`kernels.seed_keys` of its sampling_seed, as BASTION's prefill hashes it; the bench seeds every request
  under synthetic acceptance, and a request without a seed is an error here);
- `_greedy_sample_from_vocab_parallel_head` (the draft's greedy head over the target's LM head): the same
  logits, their top K_p ids kept as the step's candidates [B, γ-1, K_p]; the draft token is the first of them
  (the argmax; a top-k costs what the argmax costs at these K_p);
- `_accept_block`: the target's argmax per verify row [B, γ], then `synthetic_targets` over the truth,
  passed to SGLang's greedy accept as its `target_predict`.

Only the drafter's plain greedy head is covered: a DFlash2 drafter's selector or a LiLiCorr head drafts
elsewhere and the accept stage then finds no candidates (RuntimeError). Tensor parallelism and added
vocabulary rows are refused the same way. On CUDA SGLang folds the greedy head into the drafter's CUDA graph,
where no wrap reaches it; the seam keeps it eager (SGLang's own `SGLANG_DFLASH_EAGER_DRAFT_SAMPLER`), so a
`dflash` step under synthetic acceptance launches the head's matmul and top-k outside that graph.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from bastion_sglang import kernels
from bastion_sglang.step.synthetic_acceptance import synthetic_targets, true_tokens, truth_uniforms
from bastion_sglang.step.synthetic_profile import SyntheticAcceptanceProfile, load_synthetic_profile

WORKER = "sglang.srt.speculative.dflash_worker_v2.DFlashWorkerV2"
WRAPPED = ("forward_batch_generation", "_greedy_sample_from_vocab_parallel_head", "_accept_block")
EAGER_HEAD_ENV = "SGLANG_DFLASH_EAGER_DRAFT_SAMPLER"
"""SGLang's switch keeping DFLASH's draft greedy head out of the drafter's CUDA graph."""
KEY_ATTR = "_bastion_bench_truth_key"
"""Req attribute caching the request's walk key (int64 as a Python int)."""


class DflashTruth:
    """The seam's state in one scheduler process: the profile, the keys of the step's batch and the draft's
    candidates of the step."""

    def __init__(self, profile: SyntheticAcceptanceProfile) -> None:
        self.profile = profile
        self.ranks = len(profile.rank_probs[0])  # K_p
        self._q: dict[tuple[int, torch.device], torch.Tensor] = {}
        self.keys: torch.Tensor | None = None  # [B] int64 walk keys of the decode batch
        self.candidates: torch.Tensor | None = None  # [B · (γ-1), K_p] int64 of the step's draft

    def q(self, depth: int, device: torch.device) -> torch.Tensor:
        """[depth, K_p] float64 q of draft positions 1..depth on `device` (made once per depth)."""
        key = (depth, device)
        if key not in self._q:
            self._q[key] = self.profile.probs(depth).to(device)
        return self._q[key]

    def batch_keys(self, reqs: list[Any], device: torch.device) -> torch.Tensor:
        """[B] int64 walk keys of `reqs`: `kernels.seed_keys` of each sampling_seed (as a two's-complement
        int64, as BASTION's prefill takes it), hashed once per request. RuntimeError naming a request with no
        seed: its truth would have no key to share with BASTION's Engines."""
        for req in reqs:
            if getattr(req, KEY_ATTR, None) is None:
                seed = req.sampling_params.sampling_seed
                if seed is None:
                    raise RuntimeError(
                        f"dflash under synthetic acceptance: request {req.rid} has no sampling_seed; its "
                        "true continuation is keyed by it"
                    )
                word = torch.tensor([(int(seed) + 2**63) % 2**64 - 2**63], dtype=torch.int64)
                setattr(req, KEY_ATTR, int(kernels.seed_keys(word)[0]))
        return torch.tensor([getattr(req, KEY_ATTR) for req in reqs], dtype=torch.int64, device=device)

    def targets(self, argmax: torch.Tensor, prefix: torch.Tensor) -> torch.Tensor:
        """[B, γ] the target's token after each verify row: argmax [B, γ] the target's own (row j at depth j),
        prefix [B] the committed lengths (the block's first token, the root, sits at position prefix)."""
        if self.candidates is None or self.keys is None:
            raise RuntimeError(
                "dflash under synthetic acceptance: the verify found no draft candidates; only a DFlash "
                "drafter's greedy head is covered (not a DFlash2 selector or a LiLiCorr head)"
            )
        bs, block = argmax.shape
        horizon = block - 1
        candidates = self.candidates.view(bs, horizon, self.ranks)
        truth = true_tokens(
            candidates, self.q(horizon, argmax.device), truth_uniforms(self.keys, prefix, horizon)
        )
        depths = torch.arange(block, device=argmax.device).expand(bs, block)
        self.candidates = None
        return synthetic_targets(truth, depths, argmax)


_TRUTH: DflashTruth | None = None


def _truth() -> DflashTruth:
    if _TRUTH is None:
        raise RuntimeError("dflash synthetic acceptance: the seam ran before `install`")
    return _TRUTH


def forward_with_keys(original: Any, worker: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND `DFlashWorkerV2.forward_batch_generation`: the walk keys of a decode batch's requests first."""
    if not (batch.forward_mode.is_extend() or batch.is_extend_in_batch) and batch.reqs:
        _truth().keys = _truth().batch_keys(batch.reqs, worker.device)
    return original(worker, batch, *args, **kwargs)


def draft_head_with_candidates(
    original: Any, worker: Any, *, hidden_states: torch.Tensor, lm_head: Any, chunk_size: int = 256
) -> torch.Tensor:
    """AROUND `DFlashWorkerV2._greedy_sample_from_vocab_parallel_head`: hidden_states [N, H] -> [N] int64
    draft tokens, the argmax of hidden_states @ W.T over the base vocabulary as SGLang's tp = 1 path takes it;
    the top K_p ids [N, K_p] are kept for the accept stage."""
    del original, worker, chunk_size
    weight = getattr(lm_head, "weight", None)
    shard = getattr(lm_head, "shard_indices", None)
    if not isinstance(weight, torch.Tensor) or (
        shard is not None and (int(shard.num_added_elements) > 0 or int(shard.org_vocab_start_index) > 0)
    ):
        raise NotImplementedError(
            "dflash under synthetic acceptance covers one rank's dense LM head without added vocabulary"
        )
    vocab = int(shard.num_org_elements) if shard is not None else int(weight.shape[0])
    logits = torch.matmul(hidden_states.to(weight.dtype), weight[:vocab].T)  # [N, V]
    candidates = torch.topk(logits, _truth().ranks, dim=-1).indices  # [N, K_p], rank 0 the argmax
    _truth().candidates = candidates
    return candidates[:, 0].contiguous()


def accept_on_truth(
    original: Any,
    worker: Any,
    *,
    candidates: torch.Tensor,
    next_token_logits: torch.Tensor | None,
    sampling_info: Any,
    draft_input: Any,
    prefix_lens: torch.Tensor,
    bs: int,
    target_predict: torch.Tensor | None = None,
) -> Any:
    """AROUND `DFlashWorkerV2._accept_block`: SGLang's greedy accept on the synthetic targets."""
    if target_predict is None:
        if next_token_logits is None:
            raise RuntimeError("dflash synthetic acceptance: the verify returned neither logits nor argmax")
        target_predict = torch.argmax(next_token_logits, dim=-1)
    argmax = target_predict.view(bs, int(worker.block_size))
    targets = _truth().targets(argmax, prefix_lens)
    return original(
        worker,
        candidates=candidates,
        next_token_logits=next_token_logits,
        sampling_info=sampling_info,
        draft_input=draft_input,
        prefix_lens=prefix_lens,
        bs=bs,
        target_predict=targets,
    )


def install(profile_path: str | Path) -> None:
    """Load the profile (ValueError naming the file) and wrap the worker's three methods (idempotent)."""
    global _TRUTH
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    _TRUTH = DflashTruth(load_synthetic_profile(Path(profile_path)))
    os.environ[EAGER_HEAD_ENV] = "1"  # read when the worker builds its draft graphs, after this install
    hooks = (forward_with_keys, draft_head_with_candidates, accept_on_truth)
    targets = [f"{WORKER}.{name}" for name in WRAPPED]
    for target, hook in zip(targets, hooks, strict=True):
        if target not in HookRegistry._patched:
            HookRegistry.register(target, hook, HookType.AROUND)
    HookRegistry.apply_hooks()
    missing = [target for target in targets if target not in HookRegistry._patched]
    if missing:
        raise RuntimeError(f"the bench could not wrap {missing} for dflash under synthetic acceptance")
