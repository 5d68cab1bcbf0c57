"""Budget policies of the reference engine measured like a benchmark: the same table as `bastion bench`.

Every policy decodes the same prompts at each temperature, `repeats` rounds. In each round the policies run in
the order of row r of a Williams design (`bench.plan.repeat_order`), each in a fresh `ReferenceEngine` with
its own copy of the fitted latency model (no EMA state carried from one policy to the next), after one untimed
generation of the first prompt per policy before the first round (all its tokens: after a 16-token warm-up the
first round on an H200 ran as slow as 0.4x the later ones, ar 16.1 against 39.2 tokens/s). With `ignore_eos`
every request decodes exactly `max_new_tokens` tokens, so every policy does identical work; at temperature > 0
request i is seeded with i, so every policy draws the same uniforms (lossless sampling: the same tokens, up to
floating-point differences between passes of other widths).

Per request: decode seconds are the generate call's wall time (synchronised) minus its prefill; decode
tokens are the tokens after the first (the prefill's). A policy's decode tokens/s in a round is Σ decode
tokens / Σ decode seconds over the requests, batch size 1 (the reference engine decodes one request at a
time). Per-token latency: each step of duration d that emitted k tokens gives k samples d / k.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field
from transformers import PreTrainedModel

from bastion_sglang.bench.aggregate import ratio, summarize_rates
from bastion_sglang.bench.plan import repeat_order
from bastion_sglang.bench.report import Spread, TemperatureSummary
from bastion_sglang.bench.streaming import latency_percentiles_ms
from bastion_sglang.controller.latency import LatencyModel
from bastion_sglang.reference.drafter import DFlashDrafter
from bastion_sglang.reference.engine import ReferenceEngine
from bastion_sglang.reference.stats import GenerationResult
from bastion_sglang.step.timing import synchronize

DEFAULT_PAIR_POLICIES = (
    "ar",
    "chain",
    "fixed:1",
    "fixed:2",
    "fixed:4",
    "fixed:8",
    "fixed:16",
    "fixed:64",
    "fixed:256",
    "adaptive",
)


class PairRound(BaseModel):
    """One policy at one temperature in one round; seconds, tokens/s and milliseconds as named."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    repeat: int = Field(ge=1)
    decode_tokens: int = Field(ge=0)
    decode_seconds: float = Field(ge=0)
    prefill_seconds: float = Field(ge=0)
    decode_tokens_per_second: float = Field(ge=0)
    steps: int = Field(ge=0)
    tau: float = Field(ge=0, description="mean tokens committed per step, bonus included")
    mean_nodes: float = Field(ge=0, description="draft nodes verified per step")
    mean_verify_ms: float = Field(ge=0)
    mean_draft_ms: float = Field(ge=0)
    verify_prediction_mape: float = Field(ge=0, description="mean |predicted - measured| / measured verify")
    token_latency_p50_ms: float = Field(ge=0)
    token_latency_p90_ms: float = Field(ge=0)
    same_output_as_ar: float | None = Field(description="share of requests equal to ar's in this round")


class PolicyResult(BaseModel):
    """One policy at one temperature over the rounds."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    policy: str
    temperature: float
    rounds: list[PairRound]
    decode_tokens_per_second: Spread


class PairSummary(BaseModel):
    """One temperature: the bench's summary (the best policy in hindsight, adaptive against it and ar, paired
    per round) and adaptive against the best fixed budget."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    rates: TemperatureSummary
    best_fixed_policy: str | None
    adaptive_vs_best_fixed: float | None


class PairBenchReport(BaseModel):
    """Everything one pair bench measured; rewritten after every round."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    target: str
    draft: str
    prompts: int
    max_new_tokens: int
    ignore_eos: bool
    max_nodes: int
    width_buckets: list[int] | None = Field(description="verify widths passes were padded to; None: unpadded")
    policies: list[str]
    temperatures: list[float]
    repeats: int
    orders: list[list[str]] = Field(description="the policy order of each round")
    results: list[PolicyResult]
    summaries: list[PairSummary]


def _measure_round(
    repeat: int,
    results: Sequence[GenerationResult],
    walls: Sequence[float],
    ar_tokens: Sequence[list[int]] | None,
) -> PairRound:
    steps = [step for result in results for step in result.steps]
    prefill = sum(result.prefill_seconds for result in results)
    decode_seconds = sum(walls) - prefill
    decode_tokens = sum(max(len(result.tokens) - 1, 0) for result in results)
    latencies = [step.seconds.total / step.emitted for step in steps for _ in range(step.emitted)]
    p50, p90 = latency_percentiles_ms(latencies) if latencies else (0.0, 0.0)
    count = max(len(steps), 1)
    errors = [abs(s.predicted_verify_seconds - s.seconds.verify) / s.seconds.verify for s in steps]
    same = None
    if ar_tokens is not None:
        same = sum(r.tokens == a for r, a in zip(results, ar_tokens, strict=True)) / len(results)
    return PairRound(
        repeat=repeat,
        decode_tokens=decode_tokens,
        decode_seconds=decode_seconds,
        prefill_seconds=prefill,
        decode_tokens_per_second=decode_tokens / decode_seconds if decode_seconds > 0 else 0.0,
        steps=len(steps),
        tau=sum(step.accepted + 1 for step in steps) / count,
        mean_nodes=sum(step.nodes for step in steps) / count,
        mean_verify_ms=1e3 * sum(step.seconds.verify for step in steps) / count,
        mean_draft_ms=1e3 * sum(step.seconds.draft for step in steps) / count,
        verify_prediction_mape=sum(errors) / max(len(errors), 1),
        token_latency_p50_ms=p50,
        token_latency_p90_ms=p90,
        same_output_as_ar=same,
    )


def summarize(temperature: float, results: Sequence[PolicyResult]) -> PairSummary:
    """`bench.aggregate.summarize_rates` over the rounds at `temperature`, and adaptive's median over the
    best fixed budget's."""
    here = [result for result in results if result.temperature == temperature]
    medians = {result.policy: result.decode_tokens_per_second.median for result in here}
    fixed = [policy for policy in medians if policy.startswith("fixed:")]
    best_fixed = max(fixed, key=medians.__getitem__) if fixed else None
    return PairSummary(
        rates=summarize_rates(
            temperature,
            {result.policy: [r.decode_tokens_per_second for r in result.rounds] for result in here},
        ),
        best_fixed_policy=best_fixed,
        adaptive_vs_best_fixed=ratio(medians.get("adaptive"), medians.get(best_fixed or "")),
    )


def run_pair_bench(
    model: PreTrainedModel,
    draft_path: Path,
    latency: LatencyModel,
    prompts: Sequence[list[int]],
    *,
    target_name: str,
    policies: Sequence[str] = DEFAULT_PAIR_POLICIES,
    temperatures: Sequence[float] = (0.0,),
    repeats: int = 1,
    max_new_tokens: int = 96,
    max_nodes: int = 1024,
    ignore_eos: bool = True,
    on_round: Callable[[PairBenchReport], None] | None = None,
) -> PairBenchReport:
    """Decode `prompts` (token ids) under every policy at every temperature, `repeats` rounds (module doc).

    `latency` is the fitted model of this target on this device; each policy run plans with a fresh copy.
    `on_round` gets the report so far after every (round, temperature), so a run cut short keeps what it
    measured. ValueError for an empty or repeated policy list, or repeats < 1.
    """
    if not policies or len(set(policies)) != len(policies):
        raise ValueError(f"policies must be non-empty and distinct, got {list(policies)!r}")
    if repeats < 1 or not prompts:
        raise ValueError(f"need repeats >= 1 and at least one prompt, got {repeats} and {len(prompts)}")
    device = next(model.parameters()).device
    drafter = DFlashDrafter.from_pretrained(  # read once: each engine keeps its own draft cache
        draft_path, device=device, dtype=model.dtype, target_num_layers=int(model.config.num_hidden_layers)
    )

    def engine() -> ReferenceEngine:
        return ReferenceEngine(
            model,
            drafter,
            device=device,
            dtype=model.dtype,
            latency=copy.deepcopy(latency),
            max_nodes=max_nodes,
            eos_token_ids=[] if ignore_eos else None,
        )

    for policy in policies:  # every kernel shape class compiled once, outside the timed rounds
        engine().generate(prompts[0], max_new_tokens, policy=policy)
    rounds: dict[tuple[str, float], list[PairRound]] = {(p, t): [] for t in temperatures for p in policies}
    orders: list[list[str]] = []
    report: PairBenchReport | None = None
    for repeat in range(1, repeats + 1):
        order = list(repeat_order(list(policies), repeat - 1))
        orders.append(order)
        for temperature in temperatures:
            outputs: dict[str, tuple[list[GenerationResult], list[float]]] = {}
            for policy in order:
                runner = engine()
                results, walls = [], []
                for index, prompt in enumerate(prompts):
                    synchronize(device)
                    start = time.perf_counter()
                    results.append(
                        runner.generate(
                            prompt, max_new_tokens, temperature=temperature, seed=index, policy=policy
                        )
                    )
                    synchronize(device)
                    walls.append(time.perf_counter() - start)
                outputs[policy] = (results, walls)
            ar_tokens = [r.tokens for r in outputs["ar"][0]] if "ar" in outputs else None
            for policy, (results, walls) in outputs.items():
                rounds[(policy, temperature)].append(_measure_round(repeat, results, walls, ar_tokens))
            report = _report(
                rounds, orders, policies, temperatures, repeat, prompts, target_name, draft_path,
                max_new_tokens, max_nodes, latency.width_buckets, ignore_eos,
            )  # fmt: skip
            if on_round is not None:
                on_round(report)
    assert report is not None
    return report


def _report(
    rounds: dict[tuple[str, float], list[PairRound]],
    orders: list[list[str]],
    policies: Sequence[str],
    temperatures: Sequence[float],
    repeats_done: int,
    prompts: Sequence[list[int]],
    target_name: str,
    draft_path: Path,
    max_new_tokens: int,
    max_nodes: int,
    width_buckets: tuple[int, ...] | None,
    ignore_eos: bool,
) -> PairBenchReport:
    results = [
        PolicyResult(
            policy=policy,
            temperature=temperature,
            rounds=measured,
            decode_tokens_per_second=Spread.of([r.decode_tokens_per_second for r in measured]),
        )
        for (policy, temperature), measured in rounds.items()
        if measured
    ]
    done = sorted({result.temperature for result in results})
    return PairBenchReport(
        target=target_name,
        draft=str(draft_path),
        prompts=len(prompts),
        max_new_tokens=max_new_tokens,
        ignore_eos=ignore_eos,
        max_nodes=max_nodes,
        width_buckets=None if width_buckets is None else list(width_buckets),
        policies=list(policies),
        temperatures=list(temperatures),
        repeats=repeats_done,
        orders=orders,
        results=results,
        summaries=[summarize(temperature, results) for temperature in done],
    )


def format_table(report: PairBenchReport) -> str:
    """The report as a text table: per temperature and policy, median [min-max] decode tokens/s, τ, nodes,
    token latency p50/p90 of the last round; then the summary line."""
    lines = []
    for summary in report.summaries:
        temperature = summary.rates.temperature
        lines.append(f"T={temperature:g}  (decode tokens/s, batch 1, {report.repeats} round(s))")
        for result in (r for r in report.results if r.temperature == temperature):
            rate, last = result.decode_tokens_per_second, result.rounds[-1]
            lines.append(
                f"  {result.policy:>10}: {rate.median:8.2f} [{rate.min:.2f}-{rate.max:.2f}]"
                f"  tau {last.tau:5.2f}  nodes {last.mean_nodes:6.1f}"
                f"  p50/p90 {last.token_latency_p50_ms:6.1f}/{last.token_latency_p90_ms:6.1f} ms"
            )
        lines.append(f"  best {summary.rates.best_policy}; {_ratios(summary)}")
    return "\n".join(lines)


def _ratios(summary: PairSummary) -> str:
    rates = summary.rates
    parts = [
        f"{label} {value:.3f}"
        for label, value in (
            ("adaptive/best", rates.adaptive_vs_best),
            (f"adaptive/best fixed ({summary.best_fixed_policy})", summary.adaptive_vs_best_fixed),
            ("adaptive/ar", rates.adaptive_vs_ar),
        )
        if value is not None
    ]
    paired = rates.adaptive_vs_best_per_repeat
    if paired is not None:
        parts.append(f"paired vs best {paired.median:.3f} ({paired.min:.3f}-{paired.max:.3f})")
    return ", ".join(parts) if parts else "no adaptive run"
