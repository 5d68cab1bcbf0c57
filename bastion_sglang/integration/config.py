"""BASTION's run configuration: one frozen, validated record handed to the worker.

Terms. N_max (`max_budget`) is the most draft nodes one request may verify in a step; the verify pass then
holds at most `verify_width_cap` = N_max + 1 tokens per request (the bonus token is the root). K (`topk`) is
how many candidates per draft position the tree search may branch into. Width buckets are the verify widths
(tokens per request, root included) that a captured CUDA graph serves; the bucketed policy fills the best
one completely because its nodes are already paid for.

SGLang server arguments are mapped to this record only in `bastion_sglang/registration.py`; the record
travels on SGLang's ServerArgs (`attach_config` / `config_of`). This module imports no SGLang, so every
floor (worker, graphs, CPU support, registration) reads the configuration from here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

from bastion_sglang.controller import AdaptivePolicy, BudgetPolicy
from bastion_sglang.controller.latency import validate_width_buckets
from bastion_sglang.integration.draft_vocab import DraftVocabChoice

ALGORITHM = "BASTION"
"""The `--speculative-algorithm` name."""
CONFIG_ATTR = "_bastion_config"
"""Bookkeeping attribute of a ServerArgs record holding its BastionConfig (pickled along with the record)."""
CPU_ATTENTION_BACKEND = "torch_native"
"""The only attention backend BASTION runs on CPU (its TARGET_VERIFY tree branch comes from `cpu_support`)."""
CHOSEN_BACKENDS = {"cuda": "triton", "cpu": CPU_ATTENTION_BACKEND}
"""The attention backend BASTION, its benchmarks and its calibration use, per device kind, when none is given:
on CUDA triton (it reads the tree mask and ships with SGLang; flashinfer needs its own package), on CPU
torch_native."""
DEFAULT_MAX_BUDGET = 64
DEFAULT_TOPK = 8
DEFAULT_EMA_ALPHA = 0.1
ADAPTIVE = AdaptivePolicy()
"""The default policy (a stateless frozen value, shared)."""
StartupMode = Literal["off", "quick", "full"]
"""`--bastion-startup-calibration`: whether a server without a stored profile measures one at start-up."""
STARTUP_MODES: tuple[str, ...] = get_args(StartupMode)
STARTUP_CALIBRATION_ENV = "BASTION_STARTUP_CALIBRATION"
"""Environment variable holding the default start-up calibration mode (else quick), e.g. off for a test
suite that starts many short-lived servers."""


def default_startup_calibration() -> StartupMode:
    """The start-up calibration mode when none is given: $BASTION_STARTUP_CALIBRATION, else quick.
    ValueError names a value that is not a mode."""
    value = os.environ.get(STARTUP_CALIBRATION_ENV, "quick").strip().lower()
    if value not in STARTUP_MODES:
        raise ValueError(f"${STARTUP_CALIBRATION_ENV}={value!r} is not one of {', '.join(STARTUP_MODES)}")
    return value  # type: ignore[return-value]


def default_width_buckets(max_budget: int) -> tuple[int, ...]:
    """Powers of two from 2 below the cap, then the cap N_max + 1 itself: (2, 4, 8, ..., N_max + 1)."""
    cap = max_budget + 1
    buckets = []
    width = 2
    while width < cap:
        buckets.append(width)
        width *= 2
    buckets.append(cap)
    return tuple(buckets)


@dataclass(frozen=True)
class BastionConfig:
    """Everything BASTION needs besides SGLang's own server arguments.

    max_budget: N_max, draft nodes per request per step (>= 1); the verify width cap is N_max + 1.
    policy: how many best-first nodes to verify each step (adaptive, bucketed, fixed:N, chain).
    profile_path: a calibration profile (JSON written by `bastion calibrate`), or None for "auto": an
        uncalibrated roofline of the target corrected online by the EMA.
    ema_alpha: weight of the newest observed/predicted verify-latency ratio in the EMA, in (0, 1].
    width_buckets: verify widths (tokens per request, root included), sorted, unique, each in
        [2, N_max + 1]; the bucketed policy's candidates and the CUDA-graph widths.
    topk: K, candidates per draft position, 1 <= K <= N_max (a chain policy uses 1 whatever K is).
    draft_proposer: "module:callable" of a `draft_protocols.DraftLogitsRewriter` factory called once with
        `draft_proposer_arg` in the scheduler process; it may rewrite the drafter's logits each step
        (the seam tests use for an oracle drafter). None: the drafter's logits as they are.
    synthetic_acceptance: a `synthetic_acceptance` profile file: the drafter's distributions and the target's
        tokens of tree steps are drawn from it (speed benchmarks of a target without weights; the output
        is not the target's). None: off. Not with draft_proposer.
    overlap: whether BASTION may run under SGLang's overlap scheduler (`--bastion-overlap-schedule on`).
        False (the default): `--disable-overlap-schedule` is switched on. True: SGLang's own
        `--disable-overlap-schedule` decides (see the architecture page, "Overlap scheduling").
    startup_calibration: off | quick | full: whether a server with `auto` profile and none stored for its
        runtime measures one before it serves (`calibration.startup`); default `default_startup_calibration`.
    draft_vocab: the tokens the draft step scores (`integration.draft_vocab`): "auto" (the drafter folder's
        `draft_vocab.json` when it has one, else every token), "full" (every token) or a file's Path.
    """

    max_budget: int = DEFAULT_MAX_BUDGET
    policy: BudgetPolicy = ADAPTIVE
    profile_path: Path | None = None
    ema_alpha: float = DEFAULT_EMA_ALPHA
    width_buckets: tuple[int, ...] = default_width_buckets(DEFAULT_MAX_BUDGET)
    topk: int = DEFAULT_TOPK
    draft_proposer: str | None = None
    draft_proposer_arg: str = ""
    synthetic_acceptance: Path | None = None
    overlap: bool = False
    startup_calibration: StartupMode = field(default_factory=default_startup_calibration)
    draft_vocab: DraftVocabChoice = "auto"

    def __post_init__(self) -> None:
        if isinstance(self.max_budget, bool) or not isinstance(self.max_budget, int) or self.max_budget < 1:
            raise ValueError(f"max_budget (N_max) must be a positive int, got {self.max_budget!r}")
        if not isinstance(self.policy, BudgetPolicy):
            raise ValueError(f"policy must be a BudgetPolicy, got {self.policy!r}")
        self.policy.check_config(self.max_budget, self.width_buckets)
        if self.profile_path is not None and not isinstance(self.profile_path, Path):
            raise ValueError(f"profile_path must be a pathlib.Path or None, got {self.profile_path!r}")
        if isinstance(self.ema_alpha, bool) or not isinstance(self.ema_alpha, int | float):
            raise ValueError(f"ema_alpha must be a number in (0, 1], got {self.ema_alpha!r}")
        if not 0.0 < float(self.ema_alpha) <= 1.0:
            raise ValueError(f"ema_alpha must be in (0, 1], got {self.ema_alpha}")
        buckets = validate_width_buckets(self.width_buckets, lowest=2)
        if buckets[-1] > self.verify_width_cap:
            raise ValueError(
                f"width_buckets {buckets} must lie in [2, {self.verify_width_cap}] "
                f"(verify widths count the root; the cap is max_budget + 1)"
            )
        if isinstance(self.topk, bool) or not isinstance(self.topk, int) or self.topk < 1:
            raise ValueError(f"topk (K) must be a positive int, got {self.topk!r}")
        if self.topk > self.max_budget:
            raise ValueError(
                f"topk {self.topk} exceeds max_budget {self.max_budget}: a tree holds at most N_max nodes"
            )
        if not isinstance(self.overlap, bool):
            raise ValueError(f"overlap must be a bool, got {self.overlap!r}")
        if self.startup_calibration not in STARTUP_MODES:
            raise ValueError(
                f"startup_calibration must be one of {', '.join(STARTUP_MODES)}, "
                f"got {self.startup_calibration!r}"
            )
        if self.draft_vocab not in ("auto", "full") and not isinstance(self.draft_vocab, Path):
            raise ValueError(
                f"draft_vocab must be 'auto', 'full' or a pathlib.Path, got {self.draft_vocab!r}"
            )
        if self.synthetic_acceptance is not None and self.draft_proposer is not None:
            raise ValueError(
                "synthetic_acceptance rewrites the draft itself; it cannot run with a draft_proposer"
            )
        if self.draft_proposer is not None:
            module, _, attr = self.draft_proposer.partition(":")
            if not module or not attr:
                raise ValueError(f"draft_proposer must be 'module:callable', got {self.draft_proposer!r}")

    @property
    def verify_width_cap(self) -> int:
        """Most tokens per request in one verify pass: N_max draft nodes plus the root (bonus) token."""
        return self.max_budget + 1

    @property
    def branching(self) -> int:
        """Candidates per depth the tree search uses: `topk`, capped by the policy (1 for a chain)."""
        cap = self.policy.topk_cap
        return self.topk if cap is None else min(cap, self.topk)


def attach_config(server_args: Any, config: BastionConfig) -> None:
    """Give a ServerArgs record its BastionConfig (for `sglang.Engine(server_args=...)` callers)."""
    if not isinstance(config, BastionConfig):
        raise TypeError(f"expected a BastionConfig, got {type(config).__name__}")
    setattr(server_args, CONFIG_ATTR, config)


def config_of(server_args: Any) -> BastionConfig:
    """The record's BastionConfig, or the default one when none was attached. Reads through SGLang's views."""
    config = getattr(server_args, CONFIG_ATTR, None)
    return BastionConfig() if config is None else config
