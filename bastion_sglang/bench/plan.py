"""Planning `bastion bench`: every check before any Engine starts.

The policies and temperatures parsed, the models checked, the prompts loaded (a named set's held-out split by
default, never seen in drafter training; a JSONL file whole) and tokenized with the target's chat template,
or drawn as random token ids (`--random-prompts`: no tokenizer needed, for a target given as its config.json
alone and loaded with SGLang's dummy weights, `--load-format dummy`), the settings recorded (`BenchSettings`,
kept in the report), each policy's Engine server arguments, and the order each repeat runs the policies in.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar, cast

from pydantic import BaseModel, ConfigDict, Field

from bastion_sglang.assets.prompt_sets import (
    PROMPT_SETS,
    Prompt,
    PromptSet,
    chat_prompt_ids,
    interleave_prompts,
    load_prompts,
)
from bastion_sglang.controller.policies import parse_policy
from bastion_sglang.integration.config import CHOSEN_BACKENDS, default_width_buckets

logger = logging.getLogger(__name__)
T = TypeVar("T")

DEFAULT_POLICIES = "ar,chain,fixed:1,fixed:2,fixed:4,fixed:8,fixed:16,fixed:64,adaptive"
DEFAULT_MAX_BUDGET = 64
"""N_max passed to BASTION Engines (`--bastion-max-budget`): room for the largest default fixed budget."""
DEFAULT_REPEATS = 3
DEFAULT_PROMPTS = "mtbench"
DEFAULT_RANDOM_PROMPT_TOKENS = 128
"""Tokens of each `--random-prompts` prompt."""
MIN_NEW_TOKENS = 2
"""Fewest `--max-new-tokens`: decode throughput needs a token after the prefill's."""
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
"""A Hugging Face repository id (owner/name), accepted for a path that does not exist locally."""

PolicyKind = Literal["ar", "bastion", "dflash"]
Device = Literal["cpu", "cuda"]
Schedule = Literal["sequential", "interleaved"]
"""How a repeat runs the policies' Engines: one after another, or all alive and taking turns (`bench.run`)."""
LoadFormat = Literal["auto", "dummy"]
"""SGLang's --load-format: auto reads the weights; dummy gives random weights from config.json alone."""


@dataclass(frozen=True)
class BenchPolicy:
    """One benchmarked configuration: its spelling on the command line and the Engine it needs."""

    name: str  # "ar", "dflash", or a --bastion-policy spelling ("chain", "fixed:64", ...)
    kind: PolicyKind


CONTROL = BenchPolicy("ar-control", "ar")
"""`--control`: a second `ar` Engine, run and measured like every policy. Its per-repeat ratio to `ar` is the
run's noise floor: how far a paired ratio moves with no difference in code (an A/A comparison)."""


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
        buckets = default_width_buckets(max_budget)
        try:
            parsed = parse_policy(name, width_buckets=buckets)
        except ValueError as error:
            raise ValueError(f"--policies: {error} (or ar, dflash)") from None
        try:
            parsed.check_config(max_budget, buckets)
        except ValueError as error:
            raise ValueError(f"--policies {name} with --max-budget {max_budget}: {error}") from None
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


class BenchSettings(BaseModel):
    """What the benchmark ran: models, prompts, policies, sampling, repeats and Engine settings."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model_path: str
    draft_model_path: str | None = Field(description="None when only `ar` runs")
    prompts: str = Field(description="prompt set name or JSONL path; 'random' for --random-prompts")
    split: Literal["train", "heldout", "all"]
    random_prompt_tokens: int | None = Field(
        default=None, gt=0, description="tokens of each random prompt; None: the prompts are text"
    )
    num_prompts: int = Field(gt=0, description="prompts sent per policy, temperature and repeat")
    concurrency: int = Field(gt=0, description="requests in flight (one Engine.generate batch)")
    max_new_tokens: int = Field(ge=MIN_NEW_TOKENS)
    ignore_eos: bool
    temperatures: tuple[float, ...] = Field(min_length=1)
    policies: tuple[str, ...] = Field(min_length=1)
    repeats: int = Field(ge=1, description="rounds; each runs every policy in a fresh Engine")
    max_budget: int = Field(gt=0, description="N_max of the BASTION Engines")
    overlap_schedule: bool = Field(
        default=False, description="whether the BASTION Engines ran under SGLang's overlap scheduler"
    )
    schedule: Schedule = Field(
        default="sequential",
        description="sequential: one Engine at a time; interleaved: every Engine of a repeat alive, taking "
        "turns batch by batch",
    )
    device: Literal["cpu", "cuda"]
    attention_backend: str
    dtype: str
    load_format: LoadFormat = Field(
        default="auto", description="dummy: the target's weights were random (SGLang's dummy load format)"
    )
    profile: str | None = Field(
        default=None, description="--bastion-profile of the BASTION Engines; None: auto"
    )
    synthetic_acceptance: str | None = Field(
        default=None,
        description="the BASTION and dflash Engines accepted by this synthetic profile, not by the target; "
        "None: off",
    )
    seed: int


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


def _check_dummy_target(model_path: str) -> None:
    """ValueError naming the file when a local target's config.json names no architecture: SGLang builds the
    model class it names, and with dummy weights there is nothing else to go by."""
    config = Path(model_path) / "config.json"
    if not config.is_file():
        return
    try:
        architectures = json.loads(config.read_text(encoding="utf-8")).get("architectures")
    except (OSError, ValueError, AttributeError) as error:
        raise ValueError(f"--model-path {config}: not a readable JSON object: {error}") from None
    if not architectures:
        raise ValueError(
            f"--model-path {config}: no 'architectures' entry; --load-format dummy builds the model class "
            'it names, e.g. "architectures": ["Qwen3ForCausalLM"]'
        )


def _check_dflash_drafter_for_synthetic(draft_path: str) -> None:
    """ValueError naming the drafter when it is a local DFlash2 drafter: under synthetic acceptance the
    bench's `dflash` seam (`bench.dflash_synthetic`) covers a DFlash drafter's greedy head, and a DFlash2
    drafter's candidate selector drafts SGLang's block elsewhere."""
    from bastion_sglang.integration.drafter_config import DFLASH2_ARCHITECTURES

    config = Path(draft_path) / "config.json"
    if not config.is_file():
        return
    try:
        architectures = json.loads(config.read_text(encoding="utf-8")).get("architectures") or []
    except (OSError, ValueError, AttributeError) as error:
        raise ValueError(f"--draft-model-path {config}: not a readable JSON object: {error}") from None
    dflash2 = sorted(set(architectures) & set(DFLASH2_ARCHITECTURES))
    if dflash2:
        raise ValueError(
            f"--policies dflash with --synthetic-acceptance: {draft_path} is a DFlash2 drafter "
            f"({dflash2[0]}), whose selector drafts SGLang's block where the synthetic draws cannot reach; "
            "use a DFlash drafter or drop dflash"
        )


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """`--load-format` and `--random-prompts`, shared by `bastion bench` and `bastion step-anatomy`: a
    target measured at its shape from its config.json alone."""
    parser.add_argument(
        "--load-format",
        choices=["auto", "dummy"],
        default="auto",
        help="SGLang --load-format of every Engine: dummy gives the target random weights from its "
        "config.json alone (the folder needs no weights and, with --random-prompts, no tokenizer), to "
        "measure a model's step costs at its shape; its tokens mean nothing. Default auto",
    )
    parser.add_argument(
        "--random-prompts",
        type=int,
        default=None,
        metavar="N",
        help="N prompts of random token ids (seeded by --seed) instead of --prompts: no tokenizer is read "
        "and the Engines skip theirs",
    )
    parser.add_argument(
        "--random-prompt-tokens",
        type=int,
        default=DEFAULT_RANDOM_PROMPT_TOKENS,
        metavar="L",
        help=f"tokens of each random prompt (default {DEFAULT_RANDOM_PROMPT_TOKENS})",
    )


def named_sets(spec: str) -> tuple[PromptSet, ...] | None:
    """The prompt sets of a comma-separated `--prompts` value ("mtbench,humaneval"), or None for a file
    path; ValueError naming the entry when a list names something else."""
    if Path(spec).is_file():
        return None
    names = [name.strip() for name in spec.split(",")]
    if len(names) == 1 and names[0] not in PROMPT_SETS:
        return None
    for name in names:
        if name not in PROMPT_SETS:
            raise ValueError(f"--prompts {spec}: {name!r} is not one of {list(PROMPT_SETS)}")
    if len(set(names)) < len(names):
        raise ValueError(f"--prompts {spec}: a set is named twice")
    return tuple(cast("PromptSet", name) for name in names)


def plan_from_args(args: argparse.Namespace) -> BenchPlan:
    """Validate the arguments and load the prompts; ValueError or MissingPackageError naming the bad value."""
    from bastion_sglang.calibration.identity import detect_device

    if args.max_budget < 1:
        raise ValueError(f"--max-budget must be >= 1, got {args.max_budget}")
    policies = parse_policies(args.policies, args.max_budget)
    if args.control:
        if not any(policy.name == "ar" for policy in policies):
            raise ValueError(
                f"--control runs a second ar Engine beside ar: add ar to --policies {args.policies}"
            )
        policies = (*policies, CONTROL)
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
    if device == "cpu" and any(p.kind == "dflash" for p in policies) and any(t > 0 for t in temperatures):
        raise ValueError(
            f"--policies dflash on the CPU: SGLang's DFLASH worker verifies greedily there whatever the "
            f"temperature, so --temperatures {args.temperatures} must be 0 (or use --device cuda)"
        )
    model_path = _check_model("--model-path", args.model_path)
    if args.load_format == "dummy":
        _check_dummy_target(model_path)
    speculative = any(p.kind != "ar" for p in policies)
    draft_path = _check_model("--draft-model-path", args.draft_model_path) if speculative else None
    if args.bastion_profile is not None and not Path(args.bastion_profile).is_file():
        raise ValueError(f"--bastion-profile {args.bastion_profile}: no such file")
    if args.synthetic_acceptance is not None:
        from bastion_sglang.step.synthetic_profile import load_synthetic_profile

        load_synthetic_profile(Path(args.synthetic_acceptance))  # ValueError names the file and field
        if any(p.kind == "dflash" for p in policies) and draft_path is not None:
            _check_dflash_drafter_for_synthetic(draft_path)
        if any(t > 0 for t in temperatures):
            raise ValueError(
                f"--synthetic-acceptance profiles describe greedy continuations: --temperatures "
                f"{args.temperatures} must be 0"
            )
        if not args.ignore_eos:
            raise ValueError(
                "--synthetic-acceptance: only the length may end a request (its tokens say nothing of where "
                "the text would end): add --ignore-eos"
            )
    if args.random_prompts is not None:
        prompts_name, split = "random", "all"
        prompt_ids = random_prompts(args, model_path)
    else:
        prompts_name = args.prompts or DEFAULT_PROMPTS
        split, texts = text_prompts(prompts_name, args.split, args.num_prompts)
        prompt_ids = tokenize_prompts(model_path, texts)
    attention = args.attention_backend or CHOSEN_BACKENDS["cpu" if device == "cpu" else "cuda"]
    settings = BenchSettings(
        model_path=model_path,
        draft_model_path=draft_path,
        prompts=prompts_name,
        split=split,
        random_prompt_tokens=args.random_prompt_tokens if args.random_prompts is not None else None,
        num_prompts=len(prompt_ids),
        concurrency=args.concurrency,
        max_new_tokens=args.max_new_tokens,
        ignore_eos=args.ignore_eos,
        temperatures=temperatures,
        policies=tuple(p.name for p in policies),
        repeats=args.repeats,
        max_budget=args.max_budget,
        overlap_schedule=args.bastion_overlap_schedule == "on",
        schedule=args.schedule,
        device=device,
        attention_backend=attention,
        dtype=args.dtype,
        load_format=args.load_format,
        profile=args.bastion_profile,
        synthetic_acceptance=args.synthetic_acceptance,
        seed=args.seed,
    )
    return BenchPlan(
        settings=settings,
        policies=policies,
        prompt_ids=tuple(prompt_ids),
        out=args.out,
        mem_fraction_static=args.mem_fraction_static or (0.2 if device == "cpu" else None),
        max_total_tokens=args.max_total_tokens or (65536 if device == "cpu" else None),
        sglang_log_level=args.sglang_log_level,
    )


def text_prompts(spec: str, split: str | None, num_prompts: int | None) -> tuple[str, list[str]]:
    """(the split taken, the first user turn of each prompt) of `--prompts spec`: named sets interleaved or
    a JSONL file, the first `num_prompts` of them; ValueError naming the value when none are there."""
    sets = named_sets(spec)
    path = Path(spec)
    if sets is None and not path.is_file() and (path.suffix or len(path.parts) > 1):
        raise ValueError(f"--prompts {spec}: no such file (or sets of {list(PROMPT_SETS)})")
    split = split or ("heldout" if sets is not None else "all")
    prompts = load_prompts(spec, split=split) if sets is None else interleave_prompts(sets, split=split)
    if num_prompts is not None:
        prompts = prompts[:num_prompts]
    if not prompts:
        raise ValueError(f"--prompts {spec}: the {split} split holds no prompts")
    if num_prompts is not None and len(prompts) < num_prompts:
        logger.warning(
            "--num-prompts %d: the %s split of %s holds %d; using them all",
            num_prompts,
            split,
            spec,
            len(prompts),
        )
    return split, [p.turns[0] for p in prompts]


def random_prompts(args: argparse.Namespace, model_path: str) -> list[list[int]]:
    """`--random-prompts N` prompts of `--random-prompt-tokens` ids each, uniform over the target's
    vocabulary (config.json: no tokenizer is read) from a generator seeded with `--seed`, so every policy and
    repeat gets the same ones. ValueError naming the flag that conflicts or is out of range."""
    import torch
    from transformers import AutoConfig

    if args.prompts is not None or args.split is not None:
        given = "--prompts" if args.prompts is not None else "--split"
        raise ValueError(f"--random-prompts makes its own prompts; drop {given}")
    if args.random_prompts < 1 or args.random_prompt_tokens < 1:
        raise ValueError(
            f"--random-prompts {args.random_prompts} --random-prompt-tokens {args.random_prompt_tokens}: "
            "both must be >= 1"
        )
    try:
        vocab = int(AutoConfig.from_pretrained(model_path).get_text_config().vocab_size)
    except (OSError, ValueError, AttributeError) as error:
        raise ValueError(f"--model-path {model_path}: no vocab_size in its config: {error}") from None
    count = args.random_prompts if args.num_prompts is None else min(args.num_prompts, args.random_prompts)
    generator = torch.Generator().manual_seed(args.seed)
    return torch.randint(0, vocab, (count, args.random_prompt_tokens), generator=generator).tolist()


def tokenize_prompts(model_path: str, texts: Sequence[str]) -> list[list[int]]:
    """Token ids of each text as the first user turn in the target tokenizer's chat template.

    ValueError naming the model when its tokenizer does not load or has no chat template.
    """
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(model_path)
    except OSError as error:
        raise ValueError(f"--model-path {model_path}: no tokenizer could be loaded: {error}") from None
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"--model-path {model_path}: the tokenizer has no chat template")
    return [
        chat_prompt_ids(tokenizer, Prompt(source="bench", id=str(i), turns=(t,))) for i, t in enumerate(texts)
    ]


def server_args_for(plan: BenchPlan, policy: BenchPolicy, overrides: Mapping[str, Any] | None = None) -> Any:
    """The ServerArgs record of `policy`'s Engine (BASTION's config attached as `attach_config` does). Every
    policy's Engine exports metrics (the bench reads BASTION's series), so all of them do the same work, and
    sleeps while idle: SGLang's scheduler otherwise polls for requests without pause, and under the
    interleaved schedule the waiting Engines would take the CPU from the one being measured. overrides:
    further ServerArgs fields, e.g. `bastion step-anatomy`'s `disable_overlap_schedule`."""
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import ServerArgs

    from bastion_sglang.bench.dflash_engine import mark_dflash_engine, prepare_bench_process
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
        enable_metrics=True,
        sleep_on_idle=True,
    )
    if settings.device == "cpu":
        kwargs["disable_cuda_graph"] = True
    if plan.mem_fraction_static is not None:
        kwargs["mem_fraction_static"] = plan.mem_fraction_static
    if plan.max_total_tokens is not None:
        kwargs["max_total_tokens"] = plan.max_total_tokens
    if settings.load_format != "auto":
        kwargs["load_format"] = settings.load_format
    if settings.random_prompt_tokens is not None:
        kwargs["skip_tokenizer_init"] = True  # token ids in, token ids out: no text is ever needed
    if policy.kind == "bastion":
        kwargs |= dict(
            speculative_algorithm="BASTION",
            speculative_draft_model_path=settings.draft_model_path,
        )
    elif policy.kind == "dflash":
        kwargs |= dict(speculative_algorithm="DFLASH", speculative_draft_model_path=settings.draft_model_path)
        prepare_bench_process(cpu=settings.device == "cpu")
    server_args = ServerArgs(**(kwargs | dict(overrides or {})))
    if policy.kind == "dflash" and (settings.device == "cpu" or settings.synthetic_acceptance is not None):
        mark_dflash_engine(
            server_args,
            cpu=settings.device == "cpu",
            synthetic_acceptance=settings.synthetic_acceptance,
        )
    if policy.kind == "bastion":
        config = make_config(
            max_budget=settings.max_budget,
            policy=policy.name,
            profile=settings.profile,
            overlap=settings.overlap_schedule,
            synthetic_acceptance=settings.synthetic_acceptance,
        )
        attach_config(server_args, config)
    return server_args


def repeat_order(policies: Sequence[T], repeat_index: int) -> tuple[T, ...]:
    """The policies in the order round `repeat_index` (from 0) runs them: row `repeat_index` of a Williams
    design, balanced for carry-over.

    A policy can leave the machine slower for the next one: on the 2-core CPU at concurrency 8, adaptive
    ran at 10.2 decode tokens/s right after fixed:64 and at 11.8 when it ran first. Rotating one order keeps
    every policy's predecessor the same in every round, so such a penalty always fell on the same policy.
    In the Williams design row r is (b_0 + r, ..., b_{n-1} + r) mod n for b = 0, 1, n-1, 2, n-2, ...: over n
    rows (n even) or those n rows and their mirror images (n odd, 2n rows) every policy follows every other
    one equally often and takes every position equally often; in the first three rows of the default nine
    policies no policy follows the same one twice. Rounds beyond that repeat the rows.
    """
    count = len(policies)
    base = [0] + [(k + 1) // 2 if k % 2 else count - k // 2 for k in range(1, count)]
    row = repeat_index % (count if count % 2 == 0 else 2 * count)
    order = [policies[(b + row) % count] for b in base]
    return tuple(order if row < count else reversed(order))
