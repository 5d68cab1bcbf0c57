"""The reference engine: BASTION decoding (batch 1) on a Transformers target, shared planner and kernels.

One speculative step (`docs/architecture.md`, "One decode step"), with ctx = tokens in the target's cache
and the bonus token at position ctx:

1. draft: the proposer gives the top-k tokens of the next D positions (`DraftTopK` [1, D, k]), or, for a
   DFlash2 drafter, its candidate lattice (`DraftLattice` [1, D, K, K], `reference.lattice_proposer`);
2. plan: `build_trees_auto` (best-first, up to the budget; on a lattice `build_lattice_trees`,
   `lattice_plan`), `plan_batch` (the worker's batch planner, at B = 1) picks n, `flatten_trees` and
   `build_verify_layout` give the W = n + 1 verify rows;
3. verify: one target forward over the W tokens, positions ctx + depth, ancestor-only mask; with width
   buckets (as the worker runs its captured graphs) the rows are padded to the bucket W_v >= W
   (`graph_buckets.pad_verify_rows`), so a GPU sees the same few pass shapes every step instead of a new
   one per W, and only the W real rows' logits and features are read;
4. accept: greedy walk at temperature 0, else the sampling walk on the target's processed distribution;
   the accepted rows move to the front of the tree block and the cache is cut to ctx + accepted + 1;
   the accepted tokens and the bonus are emitted; the accepted positions' target features go to the
   drafter next step; the measured verify time updates the latency model's EMA.

Decisions. Each request that drafts has its own `StepController`, the worker's (batch 1): the gate, the
drafted steps' evidence, the acceptance tracker (fed the realised accepted counts) and the pending plans; the
engine's latency model and step-cost tracker are shared by its requests. A policy that `may_decline`
(adaptive, bucketed) declines as the worker does: a drafted step whose best speculative plan does not beat
plain decoding (`BatchPlan.speculative_speedup` <= 1, drafter pass included) verifies the root only, and the
next steps skip the drafter and decode plainly until the gate's backoff probes again; before a probe, the
request's last drafted Â curve re-priced at the current context (`speculation_ceiling`) may veto it. A
skipped step keeps the target features of its position for the drafter, which reads them at the next drafted
step, so the drafter's context stays complete. Steps and outputs are those of plain decoding while skipping.

Sampling coupling. At temperature > 0 the uniform used for a node is the one of the output index it
predicts (`uniforms[emitted + depth]`, drawn once per request from the seeded generator), the same
uniform plain decoding uses for that index. Each emitted token is the inverse-CDF sample of the target's
distribution after the tokens before it, with a uniform independent of them, so the output is distributed
exactly as the target's; and for one seed it is the same token sequence whatever the tree, the policy or
the timing-driven budget choices (up to floating-point differences between the passes).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel

from bastion_sglang.controller import BudgetPolicy, parse_policy
from bastion_sglang.controller.acceptance import AcceptanceCalibration
from bastion_sglang.controller.horizon import DraftHorizon
from bastion_sglang.controller.latency import LatencyModel
from bastion_sglang.controller.profile import StepCosts
from bastion_sglang.controller.roofline import HardwareSpec, ModelShape, RooflineModel
from bastion_sglang.controller.step_costs import COLD_STEPS, StepCostTracker
from bastion_sglang.integration.drafter_config import check_drafter_fits
from bastion_sglang.kernels import (
    accept_greedy,
    accept_sampling,
    accepted_kv_moves,
    build_verify_layout,
    flatten_trees,
    sample_tokens,
)
from bastion_sglang.kernels.types import DraftTopK
from bastion_sglang.reference.drafter import DFlashDrafter
from bastion_sglang.reference.lattice_proposer import DFlash2Proposer
from bastion_sglang.reference.proposer import DFlashProposer
from bastion_sglang.reference.sampling import SamplingParams
from bastion_sglang.reference.stats import GenerationResult, StepStats
from bastion_sglang.reference.target import SlotCache, TargetModel, load_causal_lm
from bastion_sglang.step.draft_protocols import DraftInput, DraftSource
from bastion_sglang.step.graph_buckets import pad_verify_rows
from bastion_sglang.step.lattice_plan import plan_draft
from bastion_sglang.step.step_controller import StepController, StepRecord, StepStart
from bastion_sglang.step.timing import StageTimer

MAX_TOPK = 64
"""Largest K (candidates per draft position) the engine asks the proposer for."""
COST_DECAY = 0.9
"""Weight the online step-cost estimates keep per step (`StepCostTracker`; when no StepCosts are given)."""
REQUEST = "request"
"""The request id a request's own step controller knows it by (one request per controller)."""


@dataclass
class DecodeState:
    """Mutable state of one request while it decodes (made by `ReferenceEngine.start`)."""

    tokens: torch.Tensor  # [capacity] int64 on the device: prompt + emitted tokens; valid up to `length`
    length: int  # committed tokens; the last one is the bonus token (not yet in the target's cache)
    prompt_len: int
    max_new_tokens: int
    eos: frozenset[int]
    sampling: SamplingParams
    policy: BudgetPolicy | None  # None: plain decoding
    budget: int  # nodes of the tree built each step (0 for plain decoding)
    topk: int  # K candidates per draft position (0 for plain decoding)
    cache: SlotCache  # the target's KV cache: rows 0..length-2 after every step
    uniforms: torch.Tensor | None  # [max_new_tokens + D + 1] float32: one uniform per output index
    new_features: torch.Tensor | None = None  # [n, F·h] features of cache positions not yet drafted from
    controller: StepController | None = None  # the request's step decisions (None: plain decoding)
    output: list[int] = field(default_factory=list)
    finished: bool = False
    prefill_seconds: float = 0.0

    @property
    def ctx_len(self) -> int:
        """Tokens in the target's KV cache: the bonus token's position."""
        return self.length - 1

    def commit(self, new_tokens: torch.Tensor, host_tokens: list[int]) -> int:
        """Append new_tokens [m] (same values as host_tokens) up to the stops; returns how many were kept."""
        keep = host_tokens[: self.max_new_tokens - len(self.output)]
        for index, token in enumerate(keep):
            if token in self.eos:
                keep = keep[: index + 1]
                self.finished = True
                break
        self.tokens[self.length : self.length + len(keep)] = new_tokens[: len(keep)]
        self.length += len(keep)
        self.output.extend(keep)
        if len(self.output) >= self.max_new_tokens:
            self.finished = True
        return len(keep)


class ReferenceEngine:
    """BASTION decoding of one request at a time with a Hugging Face target.

    target: a causal-LM folder or a loaded `PreTrainedModel` (moved to device/dtype).
    drafter: a DFlash or DFlash2 checkpoint folder, a `DFlashDrafter`, any `DraftSource`, or None (plain
        decoding only). A DFlash(2) drafter is checked against the target (`check_drafter_fits`); a DFlash2
        one drafts lattices (`DFlash2Proposer`).
    hardware / latency: the verify-latency model the policies plan with: a given `LatencyModel` (e.g.
        from a calibration profile), else an uncalibrated roofline of the target on `hardware` (required
        then: there is no default GPU), with `width_buckets` if given. Its EMA is updated every step.
    step_costs: T_draft, T_aux and L_AR for the policies; None: T_draft and T_aux (with its per-token slope)
        are fitted online to this engine's measured stages (`StepCostTracker`, as the worker does) and L_AR
        is the latency model's prediction for one token at the current context.
    acceptance: the drafter's acceptance calibration (trees are built on its calibrated log-probabilities,
        so Â and the policies see calibrated values); None: the raw drafter probabilities. With a DFlash2
        drafter the trees are built on its calibrated transitions (`lattice_plan`; a map fitted on lattice
        records, `controller.lattice_acceptance`).
    max_nodes: N_max, the tree budget of the adaptive policies. eos_token_ids: None reads the target's
        generation config.
    """

    def __init__(
        self,
        target: str | Path | PreTrainedModel,
        drafter: str | Path | DFlashDrafter | DraftSource | None = None,
        *,
        device: torch.device | str,
        dtype: torch.dtype,
        hardware: HardwareSpec | None = None,
        latency: LatencyModel | None = None,
        width_buckets: Sequence[int] | None = None,
        step_costs: StepCosts | None = None,
        acceptance: AcceptanceCalibration | None = None,
        max_nodes: int = 1024,
        attn_implementation: str = "sdpa",
        eos_token_ids: Sequence[int] | None = None,
    ) -> None:
        self.device = torch.device(device)
        if isinstance(target, PreTrainedModel):
            model = target.to(device=self.device, dtype=dtype).eval()
        else:
            model = load_causal_lm(
                target, device=self.device, dtype=dtype, attn_implementation=attn_implementation
            )
        config = model.config.to_dict()
        self.proposer = self._make_proposer(drafter, model, dtype, config)
        self.target = TargetModel(model, self.proposer.feature_layers if self.proposer is not None else ())
        self.latency = self._make_latency(latency, hardware, width_buckets, config, dtype)
        self.step_costs = step_costs
        self.acceptance = acceptance
        self._costs = StepCostTracker(decay=COST_DECAY, warmup_steps=COLD_STEPS)
        if isinstance(max_nodes, bool) or not isinstance(max_nodes, int) or max_nodes < 1:
            raise ValueError(f"max_nodes must be a positive int, got {max_nodes!r}")
        self.max_nodes = max_nodes
        self.vocab_size = int(model.config.vocab_size)
        if eos_token_ids is None:
            configured = model.generation_config.eos_token_id if model.generation_config else None
            eos_token_ids = (
                [] if configured is None else [configured] if isinstance(configured, int) else configured
            )
        self.eos = frozenset(int(token) for token in eos_token_ids)

    def _make_proposer(
        self,
        drafter: str | Path | DFlashDrafter | DraftSource | None,
        model: PreTrainedModel,
        dtype: torch.dtype,
        config: dict[str, Any],
    ) -> DraftSource | None:
        if drafter is None:
            return None
        if isinstance(drafter, str | Path):
            drafter = DFlashDrafter.from_pretrained(
                drafter, device=self.device, dtype=dtype, target_num_layers=int(config["num_hidden_layers"])
            )
        if isinstance(drafter, DFlashDrafter):
            check_drafter_fits(drafter.config, config)
            source = DFlashProposer if drafter.candidate_selector is None else DFlash2Proposer
            return source(
                drafter.to(device=self.device, dtype=dtype).eval(),
                model.get_input_embeddings(),
                model.get_output_embeddings(),
            )
        return drafter

    @staticmethod
    def _make_latency(
        latency: LatencyModel | None,
        hardware: HardwareSpec | None,
        width_buckets: Sequence[int] | None,
        config: dict[str, Any],
        dtype: torch.dtype,
    ) -> LatencyModel:
        if latency is not None:
            if hardware is not None or width_buckets is not None:
                raise ValueError("pass either latency= or hardware= (with width_buckets=), not both")
            return latency
        if hardware is None:
            raise ValueError(
                "no latency model: pass latency= (e.g. from a calibration profile) or hardware= "
                "(a HardwareSpec for the uncalibrated roofline; there is no default GPU)"
            )
        shape = ModelShape.from_hf_config(config)
        roofline = RooflineModel(shape, hardware, bytes_per_element=torch.finfo(dtype).bits // 8)
        return LatencyModel(roofline, width_buckets=width_buckets)

    def resolve_policy(self, policy: str | BudgetPolicy | None) -> BudgetPolicy | None:
        """A BudgetPolicy from its spelling (adaptive, bucketed, fixed:N, chain, ar); None: plain decoding."""
        resolved = parse_policy(policy, self.latency.width_buckets) if isinstance(policy, str) else policy
        if resolved is not None and self.proposer is None:
            raise ValueError(f"policy {policy!r} drafts, but the engine has no drafter; use 'ar' or add one")
        return resolved

    def tree_budget(self, policy: BudgetPolicy) -> tuple[int, int]:
        """(nodes to build, K candidates per depth) for `policy` with this proposer and latency model."""
        if self.proposer is None:
            raise ValueError("tree budgets need a drafter")
        buckets = self.latency.width_buckets
        budget = policy.tree_budget(
            self.max_nodes, self.proposer.depth, None if buckets is None else buckets[-1]
        )
        cap = policy.topk_cap if policy.topk_cap is not None else MAX_TOPK
        return budget, min(cap, MAX_TOPK, budget, self.vocab_size)

    def _verify_width(self, nodes: int) -> int:
        """W_v: the width a verify pass of `nodes` draft nodes (and the root) runs at: its width bucket."""
        return self.latency.padded_width(nodes + 1)

    def _controller(self, policy: BudgetPolicy, budget: int, topk: int) -> StepController:
        """A request's step controller: the engine's latency model and step costs, `policy` at `budget` nodes
        over `topk` candidates per position, the drafter scoring every position."""
        if self.proposer is None:
            raise ValueError("a step controller needs a drafter")
        return StepController(
            latency=self.latency,
            costs=self._costs,
            policy=policy,
            budget=budget,
            horizon=DraftHorizon.full(self.proposer.depth),
            acceptance=self.acceptance,
            branching=topk,
            device=self.device,
            fixed_costs=self.step_costs,
        )

    @torch.no_grad()
    def generate(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = -1,
        min_p: float = 0.0,
        seed: int | None = None,
        policy: str | BudgetPolicy | None = "adaptive",
    ) -> GenerationResult:
        """Decode up to max_new_tokens tokens after `prompt_ids`; stop after an EOS token (kept).

        temperature 0 is greedy; otherwise the target's distribution after temperature, top_p, top_k and
        min_p, sampled with a generator seeded by `seed` (None: a fresh seed). policy: adaptive,
        bucketed, fixed:N, chain, ar (plain decoding), or a BudgetPolicy.
        """
        state = self.start(prompt_ids, max_new_tokens, temperature, top_p, top_k, min_p, seed, policy)
        steps = []
        while not state.finished:
            steps.append(self.step(state))
        return GenerationResult(tokens=state.output, steps=steps, prefill_seconds=state.prefill_seconds)

    @torch.no_grad()
    def start(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = -1,
        min_p: float = 0.0,
        seed: int | None = None,
        policy: str | BudgetPolicy | None = "adaptive",
    ) -> DecodeState:
        """Prefill the prompt and emit the first token; `step` then decodes the rest (see `generate`)."""
        sampling = SamplingParams(temperature, top_p, top_k, min_p)
        budget_policy = self.resolve_policy(policy)
        if not prompt_ids or any(not 0 <= token < self.vocab_size for token in prompt_ids):
            raise ValueError(
                f"prompt_ids must be non-empty token ids in [0, {self.vocab_size}), got {prompt_ids!r}"
            )
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
        budget, topk = self.tree_budget(budget_policy) if budget_policy is not None else (0, 0)
        depth = self.proposer.depth if self.proposer is not None else 0
        prompt_len = len(prompt_ids)
        tokens = torch.zeros(prompt_len + max_new_tokens + 1, dtype=torch.int64, device=self.device)
        tokens[:prompt_len] = torch.tensor(prompt_ids, dtype=torch.int64)
        uniforms = None
        if not sampling.greedy:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(seed if seed is not None else int(torch.seed()))
            uniforms = torch.rand(max_new_tokens + depth + 1, generator=generator, device=self.device)
        state = DecodeState(
            tokens=tokens,
            length=prompt_len,
            prompt_len=prompt_len,
            max_new_tokens=max_new_tokens,
            eos=self.eos,
            sampling=sampling,
            policy=budget_policy,
            budget=budget,
            topk=topk,
            cache=self.target.new_cache(prompt_len + max_new_tokens + self._verify_width(budget)),
            uniforms=uniforms,
            controller=None if budget_policy is None else self._controller(budget_policy, budget, topk),
        )
        if budget_policy is not None and self.proposer is not None:
            self.proposer.start(prompt_len + max_new_tokens + 1)
        timer = StageTimer(self.device)
        prefill = self.target.prefill(state.cache, tokens[:prompt_len])
        first = self._pick(prefill.logits[-1:], state, 0)
        state.commit(first, first.tolist())  # host sync: the first token decides whether to stop
        state.new_features = prefill.features
        state.prefill_seconds = timer.finish().total
        return state

    @torch.no_grad()
    def step(self, state: DecodeState) -> StepStats:
        """One decoding step of an unfinished request: a plain one, or draft-plan-verify-accept."""
        if state.finished:
            raise ValueError("the request has finished; start a new one")
        controller = state.controller
        if controller is None:
            return self._plain_step(state)
        step = controller.begin([state.ctx_len], [state.uniforms is None], [REQUEST])
        if controller.draft_horizon(step, decides=True) == 0:
            return self._plain_step(state, step)
        return self._speculative_step(state, controller, step)

    @staticmethod
    def _pick(logits: torch.Tensor, state: DecodeState, index: int) -> torch.Tensor:
        """The target's token after logits [1, V] for output index `index`: argmax, or a sample. -> [1]."""
        if state.uniforms is None:
            return torch.argmax(logits, dim=-1)
        return sample_tokens(state.sampling.probs(logits), state.uniforms[index : index + 1])

    def _plain_step(self, state: DecodeState, step: StepStart | None = None) -> StepStats:
        """One token of plain autoregressive decoding; under a policy (`step`: a step the gate skipped) the
        position's target features are kept for the drafter's next pass and the controller observes it."""
        ctx = state.ctx_len
        predicted = self.latency.predict_plain(ctx)
        timer = StageTimer(self.device)
        with timer.stage("verify"):
            out = self.target.forward(
                state.cache,
                state.tokens[ctx : ctx + 1],
                torch.tensor([ctx], device=self.device),
                torch.ones((1, 1), dtype=torch.bool, device=self.device),
            )
        with timer.stage("accept"):
            token = self._pick(out.logits, state, len(state.output))
            emitted = state.commit(token, token.tolist())  # host sync: the token decides whether to stop
            if state.policy is not None and out.features is not None and state.new_features is not None:
                state.new_features = torch.cat([state.new_features, out.features])
        seconds = timer.finish()
        controller = state.controller
        if step is None or controller is None:
            self.latency.observe_plain(ctx, seconds.verify)
        else:
            controller.record(step, None)
            controller.end_timed(StepRecord(step.index, [1], [ctx], predicted, None, False), seconds)
            controller.verified([0])
        return StepStats(ctx, 0, 1, 1.0, 0, emitted, predicted, seconds)

    def _speculative_step(self, state: DecodeState, controller: StepController, step: StepStart) -> StepStats:
        """Draft, plan, verify and accept one tree (module docstring)."""
        if self.proposer is None:
            raise ValueError("a speculative step needs a drafter")
        ctx = state.ctx_len
        ctx_tensor = torch.tensor([ctx], device=self.device)
        timer = StageTimer(self.device)
        with timer.stage("draft"):
            draft_input = DraftInput(state.tokens[: state.length], state.new_features)
            proposal = self.proposer.propose(draft_input, state.topk)
        with timer.stage("plan"):
            planned = plan_draft(controller, step, proposal, state.topk)  # host sync: scores
            controller.record(step, planned)
            plan = planned.plan
            nodes, expected = plan.node_counts[0], plan.expected_accept[0]
            width = nodes + 1
            rows = flatten_trees(planned.trees, state.tokens[ctx : ctx + 1], width)
            padded = pad_verify_rows(rows, build_verify_layout(rows, ctx_tensor), self._verify_width(nodes))
        with timer.stage("verify"):
            out = self.target.forward(
                state.cache, padded.tokens[0], padded.positions[0], padded.ancestor_mask[0]
            )
        with timer.stage("accept"):
            logits = out.logits[:width]
            if state.uniforms is None:
                result = accept_greedy(rows, logits[None])
            else:
                probs = state.sampling.probs(logits)
                uniforms = state.uniforms[len(state.output) + rows.depths]  # [1, W]: by output index
                result = accept_sampling(rows, probs[None], uniforms)
            state.cache.move_rows(accepted_kv_moves(result.accept_index, result.accept_length, ctx_tensor))
            path = result.accept_index[0].clamp(min=0)
            step_tokens = torch.cat([rows.tokens[0, path[1:]], result.bonus_tokens])  # [W]: path, then bonus
            host = torch.cat([result.accept_length, step_tokens]).tolist()  # host sync: the step's tokens
            accepted = host[0]
            state.cache.truncate(ctx + accepted + 1)
            new_tokens = torch.cat([step_tokens[:accepted], result.bonus_tokens])
            emitted = state.commit(new_tokens, [*host[1 : 1 + accepted], host[-1]])
            if out.features is not None:
                state.new_features = out.features[result.accept_index[0, : accepted + 1]]
        seconds = timer.finish()
        predicted = self.latency.predict(width, ctx)
        # the pass ran at its bucket's width, as the worker records it (a width of 1 is a plain step's)
        record = StepRecord(step.index, [self._verify_width(nodes)], [ctx], predicted, None, True)
        controller.end_timed(record, seconds)
        controller.verified([accepted])
        top, lattice = (proposal, None) if isinstance(proposal, DraftTopK) else (None, proposal)
        return StepStats(ctx, nodes, width, expected, accepted, emitted, predicted, seconds, top, lattice)
