"""GPU evidence from the reference engine: verify latency and its calibrated fit, planner overhead per step,
and end-to-end speed of the budget policies on a trained target/drafter pair.

    python benchmarks/reference_gpu.py --out results/                      # (a) on a random Qwen3-8B shape
    python benchmarks/reference_gpu.py --out results/ --target T --draft D [--prompts prompts.txt]   # (a)+(b)
    python benchmarks/reference_gpu.py --out /tmp/smoke --device cpu --smoke   # tiny shapes, end to end

(a) latency.json: the target's verify pass (the engine's own forward: explicit tree mask, positions, the
    drafter's feature layers collected) timed with CUDA events, median of --repeats, over s (tokens
    verified) in 1, 2, 4, .., 1024 and c (cached tokens) in 64, 128, .., 8192 (s = 1 is the plain decode
    step, a "decode" sample); the bare roofline and the calibrated fit (`fit_latency`), RMSE/MAPE in sample,
    and MAPE with each whole width and each whole context left out of the fit (`validate_leave_out`).
    Without --target the model is Qwen3-8B-shaped with random bf16 weights made on the device (no download).
    planner.json: microseconds per step of the planner as the engine runs it (top-k of the drafter logits,
    `build_tree` heap or `build_trees` beam, then the adaptive choice with the fitted latency model) at
    budgets 64..1024, next to the verify milliseconds of a pass of that width.
(b) pair.json (with --target/--draft): `reference.pair_bench`, the table of `bastion bench` at batch 1: decode
    tokens/s (prefill excluded) of every --policies entry at every --temperatures value over --pair-repeats
    rounds in Williams order, τ, nodes per step, per-token latency p50/p90, the best policy in hindsight and
    adaptive's ratio to it, to the best fixed budget and to ar; every policy run plans with a fresh copy of
    the latency model fitted in (a) on this very target, and (by default) ignores EOS so every policy
    decodes the same number of tokens.

The hardware peaks of the roofline come from the CUDA device name (`lookup_gpu`) unless --peak-flops and
--bandwidth are given; the CPU smoke run uses nominal peaks, named as such in its JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import transformers
from pydantic import BaseModel, ConfigDict
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, Qwen3Config

from bastion_sglang.controller import AdaptivePolicy, build_tree, build_trees
from bastion_sglang.controller.latency import (
    FitReport,
    LatencyFit,
    LatencyModel,
    LatencySample,
    LeaveOutReport,
    evaluate_fit,
    fit_latency,
    validate_leave_out,
    validate_width_buckets,
)
from bastion_sglang.controller.profile import StepCosts
from bastion_sglang.controller.roofline import (
    CPU_HARDWARE,
    HardwareSpec,
    ModelShape,
    RooflineModel,
    lookup_gpu,
)
from bastion_sglang.integration.config import default_width_buckets
from bastion_sglang.integration.drafter_config import DrafterConfig, default_target_layer_ids
from bastion_sglang.kernels import topk_logprobs
from bastion_sglang.reference import DFlashDrafter, TargetModel, load_causal_lm
from bastion_sglang.reference.pair_bench import (
    DEFAULT_PAIR_POLICIES,
    PairBenchReport,
    format_table,
    run_pair_bench,
)
from bastion_sglang.step.timing import StageTimer, synchronize

QWEN3_8B = dict(
    vocab_size=151936,
    hidden_size=4096,
    intermediate_size=12288,
    num_hidden_layers=36,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    tie_word_embeddings=False,
)
TINY = dict(QWEN3_8B, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4)
TINY.update(num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096)
FULL_WIDTHS = tuple(2**i for i in range(11))  # 1 .. 1024
FULL_CONTEXTS = tuple(64 * 2**i for i in range(8))  # 64 .. 8192
FULL_BUDGETS = (64, 128, 256, 512, 1024)
PLANNER_CONTEXT = 1024
PLANNER_DEPTH = 15  # D of a block of 16
DEFAULT_PROMPTS = (
    "Solve step by step: a train covers 120 km in 1.5 hours, then 80 km in 1 hour. Find its average speed.",
    "Write a Python function that returns the n-th Fibonacci number using memoization.",
    "Explain the difference between a process and a thread in an operating system.",
    "Prove that the square root of 2 is irrational.",
    "Write a haiku about the sea, then explain its imagery.",
    "Implement binary search in C and explain its complexity.",
    "What are the main causes of the French Revolution? Answer in five bullet points.",
    "Compute the derivative of x^3 * sin(x) and simplify.",
)


class Environment(BaseModel):
    model_config = ConfigDict(frozen=True)

    device: str
    device_name: str
    torch_version: str
    transformers_version: str
    dtype: str
    hardware: HardwareSpec


class LatencyReport(BaseModel):
    """Measured verify passes and the calibrated roofline fitted to them."""

    model_config = ConfigDict(frozen=True)

    environment: Environment
    model_source: str  # "random Qwen3-8B shape", "random tiny shape", or the target folder
    shape: ModelShape
    feature_layers: tuple[int, ...]
    repeats: int
    samples: list[LatencySample]  # median seconds per (s, c); s = 1: plain decode ("decode" samples)
    fit: LatencyFit
    in_sample: FitReport
    leave_out: LeaveOutReport  # each whole width, each whole context left out of the fit and predicted


class PlannerRow(BaseModel):
    model_config = ConfigDict(frozen=True)

    budget: int
    topk: int  # K candidates per depth
    chosen_nodes: int  # what the adaptive policy picked on this draft
    topk_us: float  # log-softmax + top-k of the [1, D, V] drafter logits
    heap_plan_us: float  # build_tree (host heap) + adaptive choice
    beam_plan_us: float  # build_trees (device beam) + adaptive choice
    verify_ms_fitted: float  # calibrated prediction for a pass of budget + 1 tokens at PLANNER_CONTEXT
    verify_ms_measured: float  # the measured median at the nearest measured width, PLANNER_CONTEXT-ish
    beam_plan_share: float  # beam_plan_us / (verify_ms_fitted · 1000)


class PlannerReport(BaseModel):
    model_config = ConfigDict(frozen=True)

    environment: Environment
    depth: int
    context: int
    repeats: int
    rows: list[PlannerRow]


class PairReport(BaseModel):
    model_config = ConfigDict(frozen=True)

    environment: Environment
    bench: PairBenchReport


def median_seconds(run: Callable[[], object], device: torch.device, repeats: int, warmup: int = 1) -> float:
    """Median wall seconds of run() (device work included)."""
    for _ in range(warmup):
        run()
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        run()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def random_target(shape: dict, device: torch.device, dtype: torch.dtype) -> PreTrainedModel:
    """A Qwen3 causal LM with random weights, initialised directly on the device."""
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(
            Qwen3Config(**shape), dtype=dtype, attn_implementation="sdpa"
        )
    return model.eval()


def measure_verify(
    target: TargetModel, widths: Sequence[int], contexts: Sequence[int], repeats: int
) -> list[LatencySample]:
    """Median verify seconds per (s, c): one prefill of max(c) random tokens, then for every c (descending)
    and width s an untimed pass at c, then `repeats` CUDA-event timed passes of a causal block of s tokens
    at c - repeats, .., c - 1 cached tokens. Each timed pass meets a key length it has not run at, as every
    decoding step of the engine does, so a cost paid per new shape (a kernel plan built per shape) shows
    here instead of being warmed away. A width of 1 is a plain decode step (mode "decode")."""
    if repeats >= min(contexts):
        raise ValueError(f"repeats ({repeats}) must be below the smallest context ({min(contexts)})")
    device = target.device
    vocab = int(target.model.config.vocab_size)
    cache = target.new_cache(max(contexts) + max(widths))
    generator = torch.Generator(device=device).manual_seed(0)
    prompt = torch.randint(0, vocab, (max(contexts),), generator=generator, device=device)
    target.prefill(cache, prompt)
    samples = []
    for c in sorted(contexts, reverse=True):
        cache.truncate(c)
        for s in widths:
            tokens = torch.randint(0, vocab, (s,), generator=generator, device=device)
            positions = torch.arange(c, c + s, device=device)
            visible = torch.ones((s, s), dtype=torch.bool, device=device).tril()
            times = []
            for context in (c, *range(c - repeats, c)):  # the first pass warms what depends on s only
                cache.truncate(context)
                timer = StageTimer(device)
                with timer.stage("verify"):
                    target.forward(cache, tokens, positions + (context - c), visible)
                seconds = timer.finish().verify
                if context != c:
                    times.append(seconds)
            cache.truncate(c)
            mode = "decode" if s == 1 else "verify"
            samples.append(LatencySample(s=s, c=c, seconds=statistics.median(times), mode=mode))
    return samples


def run_latency(
    target: TargetModel,
    environment: Environment,
    source: str,
    widths: Sequence[int],
    contexts: Sequence[int],
    repeats: int,
    width_buckets: Sequence[int] | None,
) -> tuple[LatencyReport, LatencyModel]:
    config = target.model.config.to_dict()
    shape = ModelShape.from_hf_config(config)
    roofline = RooflineModel(
        shape, environment.hardware, bytes_per_element=torch.finfo(target.dtype).bits // 8
    )
    samples = measure_verify(target, widths, contexts, repeats)
    fit = fit_latency(roofline, samples)
    report = LatencyReport(
        environment=environment,
        model_source=source,
        shape=shape,
        feature_layers=target.feature_layers,
        repeats=repeats,
        samples=samples,
        fit=fit,
        in_sample=evaluate_fit(roofline, fit, samples),
        leave_out=validate_leave_out(roofline, samples),
    )
    return report, LatencyModel(roofline, fit, width_buckets=width_buckets)


def run_planner(
    latency: LatencyModel,
    samples: Sequence[LatencySample],
    vocab: int,
    budgets: Sequence[int],
    environment: Environment,
    repeats: int,
) -> PlannerReport:
    """Planner cost per step on a peaked random draft distribution ([1, D, V] logits on the device)."""
    device = torch.device(environment.device)
    generator = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn((1, PLANNER_DEPTH, vocab), generator=generator, device=device) * 4.0
    policy = AdaptivePolicy()
    costs = StepCosts(t_draft=1e-3, t_aux=5e-4, l_ar=latency.predict_plain(PLANNER_CONTEXT))
    nearest_context = min({sample.c for sample in samples}, key=lambda c: abs(c - PLANNER_CONTEXT))
    rows = []
    for budget in budgets:
        k = min(64, budget, vocab)
        draft = topk_logprobs(logits, k)

        def heap_plan(draft=draft, budget=budget) -> int:
            tree = build_tree(draft.logprobs[0], draft.token_ids[0], budget)
            return policy.choose(tree.log_scores, PLANNER_CONTEXT, latency, costs)

        def beam_plan(draft=draft, budget=budget) -> int:
            trees = build_trees(draft.logprobs, draft.token_ids, budget)
            return policy.choose(trees.log_scores[0], PLANNER_CONTEXT, latency, costs)

        width = budget + 1
        nearest = [x for x in samples if x.c == nearest_context and x.mode == "verify"]
        measured = min(nearest, key=lambda x: abs(x.s - width))
        verify_fitted = latency.predict(width, PLANNER_CONTEXT)
        beam_us = median_seconds(beam_plan, device, repeats) * 1e6
        rows.append(
            PlannerRow(
                budget=budget,
                topk=k,
                chosen_nodes=beam_plan(),
                topk_us=median_seconds(lambda k=k: topk_logprobs(logits, k), device, repeats) * 1e6,
                heap_plan_us=median_seconds(heap_plan, device, repeats) * 1e6,
                beam_plan_us=beam_us,
                verify_ms_fitted=verify_fitted * 1e3,
                verify_ms_measured=measured.seconds * 1e3,
                beam_plan_share=beam_us / (verify_fitted * 1e6),
            )
        )
    return PlannerReport(
        environment=environment, depth=PLANNER_DEPTH, context=PLANNER_CONTEXT, repeats=repeats, rows=rows
    )


def load_prompts(target_path: Path, prompts_file: Path | None, count: int, vocab: int) -> list[list[int]]:
    """Token ids of the prompts through the target's chat template: --prompts as a text file (one prompt per
    line) or JSONL (`{"prompt": ...}` per line, for prompts with newlines), else the defaults; a folder
    without a tokenizer (the smoke pair) gets fixed random ids."""
    if not (target_path / "tokenizer_config.json").exists():
        generator = torch.Generator().manual_seed(0)
        return [torch.randint(0, vocab, (12,), generator=generator).tolist() for _ in range(count)]
    tokenizer = AutoTokenizer.from_pretrained(target_path)
    texts = list(DEFAULT_PROMPTS) if prompts_file is None else prompts_file.read_text().splitlines()
    if prompts_file is not None and prompts_file.suffix == ".jsonl":
        texts = [json.loads(line)["prompt"] for line in texts if line.strip()]
    texts = [text for text in texts if text.strip()][:count]
    if tokenizer.chat_template:
        return [
            tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, return_dict=True
            )["input_ids"]
            for text in texts
        ]
    return [tokenizer(text)["input_ids"] for text in texts]


def smoke_pair(folder: Path, model: PreTrainedModel) -> tuple[Path, Path]:
    """Save the tiny random target and a random DFlash drafter for it (z-lab format) under `folder`."""
    target_path = folder / "target"
    model.save_pretrained(target_path)
    config = model.config
    layers = default_target_layer_ids(config.num_hidden_layers, 2)
    drafter_config = DrafterConfig(
        hidden_size=config.hidden_size,
        num_hidden_layers=2,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        intermediate_size=config.intermediate_size,
        rms_norm_eps=config.rms_norm_eps,
        rope_theta=1e6,
        vocab_size=config.vocab_size,
        block_size=16,
        num_target_layers=config.num_hidden_layers,
        mask_token_id=config.vocab_size - 1,
        target_layer_ids=layers,
    )
    torch.manual_seed(0)
    draft_path = DFlashDrafter(drafter_config).save_pretrained(folder / "draft")
    return target_path, draft_path


def environment_for(device: torch.device, dtype: torch.dtype, args: argparse.Namespace) -> Environment:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    if args.peak_flops is not None and args.bandwidth is not None:
        hardware = HardwareSpec(name=f"{name} (given)", peak_flops=args.peak_flops, bandwidth=args.bandwidth)
    elif device.type == "cuda":
        hardware = lookup_gpu(name)
    elif args.smoke:
        hardware = CPU_HARDWARE
    else:
        raise SystemExit("on a CPU pass --peak-flops and --bandwidth (or --smoke for nominal peaks)")
    return Environment(
        device=str(device),
        device_name=name,
        torch_version=torch.__version__,
        transformers_version=transformers.__version__,
        dtype=str(dtype).removeprefix("torch."),
        hardware=hardware,
    )


def write(out: Path, name: str, report: BaseModel) -> None:
    path = out / name
    path.write_text(report.model_dump_json(indent=2) + "\n")
    print(f"wrote {path}")


def parse_width_buckets(spec: str | None, max_nodes: int, device: torch.device) -> tuple[int, ...] | None:
    """--width-buckets: None (the default) gives the worker's buckets on CUDA and none elsewhere."""
    if spec is None:
        return default_width_buckets(max_nodes) if device.type == "cuda" else None
    if spec.strip().lower() == "none":
        return None
    return validate_width_buckets([int(value) for value in spec.split(",") if value.strip()], lowest=2)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True, help="folder for the JSON reports")
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes and grids: an end-to-end check")
    parser.add_argument("--target", type=Path, help="trained target folder (with --draft: part b)")
    parser.add_argument("--draft", type=Path, help="trained DFlash drafter folder (z-lab format)")
    parser.add_argument(
        "--prompts",
        type=Path,
        help='text file (one prompt per line) or .jsonl ({"prompt": ...} per line); default: 8 built in',
    )
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument(
        "--policies",
        default=",".join(DEFAULT_PAIR_POLICIES),
        help="comma-separated policies of part b (ar, chain, fixed:N, bucketed, adaptive)",
    )
    parser.add_argument("--temperatures", default="0", help="comma-separated temperatures of part b")
    parser.add_argument("--pair-repeats", type=int, default=2, help="rounds of part b (Williams order)")
    parser.add_argument(
        "--keep-eos", action="store_true", help="stop at EOS (default: every request decodes all its tokens)"
    )
    parser.add_argument("--max-nodes", type=int, default=1024, help="tree budget cap of the adaptive policy")
    parser.add_argument(
        "--width-buckets",
        help="comma-separated verify widths (root included) that passes are padded to, as the worker's CUDA "
        "graphs run them, or 'none'; default: the worker's (2, 4, .., N_max + 1) on CUDA, none on a CPU",
    )
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats per latency point")
    parser.add_argument("--peak-flops", type=float, help="FLOP/s for the roofline (default: by device name)")
    parser.add_argument("--bandwidth", type=float, help="bytes/s for the roofline (default: by device name)")
    args = parser.parse_args(argv)
    if (args.target is None) != (args.draft is None):
        parser.error("--target and --draft go together")
    device = torch.device(args.device)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    args.out.mkdir(parents=True, exist_ok=True)
    environment = environment_for(device, dtype, args)
    torch.manual_seed(0)

    if args.smoke:
        torch.set_num_threads(1)  # tiny shapes: intra-op threads only add contention
        widths, contexts, budgets, repeats = (1, 2, 4, 8, 16), (16, 32, 64), (8, 16, 32), 2
        max_new_tokens, prompt_count, policies = 16, 2, ("ar", "chain", "fixed:8", "fixed:16", "adaptive")
    else:
        widths, contexts, budgets, repeats = FULL_WIDTHS, FULL_CONTEXTS, FULL_BUDGETS, args.repeats
        max_new_tokens, prompt_count = args.max_new_tokens, args.num_prompts
        policies = tuple(name.strip() for name in args.policies.split(",") if name.strip())
    temperatures = tuple(float(value) for value in args.temperatures.split(",") if value.strip())
    try:
        width_buckets = parse_width_buckets(args.width_buckets, args.max_nodes, device)
    except ValueError as error:
        parser.error(f"--width-buckets {args.width_buckets!r}: {error}")

    with tempfile.TemporaryDirectory() as scratch:
        if args.target is not None:
            target_path, draft_path = args.target, args.draft
            model = load_causal_lm(target_path, device=device, dtype=dtype)
            source = str(target_path)
        else:
            model = random_target(TINY if args.smoke else QWEN3_8B, device, dtype)
            source = "random tiny shape" if args.smoke else "random Qwen3-8B shape"
            target_path, draft_path = smoke_pair(Path(scratch), model) if args.smoke else (None, None)
        layers = (
            DrafterConfig.from_json(
                draft_path, target_num_layers=model.config.num_hidden_layers
            ).target_layer_ids
            if draft_path is not None
            else default_target_layer_ids(model.config.num_hidden_layers, 5)
        )
        latency_report, latency = run_latency(
            TargetModel(model, layers), environment, source, widths, contexts, repeats, width_buckets
        )
        write(args.out, "latency.json", latency_report)
        fit_errors = latency_report.in_sample
        print(
            f"verify fit: raw MAPE {fit_errors.mape_raw:.1%}, fitted {fit_errors.mape_fit:.1%}; left out: "
            f"widths MAPE {latency_report.leave_out.mape_widths or 0:.1%}, contexts MAPE "
            f"{latency_report.leave_out.mape_contexts or 0:.1%}"
        )
        planner = run_planner(
            latency, latency_report.samples, int(model.config.vocab_size), budgets, environment, repeats
        )
        write(args.out, "planner.json", planner)
        if target_path is not None and draft_path is not None:
            prompts = load_prompts(
                Path(target_path), args.prompts, prompt_count, int(model.config.vocab_size)
            )

            def save(bench: PairBenchReport) -> None:
                write(args.out, "pair.json", PairReport(environment=environment, bench=bench))
                print(format_table(bench), flush=True)

            run_pair_bench(
                model,
                Path(draft_path),
                latency,
                prompts,
                target_name=str(target_path),
                policies=policies,
                temperatures=temperatures,
                repeats=args.pair_repeats,
                max_new_tokens=max_new_tokens,
                max_nodes=args.max_nodes,
                ignore_eos=not args.keep_eos,
                on_round=save,
            )


if __name__ == "__main__":
    main()
