"""The step controller alone, served a synthetic acceptance profile: which trees each policy plans over
the first decode steps, and the speedup the latency model prices them at.

    python benchmarks/controller_synthetic.py --latency-profile P.json \
        --synthetic tools/offline_gpu/profiles/qwen3-8b-dflash-b16-gsm8k.json \
        --out controller_synthetic.json [--target <demo target>] [--batch 1] [--steps 60] [--seeds 8] \
        [--policies fixed:8,fixed:15,adaptive] [--prior-weights 1 16] [--context 300]

No Engine runs: `step.step_controller.StepController` plans every step on the drafter's stated
probabilities of the synthetic profile (`SyntheticAcceptanceProfile.stated_probs`: over-confident unless its
drafter temperature is 1), the truth draws each position's rank from the profile's own q (one draw per
request, step and position, from a generator seeded per seed, so every policy meets the same continuations),
and the walk down the planned tree gives the accepted length the controller then learns from
(`StepController.verified`). Latency is the latency profile's, not learnt: a step costs the profile's
T_draft + T_aux plus its verify pass at the planned width, and the speedup is
Σ committed tokens · L_AR / (B · Σ step seconds), what the planner's own model says of the trees it chose.
So the figures isolate acceptance learning (the online depth map, the scalar correction, the draft horizon,
the gate) from the machine: they say what adaptive plans, on this profile, in the number of steps a short
bench runs, against fixed budgets. `--prior-weights` reruns adaptive with each weight of the depth map's
prior. Prints mean and per-seed speedups, adaptive's over the best fixed budget, and writes them as JSON.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import numpy as np
import torch
from pydantic import BaseModel

from bastion_sglang.controller.acceptance import realised_accept_length
from bastion_sglang.controller.depth_acceptance import DEFAULT_PRIOR_WEIGHT, OnlineDepthMap
from bastion_sglang.controller.horizon import DraftHorizon
from bastion_sglang.controller.latency import LatencyModel
from bastion_sglang.controller.policies import AdaptivePolicy, FixedPolicy
from bastion_sglang.controller.profile import CalibrationProfile, load_profile
from bastion_sglang.controller.roofline import ModelShape, RooflineModel
from bastion_sglang.controller.step_costs import StepCostTracker
from bastion_sglang.demo.target import demo_target_dir
from bastion_sglang.kernels.types import DraftTopK
from bastion_sglang.step.step_controller import StepController
from bastion_sglang.step.synthetic_profile import SyntheticAcceptanceProfile, load_synthetic_profile

DEPTH = 15
"""Draft positions per step (a DFlash block of 16)."""
TOPK = 8
BUDGET = 256


class Case(BaseModel):
    policy: str
    prior_weight: float | None
    speedups: list[float]
    mean_speedup: float
    mean_nodes: float
    mean_accept: float


def serve(
    policy: str,
    prior_weight: float,
    seed: int,
    args: argparse.Namespace,
    latency_profile: CalibrationProfile,
    synthetic: SyntheticAcceptanceProfile,
    shape: ModelShape,
) -> tuple[float, float, float]:
    """(speedup, mean nodes, mean accepted length) of `args.steps` steps of one policy and seed."""
    roofline = RooflineModel(shape, latency_profile.hardware, latency_profile.bytes_per_element)
    latency = LatencyModel(roofline, latency_profile.fit)
    adaptive = policy == "adaptive"
    controller = StepController(
        latency=latency,
        costs=StepCostTracker(prior=latency_profile.step_costs),
        policy=AdaptivePolicy() if adaptive else FixedPolicy(int(policy.split(":")[1])),
        budget=BUDGET,
        horizon=DraftHorizon(DEPTH) if adaptive else DraftHorizon.full(DEPTH),
        acceptance=None,
        branching=TOPK,
        device=torch.device("cpu"),
    )
    controller.depth_map = OnlineDepthMap(DEPTH, prior_weight=prior_weight)
    batch, contexts = args.batch, [args.context] * args.batch
    stated = synthetic.stated_probs(DEPTH)[0][:, :TOPK].clamp_min(1e-30).log().float()
    truth = synthetic.probs(DEPTH)[:, :TOPK].numpy()
    outcomes = np.concatenate([truth, (1.0 - truth.sum(axis=1, keepdims=True)).clip(min=0.0)], axis=1)
    generator = np.random.default_rng(seed)
    costs = latency_profile.step_costs
    l_ar = latency.predict_plain_batch(contexts)
    committed = seconds = nodes = 0.0
    for _ in range(args.steps):
        ranks = np.stack([[generator.choice(TOPK + 1, p=row) for row in outcomes] for _ in range(batch)])
        step = controller.begin(contexts, [True] * batch, [f"request {i}" for i in range(batch)])
        horizon = controller.draft_horizon(step, decides=True)
        if horizon == 0:
            controller.record(step, None)
            controller.verified([0] * batch)
            committed, seconds = committed + batch, seconds + l_ar
            continue
        top = DraftTopK(
            stated[None, :horizon].repeat(batch, 1, 1), torch.arange(TOPK).repeat(batch, horizon, 1)
        )
        planned = controller.plan(step, top)
        counts = planned.plan.node_counts
        host = planned.trees.on_host()
        accepted = [  # token ids are ranks, and rank TOPK (none of the candidates) is no node's token
            realised_accept_length(
                host.tokens[b, : counts[b]].tolist(),
                host.parents[b, : counts[b]].tolist(),
                host.depths[b, : counts[b]].tolist(),
                ranks[b].tolist(),
            )
            - 1
            for b in range(batch)
        ]
        deepest = max((int(host.depths[b, : counts[b]].max()) for b in range(batch) if counts[b]), default=0)
        controller.record(step, planned, deepest)
        controller.verified(accepted)
        width = max(counts) + 1
        verify = latency.predict_batch([width] * batch, contexts)
        committed += sum(accepted) + batch
        seconds += costs.t_draft + costs.t_aux + costs.t_aux_per_token * width * batch + verify
        nodes += sum(counts) / batch
    return committed * l_ar / (batch * seconds), nodes / args.steps, committed / (batch * args.steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--latency-profile", type=Path, required=True, help="a calibration profile (JSON)")
    parser.add_argument("--synthetic", type=Path, required=True, help="a synthetic acceptance profile (JSON)")
    parser.add_argument(
        "--target", type=Path, help="the target's folder (config.json); default the demo target"
    )
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--seeds", type=int, default=8)
    parser.add_argument("--policies", default="fixed:8,fixed:15,adaptive")
    parser.add_argument("--prior-weights", type=float, nargs="+", default=[DEFAULT_PRIOR_WEIGHT])
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    latency_profile = load_profile(args.latency_profile)
    synthetic = load_synthetic_profile(args.synthetic)
    shape = ModelShape.from_hf_config(args.target or demo_target_dir())
    cases = []
    for policy in args.policies.split(","):
        for weight in args.prior_weights if policy == "adaptive" else [DEFAULT_PRIOR_WEIGHT]:
            runs = [
                serve(policy, weight, seed, args, latency_profile, synthetic, shape)
                for seed in range(args.seeds)
            ]
            speedups = [run[0] for run in runs]
            cases.append(
                Case(
                    policy=policy,
                    prior_weight=weight if policy == "adaptive" else None,
                    speedups=speedups,
                    mean_speedup=statistics.mean(speedups),
                    mean_nodes=statistics.mean(run[1] for run in runs),
                    mean_accept=statistics.mean(run[2] for run in runs),
                )
            )
    best_fixed = max((case.mean_speedup for case in cases if case.policy != "adaptive"), default=None)
    print(f"{synthetic.name}: B = {args.batch}, {args.steps} steps, {args.seeds} seeds (speedup as priced)")
    for case in cases:
        label = case.policy if case.prior_weight is None else f"adaptive (prior {case.prior_weight:g})"
        ratio = "" if best_fixed is None else f", {case.mean_speedup / best_fixed:.3f}x the best fixed"
        per_seed = " ".join(f"{value:.2f}" for value in case.speedups)
        print(
            f"{label:<24} speedup {case.mean_speedup:.3f}{ratio}; nodes {case.mean_nodes:.1f}, "
            f"accepted {case.mean_accept:.2f}; per seed {per_seed}"
        )
    args.out.write_text("[" + ",".join(case.model_dump_json() for case in cases) + "]")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
