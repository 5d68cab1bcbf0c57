"""`bastion bench`: every policy through the real in-process `sglang.Engine`, on the same prompts, repeated.

    bastion bench --model-path T --draft-model-path D --prompts humaneval|mtbench|sharegpt|FILE.jsonl \
        [--policies ar,chain,fixed:1,fixed:2,fixed:4,fixed:8,fixed:16,fixed:64,adaptive] \
        [--temperatures 0,0.7] [--concurrency N] [--repeats R] ...

Policies: `ar` is the Engine without speculation; `chain`, `fixed:N`, `adaptive` and `bucketed` are
`--speculative-algorithm BASTION` with that `--bastion-policy` (and `--max-budget` as N_max); `dflash` is
SGLang's built-in DFLASH worker (CUDA only).

Repeats: `--repeats R` rounds. In each, every policy gets a fresh Engine in a process of its own (fresh
online latency corrections, caches and allocator), shut down before the next one starts. Round r (from 0)
runs the policies rotated by r, policies[r:] + policies[:r], so slow drift of the machine (clocks, heat,
other load) does not always favour the same policy; each round's order is logged and kept in the report.
Each Engine answers one warm-up request, then runs every temperature on the same prompts: a named set's
held-out split by default (never seen in drafter training), a JSONL file whole, each rendered with the target
tokenizer's chat template, sent in batches of `--concurrency` requests (one `Engine.generate(input_ids=[...],
stream=True)` call per batch).

Streaming (SGLang 0.5.23): for a list of input ids, the Engine yields the chunks of all the batch's requests
interleaved, each tagged with `index` (the request's position in the list). Every chunk's meta_info carries
`completion_tokens`, the request's tokens so far (cumulative); a request's last chunk has a non-null
`finish_reason` and, under speculation, `spec_verify_ct`. SGLang streams every scheduler step (stream
interval 1): the first chunk holds the prefill's token, each later one the tokens of one decode step (several
per verify pass). A chunk's arrival time is `time.perf_counter()` when the Engine's generator hands it over.

Per policy, temperature and repeat (`RepeatMeasurement`):
- wall tokens/s: completion tokens / wall seconds of the generate calls (first call to last chunk; prefill and
  queueing included, engine start-up and warm-up excluded);
- decode tokens/s: Σ decode tokens / Σ decode seconds over the requests, where a request's decode seconds are
  the arrival of its last token-carrying chunk minus that of its first chunk, and its decode tokens are the
  tokens that arrived after its first chunk (completion_tokens - 1, the first chunk holding the prefill's
  token). Prefill excluded. A per-request rate: with `--concurrency c` requests decode side by side, so the
  Engine's aggregate decode rate is up to c times it;
- per-token latency p50 / p90 (ms): each chunk after a request's first, carrying k new tokens g seconds after
  that request's previous token-carrying chunk, gives k samples g / k (a verify pass commits several tokens at
  once); percentiles (linear interpolation) over the samples of all the requests. Σ samples = Σ decode
  seconds, so their mean is 1 / decode tokens/s.

Per policy and temperature (`BenchRow`), over the repeats:
- medians, with min and max (each repeat's values under `per_repeat`): decode tokens/s and wall tokens/s; the
  token latency p50 and p90 are the medians of each repeat's percentile;
- speedup: median decode tokens/s over `ar`'s at the same temperature; wall_speedup: the same for wall
  tokens/s (null when `ar` is not run);
- pooled over every repeat's requests and steps (ratios of totals, not medians): requests, completion tokens,
  verify passes, and τ, the mean accepted length: Σ completion_tokens / Σ spec_verify_ct (tokens committed per
  verify pass, bonus included; 1.0 for `ar`).

The worker's histograms, pooled the same way: Σ over the repeats of each histogram's `_sum` growth over the
temperature's generate calls, over Σ of its `_count` growth, read with prometheus_client's multiprocess
collector from each Engine's PROMETHEUS_MULTIPROC_DIR (null for `ar` and `dflash`, which do not export them):
- mean budget: draft nodes verified per request per step (`sglang:bastion_tree_nodes`);
- mean_expected_accept_length: Â per request per step, the calibrated estimate the planner maximised (tokens
  committed, bonus included); mean_expected_accept_length_raw: the same trees' uncalibrated Â;
- realised_accept_length: tokens committed per request per step, as the worker counted them;
- accept_error / accept_error_raw: expected / realised - 1 (signed), calibrated and raw;
- latency_mape: mean |estimated - observed| / observed verify latency per pass, after the worker's warm-up;
- stage_ms: mean milliseconds per decode step of each stage (draft, plan, verify, accept, commit) and of
  `other`, the host time between two decode steps outside the worker.

Per temperature (`TemperatureSummary`): the best policy in hindsight, the one with the highest median decode
tokens/s, and adaptive's median decode tokens/s over the best's and over `ar`'s (when they are run).

Outputs in `--out`: `bench.json` (`BenchReport`), `bench.png` (median decode tokens/s with min-max error bars,
and τ, per policy, grouped by temperature), and the tables and per-temperature summary on stdout.
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata
import itertools
import logging
import math
import multiprocessing
import os
import re
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from multiprocessing.context import SpawnContext
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator
from tqdm import tqdm

from bastion_sglang.assets import MissingPackageError
from bastion_sglang.config import default_width_buckets
from bastion_sglang.controller.policies import FixedPolicy, parse_policy

HELP = (
    "Benchmark ar, chain, fixed:N, adaptive, bucketed and dflash through sglang.Engine on the same prompts, "
    "each repeat in fresh Engines: median decode and wall tokens/s with their spread, per-token latency "
    "p50/p90, mean accepted length, mean tree budget, speedup over ar and the best policy in hindsight, "
    "as a table, JSON and PNG."
)

logger = logging.getLogger(__name__)

DEFAULT_POLICIES = "ar,chain,fixed:1,fixed:2,fixed:4,fixed:8,fixed:16,fixed:64,adaptive"
DEFAULT_MAX_BUDGET = 64
"""N_max passed to BASTION Engines (`--bastion-max-budget`): room for the largest default fixed budget."""
DEFAULT_REPEATS = 3
MIN_NEW_TOKENS = 2
"""Fewest `--max-new-tokens`: decode throughput needs a token after the prefill's."""
TREE_NODES_METRIC = "sglang:bastion_tree_nodes"
"""The worker's histogram of draft nodes verified per request per step (bastion_sglang.metrics)."""
EXPECTED_METRIC = "sglang:bastion_expected_accept_length"
EXPECTED_RAW_METRIC = "sglang:bastion_expected_accept_length_raw"
REALISED_METRIC = "sglang:bastion_accept_length"
LATENCY_ERROR_METRIC = "sglang:bastion_verify_relative_error"
WORKER_METRICS = (
    TREE_NODES_METRIC,
    EXPECTED_METRIC,
    EXPECTED_RAW_METRIC,
    REALISED_METRIC,
    LATENCY_ERROR_METRIC,
)
STAGE_METRIC = "sglang:bastion_step_stage_seconds"
STAGE_NAMES = ("draft", "plan", "verify", "accept", "commit", "other")
PROMETHEUS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"
REPORT_NAME = "bench.json"
PLOT_NAME = "bench.png"
RUN_NAME = "run.json"
"""The `PolicyRun` one policy process writes into its scratch folder for the parent."""
WARMUP_TOKENS = 4
"""New tokens of each Engine's warm-up request (one prompt, T = 0), excluded from every measurement."""
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
"""A Hugging Face repository id (owner/name), accepted for a path that does not exist locally."""
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
"""Log format of the policy processes (the `bastion` command's own)."""
VERSIONED_PACKAGES = ("bastion-sglang", "sglang", "torch", "transformers", "prometheus-client")

PolicyKind = Literal["ar", "bastion", "dflash"]
Device = Literal["cpu", "cuda"]


@dataclass(frozen=True)
class BenchPolicy:
    """One benchmarked configuration: its spelling on the command line and the Engine it needs."""

    name: str  # "ar", "dflash", or a --bastion-policy spelling ("chain", "fixed:64", ...)
    kind: PolicyKind


def parse_policies(text: str, max_budget: int) -> tuple[BenchPolicy, ...]:
    """'ar,chain,fixed:64' -> BenchPolicy per name, in order; ValueError naming an unknown or repeated one."""
    names = [part.strip().lower() for part in text.split(",") if part.strip()]
    if not names:
        raise ValueError(f"--policies {text!r} names no policy")
    policies = []
    for name in names:
        if name in ("ar", "dflash"):
            policies.append(BenchPolicy(name, "ar" if name == "ar" else "dflash"))
            continue
        try:
            parsed = parse_policy(name, width_buckets=default_width_buckets(max_budget))
        except ValueError as error:
            raise ValueError(f"--policies: {error} (or dflash, on CUDA)") from None
        if isinstance(parsed, FixedPolicy) and parsed.nodes > max_budget:
            raise ValueError(
                f"--policies {name}: {parsed.nodes} nodes exceed --max-budget {max_budget} (N_max); raise it"
            )
        policies.append(BenchPolicy(name, "bastion"))
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ValueError(f"--policies names {repeated} more than once")
    return tuple(policies)


def parse_temperatures(text: str) -> tuple[float, ...]:
    """'0,0.7' -> (0.0, 0.7); ValueError naming a value that is not a finite number >= 0."""
    values = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        try:
            value = float(part)
        except ValueError:
            raise ValueError(f"--temperatures: {part!r} is not a number") from None
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"--temperatures: {part!r} must be a finite number >= 0")
        values.append(value)
    if not values:
        raise ValueError(f"--temperatures {text!r} names no temperature")
    return tuple(values)


# ---- the report file ----------------------------------------------------------------------------------


class BenchSettings(BaseModel):
    """What the benchmark ran: models, prompts, policies, sampling, repeats and Engine settings."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model_path: str
    draft_model_path: str | None = Field(description="None when only `ar` runs")
    prompts: str = Field(description="prompt set name or JSONL path")
    split: Literal["train", "heldout", "all"]
    num_prompts: int = Field(gt=0, description="prompts sent per policy, temperature and repeat")
    concurrency: int = Field(gt=0, description="requests in flight (one Engine.generate batch)")
    max_new_tokens: int = Field(ge=MIN_NEW_TOKENS)
    ignore_eos: bool
    temperatures: tuple[float, ...] = Field(min_length=1)
    policies: tuple[str, ...] = Field(min_length=1)
    repeats: int = Field(ge=1, description="rounds; each runs every policy in a fresh Engine")
    max_budget: int = Field(gt=0, description="N_max of the BASTION Engines")
    device: Literal["cpu", "cuda"]
    attention_backend: str
    dtype: str
    seed: int


class StageMs(BaseModel):
    """Mean milliseconds per decode step of each stage (`other`: per decode step that followed one)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    draft: float = Field(ge=0)
    plan: float = Field(ge=0)
    verify: float = Field(ge=0)
    accept: float = Field(ge=0)
    commit: float = Field(ge=0)
    other: float = Field(ge=0)


class Spread(BaseModel):
    """A rate over the repeats, tokens/s: its median, min and max (each repeat's value is in `per_repeat`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    median: float = Field(ge=0)
    min: float = Field(ge=0)
    max: float = Field(ge=0)

    @model_validator(mode="after")
    def _ordered(self) -> Spread:
        if not self.min <= self.median <= self.max:
            raise ValueError(f"needs min <= median <= max, got {self.min}, {self.median}, {self.max}")
        return self

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        """The spread of one value per repeat (at least one)."""
        return cls(median=statistics.median(values), min=min(values), max=max(values))


class RepeatMeasurement(BaseModel):
    """One policy at one temperature in one repeat (its own fresh Engine); definitions in the module doc."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    repeat: int = Field(ge=1, description="the round, from 1")
    requests: int = Field(gt=0)
    completion_tokens: int = Field(ge=0, description="Σ meta_info completion_tokens")
    verify_passes: int | None = Field(description="Σ meta_info spec_verify_ct; None for ar")
    wall_seconds: float = Field(gt=0, description="wall time of the generate calls, seconds")
    tokens_per_second: float = Field(ge=0, description="completion_tokens / wall_seconds (prefill included)")
    decode_tokens: int = Field(gt=0, description="Σ per request: tokens that arrived after its first chunk")
    decode_seconds: float = Field(gt=0, description="Σ per request: last token's arrival - first's, seconds")
    decode_tokens_per_second: float = Field(gt=0, description="decode_tokens / decode_seconds, per request")
    token_latency_p50_ms: float = Field(ge=0, description="median per-token latency after the prefill, ms")
    token_latency_p90_ms: float = Field(ge=0, description="90th percentile per-token latency, ms")


class BenchRow(BaseModel):
    """One policy at one temperature over every repeat: medians of the rates, pooled means of the rest."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    policy: str
    temperature: float = Field(ge=0)
    per_repeat: tuple[RepeatMeasurement, ...] = Field(min_length=1, description="each repeat's, in order")
    requests: int = Field(gt=0, description="Σ over the repeats")
    completion_tokens: int = Field(ge=0, description="Σ meta_info completion_tokens over the repeats")
    verify_passes: int | None = Field(description="Σ meta_info spec_verify_ct over the repeats; None for ar")
    decode_tokens_per_second: Spread = Field(description="per request, prefill excluded; over the repeats")
    tokens_per_second: Spread = Field(description="wall clock, prefill included; over the repeats")
    token_latency_p50_ms: float = Field(ge=0, description="median over the repeats of each one's p50, ms")
    token_latency_p90_ms: float = Field(ge=0, description="median over the repeats of each one's p90, ms")
    mean_accept_length: float = Field(ge=0, description="τ = completion_tokens / verify_passes; 1 for ar")
    mean_budget: float | None = Field(
        description="draft nodes verified per request per step (sglang:bastion_tree_nodes); None: not BASTION"
    )
    speedup: float | None = Field(description="median decode tokens/s over ar's at this temperature")
    wall_speedup: float | None = Field(description="median wall tokens/s over ar's at this temperature")
    mean_expected_accept_length: float | None = Field(
        default=None, description="calibrated Â per request per step; None: not BASTION"
    )
    mean_expected_accept_length_raw: float | None = Field(default=None, description="uncalibrated Â")
    realised_accept_length: float | None = Field(
        default=None, description="tokens committed per request per step (the worker's count)"
    )
    accept_error: float | None = Field(default=None, description="expected / realised - 1, calibrated")
    accept_error_raw: float | None = Field(default=None, description="expected / realised - 1, raw")
    latency_mape: float | None = Field(default=None, description="mean relative verify-latency error")
    stage_ms: StageMs | None = Field(default=None, description="mean ms per decode step per stage")


class TemperatureSummary(BaseModel):
    """The best policy in hindsight at one temperature (by median decode tokens/s); adaptive against it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    temperature: float = Field(ge=0)
    best_policy: str = Field(description="the policy with the highest median decode tokens/s")
    best_decode_tokens_per_second: float = Field(ge=0, description="its median decode tokens/s")
    adaptive_vs_best: float | None = Field(
        description="adaptive's median decode tokens/s over the best's; None: adaptive not run"
    )
    adaptive_vs_ar: float | None = Field(
        description="adaptive's median decode tokens/s over ar's; None: adaptive or ar not run"
    )


class BenchReport(BaseModel):
    """`bench.json`: the settings, where it ran, package versions, each repeat's policy order, one row per
    policy × temperature and one summary per temperature."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    format_version: Literal[2] = 2
    created: str = Field(description="UTC time the report was written, ISO 8601")
    settings: BenchSettings
    device: str = Field(description="device name: the GPU's, or 'CPU <model>'")
    versions: dict[str, str] = Field(description="installed package -> version")
    repeat_orders: tuple[tuple[str, ...], ...] = Field(min_length=1, description="policy order per repeat")
    rows: tuple[BenchRow, ...] = Field(min_length=1)
    summaries: tuple[TemperatureSummary, ...] = Field(min_length=1, description="one per temperature")

    @model_validator(mode="after")
    def _orders_run_every_policy(self) -> BenchReport:
        if len(self.repeat_orders) != self.settings.repeats:
            raise ValueError(f"{len(self.repeat_orders)} repeat orders for {self.settings.repeats} repeats")
        for order in self.repeat_orders:
            if sorted(order) != sorted(self.settings.policies):
                raise ValueError(f"repeat order {order} does not run each of {self.settings.policies} once")
        return self


# ---- planning: every check before any Engine starts ---------------------------------------------------


@dataclass(frozen=True)
class BenchPlan:
    """The validated command line, with the prompts loaded and tokenized."""

    settings: BenchSettings
    policies: tuple[BenchPolicy, ...]
    prompt_ids: tuple[list[int], ...]  # per prompt: its first user turn in the target's chat template
    out: Path
    mem_fraction_static: float | None
    max_total_tokens: int | None
    sglang_log_level: str


def _check_model(flag: str, value: str | None) -> str:
    """A local model folder (config.json inside) or a Hub id; ValueError naming the flag and value."""
    if value is None:
        raise ValueError(f"{flag} is required")
    path = Path(value)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"{flag} {value}: the folder has no config.json")
        return str(path)
    if path.exists() or value.startswith((".", "/", "~")) or not HUB_ID.match(value):
        raise ValueError(f"{flag} {value}: no such model folder (and not a Hugging Face id owner/name)")
    logger.info("%s %s is not a local folder; SGLang will fetch it as a Hugging Face id", flag, value)
    return value


def plan_from_args(args: argparse.Namespace) -> BenchPlan:
    """Validate the arguments and load the prompts; ValueError or MissingPackageError naming the bad value."""
    from bastion_sglang.calibration.identity import detect_device
    from bastion_sglang.prompt_sets import PROMPT_SETS, load_prompts

    if args.max_budget < 1:
        raise ValueError(f"--max-budget must be >= 1, got {args.max_budget}")
    policies = parse_policies(args.policies, args.max_budget)
    temperatures = parse_temperatures(args.temperatures)
    for flag, value in (("--num-prompts", args.num_prompts), ("--concurrency", args.concurrency)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    if args.max_new_tokens < MIN_NEW_TOKENS:
        raise ValueError(
            f"--max-new-tokens must be >= {MIN_NEW_TOKENS} (decode starts after the first token), "
            f"got {args.max_new_tokens}"
        )
    device: Device = (
        "cuda" if detect_device(None if args.device == "auto" else args.device).type == "cuda" else "cpu"
    )
    if device == "cpu" and any(p.kind == "dflash" for p in policies):
        raise ValueError(
            "--policies dflash: SGLang's DFLASH worker runs on CUDA only; drop dflash or use --device cuda"
        )
    model_path = _check_model("--model-path", args.model_path)
    speculative = any(p.kind != "ar" for p in policies)
    draft_path = _check_model("--draft-model-path", args.draft_model_path) if speculative else None
    named = args.prompts in PROMPT_SETS
    prompts_path = Path(args.prompts)
    if not named and not prompts_path.is_file() and (prompts_path.suffix or len(prompts_path.parts) > 1):
        raise ValueError(f"--prompts {args.prompts}: no such file (or one of {list(PROMPT_SETS)})")
    split = args.split or ("heldout" if named else "all")
    prompts = load_prompts(args.prompts, split=split)
    if args.num_prompts is not None:
        prompts = prompts[: args.num_prompts]
    if not prompts:
        raise ValueError(f"--prompts {args.prompts}: the {split} split holds no prompts")
    if args.num_prompts is not None and len(prompts) < args.num_prompts:
        logger.warning(
            "--num-prompts %d: the %s split of %s holds %d; using them all",
            args.num_prompts,
            split,
            args.prompts,
            len(prompts),
        )
    attention = args.attention_backend or ("torch_native" if device == "cpu" else "triton")
    settings = BenchSettings(
        model_path=model_path,
        draft_model_path=draft_path,
        prompts=str(args.prompts),
        split=split,
        num_prompts=len(prompts),
        concurrency=args.concurrency,
        max_new_tokens=args.max_new_tokens,
        ignore_eos=args.ignore_eos,
        temperatures=temperatures,
        policies=tuple(p.name for p in policies),
        repeats=args.repeats,
        max_budget=args.max_budget,
        device=device,
        attention_backend=attention,
        dtype=args.dtype,
        seed=args.seed,
    )
    return BenchPlan(
        settings=settings,
        policies=policies,
        prompt_ids=tokenize_prompts(model_path, [p.turns[0] for p in prompts]),
        out=args.out,
        mem_fraction_static=args.mem_fraction_static or (0.2 if device == "cpu" else None),
        max_total_tokens=args.max_total_tokens or (65536 if device == "cpu" else None),
        sglang_log_level=args.sglang_log_level,
    )


# ---- running ------------------------------------------------------------------------------------------


def tokenize_prompts(model_path: str, texts: Sequence[str]) -> list[list[int]]:
    """Token ids of each text as the first user turn in the target tokenizer's chat template.

    ValueError naming the model when its tokenizer does not load or has no chat template.
    """
    from transformers import AutoTokenizer

    from bastion_sglang.prompt_sets import Prompt, chat_prompt_ids

    try:
        tokenizer = AutoTokenizer.from_pretrained(model_path)
    except OSError as error:
        raise ValueError(f"--model-path {model_path}: no tokenizer could be loaded: {error}") from None
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"--model-path {model_path}: the tokenizer has no chat template")
    return [
        chat_prompt_ids(tokenizer, Prompt(source="bench", id=str(i), turns=(t,))) for i, t in enumerate(texts)
    ]


def server_args_for(plan: BenchPlan, policy: BenchPolicy) -> Any:
    """The ServerArgs record of `policy`'s Engine (BASTION's config attached as `attach_config` does)."""
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import ServerArgs

    from bastion_sglang.registration import attach_config, make_config

    load_plugins()
    settings = plan.settings
    kwargs: dict[str, Any] = dict(
        model_path=settings.model_path,
        device=settings.device,
        attention_backend=settings.attention_backend,
        dtype=settings.dtype,
        random_seed=settings.seed,
        log_level=plan.sglang_log_level,
    )
    if settings.device == "cpu":
        kwargs["disable_cuda_graph"] = True
    if plan.mem_fraction_static is not None:
        kwargs["mem_fraction_static"] = plan.mem_fraction_static
    if plan.max_total_tokens is not None:
        kwargs["max_total_tokens"] = plan.max_total_tokens
    if policy.kind == "bastion":
        kwargs |= dict(
            speculative_algorithm="BASTION",
            speculative_draft_model_path=settings.draft_model_path,
            enable_metrics=True,
        )
    elif policy.kind == "dflash":
        kwargs |= dict(speculative_algorithm="DFLASH", speculative_draft_model_path=settings.draft_model_path)
    server_args = ServerArgs(**kwargs)
    if policy.kind == "bastion":
        attach_config(server_args, make_config(max_budget=settings.max_budget, policy=policy.name))
    return server_args


def repeat_order(policies: Sequence[BenchPolicy], repeat_index: int) -> tuple[BenchPolicy, ...]:
    """The policies in the order round `repeat_index` (from 0) runs them: rotated left by that many."""
    shift = repeat_index % len(policies)
    return (*policies[shift:], *policies[:shift])


# ---- the worker's histograms --------------------------------------------------------------------------


class HistogramTotals(BaseModel):
    """`_sum` and `_count` of one histogram, summed over its label sets and processes (or their growth)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    total: float
    count: float

    def minus(self, before: HistogramTotals) -> HistogramTotals:
        """The growth since `before`."""
        return HistogramTotals(total=self.total - before.total, count=self.count - before.count)

    def plus(self, other: HistogramTotals) -> HistogramTotals:
        return HistogramTotals(total=self.total + other.total, count=self.count + other.count)

    def mean(self) -> float | None:
        """total / count; None without samples."""
        return self.total / self.count if self.count > 0 else None


def read_histogram(directory: Path, name: str, stage: str | None = None) -> HistogramTotals:
    """Totals of histogram `name` in a prometheus_client multiprocess directory (zeros when absent);
    stage: only the samples with that `stage` label."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(directory))
    total = count = 0.0
    for family in registry.collect():
        if family.name != name:
            continue
        for sample in family.samples:
            if stage is not None and sample.labels.get("stage") != stage:
                continue
            if sample.name == f"{name}_sum":
                total += sample.value
            elif sample.name == f"{name}_count":
                count += sample.value
    return HistogramTotals(total=total, count=count)


class WorkerTotals(BaseModel):
    """The worker's histogram totals at one moment, or their growth: per metric and per stage."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    metrics: dict[str, HistogramTotals]
    stages: dict[str, HistogramTotals]

    @classmethod
    def read(cls, directory: Path) -> WorkerTotals:
        return cls(
            metrics={name: read_histogram(directory, name) for name in WORKER_METRICS},
            stages={stage: read_histogram(directory, STAGE_METRIC, stage) for stage in STAGE_NAMES},
        )

    def minus(self, before: WorkerTotals) -> WorkerTotals:
        """The growth of every histogram since `before`."""
        return WorkerTotals(
            metrics={name: totals.minus(before.metrics[name]) for name, totals in self.metrics.items()},
            stages={name: totals.minus(before.stages[name]) for name, totals in self.stages.items()},
        )

    def plus(self, other: WorkerTotals) -> WorkerTotals:
        """Both growths pooled (repeats of one policy at one temperature)."""
        return WorkerTotals(
            metrics={name: totals.plus(other.metrics[name]) for name, totals in self.metrics.items()},
            stages={name: totals.plus(other.stages[name]) for name, totals in self.stages.items()},
        )


@dataclass(frozen=True)
class EstimateSummary:
    """What the worker's histogram growth says about the steps it covers (module docstring)."""

    mean_budget: float | None
    expected: float | None
    expected_raw: float | None
    realised: float | None
    latency_mape: float | None
    stage_ms: StageMs | None

    @classmethod
    def of(cls, growth: WorkerTotals) -> EstimateSummary:
        """Σ `_sum` growth / Σ `_count` growth of each histogram; stage means in ms (None: no verify step)."""
        stage_means = {stage: growth.stages[stage].mean() for stage in STAGE_NAMES}
        stage_ms = (
            None
            if stage_means["verify"] is None
            else StageMs(**{stage: 1e3 * (value or 0.0) for stage, value in stage_means.items()})
        )
        return cls(
            mean_budget=growth.metrics[TREE_NODES_METRIC].mean(),
            expected=growth.metrics[EXPECTED_METRIC].mean(),
            expected_raw=growth.metrics[EXPECTED_RAW_METRIC].mean(),
            realised=growth.metrics[REALISED_METRIC].mean(),
            latency_mape=growth.metrics[LATENCY_ERROR_METRIC].mean(),
            stage_ms=stage_ms,
        )


# ---- one repeat of one policy: streaming and timing ---------------------------------------------------


@dataclass(frozen=True)
class ChunkArrival:
    """One streamed chunk of a request: when the client got it and the request's tokens by then."""

    seconds: float  # time.perf_counter() at arrival, seconds
    completion_tokens: int  # meta_info completion_tokens: cumulative


@dataclass(frozen=True)
class StreamedRequest:
    """Every chunk of one request, in arrival order, and its final spec_verify_ct (None: not speculative)."""

    arrivals: tuple[ChunkArrival, ...]
    verify_passes: int | None

    @property
    def completion_tokens(self) -> int:
        return self.arrivals[-1].completion_tokens


@dataclass(frozen=True)
class DecodeTiming:
    """The decode phase of one request (or of several, summed): what arrived after the first chunk."""

    decode_tokens: int
    decode_seconds: float
    token_latencies: tuple[float, ...]  # seconds per token, one sample per decode token


def decode_timing(arrivals: Sequence[ChunkArrival]) -> DecodeTiming:
    """Decode tokens, seconds and per-token latencies of one request's chunks (module docstring).

    Chunks that bring no new token are skipped; the first token-carrying chunk (the prefill's) starts the
    clock; each later one with k new tokens, g seconds after the previous token-carrying chunk, gives k
    latency samples of g / k.
    """
    carrying: list[ChunkArrival] = []
    for chunk in arrivals:
        if chunk.completion_tokens > (carrying[-1].completion_tokens if carrying else 0):
            carrying.append(chunk)
    if not carrying:
        return DecodeTiming(0, 0.0, ())
    latencies: list[float] = []
    for previous, chunk in itertools.pairwise(carrying):
        tokens = chunk.completion_tokens - previous.completion_tokens
        latencies += [(chunk.seconds - previous.seconds) / tokens] * tokens
    first, last = carrying[0], carrying[-1]
    return DecodeTiming(
        last.completion_tokens - first.completion_tokens, last.seconds - first.seconds, tuple(latencies)
    )


def pooled_timing(timings: Sequence[DecodeTiming]) -> DecodeTiming:
    """Several requests' decode timings summed: Σ tokens, Σ seconds, every latency sample."""
    return DecodeTiming(
        sum(t.decode_tokens for t in timings),
        sum(t.decode_seconds for t in timings),
        tuple(itertools.chain.from_iterable(t.token_latencies for t in timings)),
    )


def latency_percentiles_ms(latencies: Sequence[float]) -> tuple[float, float]:
    """(p50, p90) in ms of per-token latencies in seconds, interpolating linearly between samples."""
    p50, p90 = np.percentile(np.asarray(latencies, dtype=np.float64), [50.0, 90.0])
    return 1e3 * float(p50), 1e3 * float(p90)


def _check_finish(reason: Any, index: int) -> None:
    """RuntimeError when a request's finish_reason says the Engine aborted it."""
    if isinstance(reason, dict) and reason.get("type") == "abort":
        raise RuntimeError(f"the Engine aborted request {index} of a batch: {reason.get('message')}")


def stream_batch(
    engine: Any, prompt_ids: Sequence[list[int]], params: Sequence[dict[str, Any]]
) -> list[StreamedRequest]:
    """Send one batch with `stream=True`; every request's chunk arrivals and final spec_verify_ct.

    Chunks of the batch's requests arrive interleaved, each naming its request by `index`; RuntimeError if a
    request is aborted or its stream ends without a finished chunk.
    """
    arrivals: list[list[ChunkArrival]] = [[] for _ in prompt_ids]
    verify_passes: list[int | None] = [None] * len(prompt_ids)
    finished = [False] * len(prompt_ids)
    for chunk in engine.generate(input_ids=list(prompt_ids), sampling_params=list(params), stream=True):
        now = time.perf_counter()
        index = chunk["index"]
        meta = chunk["meta_info"]
        arrivals[index].append(ChunkArrival(now, int(meta["completion_tokens"])))
        if meta.get("finish_reason") is not None:
            _check_finish(meta["finish_reason"], index)
            finished[index] = True
            passes = meta.get("spec_verify_ct")
            verify_passes[index] = None if passes is None else int(passes)
    if not all(finished):
        raise RuntimeError(
            f"requests {[i for i, done in enumerate(finished) if not done]}: stream ended early"
        )
    return [StreamedRequest(tuple(a), v) for a, v in zip(arrivals, verify_passes, strict=True)]


@dataclass(frozen=True)
class Measured:
    """What one policy returned at one temperature in one repeat."""

    requests: int
    completion_tokens: int
    verify_passes: int | None  # None: no response carried spec_verify_ct
    wall_seconds: float
    decode: DecodeTiming  # every request's, pooled
    growth: WorkerTotals | None  # the worker's histogram growth; None: the Engine exports no BASTION series

    @classmethod
    def of(
        cls, requests: Sequence[StreamedRequest], wall_seconds: float, growth: WorkerTotals | None
    ) -> Measured:
        passes = [r.verify_passes for r in requests if r.verify_passes is not None]
        return cls(
            requests=len(requests),
            completion_tokens=sum(r.completion_tokens for r in requests),
            verify_passes=sum(passes) if passes else None,
            wall_seconds=wall_seconds,
            decode=pooled_timing([decode_timing(r.arrivals) for r in requests]),
            growth=growth,
        )


def sampling_params(settings: BenchSettings, temperature: float) -> list[dict[str, Any]]:
    """Per prompt: its sampling parameters at `temperature` (request i samples with seed + i when T > 0)."""
    return [
        {
            "temperature": temperature,
            "max_new_tokens": settings.max_new_tokens,
            "ignore_eos": settings.ignore_eos,
            **({"sampling_seed": settings.seed + i} if temperature > 0 else {}),
        }
        for i in range(settings.num_prompts)
    ]


def measure(
    engine: Any,
    prompt_ids: Sequence[list[int]],
    temperature: float,
    plan: BenchPlan,
    metrics_dir: Path | None,
    label: str,
) -> Measured:
    """Stream every prompt at `temperature`, `concurrency` at a time; time only the generate calls.

    metrics_dir: the Engine's Prometheus folder when its worker exports the sglang:bastion_* series.
    """
    settings = plan.settings
    params = sampling_params(settings, temperature)
    before = WorkerTotals.read(metrics_dir) if metrics_dir is not None else None
    requests: list[StreamedRequest] = []
    seconds = 0.0
    with tqdm(total=len(prompt_ids), desc=label, unit="req", leave=False) as bar:
        for start in range(0, len(prompt_ids), settings.concurrency):
            end = start + settings.concurrency
            began = time.perf_counter()
            batch = stream_batch(engine, prompt_ids[start:end], params[start:end])
            seconds += time.perf_counter() - began
            requests += batch
            bar.update(len(batch))
    growth = None
    if metrics_dir is not None and before is not None:
        growth = WorkerTotals.read(metrics_dir).minus(before)
        if growth.metrics[TREE_NODES_METRIC].count <= 0:
            logger.warning(
                "%s: the worker recorded no %s samples; mean budget unknown", label, TREE_NODES_METRIC
            )
    return Measured.of(requests, seconds, growth)


def repeat_measurement(policy: BenchPolicy, repeat: int, measured: Measured) -> RepeatMeasurement:
    """The report's record of one measurement; RuntimeError when it cannot be one (nothing decoded, or a
    speculative Engine that reported no verify pass)."""
    if policy.kind != "ar" and not measured.verify_passes:
        raise RuntimeError(f"{policy.name}: the Engine reported no spec_verify_ct; is speculation running?")
    decode = measured.decode
    if decode.decode_tokens <= 0 or decode.decode_seconds <= 0:
        raise RuntimeError(
            f"{policy.name}: no token arrived after any request's first one, so no decode time was measured "
            "(pass --ignore-eos)"
        )
    p50, p90 = latency_percentiles_ms(decode.token_latencies)
    return RepeatMeasurement(
        repeat=repeat,
        requests=measured.requests,
        completion_tokens=measured.completion_tokens,
        verify_passes=measured.verify_passes,
        wall_seconds=measured.wall_seconds,
        tokens_per_second=measured.completion_tokens / measured.wall_seconds,
        decode_tokens=decode.decode_tokens,
        decode_seconds=decode.decode_seconds,
        decode_tokens_per_second=decode.decode_tokens / decode.decode_seconds,
        token_latency_p50_ms=p50,
        token_latency_p90_ms=p90,
    )


class TemperatureRun(BaseModel):
    """One policy at one temperature in one repeat, as its process hands it to the parent."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    temperature: float = Field(ge=0)
    measurement: RepeatMeasurement
    growth: WorkerTotals | None = Field(description="the worker's histogram growth; None: not BASTION")


class PolicyRun(BaseModel):
    """What one policy process writes to its scratch folder (`RUN_NAME`): every temperature of one repeat."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    policy: str
    repeat: int = Field(ge=1)
    runs: tuple[TemperatureRun, ...] = Field(min_length=1)


def run_policy(
    plan: BenchPlan,
    policy: BenchPolicy,
    repeat: int,
    scratch: Path,
    log_level: int,
) -> None:
    """Body of one policy's process in one repeat: start a fresh Engine, warm up, measure every temperature,
    shut down.

    Writes `PolicyRun` to scratch/run.json. The Engine's processes write their Prometheus samples into
    scratch/metrics: prometheus_client's multiprocess mode is configured only by PROMETHEUS_MULTIPROC_DIR,
    which the scheduler process inherits when the Engine starts it. One process per Engine because an
    Engine with metrics registers its tokenizer-side series in its process's default registry, so a second
    one in the same process fails on duplicated series.
    """
    import sglang

    metrics_dir = scratch / "metrics"
    metrics_dir.mkdir(parents=True)
    os.environ[PROMETHEUS_DIR_ENV] = str(metrics_dir)  # read by this process's Engine and its children
    began = time.perf_counter()
    engine = sglang.Engine(server_args=server_args_for(plan, policy))
    # The Engine set this process's root logger to its own level and format; restore the command's.
    logging.basicConfig(level=log_level, format=LOG_FORMAT, force=True)
    logging.getLogger("sglang").setLevel(plan.sglang_log_level.upper())
    prompt_ids = plan.prompt_ids
    runs = []
    try:
        logger.info(
            "%s (repeat %d): engine ready in %.1f s", policy.name, repeat, time.perf_counter() - began
        )
        stream_batch(engine, prompt_ids[:1], [{"temperature": 0.0, "max_new_tokens": WARMUP_TOKENS}])
        for temperature in plan.settings.temperatures:
            label = f"{policy.name} T={temperature:g} repeat {repeat}"
            exported = metrics_dir if policy.kind == "bastion" else None
            measured = measure(engine, prompt_ids, temperature, plan, exported, label)
            record = repeat_measurement(policy, repeat, measured)
            runs.append(TemperatureRun(temperature=temperature, measurement=record, growth=measured.growth))
            logger.info(
                "%s: %.1f decode tokens/s, %.1f wall tokens/s, token latency p50 %.1f ms, p90 %.1f ms",
                label,
                record.decode_tokens_per_second,
                record.tokens_per_second,
                record.token_latency_p50_ms,
                record.token_latency_p90_ms,
            )
    finally:
        engine.shutdown()
    result = PolicyRun(policy=policy.name, repeat=repeat, runs=tuple(runs))
    (scratch / RUN_NAME).write_text(result.model_dump_json(), encoding="utf-8")


def run_policy_process(
    context: SpawnContext, plan: BenchPlan, policy: BenchPolicy, repeat: int, scratch: Path
) -> PolicyRun:
    """Run `run_policy` in a fresh process and read back what it wrote; RuntimeError naming the policy if
    the process fails."""
    scratch.mkdir(parents=True)
    process = context.Process(
        target=run_policy,
        args=(plan, policy, repeat, scratch, logging.getLogger().getEffectiveLevel()),
        name=f"bastion-bench-{policy.name}-{repeat}",
    )
    process.start()
    process.join()
    if process.exitcode != 0:
        raise RuntimeError(
            f"policy {policy.name}, repeat {repeat}: its benchmark process exited with status "
            f"{process.exitcode} (its error is logged above)"
        )
    logger.info("%s (repeat %d): engine shut down", policy.name, repeat)
    return PolicyRun.model_validate_json((scratch / RUN_NAME).read_text(encoding="utf-8"))


# ---- aggregation over the repeats ---------------------------------------------------------------------


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    """numerator / denominator; None when either is missing or the denominator is 0."""
    return None if numerator is None or not denominator else numerator / denominator


def _relative_error(expected: float | None, realised: float | None) -> float | None:
    """expected / realised - 1; None when either is missing or realised is 0."""
    ratio = _ratio(expected, realised)
    return None if ratio is None else ratio - 1.0


def _estimate_fields(estimate: EstimateSummary | None) -> dict[str, Any]:
    """The `BenchRow` fields of the controller's estimate (the row's defaults, None, without one)."""
    if estimate is None:
        return {"mean_budget": None}
    return {
        "mean_budget": estimate.mean_budget,
        "mean_expected_accept_length": estimate.expected,
        "mean_expected_accept_length_raw": estimate.expected_raw,
        "realised_accept_length": estimate.realised,
        "accept_error": _relative_error(estimate.expected, estimate.realised),
        "accept_error_raw": _relative_error(estimate.expected_raw, estimate.realised),
        "latency_mape": estimate.latency_mape,
        "stage_ms": estimate.stage_ms,
    }


def make_row(policy: str, temperature: float, runs: Sequence[TemperatureRun]) -> BenchRow:
    """The report row of one policy at one temperature from its repeats, in repeat order (module docstring:
    medians of the rates, pooled totals for the rest); speedups are filled in by `with_speedups`."""
    per_repeat = tuple(run.measurement for run in runs)
    completion = sum(m.completion_tokens for m in per_repeat)
    passes = [m.verify_passes for m in per_repeat if m.verify_passes is not None]
    verify_passes = sum(passes) if passes else None
    growths = [run.growth for run in runs if run.growth is not None]
    estimate = EstimateSummary.of(functools.reduce(WorkerTotals.plus, growths)) if growths else None
    return BenchRow(
        policy=policy,
        temperature=temperature,
        per_repeat=per_repeat,
        requests=sum(m.requests for m in per_repeat),
        completion_tokens=completion,
        verify_passes=verify_passes,
        decode_tokens_per_second=Spread.of([m.decode_tokens_per_second for m in per_repeat]),
        tokens_per_second=Spread.of([m.tokens_per_second for m in per_repeat]),
        token_latency_p50_ms=statistics.median(m.token_latency_p50_ms for m in per_repeat),
        token_latency_p90_ms=statistics.median(m.token_latency_p90_ms for m in per_repeat),
        mean_accept_length=completion / verify_passes if verify_passes else 1.0,
        speedup=None,
        wall_speedup=None,
        **_estimate_fields(estimate),
    )


def with_speedups(rows: Sequence[BenchRow]) -> tuple[BenchRow, ...]:
    """Rows with `speedup` and `wall_speedup`: their median decode and wall tokens/s over the `ar` row's of
    the same temperature (None where there is none)."""
    decode = {row.temperature: row.decode_tokens_per_second.median for row in rows if row.policy == "ar"}
    wall = {row.temperature: row.tokens_per_second.median for row in rows if row.policy == "ar"}
    return tuple(
        row.model_copy(
            update={
                "speedup": _ratio(row.decode_tokens_per_second.median, decode.get(row.temperature)),
                "wall_speedup": _ratio(row.tokens_per_second.median, wall.get(row.temperature)),
            }
        )
        for row in rows
    )


def summarize(rows: Sequence[BenchRow], temperatures: Sequence[float]) -> tuple[TemperatureSummary, ...]:
    """Per temperature: the best policy in hindsight by median decode tokens/s (the first listed on a tie),
    and adaptive's median over the best's and ar's."""
    summaries = []
    for temperature in temperatures:
        rates = {
            row.policy: row.decode_tokens_per_second.median for row in rows if row.temperature == temperature
        }
        best = max(rates, key=rates.__getitem__)
        adaptive = rates.get("adaptive")
        summaries.append(
            TemperatureSummary(
                temperature=temperature,
                best_policy=best,
                best_decode_tokens_per_second=rates[best],
                adaptive_vs_best=_ratio(adaptive, rates[best]),
                adaptive_vs_ar=_ratio(adaptive, rates.get("ar")),
            )
        )
    return tuple(summaries)


def package_versions() -> dict[str, str]:
    """Installed versions of the packages that decide the numbers (absent ones left out)."""
    versions = {}
    for name in VERSIONED_PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return versions


def run_bench(plan: BenchPlan) -> BenchReport:
    """Run every repeat: each policy in a fresh process and Engine, in that repeat's rotated order, at every
    temperature; return the report (unwritten).

    Raises RuntimeError naming the policy whose process failed.
    """
    import torch

    from bastion_sglang.calibration.identity import device_name

    settings = plan.settings
    prompt_ids = plan.prompt_ids
    logger.info(
        "%d prompts from %s (%s split), %d to %d tokens templated; %d repeats x %d policies x "
        "%d temperatures, concurrency %d, %d new tokens",
        len(prompt_ids),
        settings.prompts,
        settings.split,
        min(len(ids) for ids in prompt_ids),
        max(len(ids) for ids in prompt_ids),
        settings.repeats,
        len(plan.policies),
        len(settings.temperatures),
        settings.concurrency,
        settings.max_new_tokens,
    )
    context = multiprocessing.get_context("spawn")
    runs: defaultdict[tuple[str, float], list[TemperatureRun]] = defaultdict(list)
    orders = []
    with tempfile.TemporaryDirectory(prefix="bastion-bench-") as root:
        for repeat in range(1, settings.repeats + 1):
            order = repeat_order(plan.policies, repeat - 1)
            orders.append(tuple(policy.name for policy in order))
            logger.info("repeat %d/%d: policy order %s", repeat, settings.repeats, ", ".join(orders[-1]))
            for policy in order:
                scratch = Path(root) / f"repeat{repeat}-policy{plan.policies.index(policy)}"
                for run in run_policy_process(context, plan, policy, repeat, scratch).runs:
                    runs[(policy.name, run.temperature)].append(run)
    rows = with_speedups(
        [
            make_row(policy.name, temperature, runs[(policy.name, temperature)])
            for policy in plan.policies
            for temperature in settings.temperatures
        ]
    )
    return BenchReport(
        created=datetime.now(UTC).isoformat(timespec="seconds"),
        settings=settings,
        device=device_name(torch.device(settings.device)),
        versions=package_versions(),
        repeat_orders=tuple(orders),
        rows=rows,
        summaries=summarize(rows, settings.temperatures),
    )


# ---- output -------------------------------------------------------------------------------------------


def _number(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:+.1f}%"


def _rate_table(rows: Sequence[BenchRow]) -> list[str]:
    """Median decode tokens/s with min and max, median wall tokens/s, token latency, speedup, τ, budget."""
    header = (
        f"{'policy':<12} {'T':>5} {'decode/s':>9} {'min':>8} {'max':>8} {'wall/s':>8} {'p50_ms':>7} "
        f"{'p90_ms':>7} {'speedup':>8} {'tau':>6} {'budget':>7} {'tokens':>8}"
    )
    lines = [header, "-" * len(header)]
    for row in rows:
        decode = row.decode_tokens_per_second
        lines.append(
            f"{row.policy:<12} {row.temperature:>5g} {decode.median:>9.1f} {decode.min:>8.1f} "
            f"{decode.max:>8.1f} {row.tokens_per_second.median:>8.1f} {row.token_latency_p50_ms:>7.2f} "
            f"{row.token_latency_p90_ms:>7.2f} {_number(row.speedup, 2):>8} {row.mean_accept_length:>6.2f} "
            f"{_number(row.mean_budget, 1):>7} {row.completion_tokens:>8d}"
        )
    return lines


def _estimate_table(rows: Sequence[BenchRow]) -> list[str]:
    """The controller's estimate against what happened, for the rows that have one (none: no lines)."""
    estimated = [row for row in rows if row.mean_expected_accept_length is not None]
    if not estimated:
        return []
    header = (
        f"{'policy':<12} {'T':>5} {'Â':>6} {'Â raw':>6} {'real':>6} {'err':>7} {'raw err':>8} {'lat MAPE':>9}"
    )
    lines = ["", "controller estimate per request per step", header, "-" * len(header)]
    for row in estimated:
        mape = "-" if row.latency_mape is None else f"{100 * row.latency_mape:.1f}%"
        lines.append(
            f"{row.policy:<12} {row.temperature:>5g} {_number(row.mean_expected_accept_length, 2):>6} "
            f"{_number(row.mean_expected_accept_length_raw, 2):>6} "
            f"{_number(row.realised_accept_length, 2):>6} {_percent(row.accept_error):>7} "
            f"{_percent(row.accept_error_raw):>8} {mape:>9}"
        )
    return lines


def _stage_table(rows: Sequence[BenchRow]) -> list[str]:
    """Mean ms per decode step of each stage, for the rows that have them (none: no lines)."""
    staged = [(row, row.stage_ms) for row in rows if row.stage_ms is not None]
    if not staged:
        return []
    header = f"{'policy':<12} {'T':>5} " + " ".join(f"{name:>8}" for name in STAGE_NAMES)
    lines = ["", "ms per decode step", header, "-" * len(header)]
    for row, stages in staged:
        values = " ".join(f"{getattr(stages, name):>8.2f}" for name in STAGE_NAMES)
        lines.append(f"{row.policy:<12} {row.temperature:>5g} {values}")
    return lines


def summary_line(summary: TemperatureSummary) -> str:
    """'T=0: best fixed:4 (16.1 tok/s); adaptive 0.97x best, 0.98x ar' (the adaptive part when it ran)."""
    rate = summary.best_decode_tokens_per_second
    line = f"T={summary.temperature:g}: best {summary.best_policy} ({rate:.1f} tok/s)"
    ratios = [
        f"{ratio:.2f}x {name}"
        for name, ratio in (("best", summary.adaptive_vs_best), ("ar", summary.adaptive_vs_ar))
        if ratio is not None
    ]
    return f"{line}; adaptive {', '.join(ratios)}" if ratios else line


def format_table(report: BenchReport) -> str:
    """The rows as fixed-width text tables (one line per policy × temperature), then the best policy in
    hindsight per temperature."""
    rows = report.rows
    lines = [
        *_rate_table(rows),
        *_estimate_table(rows),
        *_stage_table(rows),
        "",
        f"best in hindsight by median decode tokens/s over {report.settings.repeats} repeats",
        *(summary_line(summary) for summary in report.summaries),
    ]
    return "\n".join(lines)


def plot_report(report: BenchReport, path: Path) -> Path:
    """Bar charts of median decode tokens/s with min-max error bars (top) and τ (bottom): one group per
    temperature, one bar per policy (PNG)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    policies = list(report.settings.policies)
    temperatures = list(report.settings.temperatures)
    by_key = {(row.policy, row.temperature): row for row in report.rows}
    figure = Figure(figsize=(max(6.0, 1.2 * len(policies) * len(temperatures) + 2), 7), layout="constrained")
    FigureCanvasAgg(figure)
    top, bottom = figure.subplots(2, 1, sharex=True)
    width = 0.8 / len(policies)
    for i, policy in enumerate(policies):
        xs = [t + (i - (len(policies) - 1) / 2) * width for t in range(len(temperatures))]
        rates = [by_key[(policy, temperature)].decode_tokens_per_second for temperature in temperatures]
        medians = [rate.median for rate in rates]
        spread = [[rate.median - rate.min for rate in rates], [rate.max - rate.median for rate in rates]]
        top.bar(xs, medians, width, yerr=spread, capsize=3, label=policy)
        taus = [by_key[(policy, temperature)].mean_accept_length for temperature in temperatures]
        bottom.bar(xs, taus, width, label=policy)
    top.set_ylabel("decode tokens/s (median, min-max)")
    bottom.set_ylabel("mean accepted length τ")
    bottom.set_xticks(range(len(temperatures)), [f"T = {t:g}" for t in temperatures])
    top.legend(ncols=min(len(policies), 4), fontsize="small")
    settings = report.settings
    top.set_title(
        f"{Path(settings.model_path).name} on {report.device}: {settings.num_prompts} "
        f"{Path(settings.prompts).name} prompts, concurrency {settings.concurrency}, "
        f"{settings.repeats} repeats",
        fontsize="medium",
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    return path


def write_outputs(report: BenchReport, out: Path) -> tuple[Path, Path]:
    """Write `bench.json` and `bench.png` into `out`; returns their paths."""
    out.mkdir(parents=True, exist_ok=True)
    json_path = out / REPORT_NAME
    json_path.write_text(report.model_dump_json(indent=2) + "\n", encoding="utf-8")
    return json_path, plot_report(report, out / PLOT_NAME)


# ---- command line -------------------------------------------------------------------------------------


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (argparse names the option in its error otherwise)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `bastion bench`."""
    parser.add_argument("--model-path", default=None, help="target: model folder or Hugging Face id")
    parser.add_argument(
        "--draft-model-path", default=None, help="DFlash drafter (needed by every policy but ar)"
    )
    parser.add_argument(
        "--prompts",
        default="mtbench",
        help="humaneval, mtbench, sharegpt, or a JSONL file of {'prompt': ...} / {'turns': [...]} lines",
    )
    parser.add_argument(
        "--split",
        choices=["heldout", "train", "all"],
        default=None,
        help="prompt split (default: heldout for a named set, unseen in drafter training; all for a file)",
    )
    parser.add_argument(
        "--policies",
        default=DEFAULT_POLICIES,
        help=f"comma-separated: ar, chain, fixed:N, adaptive, bucketed, dflash (CUDA only); default "
        f"{DEFAULT_POLICIES}",
    )
    parser.add_argument(
        "--repeats",
        type=positive_int,
        default=DEFAULT_REPEATS,
        help=f"rounds, each running every policy in a fresh Engine, the order rotated by one per round; rows "
        f"report the median over the rounds with min and max (default {DEFAULT_REPEATS})",
    )
    parser.add_argument(
        "--device", choices=["auto", "cpu", "cuda"], default="auto", help="auto: cuda if seen"
    )
    parser.add_argument(
        "--concurrency",
        type=int,
        default=1,
        help="requests in flight (one streamed generate batch); decode tokens/s and token latency are per "
        "request",
    )
    parser.add_argument("--num-prompts", type=int, default=None, help="first N prompts of the split (all)")
    parser.add_argument(
        "--max-new-tokens",
        type=int,
        default=256,
        help=f"completion tokens per request (at least {MIN_NEW_TOKENS}: decode starts after the first)",
    )
    parser.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens tokens")
    parser.add_argument(
        "--temperatures", default="0", help="comma-separated sampling temperatures, e.g. 0,0.7"
    )
    parser.add_argument(
        "--max-budget",
        type=int,
        default=DEFAULT_MAX_BUDGET,
        help=f"--bastion-max-budget of the BASTION Engines (N_max), at least every fixed:N; default "
        f"{DEFAULT_MAX_BUDGET}",
    )
    parser.add_argument(
        "--attention-backend",
        default=None,
        help="SGLang attention backend (default: torch_native on cpu, triton)",
    )
    parser.add_argument("--dtype", default="auto", help="SGLang --dtype (float32 keeps CPU runs exact)")
    parser.add_argument(
        "--mem-fraction-static", type=float, default=None, help="SGLang setting (default 0.2 on cpu)"
    )
    parser.add_argument(
        "--max-total-tokens", type=int, default=None, help="KV pool tokens (default 65536 on cpu)"
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="Engine random seed; request i samples with seed+i"
    )
    parser.add_argument(
        "--out", type=Path, default=Path("bench-results"), help="folder for bench.json and .png"
    )
    parser.add_argument("--sglang-log-level", default="warning", help="log level of the Engines' processes")


def run(args: argparse.Namespace) -> int:
    """Run `bastion bench`: status 2 (naming the bad value) before any Engine starts, 1 if a policy fails."""
    try:
        plan = plan_from_args(args)
    except (ValueError, MissingPackageError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    try:
        report = run_bench(plan)
    except RuntimeError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    json_path, plot_path = write_outputs(report, plan.out)
    print(format_table(report))
    print(f"\nwrote {json_path} and {plot_path}")
    return 0
