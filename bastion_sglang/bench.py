"""`bastion bench`: every policy through the real in-process `sglang.Engine`, on the same prompts.

    bastion bench --model-path T --draft-model-path D --prompts humaneval|mtbench|sharegpt|FILE.jsonl \
        --policies ar,chain,fixed:64,fixed:256,adaptive [--temperatures 0,0.7] [--concurrency N] ...

Policies: `ar` is the Engine without speculation; `chain`, `fixed:N`, `adaptive` and `bucketed` are
`--speculative-algorithm BASTION` with that `--bastion-policy` (and `--max-budget` as N_max); `dflash` is
SGLang's built-in DFLASH worker (CUDA only). One Engine per policy (in a process of its own), shut down
before the next; each runs every temperature on the same prompts: a named set's held-out split by default
(never seen in drafter training), a JSONL file whole, each rendered with the target tokenizer's chat
template, sent in batches of `--concurrency` requests (`Engine.generate` with a list of input ids), after
one warm-up request.

Per policy and temperature:
- tokens/s: completion tokens / wall seconds of the generate calls (engine start-up and warm-up excluded);
- τ, the mean accepted length: Σ completion_tokens / Σ spec_verify_ct over the responses' meta_info
  (tokens committed per verify pass, bonus included; 1.0 for `ar`);
- mean budget: draft nodes verified per request per step, from the BASTION worker's
  `sglang:bastion_tree_nodes` histogram (`_sum` / `_count` growth over the temperature's generate calls),
  read with prometheus_client's multiprocess collector from the Engine's PROMETHEUS_MULTIPROC_DIR
  (null for `ar` and `dflash`, which do not export it);
- speedup: tokens/s over `ar`'s at the same temperature in the same run (null when `ar` is not run).

The controller's estimate, for BASTION policies (null for `ar` and `dflash`), from the worker's histograms
over the same steps (`_sum` / `_count` growth over the temperature's generate calls):
- mean_expected_accept_length: Â per request per step, the calibrated estimate the planner maximised
  (tokens committed, bonus included); mean_expected_accept_length_raw: the same trees' uncalibrated Â;
- realised_accept_length: tokens committed per request per step, as the worker counted them;
- accept_error / accept_error_raw: expected / realised - 1 (signed), calibrated and raw;
- latency_mape: mean |estimated - observed| / observed verify latency per pass, after the worker's warm-up;
- stage_ms: mean milliseconds per decode step of each stage (draft, plan, verify, accept, commit) and of
  `other`, the host time between two decode steps outside the worker.

Outputs in `--out`: `bench.json` (`BenchReport`), `bench.png` (tokens/s and τ per policy, grouped by
temperature), and the table on stdout.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import logging
import math
import multiprocessing
import os
import re
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from tqdm import tqdm

from bastion_sglang.assets import MissingPackageError
from bastion_sglang.config import default_width_buckets
from bastion_sglang.controller.policies import FixedPolicy, parse_policy

HELP = (
    "Benchmark ar, chain, fixed:N, adaptive, bucketed and dflash through sglang.Engine on the same prompts: "
    "tokens/s, mean accepted length, mean tree budget and speedup over ar, as a table, JSON and PNG."
)

logger = logging.getLogger(__name__)

DEFAULT_POLICIES = "ar,chain,fixed:64,fixed:256,adaptive"
DEFAULT_MAX_BUDGET = 256
"""N_max passed to BASTION Engines (`--bastion-max-budget`): room for the largest default fixed budget."""
TREE_NODES_METRIC = "sglang:bastion_tree_nodes"
"""The worker's histogram of draft nodes verified per request per step (bastion_sglang.metrics)."""
EXPECTED_METRIC = "sglang:bastion_expected_accept_length"
EXPECTED_RAW_METRIC = "sglang:bastion_expected_accept_length_raw"
REALISED_METRIC = "sglang:bastion_accept_length"
LATENCY_ERROR_METRIC = "sglang:bastion_verify_relative_error"
STAGE_METRIC = "sglang:bastion_step_stage_seconds"
STAGE_NAMES = ("draft", "plan", "verify", "accept", "commit", "other")
PROMETHEUS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"
REPORT_NAME = "bench.json"
PLOT_NAME = "bench.png"
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


# ---- the report file -----------------------------------------------------------------------------


class BenchSettings(BaseModel):
    """What the benchmark ran: models, prompts, policies, sampling and Engine settings."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model_path: str
    draft_model_path: str | None = Field(description="None when only `ar` runs")
    prompts: str = Field(description="prompt set name or JSONL path")
    split: Literal["train", "heldout", "all"]
    num_prompts: int = Field(gt=0, description="prompts sent per policy and temperature")
    concurrency: int = Field(gt=0, description="requests in flight (one Engine.generate batch)")
    max_new_tokens: int = Field(gt=0)
    ignore_eos: bool
    temperatures: tuple[float, ...] = Field(min_length=1)
    policies: tuple[str, ...] = Field(min_length=1)
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


class BenchRow(BaseModel):
    """One policy at one temperature."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    policy: str
    temperature: float = Field(ge=0)
    requests: int = Field(gt=0)
    completion_tokens: int = Field(ge=0, description="Σ meta_info completion_tokens")
    verify_passes: int | None = Field(description="Σ meta_info spec_verify_ct; None for ar")
    wall_seconds: float = Field(gt=0, description="wall time of the generate calls, seconds")
    tokens_per_second: float = Field(ge=0, description="completion_tokens / wall_seconds")
    mean_accept_length: float = Field(ge=0, description="τ = completion_tokens / verify_passes; 1 for ar")
    mean_budget: float | None = Field(
        description="draft nodes verified per request per step (sglang:bastion_tree_nodes); None: not BASTION"
    )
    speedup: float | None = Field(description="tokens/s over ar's at this temperature; None without ar")
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


class BenchReport(BaseModel):
    """`bench.json`: the settings, where it ran, package versions, one row per policy × temperature."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    format_version: Literal[1] = 1
    created: str = Field(description="UTC time the report was written, ISO 8601")
    settings: BenchSettings
    device: str = Field(description="device name: the GPU's, or 'CPU <model>'")
    versions: dict[str, str] = Field(description="installed package -> version")
    rows: tuple[BenchRow, ...] = Field(min_length=1)


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
    from bastion_sglang.training.data import PROMPT_SETS, load_prompts

    if args.max_budget < 1:
        raise ValueError(f"--max-budget must be >= 1, got {args.max_budget}")
    policies = parse_policies(args.policies, args.max_budget)
    temperatures = parse_temperatures(args.temperatures)
    for flag, value in (
        ("--num-prompts", args.num_prompts),
        ("--concurrency", args.concurrency),
        ("--max-new-tokens", args.max_new_tokens),
    ):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
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

    from bastion_sglang.training.data import Prompt, chat_prompt_ids

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


@dataclass(frozen=True)
class HistogramTotals:
    """`_sum` and `_count` of one histogram, summed over its label sets and processes."""

    total: float
    count: float


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
    return HistogramTotals(total, count)


@dataclass(frozen=True)
class WorkerTotals:
    """The worker's histogram totals at one moment: per metric (and per stage) `HistogramTotals`."""

    metrics: dict[str, HistogramTotals]
    stages: dict[str, HistogramTotals]

    @classmethod
    def read(cls, directory: Path) -> WorkerTotals:
        names = (
            TREE_NODES_METRIC,
            EXPECTED_METRIC,
            EXPECTED_RAW_METRIC,
            REALISED_METRIC,
            LATENCY_ERROR_METRIC,
        )
        return cls(
            metrics={name: read_histogram(directory, name) for name in names},
            stages={stage: read_histogram(directory, STAGE_METRIC, stage) for stage in STAGE_NAMES},
        )


def _mean_between(before: HistogramTotals, after: HistogramTotals) -> float | None:
    count = after.count - before.count
    return (after.total - before.total) / count if count > 0 else None


@dataclass(frozen=True)
class EstimateSummary:
    """What the worker's histograms say about the steps between two `WorkerTotals` (module docstring)."""

    mean_budget: float | None
    expected: float | None
    expected_raw: float | None
    realised: float | None
    latency_mape: float | None
    stage_ms: StageMs | None

    @classmethod
    def between(cls, before: WorkerTotals, after: WorkerTotals) -> EstimateSummary:
        means = {name: _mean_between(before.metrics[name], after.metrics[name]) for name in before.metrics}
        stage_means = {s: _mean_between(before.stages[s], after.stages[s]) for s in STAGE_NAMES}
        stage_ms = (
            None
            if stage_means["verify"] is None
            else StageMs(**{s: 1e3 * (value or 0.0) for s, value in stage_means.items()})
        )
        return cls(
            mean_budget=means[TREE_NODES_METRIC],
            expected=means[EXPECTED_METRIC],
            expected_raw=means[EXPECTED_RAW_METRIC],
            realised=means[REALISED_METRIC],
            latency_mape=means[LATENCY_ERROR_METRIC],
            stage_ms=stage_ms,
        )


@dataclass(frozen=True)
class Measured:
    """What one policy returned at one temperature."""

    requests: int
    completion_tokens: int
    verify_passes: int | None
    wall_seconds: float
    estimate: EstimateSummary | None  # None: the Engine exports no BASTION series


def measure(
    engine: Any,
    prompt_ids: Sequence[list[int]],
    temperature: float,
    plan: BenchPlan,
    metrics_dir: Path | None,
    label: str,
) -> Measured:
    """Send every prompt at `temperature`, `concurrency` at a time; time only the generate calls.

    metrics_dir: the Engine's Prometheus folder when its worker exports the sglang:bastion_* series.
    """
    settings = plan.settings
    params = [
        {
            "temperature": temperature,
            "max_new_tokens": settings.max_new_tokens,
            "ignore_eos": settings.ignore_eos,
            **({"sampling_seed": settings.seed + i} if temperature > 0 else {}),
        }
        for i in range(len(prompt_ids))
    ]
    before = WorkerTotals.read(metrics_dir) if metrics_dir is not None else None
    tokens = passes = 0
    spec_seen = False
    seconds = 0.0
    with tqdm(total=len(prompt_ids), desc=label, unit="req", leave=False) as bar:
        for start in range(0, len(prompt_ids), settings.concurrency):
            end = start + settings.concurrency
            began = time.perf_counter()
            outputs = engine.generate(
                input_ids=list(prompt_ids[start:end]), sampling_params=params[start:end]
            )
            seconds += time.perf_counter() - began
            for output in outputs:
                meta = output["meta_info"]
                tokens += int(meta["completion_tokens"])
                if meta.get("spec_verify_ct") is not None:
                    spec_seen = True
                    passes += int(meta["spec_verify_ct"])
            bar.update(len(outputs))
    estimate = None
    if metrics_dir is not None and before is not None:
        estimate = EstimateSummary.between(before, WorkerTotals.read(metrics_dir))
        if estimate.mean_budget is None:
            logger.warning(
                "%s: the worker recorded no %s samples; mean budget unknown", label, TREE_NODES_METRIC
            )
    return Measured(len(prompt_ids), tokens, passes if spec_seen else None, seconds, estimate)


def _relative_error(expected: float | None, realised: float | None) -> float | None:
    return None if expected is None or not realised else expected / realised - 1.0


def make_row(policy: BenchPolicy, temperature: float, measured: Measured) -> BenchRow:
    """The report row of one measurement (speedup filled in by `with_speedups`)."""
    if measured.verify_passes:
        tau = measured.completion_tokens / measured.verify_passes
    elif policy.kind == "ar":
        tau = 1.0
    else:
        raise RuntimeError(f"{policy.name}: the Engine reported no spec_verify_ct; is speculation running?")
    estimate = measured.estimate
    if estimate is None:
        return BenchRow(
            policy=policy.name,
            temperature=temperature,
            requests=measured.requests,
            completion_tokens=measured.completion_tokens,
            verify_passes=measured.verify_passes,
            wall_seconds=measured.wall_seconds,
            tokens_per_second=measured.completion_tokens / measured.wall_seconds,
            mean_accept_length=tau,
            mean_budget=None,
            speedup=None,
        )
    return BenchRow(
        policy=policy.name,
        temperature=temperature,
        requests=measured.requests,
        completion_tokens=measured.completion_tokens,
        verify_passes=measured.verify_passes,
        wall_seconds=measured.wall_seconds,
        tokens_per_second=measured.completion_tokens / measured.wall_seconds,
        mean_accept_length=tau,
        mean_budget=estimate.mean_budget,
        speedup=None,
        mean_expected_accept_length=estimate.expected,
        mean_expected_accept_length_raw=estimate.expected_raw,
        realised_accept_length=estimate.realised,
        accept_error=_relative_error(estimate.expected, estimate.realised),
        accept_error_raw=_relative_error(estimate.expected_raw, estimate.realised),
        latency_mape=estimate.latency_mape,
        stage_ms=estimate.stage_ms,
    )


def with_speedups(rows: Sequence[BenchRow]) -> tuple[BenchRow, ...]:
    """Rows with `speedup` = tokens/s over the `ar` row of the same temperature (None where there is none)."""
    baseline = {row.temperature: row.tokens_per_second for row in rows if row.policy == "ar"}
    return tuple(
        row.model_copy(
            update={
                "speedup": row.tokens_per_second / baseline[row.temperature]
                if baseline.get(row.temperature)
                else None
            }
        )
        for row in rows
    )


def package_versions() -> dict[str, str]:
    """Installed versions of the packages that decide the numbers (absent ones left out)."""
    versions = {}
    for name in VERSIONED_PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return versions


class PolicyRows(BaseModel):
    """The rows one policy process hands back to the parent (a JSON file in the run's scratch folder)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    rows: tuple[BenchRow, ...] = Field(min_length=1)


def run_policy(
    plan: BenchPlan,
    policy: BenchPolicy,
    scratch: Path,
    log_level: int,
) -> None:
    """Body of one policy's process: start its Engine, warm up, measure every temperature, shut down.

    Writes `PolicyRows` to scratch/rows.json. The Engine's processes write their Prometheus samples into
    scratch/metrics: prometheus_client's multiprocess mode is configured only by PROMETHEUS_MULTIPROC_DIR,
    which the scheduler process inherits when the Engine starts it. One process per policy because an
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
    rows = []
    try:
        logger.info("%s: engine ready in %.1f s", policy.name, time.perf_counter() - began)
        engine.generate(
            input_ids=[prompt_ids[0]], sampling_params={"temperature": 0.0, "max_new_tokens": WARMUP_TOKENS}
        )
        for temperature in plan.settings.temperatures:
            label = f"{policy.name} T={temperature:g}"
            exported = metrics_dir if policy.kind == "bastion" else None
            row = make_row(
                policy, temperature, measure(engine, prompt_ids, temperature, plan, exported, label)
            )
            rows.append(row)
            logger.info(
                "%s: %d tokens in %.2f s, %.1f tokens/s, tau %.2f, mean budget %s",
                label,
                row.completion_tokens,
                row.wall_seconds,
                row.tokens_per_second,
                row.mean_accept_length,
                "n/a" if row.mean_budget is None else f"{row.mean_budget:.1f}",
            )
    finally:
        engine.shutdown()
    (scratch / "rows.json").write_text(PolicyRows(rows=tuple(rows)).model_dump_json(), encoding="utf-8")


def run_bench(plan: BenchPlan) -> BenchReport:
    """Run every policy (one process and Engine each) at every temperature; return the report (unwritten).

    Raises RuntimeError naming the policy whose process failed.
    """
    import torch

    from bastion_sglang.calibration.identity import device_name

    settings = plan.settings
    prompt_ids = plan.prompt_ids
    logger.info(
        "%d prompts from %s (%s split), %d to %d tokens templated; %d policies x %d temperatures, "
        "concurrency %d, %d new tokens",
        len(prompt_ids),
        settings.prompts,
        settings.split,
        min(len(ids) for ids in prompt_ids),
        max(len(ids) for ids in prompt_ids),
        len(plan.policies),
        len(settings.temperatures),
        settings.concurrency,
        settings.max_new_tokens,
    )
    context = multiprocessing.get_context("spawn")
    rows: list[BenchRow] = []
    with tempfile.TemporaryDirectory(prefix="bastion-bench-") as root:
        for index, policy in enumerate(plan.policies):
            scratch = Path(root) / str(index)
            scratch.mkdir()
            process = context.Process(
                target=run_policy,
                args=(plan, policy, scratch, logging.getLogger().getEffectiveLevel()),
                name=f"bastion-bench-{policy.name}",
            )
            process.start()
            process.join()
            if process.exitcode != 0:
                raise RuntimeError(
                    f"policy {policy.name}: its benchmark process exited with status {process.exitcode} "
                    "(its error is logged above)"
                )
            rows.extend(
                PolicyRows.model_validate_json((scratch / "rows.json").read_text(encoding="utf-8")).rows
            )
            logger.info("%s: engine shut down", policy.name)
    return BenchReport(
        created=datetime.now(UTC).isoformat(timespec="seconds"),
        settings=settings,
        device=device_name(torch.device(settings.device)),
        versions=package_versions(),
        rows=with_speedups(rows),
    )


# ---- output -------------------------------------------------------------------------------------------


def format_table(report: BenchReport) -> str:
    """The rows as a fixed-width text table (one line per policy × temperature)."""

    def number(value: float | None, digits: int) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    def percent(value: float | None) -> str:
        return "-" if value is None else f"{100 * value:+.1f}%"

    header = (
        f"{'policy':<12} {'T':>5} {'tokens/s':>10} {'tau':>6} {'budget':>7} {'speedup':>8} {'tokens':>8} "
        f"{'Â':>6} {'Â raw':>6} {'real':>6} {'err':>7} {'raw err':>8} {'lat MAPE':>9}"
    )
    lines = [header, "-" * len(header)]
    for row in report.rows:
        lines.append(
            f"{row.policy:<12} {row.temperature:>5g} {row.tokens_per_second:>10.1f} "
            f"{row.mean_accept_length:>6.2f} {number(row.mean_budget, 1):>7} {number(row.speedup, 2):>8} "
            f"{row.completion_tokens:>8d} {number(row.mean_expected_accept_length, 2):>6} "
            f"{number(row.mean_expected_accept_length_raw, 2):>6} {number(row.realised_accept_length, 2):>6} "
            f"{percent(row.accept_error):>7} {percent(row.accept_error_raw):>8} "
            f"{'-' if row.latency_mape is None else f'{100 * row.latency_mape:.1f}%':>9}"
        )
    staged = [(row, row.stage_ms) for row in report.rows if row.stage_ms is not None]
    if staged:
        stage_header = f"{'policy':<12} {'T':>5} " + " ".join(f"{name:>8}" for name in STAGE_NAMES)
        lines += ["", "ms per decode step", stage_header, "-" * len(stage_header)]
        for row, stages in staged:
            values = " ".join(f"{getattr(stages, name):>8.2f}" for name in STAGE_NAMES)
            lines.append(f"{row.policy:<12} {row.temperature:>5g} {values}")
    return "\n".join(lines)


def plot_report(report: BenchReport, path: Path) -> Path:
    """Bar charts of tokens/s (top) and τ (bottom): one group per temperature, one bar per policy (PNG)."""
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
        rows = [by_key[(policy, temperature)] for temperature in temperatures]
        top.bar(xs, [row.tokens_per_second for row in rows], width, label=policy)
        bottom.bar(xs, [row.mean_accept_length for row in rows], width, label=policy)
    top.set_ylabel("output tokens/s")
    bottom.set_ylabel("mean accepted length τ")
    bottom.set_xticks(range(len(temperatures)), [f"T = {t:g}" for t in temperatures])
    top.legend(ncols=min(len(policies), 4), fontsize="small")
    settings = report.settings
    top.set_title(
        f"{Path(settings.model_path).name} on {report.device}: {settings.num_prompts} "
        f"{Path(settings.prompts).name} prompts, concurrency {settings.concurrency}",
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
        "--device", choices=["auto", "cpu", "cuda"], default="auto", help="auto: cuda if seen"
    )
    parser.add_argument("--concurrency", type=int, default=1, help="requests in flight (one generate batch)")
    parser.add_argument("--num-prompts", type=int, default=None, help="first N prompts of the split (all)")
    parser.add_argument("--max-new-tokens", type=int, default=256, help="completion tokens per request")
    parser.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens tokens")
    parser.add_argument(
        "--temperatures", default="0", help="comma-separated sampling temperatures, e.g. 0,0.7"
    )
    parser.add_argument(
        "--max-budget",
        type=int,
        default=DEFAULT_MAX_BUDGET,
        help=f"--bastion-max-budget of the BASTION Engines (N_max); default {DEFAULT_MAX_BUDGET}",
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
