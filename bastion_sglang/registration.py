"""BASTION inside stock SGLang 0.5.23: the algorithm spec, its server-argument handling, its CLI flags.

How the pieces reach SGLang (all through its plugin API, `sglang.srt.plugins`):
- `SpeculativeAlgorithm.register("BASTION", spec_class=BastionSpecAlgo)` makes `--speculative-algorithm
  BASTION` resolve; the factory returns `bastion_sglang.worker.BastionWorker` (imported only then).
- `HookRegistry` hooks add the `--bastion-*` flags to `ServerArgs.add_cli_args` and, in
  `ServerArgs.from_cli_args`, turn them into a validated `BastionConfig` stored on the ServerArgs record
  (attribute `_bastion_config`). The record is pickled into every scheduler process with its bookkeeping
  attributes, so the worker reads the same object. Python callers attach one with `attach_config`.
- `bastion_sglang.integration.cpu_support`, only in a process that serves BASTION on the CPU: its import
  placeholders before SGLang resolves the server arguments (a hook on `ServerArgs.resolve_once`), and its CPU
  stand-ins in the scheduler process (a hook on `Scheduler.__init__`). A process that loads the plugin but
  serves another algorithm, or BASTION on CUDA, gets neither.
- The attention backend: a resolution hook (SGLang's `register_resolution_hook`) around the pipeline's
  `handle_cpu_backends` step, the first that fills in a default backend, chooses one BASTION can verify
  trees with when `--attention-backend` is not given (`choose_attention_backend`), and refuses a named one
  it cannot use, before SGLang's own default (fa3 on Hopper) is filled in.
- A hook on SGLang's per-request DFlash check refuses, per request, the parameters BASTION cannot honour
  exactly (`bastion_sglang.integration.request_support`).
- A hook on `ModelRunner._decode_cuda_graph_runner_cls` gives BASTION's target its own verify graph runner
  (`bastion_sglang.step.graphs`: captured with the tree mask, one per width bucket).
- A hook on the scheduler's output streamer writes BASTION's held metrics before a finished request's
  output leaves (`bastion_sglang.step.metrics`: writes are batched over decode steps).

This module is the only place where SGLang server arguments are mapped to `BastionConfig`.
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sglang.srt.speculative.spec_registry import CustomSpecAlgo

from bastion_sglang.controller import BudgetPolicy, parse_policy
from bastion_sglang.integration.config import (
    ALGORITHM,
    CHOSEN_BACKENDS,
    CPU_ATTENTION_BACKEND,
    DEFAULT_EMA_ALPHA,
    DEFAULT_MAX_BUDGET,
    DEFAULT_TOPK,
    STARTUP_MODES,
    BastionConfig,
    StartupMode,
    attach_config,
    config_of,
    default_startup_calibration,
    default_width_buckets,
)
from bastion_sglang.integration.draft_vocab import DraftVocabChoice

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch
    from sglang.srt.managers.overlap_utils import FutureMap
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    from bastion_sglang.integration.drafter_config import SelectorConfig

logger = logging.getLogger(__name__)

MAX_BUDGET_LIMIT = 1024
"""Largest N_max accepted: the largest budget the BASTION paper sweeps. On CUDA the target's verify mask
buffer (FULL_MASK layout) holds max_batch x W x (context + W) booleans, so wider trees cost memory on
every captured batch size; beyond 1024 nodes the expected accepted length of a 16-token block is flat."""

CUDA_TREE_MASK_BACKENDS = ("triton", "flashinfer")
"""Attention backends whose TARGET_VERIFY path reads an arbitrary per-request custom mask on CUDA."""
ATTENTION_BACKEND_FLAGS = (
    ("attention_backend", "--attention-backend"),
    ("prefill_attention_backend", "--prefill-attention-backend"),
    ("decode_attention_backend", "--decode-attention-backend"),
)
"""(ServerArgs field, its flag) of every attention backend the user may name."""
CHOOSE_BACKEND_STEP = "handle_cpu_backends"
"""The resolution step `choose_attention_backend` wraps: the first in SGLang 0.5.23's pipeline that fills in
a default attention backend (on CPU; `handle_attention_backend_compatibility` does on CUDA, later), after
`handle_missing_default_values` has resolved the device."""


@dataclass(frozen=True)
class _Flag:
    """One `--bastion-*` command-line flag (argparse destination `dest`)."""

    flag: str
    dest: str
    type: Callable[[str], Any]
    metavar: str
    help: str


def _width_list(text: str) -> tuple[int, ...]:
    """'16,32,64' -> (16, 32, 64); argparse turns the ValueError into a usage error."""
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from error


def _on_off(text: str) -> bool:
    """'on' -> True, 'off' -> False; anything else is an argparse usage error."""
    value = text.strip().lower()
    if value not in ("on", "off"):
        raise argparse.ArgumentTypeError(f"expected on or off, got {text!r}")
    return value == "on"


def _startup_mode(text: str) -> str:
    """'quick' -> 'quick' (off, quick, full); anything else is an argparse usage error."""
    value = text.strip().lower()
    if value not in STARTUP_MODES:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(STARTUP_MODES)}, got {text!r}")
    return value


FLAGS: tuple[_Flag, ...] = (
    _Flag(
        "--bastion-max-budget",
        "bastion_max_budget",
        int,
        "N",
        f"BASTION: most draft nodes per request per step (N_max, 1..{MAX_BUDGET_LIMIT}); verify width cap "
        f"is N_max + 1. Default {DEFAULT_MAX_BUDGET}.",
    ),
    _Flag(
        "--bastion-policy",
        "bastion_policy",
        str,
        "POLICY",
        "BASTION: tree-size policy. adaptive (default): grow the best-first tree while the estimated speedup "
        "rises; bucketed: fill the best verify-width bucket; fixed:N: always N nodes; chain: the drafter's "
        "top-1 token at every depth (DFlash's verification).",
    ),
    _Flag(
        "--bastion-profile",
        "bastion_profile",
        str,
        "auto|PATH",
        "BASTION: latency profile. auto (default): an uncalibrated roofline of the target corrected online; "
        "PATH: a JSON profile written by `bastion calibrate`.",
    ),
    _Flag(
        "--bastion-ema-alpha",
        "bastion_ema_alpha",
        float,
        "ALPHA",
        f"BASTION: weight of the newest observed/predicted verify latency in the EMA, in (0, 1]. "
        f"Default {DEFAULT_EMA_ALPHA}.",
    ),
    _Flag(
        "--bastion-width-buckets",
        "bastion_width_buckets",
        _width_list,
        "W1,W2,...",
        "BASTION: verify widths (tokens per request, root included) for the bucketed policy and CUDA graphs, "
        "sorted, each in [2, N_max + 1]. Default: powers of two below N_max + 1, then N_max + 1.",
    ),
    _Flag(
        "--bastion-topk",
        "bastion_topk",
        int,
        "K",
        f"BASTION: candidates per draft position the tree may branch into (1..N_max); default {DEFAULT_TOPK}",
    ),
    _Flag(
        "--bastion-overlap-schedule",
        "bastion_overlap_schedule",
        _on_off,
        "on|off",
        "BASTION: off (default): run without overlap scheduling (--disable-overlap-schedule is switched on); "
        "on: let SGLang's overlap scheduler prepare the next batch while a step runs (then "
        "--disable-overlap-schedule decides); every request parameter acts as without it.",
    ),
    _Flag(
        "--bastion-startup-calibration",
        "bastion_startup_calibration",
        _startup_mode,
        "off|quick|full",
        "BASTION: with --bastion-profile auto and no stored profile for this device, target, dtype, "
        "attention backend and tp (or one fitted for another drafter), measure one before serving and store "
        "it. quick "
        "(default, or $BASTION_STARTUP_CALIBRATION): the server's verify widths at 3 contexts and 9 prompts; "
        "full: bastion calibrate's width grid up to 8192 tokens of context and 24 prompts; off: plan on the "
        "uncalibrated roofline corrected online.",
    ),
    _Flag(
        "--bastion-draft-vocab",
        "bastion_draft_vocab",
        str,
        "auto|full|PATH",
        "BASTION: the tokens the draft step scores with the target's LM head. auto (default): the drafter "
        "folder's draft_vocab.json (written by `bastion draft-vocab`) when it has one, else every token; "
        "full: every token; PATH: a draft_vocab.json. A smaller vocabulary makes the draft step cheaper "
        "where the head is bound by its weight reads; output stays the target's either way.",
    ),
)


def make_config(
    *,
    max_budget: int | None = None,
    policy: str | None = None,
    profile: str | None = None,
    ema_alpha: float | None = None,
    width_buckets: tuple[int, ...] | None = None,
    topk: int | None = None,
    overlap: bool | None = None,
    startup_calibration: StartupMode | None = None,
    synthetic_acceptance: str | None = None,
    draft_vocab: str | None = None,
) -> BastionConfig:
    """BastionConfig from the command-line spellings (None: the default). ValueError names a bad value.

    policy: adaptive | bucketed | fixed:N | chain. profile: "auto" or a path to a calibration profile.
    overlap: whether SGLang's overlap scheduler may run BASTION (default False). startup_calibration:
    off | quick | full (default `config.default_startup_calibration`). synthetic_acceptance: a
    `synthetic_acceptance` profile file (speed benchmarks only; None: off). draft_vocab: auto | full | a
    draft vocabulary file (default auto).
    """
    budget = DEFAULT_MAX_BUDGET if max_budget is None else max_budget
    if isinstance(budget, int) and budget > MAX_BUDGET_LIMIT:
        raise ValueError(
            f"--bastion-max-budget {budget} exceeds the limit {MAX_BUDGET_LIMIT} "
            f"(verify width {budget + 1} per request)"
        )
    buckets = (
        default_width_buckets(budget) if width_buckets is None and isinstance(budget, int) else width_buckets
    )
    parsed: BudgetPolicy | None = parse_policy(policy or "adaptive", width_buckets=buckets)
    if parsed is None:
        raise ValueError(
            f"--bastion-policy {policy!r} disables drafting; run without --speculative-algorithm instead"
        )
    profile_path = None if profile is None or profile.strip().lower() == "auto" else Path(profile)
    return BastionConfig(
        max_budget=budget,
        policy=parsed,
        profile_path=profile_path,
        ema_alpha=DEFAULT_EMA_ALPHA if ema_alpha is None else ema_alpha,
        width_buckets=buckets if buckets is not None else (),
        topk=DEFAULT_TOPK if topk is None else topk,
        overlap=bool(overlap),
        startup_calibration=default_startup_calibration()
        if startup_calibration is None
        else startup_calibration,
        synthetic_acceptance=None if synthetic_acceptance is None else Path(synthetic_acceptance),
        draft_vocab=_draft_vocab_choice(draft_vocab),
    )


def _draft_vocab_choice(text: str | None) -> DraftVocabChoice:
    """auto (None too), full, or the Path of any other spelling."""
    value = "auto" if text is None else text.strip()
    return value.lower() if value.lower() in ("auto", "full") else Path(value)  # type: ignore[return-value]


def config_from_namespace(args: argparse.Namespace) -> BastionConfig | None:
    """The BastionConfig the `--bastion-*` flags ask for, or None when none was given."""
    given = {f.dest: getattr(args, f.dest, None) for f in FLAGS}
    if all(value is None for value in given.values()):
        return None
    return make_config(
        max_budget=given["bastion_max_budget"],
        policy=given["bastion_policy"],
        profile=given["bastion_profile"],
        ema_alpha=given["bastion_ema_alpha"],
        width_buckets=given["bastion_width_buckets"],
        topk=given["bastion_topk"],
        overlap=given["bastion_overlap_schedule"],
        startup_calibration=given["bastion_startup_calibration"],
        draft_vocab=given["bastion_draft_vocab"],
    )


# ---- CLI hooks (HookRegistry) ------------------------------------------------------------------


def _add_bastion_cli_args(result: None, parser: argparse.ArgumentParser) -> None:
    """AFTER hook of `ServerArgs.add_cli_args(parser)`: append the `--bastion-*` group."""
    group = parser.add_argument_group("BASTION speculative decoding (--speculative-algorithm BASTION)")
    for flag in FLAGS:
        group.add_argument(
            flag.flag, dest=flag.dest, type=flag.type, default=None, metavar=flag.metavar, help=flag.help
        )


def _from_cli_args_with_bastion(original: Callable[..., Any], cls: type, args: argparse.Namespace) -> Any:
    """AROUND hook of `ServerArgs.from_cli_args(args)`: build the record, then attach the BastionConfig."""
    server_args = original(cls, args)
    config = config_from_namespace(args)
    if config is None:
        return server_args
    algorithm = (args.speculative_algorithm or "").upper()
    if algorithm != ALGORITHM:
        given = sorted(f.flag for f in FLAGS if getattr(args, f.dest, None) is not None)
        raise ValueError(
            f"{', '.join(given)} need --speculative-algorithm {ALGORITHM}, got {algorithm or 'none'}"
        )
    attach_config(server_args, config)
    return server_args


def _prepare_cpu_serving(server_args: Any) -> None:
    """BEFORE hook of `ServerArgs.resolve_once(self)`: in a process that is about to resolve arguments that
    serve BASTION on the CPU, install `cpu_support`'s import placeholders (resolution imports SGLang's model
    configs). Reads the arguments as given (device None: auto-detection). Returns None, so the arguments pass
    through unchanged."""
    from bastion_sglang.integration import cpu_support

    cpu_support.prepare_cpu_serving(server_args)


def supported_attention_backends(device: str) -> tuple[str, ...]:
    """The attention backends BASTION verifies trees with on `device` ("cuda", "cuda:1", "cpu"); () on any
    other device."""
    kind = device.split(":")[0]
    if kind == "cuda":
        return CUDA_TREE_MASK_BACKENDS
    if kind == "cpu":
        return (CPU_ATTENTION_BACKEND,)
    return ()


def unsupported_backend_message(flag: str, value: str, device: str) -> str:
    """The refusal of backend `value` given as `flag` on `device`, listing the supported backends."""
    supported = supported_attention_backends(device)
    return (
        f"{flag} {value}: {ALGORITHM} on {device} verifies draft trees with a per-request tree mask, which "
        f"{value} does not read; supported: {', '.join(supported)} (leave {flag} out and {ALGORITHM} uses "
        f"{CHOSEN_BACKENDS[device.split(':')[0]]})"
    )


def choose_attention_backend(server_args: Any, previous: Callable[[Any], None]) -> None:
    """Resolution hook around SGLang's `handle_cpu_backends` step (`CHOOSE_BACKEND_STEP`): for BASTION on
    CUDA or CPU, refuse an attention backend the user named that BASTION cannot use (ValueError naming the
    flag, the value and the supported backends), and when `--attention-backend` was not given, declare
    BASTION's choice (`CHOSEN_BACKENDS`) and log one line saying which and why. Then the step itself.

    `server_args` is SGLang's record mid-resolution: its own fields are what the user gave (resolution
    declares its decisions beside them), the resolving view what has been decided so far (the device).
    Other algorithms and devices pass through untouched (`handle_server_args` refuses other devices).
    """
    from sglang.srt.arg_groups.overrides import declare_resolution, resolving_view

    cfg = resolving_view(server_args)
    device = str(cfg.device or "")
    supported = supported_attention_backends(device)
    if str(cfg.speculative_algorithm or "").upper() == ALGORITHM and supported:
        for field, flag in ATTENTION_BACKEND_FLAGS:
            named = getattr(server_args, field)
            if named is not None and named not in supported:
                raise ValueError(unsupported_backend_message(flag, named, device))
        if server_args.attention_backend is None:
            chosen = CHOSEN_BACKENDS[device.split(":")[0]]
            declare_resolution(server_args, "bastion.choose_attention_backend", attention_backend=chosen)
            logger.info(
                "%s: --attention-backend not given; using %s, which reads the per-request tree mask %s "
                "verifies with (supported on %s: %s)",
                ALGORITHM,
                chosen,
                ALGORITHM,
                device,
                ", ".join(supported),
            )
    previous(server_args)


def _scheduler_init_hook(scheduler: Any, server_args: Any, *args: Any, **kwargs: Any) -> None:
    """BEFORE hook of `Scheduler.__init__(self, server_args, ...)`: CPU support in the scheduler process.

    Returns None, so the arguments pass through unchanged.
    """
    from bastion_sglang.integration import cpu_support

    cpu_support.prepare_scheduler_process(server_args)


def _flush_metrics_before_output(streamer: Any, reqs: Any, *args: Any, **kwargs: Any) -> None:
    """BEFORE hook of `SchedulerOutputStreamer.stream_output(self, reqs, ...)`: when a request of `reqs` has
    finished, write BASTION's held metrics first (`metrics.flush_all`), so a client that has its response
    reads series that include its last steps. Returns None, so the arguments pass through unchanged."""
    from bastion_sglang.step.metrics import flush_all

    if any(req.finished() for req in reqs):
        flush_all()


def _validate_request(original: Callable[..., Any], req: Any, enable_overlap: bool) -> str | None:
    """AROUND hook of `dflash_utils.validate_dflash_request(req, enable_overlap)`, SGLang's per-request check
    for the DFlash family: on a BASTION server, also the parameters BASTION cannot honour exactly
    (`request_support.unsupported_parameter`), and under synthetic acceptance what its profile does not
    describe (`request_support.unsupported_under_synthetic_acceptance`). A message aborts that request only
    (HTTP 400)."""
    error = original(req, enable_overlap)
    if error is not None or not _serving_bastion():
        return error
    from bastion_sglang.integration import sglang_adapter as sgl
    from bastion_sglang.integration.request_support import (
        unsupported_parameter,
        unsupported_under_synthetic_acceptance,
    )

    error = unsupported_parameter(req)
    if error is None and config_of(sgl.get_server_args()).synthetic_acceptance is not None:
        error = unsupported_under_synthetic_acceptance(req)
    return error


def _serving_bastion() -> bool:
    """Whether this scheduler process serves `--speculative-algorithm BASTION`."""
    from bastion_sglang.integration import sglang_adapter as sgl

    return str(sgl.get_spec().speculative_algorithm or "").upper() == ALGORITHM


def _verify_graph_runner_class(runner_class: type, model_runner: Any) -> type | None:
    """AFTER hook of `ModelRunner._decode_cuda_graph_runner_cls()`: BASTION's target model runner captures
    its verify graphs with `graphs.BastionVerifyGraphRunner` (tree mask; the largest width bucket), every
    other runner keeps SGLang's class (None)."""
    if isinstance(model_runner.spec_algorithm, BastionSpecAlgo) and not model_runner.is_draft_worker:
        from bastion_sglang.step.graphs import BastionVerifyGraphRunner

        return BastionVerifyGraphRunner
    return None


# ---- the algorithm ---------------------------------------------------------------------------------


class BastionSpecAlgo(CustomSpecAlgo):
    """BASTION as SGLang sees it: a member of the DFlash family with its own worker and server-arg handling.

    Claiming `is_dflash_family()` gives BASTION what DFlash gets from SGLang: the target captures the hidden
    states of the drafter's `target_layer_ids` (`spec_aux_hidden_state`), the draft model gets its own KV pool
    over the target's slot ids, the DFlash model-loading path is used for the drafter, and decode allocation
    goes through the draft input's `prepare_for_decode`. `is_dflash()` stays False: the DFLASH-only branches
    (its worker, its server-arg handler, its disaggregation input and sampling-mask rules) are not BASTION's.
    Every method of the `SpeculativeAlgorithm` enum is defined here (0.5.23's CustomSpecAlgo misses some).
    """

    def is_dflash_family(self) -> bool:
        return True

    def supports_target_verify_for_draft(self) -> bool:
        return True

    def supports_prefill_shared_read_done(self) -> bool:
        return True

    def has_draft_kv(self) -> bool:
        return True

    def carries_draft_hidden_states(self) -> bool:
        return False

    def need_topk(self) -> bool:
        return False

    def get_platform_worker_cls(self) -> type | None:
        return None

    def create_future_map(
        self,
        device: torch.device,
        req_to_token_pool: ReqToTokenPool,
        needs_cpu_seq_lens: bool = True,
        needs_confidence_relay: bool = False,
    ) -> FutureMap:
        """SGLang's future map, always with host sequence lengths: under overlap scheduling the worker plans
        each step from the committed lengths on the host (`needs_cpu_seq_lens` from the attention backends is
        not enough: a backend that opts out would leave `seq_lens_cpu` None)."""
        from bastion_sglang.integration import sglang_adapter as sgl

        return sgl.future_map(device, self, req_to_token_pool, True, needs_confidence_relay)

    def get_num_tokens_per_req_for_target_verify(self, num_draft_tokens: int, is_draft_worker: bool) -> int:
        """Target verify: the width cap N_max + 1. The drafter's TARGET_VERIFY forward: its block size."""
        if not is_draft_worker:
            return num_draft_tokens
        from bastion_sglang.integration import sglang_adapter as sgl

        return int(sgl.get_spec().speculative_dflash_block_size)

    def resolve_max_speculative_num_draft_tokens(self, server_args: Any) -> int | None:
        """KV slots one request writes in a decode step: max(verify width cap N_max + 1, drafter block γ).

        The drafter's block is written at the same slots as the verify rows, so a step needs both. SGLang
        sizes the per-request decode reserve (2x this, `get_alloc_reserve_per_decode`) and its "does the
        next decode step fit, else retract" check from this value; the worker's `prepare_for_decode`
        allocates 2 * max(γ, N_max + 1). With only the width cap here (N_max + 1 < γ), the check
        under-counted and a full KV pool crashed the scheduler ("Out of memory") instead of retracting.
        """
        from sglang.srt.arg_groups.overrides import resolving_view

        cfg = resolving_view(server_args)
        width, block = cfg.speculative_num_draft_tokens, cfg.speculative_dflash_block_size
        if width is None or block is None:  # not resolved yet (handle_server_args sets both)
            return width
        return max(int(width), int(block))

    def handle_server_args(self, server_args: Any) -> None:
        handle_server_args(server_args)


def handle_server_args(server_args: Any) -> None:
    """Resolve the server arguments for BASTION; raise ValueError naming the value and the fix.

    Does what SGLang's `_handle_dflash` does (steps 1, topk 1, the drafter's block size, the draft
    attention backend, 48 running requests by default) without its device check, and BASTION's own:
    draft-token count = verify width cap N_max + 1, overlap scheduling off unless `--bastion-overlap-schedule
    on`, mixed chunks off, no pipeline parallel or DP attention, the drafter must fit the target, the backend
    must read a custom tree mask, the latency profile must load. `server_args` is SGLang's recording
    stand-in: assignments become declarations.
    """
    from sglang.srt.arg_groups.overrides import model_config_of
    from sglang.srt.utils.hf_transformers_utils import get_config

    from bastion_sglang.controller.profile import load_profile
    from bastion_sglang.integration.draft_vocab import resolve_draft_vocabulary
    from bastion_sglang.integration.drafter_config import DrafterConfig, check_drafter_fits

    config = config_of(server_args)
    cfg = server_args
    if cfg.speculative_draft_model_path is None:
        raise ValueError(f"{ALGORITHM} needs a DFlash drafter: pass --speculative-draft-model-path")
    _check_parallelism(cfg)
    _check_device_and_backend(cfg)

    draft_hf_config = get_config(
        cfg.speculative_draft_model_path,
        trust_remote_code=cfg.trust_remote_code,
        revision=cfg.speculative_draft_model_revision,
    )
    target_hf_config = model_config_of(server_args).hf_config
    drafter = DrafterConfig.from_json(
        draft_hf_config.to_dict(), target_num_layers=int(target_hf_config.num_hidden_layers)
    )
    check_drafter_fits(drafter, target_hf_config.to_dict())
    check_draft_logits_supported(draft_hf_config, drafter.selector, int(cfg.tp_size or 1))
    check_heads_split(int(cfg.tp_size or 1), target=target_hf_config, drafter=draft_hf_config)

    width_cap = config.verify_width_cap
    context_len = int(model_config_of(server_args).context_len)
    if width_cap * 2 > context_len:
        raise ValueError(
            f"--bastion-max-budget {config.max_budget} gives verify width {width_cap}, more than half the "
            f"context length {context_len}; use at most {context_len // 2 - 1}"
        )
    vocab_size = int(target_hf_config.vocab_size)
    if config.topk > vocab_size:
        raise ValueError(f"--bastion-topk {config.topk} exceeds the target vocabulary ({vocab_size})")
    if cfg.speculative_num_draft_tokens is not None and int(cfg.speculative_num_draft_tokens) != width_cap:
        raise ValueError(
            f"{ALGORITHM} sets --speculative-num-draft-tokens to the verify width N_max + 1 = {width_cap}, "
            f"got {cfg.speculative_num_draft_tokens}. Drop it, or pass "
            f"--bastion-max-budget {int(cfg.speculative_num_draft_tokens) - 1}"
        )
    block_size = (
        drafter.block_size if cfg.speculative_dflash_block_size is None else cfg.speculative_dflash_block_size
    )
    if int(block_size) < 2:
        raise ValueError(f"the drafter's block size must be >= 2 (bonus + one mask), got {block_size}")
    if config.profile_path is not None:
        load_profile(config.profile_path)  # ProfileError names the file
    resolve_draft_vocabulary(
        config.draft_vocab,
        cfg.speculative_draft_model_path,
        vocab_size,
        config.topk,
        lattice_drafter=drafter.selector is not None,
    )

    cfg.speculative_num_steps = 1
    cfg.speculative_eagle_topk = 1
    cfg.speculative_num_draft_tokens = width_cap
    cfg.speculative_dflash_block_size = int(block_size)
    if cfg.speculative_draft_attention_backend is None:
        cfg.speculative_draft_attention_backend = cfg.attention_backend
    if cfg.max_running_requests is None:
        cfg.max_running_requests = 48
    if not config.overlap and not cfg.disable_overlap_schedule:
        cfg.disable_overlap_schedule = True
        logger.warning(
            "%s runs without overlap scheduling unless --bastion-overlap-schedule on is given; "
            "--disable-overlap-schedule is now on.",
            ALGORITHM,
        )
    if cfg.enable_mixed_chunk:
        cfg.enable_mixed_chunk = False
        logger.warning(
            "%s does not support mixed chunked prefill; --enable-mixed-chunk is now off.", ALGORITHM
        )


def check_draft_logits_supported(
    draft_hf_config: Any, selector: SelectorConfig | None = None, tp_size: int = 1
) -> None:
    """Refuse a drafter whose draft distributions BASTION's draft stage would not compute as SGLang does.

    A plain DFlash drafter (selector None) is drafted as softmax(hidden_states @ lm_head.T); SGLang's plain
    `DFlashDraftModel` ignores `selector_rank`, `output_multiplier` and `final_logit_softcapping` (its greedy
    draft takes the raw argmax), while BASTION's trees would read probabilities they were meant to reshape,
    so each is refused. A DFlash2 drafter (selector: its `drafter_config.SelectorConfig`) honours all three
    through SGLang's own `compute_candidates` and `build_lattice` (`drafter_forward`), on one TP rank: its
    lattice under --tp-size > 1 is not served. The Domino projector (`projector_type`) is refused on both.
    Raises ValueError naming the field (or the architecture and the TP size)."""
    from sglang.srt.speculative.dflash_utils import parse_dflash_draft_config

    parsed = parse_dflash_draft_config(draft_hf_config=draft_hf_config)
    unsupported = {"projector_type": parsed.projector_type if parsed.is_domino else None}
    if selector is None:
        unsupported |= {
            "selector_rank": parsed.selector_rank if parsed.selector_rank else None,
            "output_multiplier": parsed.output_multiplier if parsed.output_multiplier != 1.0 else None,
            "final_logit_softcapping": parsed.final_logit_softcapping,
        }
    for field, value in unsupported.items():
        if value is not None:
            raise ValueError(
                f"{ALGORITHM} does not support the drafter's dflash_config.{field} = {value!r}: its draft "
                "logits bypass it. Serve this drafter with --speculative-algorithm DFLASH"
            )
    if selector is not None and tp_size > 1:
        raise ValueError(
            f"{ALGORITHM} serves a DFlash2 drafter ({selector.architecture}) with --tp-size 1 only, got "
            f"--tp-size {tp_size}: its candidate lattice is drafted on one rank. Use --tp-size 1, or "
            "--speculative-algorithm DFLASH"
        )


def check_heads_split(tp_size: int, **hf_configs: Any) -> None:
    """Refuse a `--tp-size` the attention heads of a model (by name: target, drafter) do not split over.

    Each TP rank holds num_attention_heads / tp query heads; KV heads are split the same way, or replicated
    when tp is a multiple of num_key_value_heads. Raises ValueError naming the model, its head counts and the
    tensor-parallel sizes that fit (before SGLang loads weights and fails an assertion deep in a layer).
    """
    for name, hf_config in hf_configs.items():
        heads = int(hf_config.num_attention_heads)
        kv_heads = int(getattr(hf_config, "num_key_value_heads", None) or heads)
        if heads % tp_size == 0 and (kv_heads % tp_size == 0 or tp_size % kv_heads == 0):
            continue
        fits = [n for n in range(1, heads + 1) if heads % n == 0 and (kv_heads % n == 0 or n % kv_heads == 0)]
        raise ValueError(
            f"--tp-size {tp_size}: the {name}'s {heads} attention heads ({kv_heads} KV heads) do not split "
            f"over {tp_size} ranks; tensor-parallel sizes that fit: {fits}"
        )


def _check_parallelism(cfg: Any) -> None:
    """Tensor parallel (`--tp-size`, rank 0 plans: `rank_sync`) and data parallel (`--dp-size`, one worker per
    replica) are served; pipeline parallel and DP attention are not. Any `--page-size` is served: with pages
    of several tokens a tree commit copies the accepted path's KV instead of permuting slot ids (`commit`)."""
    pp_size = cfg.pp_size
    if pp_size is not None and int(pp_size) != 1:
        raise ValueError(
            f"{ALGORITHM} supports --pp-size 1 only, got {pp_size}: a decode step drafts from the target's "
            "hidden states of the drafter's layers and verifies with the last layer's logits in one pass, "
            "while pipeline stages hold disjoint layers (SGLang's DFlash has the same limit). Use --tp-size"
        )
    attn_dp_size = cfg.attn_dp_size
    if attn_dp_size is not None and int(attn_dp_size) != 1:
        raise ValueError(
            f"{ALGORITHM} does not support DP attention (--attn-dp-size {attn_dp_size}): its ranks verify "
            "one batch in lockstep. Use --dp-size for independent replicas"
        )


def _check_device_and_backend(cfg: Any) -> None:
    """The resolved backends: CPU torch_native only; CUDA a backend that reads a per-request custom mask;
    no other device. `choose_attention_backend` has refused a named one already; this catches a backend
    SGLang resolved differently after BASTION's choice."""
    device = str(cfg.device or "")
    supported = supported_attention_backends(device)
    if not supported:
        raise ValueError(f"{ALGORITHM} runs on --device cuda or cpu, got {device or 'none'}")
    if cfg.attention_backend is None:
        raise ValueError(f"{ALGORITHM} on {device} needs --attention-backend, one of: {', '.join(supported)}")
    for field, flag in ATTENTION_BACKEND_FLAGS:
        value = getattr(cfg, field)
        if value is not None and value not in supported:
            raise ValueError(unsupported_backend_message(flag, value, device))


def register_algorithm() -> None:
    """Register BASTION, its CLI flags, its attention-backend choice, its CPU and scheduler-process hooks and
    its verify graph runner class (idempotent within a process). Installs nothing: what a process needs to
    serve BASTION on the CPU comes from the hooks, once its arguments say so."""
    from sglang.srt.arg_groups.resolution_hooks import register_resolution_hook
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from sglang.srt.speculative.spec_registry import get_spec

    if get_spec(ALGORITHM) is not None:
        return

    @SpeculativeAlgorithm.register(ALGORITHM, supports_overlap=True, spec_class=BastionSpecAlgo)
    def _worker_class(server_args: Any) -> type:
        from bastion_sglang.worker import BastionWorker

        return BastionWorker

    HookRegistry.register(
        "sglang.srt.server_args.ServerArgs.add_cli_args", _add_bastion_cli_args, HookType.AFTER
    )
    HookRegistry.register(
        "sglang.srt.server_args.ServerArgs.from_cli_args", _from_cli_args_with_bastion, HookType.AROUND
    )
    HookRegistry.register(
        "sglang.srt.server_args.ServerArgs.resolve_once", _prepare_cpu_serving, HookType.BEFORE
    )
    register_resolution_hook(CHOOSE_BACKEND_STEP)(choose_attention_backend)
    HookRegistry.register(
        "sglang.srt.managers.scheduler.Scheduler.__init__", _scheduler_init_hook, HookType.BEFORE
    )
    HookRegistry.register(
        "sglang.srt.speculative.dflash_utils.validate_dflash_request", _validate_request, HookType.AROUND
    )
    HookRegistry.register(
        "sglang.srt.managers.scheduler_components.output_streamer.SchedulerOutputStreamer.stream_output",
        _flush_metrics_before_output,
        HookType.BEFORE,
    )
    HookRegistry.register(
        "sglang.srt.model_executor.model_runner.ModelRunner._decode_cuda_graph_runner_cls",
        _verify_graph_runner_class,
        HookType.AFTER,
    )
