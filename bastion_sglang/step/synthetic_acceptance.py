"""Synthetic acceptance: trees exercised at a model's real step costs with a published acceptance profile.

For benchmarks of a target loaded without its weights (`--load-format dummy`), whose random drafter would
otherwise propose nothing the target accepts. It replaces both ends of what acceptance depends on:

- the draft (`SyntheticDraft.top`, a `draft_protocols.DraftTopKReader`): at draft position d (1-based) the
  drafter's own top-K_p ids get the probabilities the drafter states, the profile's q[d, k] (k = 0 the best)
  sharpened by its `drafter_temperature` (over-confident by default, as real drafters are: the planner's
  acceptance calibration has a difference to find), the rest of the vocabulary shares what is left;
- the target's tokens (`SyntheticAcceptor`, the accept stage): every request has a true continuation, at
  sequence position p the rank-k candidate of the draft position that p falls on with probability q[d, k]
  and none of them with the rest (then a token id that is none of the candidates: the target's own argmax
  would be one of them about as often as the drafter is right, which on the demo pair's real weights raised
  the chain's accepted length 8 % above the profile's), and the target's token after a verify row at depth d
  is that request's true token at draft position d + 1 (past the draft, the row's own argmax). The accept
  walk, the commit and everything after run as always.

Keyed, paired draws. The uniform that picks the rank at sequence position p is a hash of the request's seed
and p (`truth_uniforms`, the accept walk's `kernels.keyed_uniforms` on a stream of its own), not a draw from a
generator: every policy (and every batch, schedule and tree) meets the same uniforms at the same positions,
so policies compared in one repeat face the same continuations, and a repeat that sends new seeds draws new
ones. A position is resolved by one verify only (the step that accepts past it, or stops at it and emits its
bonus), and its uniform decides nothing before, so the draws stay independent across positions.

With an oracle drafter (temperature 1) the planner's raw Â is the expected accepted length (independent
positions, as it assumes; it also gives each other id its share of what q leaves, (1 - Σ q) / (V - K_p),
which the draw never takes: a difference of that size per node). The tokens emitted are not the target's:
a benchmark of speed only, never a server's output; requests the profile does not describe (T > 0, grammars,
stop conditions other than the length) are refused (`request_support`).

The profile file (`synthetic_profile.SyntheticAcceptanceProfile`) holds q for positions 1..D; deeper positions
take row D.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from bastion_sglang import kernels
from bastion_sglang.controller.acceptance import AcceptanceCalibration, AcceptanceRecord, fit_acceptance
from bastion_sglang.integration.config import BastionConfig
from bastion_sglang.kernels.types import DraftTopK
from bastion_sglang.step.accept import Acceptor
from bastion_sglang.step.draft_protocols import (
    DraftLogitsRewriter,
    DraftTopKReader,
    load_draft_logits_rewriter,
)
from bastion_sglang.step.synthetic_profile import SyntheticAcceptanceProfile, load_synthetic_profile

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import ScheduleBatch

logger = logging.getLogger(__name__)

TRUTH_STREAM = 0x5A17_C0DE_7E57_0001
"""XORed into the accept walk's keys: the truth's uniforms are a stream apart from the walk's own."""
STARTUP_PASSES = 768
"""Synthetic drafter passes the start-up acceptance map is fitted on: as many as quick start-up calibration
records on a real drafter (24 prompts x 32 roots, `calibration.startup`). About 0.6 s on the 2-core CPU."""
REST_FLOOR = 1e-9
"""Smallest probability mass left to the tokens outside the profile's candidates (keeps the logits finite)."""


class SyntheticDraft:
    """The draft side (module docstring); it keeps the last step's candidate ids [B, h, K_p] for
    `SyntheticAcceptor`."""

    def __init__(self, profile: SyntheticAcceptanceProfile) -> None:
        self.profile = profile
        self.candidates: torch.Tensor | None = None
        self._logq: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}
        self._q: dict[tuple[int, torch.device], torch.Tensor] = {}

    def q(self, depth: int, device: torch.device) -> torch.Tensor:
        """[depth, K_p] float64 q of draft positions 1..depth on `device` (made once per depth)."""
        key = (depth, device)
        if key not in self._q:
            self._q[key] = self.profile.probs(depth).to(device)
        return self._q[key]

    def log_probs(self, depth: int, vocab: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """([depth, K_p] log p, [depth, 1] log of each other token's share) as float32 on `device`: what the
        drafter states (`SyntheticAcceptanceProfile.stated_probs`), over-confident unless the profile's
        drafter_temperature is 1."""
        key = (depth, device)
        if key not in self._logq:
            stated, rest = self.profile.stated_probs(depth)
            share = rest.clamp_min(REST_FLOOR) / (vocab - stated.shape[1])
            self._logq[key] = (
                stated.clamp_min(1e-30).log().float().to(device),
                share.log().float().to(device),
            )
        return self._logq[key]

    def top(self, draft_logits: torch.Tensor, k: int) -> DraftTopK:
        """A `draft_protocols.DraftTopKReader`: draft_logits [B, h, V] -> DraftTopK [B, h, k], the drafter's
        own top ids with the log-probabilities it states (`log_probs`): the profile's q at ranks below K_p,
        an equal share of the rest beyond (ids the draw never takes). The step pays what it pays without the
        seam: one log-softmax and one top-k over the vocabulary (of max(k, K_p) ids), and no [B, h, V] tensor
        is written; the top K_p ids are kept for `SyntheticAcceptor`."""
        bs, depth, vocab = draft_logits.shape
        logq, rest = self.log_probs(depth, vocab, draft_logits.device)
        ranks = logq.shape[1]
        own = kernels.topk_logprobs(draft_logits, max(k, ranks))
        self.candidates = own.token_ids[..., :ranks]
        stated = torch.cat([logq, rest.expand(depth, max(k - ranks, 0))], dim=-1)[:, :k]
        return DraftTopK(stated.expand(bs, -1, -1).contiguous(), own.token_ids[..., :k].contiguous())


def true_tokens(candidates: torch.Tensor, q: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """[B, h] each request's true token at draft positions 1..h: candidates [B, h, K_p] int64 (distinct per
    position), q [h, K_p] float, uniforms [B, h] in [0, 1); the rank-k candidate where the uniform falls in
    rank k's share of the cumulative q, else the smallest token id that is none of the candidates."""
    width = candidates.shape[-1]
    edges = q.cumsum(-1).to(uniforms.dtype)  # [h, K_p]
    rank = (uniforms[..., None] >= edges).sum(-1)  # [B, h] in 0..K_p, K_p: no candidate
    picked = candidates.gather(-1, rank.clamp(max=width - 1)[..., None])[..., 0]
    ids = torch.arange(width + 1, device=candidates.device)  # K_p + 1 ids: one of them is no candidate
    taken = (candidates[..., None, :] == ids[:, None]).any(-1)  # [B, h, K_p + 1]
    outside = ids[(~taken).to(torch.int8).argmax(-1)]  # [B, h] the first free id
    return torch.where(rank < width, picked, outside)


def synthetic_passes(
    profile: SyntheticAcceptanceProfile, depth: int, passes: int, seed: int = 0
) -> list[AcceptanceRecord]:
    """`passes` drafter passes of `depth` positions as the seam makes them: at every position the drafter
    states `stated_probs` for its candidates (token id = rank, 0..K_p - 1), and the target's token is the
    seam's (`true_tokens`) for a uniform drawn per position from a generator seeded by `seed`."""
    stated, _ = profile.stated_probs(depth)  # [D, K_p]
    ranks = stated.shape[1]
    ids = torch.arange(ranks).expand(depth, ranks)
    uniforms = torch.from_numpy(np.random.default_rng(seed).random((passes, depth)))  # [passes, D]
    tokens = true_tokens(ids.expand(passes, depth, ranks), profile.probs(depth), uniforms)  # [passes, D]
    logprobs = stated.float().clamp_min(torch.finfo(torch.float32).tiny).log()
    return [AcceptanceRecord(logprobs, ids, tuple(row)) for row in tokens.tolist()]


def synthetic_startup_calibration(
    profile: SyntheticAcceptanceProfile, depth: int, passes: int = STARTUP_PASSES
) -> AcceptanceCalibration:
    """The acceptance map a start-up calibration fits on drafts under this profile (`fit_acceptance` on
    `synthetic_passes`): what the seam's passes would show it, without running them."""
    return fit_acceptance(synthetic_passes(profile, depth, passes), depth)


def truth_uniforms(keys: torch.Tensor, prefix: torch.Tensor, horizon: int) -> torch.Tensor:
    """[B, h] float64 uniforms of draft positions 1..h: keys [B] int64 walk keys (`kernels.seed_keys`), prefix
    [B] committed lengths (draft position d is sequence position prefix + d). A function of the seed and the
    sequence position alone (module docstring)."""
    positions = prefix[:, None].to(torch.int64) + torch.arange(1, horizon + 1, device=prefix.device)
    stream = kernels.seed_keys(keys ^ TRUTH_STREAM)
    return kernels.keyed_uniforms(stream, positions).to(torch.float64)


def synthetic_targets(truth: torch.Tensor, depths: torch.Tensor, argmax: torch.Tensor) -> torch.Tensor:
    """[B, W] the target's token after each verify row: truth [B, h] at the row's depth (a row at depth d is
    followed by position d + 1, truth column d); the row's own argmax [B, W] where the row is at depth h (past
    the draft). depths: [B, W] int64, the root 0."""
    horizon = truth.shape[1]
    column = truth.gather(1, depths.clamp(max=horizon - 1))
    return torch.where(depths < horizon, column, argmax)


class SyntheticAcceptor(Acceptor):
    """The accept stage with the target's tokens of a tree step drawn as the module docstring says; width-1
    steps keep the target's own tokens."""

    def __init__(self, vocab_size: int, sampling_backend: str, draft: SyntheticDraft) -> None:
        super().__init__(vocab_size, sampling_backend)
        self._draft = draft

    def target_tokens(
        self,
        batch: ScheduleBatch,
        logits: torch.Tensor,
        rows: kernels.TreeBatch,
        keys: torch.Tensor,
        prefix: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The target's own tokens (`Acceptor.target_tokens`), then on each request's true continuation over
        the step's draft candidates, keyed by its seed and the positions (module docstring)."""
        tokens, probs = super().target_tokens(batch, logits, rows, keys, prefix)
        candidates = self._draft.candidates
        if candidates is None:
            raise RuntimeError("synthetic acceptance: a tree step came before any draft")
        horizon = candidates.shape[1]
        uniforms = truth_uniforms(keys, prefix, horizon)
        truth = true_tokens(candidates, self._draft.q(horizon, tokens.device), uniforms)
        return synthetic_targets(truth, rows.depths, tokens), probs


@dataclass(frozen=True)
class DraftSeams:
    """What the worker's draft and accept stages are built with: the draft rewriter
    (`BastionConfig.draft_proposer`, None under synthetic acceptance), the reader of the top-k the tree search
    plans on, and the accept stage."""

    rewriter: DraftLogitsRewriter | None
    top_k: DraftTopKReader
    acceptor: Acceptor


def draft_seams(config: BastionConfig, tp_size: int, vocab_size: int, sampling_backend: str) -> DraftSeams:
    """The configured rewriter with `kernels.topk_logprobs` and `Acceptor`; with `synthetic_acceptance`, the
    reader and the accept stage of its profile (`SyntheticDraft.top`, `SyntheticAcceptor`). Synthetic
    acceptance draws on one rank: a `ValueError` with `tp_size` > 1."""
    path = config.synthetic_acceptance
    if path is None:
        return DraftSeams(
            load_draft_logits_rewriter(config), kernels.topk_logprobs, Acceptor(vocab_size, sampling_backend)
        )
    if tp_size > 1:
        raise ValueError(f"synthetic acceptance ({path}) draws on one rank; run it with --tp-size 1")
    draft = SyntheticDraft(load_synthetic_profile(path))
    logger.warning(
        "BASTION: synthetic acceptance from %s (%s): tree steps accept by this profile, not by the target; "
        "the output is not the target's (a speed benchmark only)",
        path,
        draft.profile.name,
    )
    return DraftSeams(None, draft.top, SyntheticAcceptor(vocab_size, sampling_backend, draft))
