"""A server's start-up calibration: with no stored profile for its identity, the server measures its own
verify latency, step costs and drafter acceptance before it reports healthy, and stores the profile.

When (`needs_startup_calibration`): `--bastion-startup-calibration` is quick or full, `--bastion-profile` is
`auto`, the policy plans on the latency model (adaptive, bucketed), and the profile store holds no profile
that matches this runtime (`identity`: device, target, dtype, attention backend, tp, SGLang version and
serving settings), or, for a runtime that plans with an acceptance map (real weights, real drafts), none
measured with this drafter (its weights hash).

What (`StartupCalibration.run`), on the server's own target ModelRunner before it serves anything:
- the device's peak matmul FLOP/s and copy bandwidth (`microbench.measure_peaks`, a second or two);
- the verify grid (`sweep.measure_verify_grid`): quick: the server's planning widths (its CUDA-graph
  buckets and the cap) at three contexts (64, 256, 1024 tokens, cut to what the KV pool and context length
  hold), and batches of 4 and 16 requests at the smallest, 1 warm-up and 3 timed rounds; full: `bastion
  calibrate`'s width grid up to the cap at contexts from 64 to 8192 tokens, and batches of 2 to 64 requests,
  2 warm-up and 5 timed rounds; plain decode in every cache state. Batches are cut to what the server runs at
  once (its request pool) and its KV pool holds: a server that only ever saw batch 1 priced a batch of 8
  from the roofline's extrapolation, and on the CPU demo pair declined every step where the chain paid;
- the same latency fit and step costs as `bastion calibrate` (`sweep.measure_step_costs`);
- acceptance (`SglangMeasurement.greedy_records`): quick: 24 prompts and 32 roots each, full: 36 and 48, of
  ShareGPT's held-out split (no drafter training or default benchmark sees them; as many as the KV pool holds
  at once), the target's greedy continuation in SGLang's own forwards and the drafter's top-K at every root
  (a DFlash2 drafter's lattice, whose map the worker applies to its transitions); fitted and scored as
  `bastion calibrate` does (`acceptance_fit.fit_held_out`).
Under --tp-size N every rank measures (each forward is a collective, so all ranks run the same grid and
prompts in step; the drafter's LM head is gathered over the ranks as the draft step's is) and rank 0, whose
plans the others follow (`step.rank_sync`), stores the profile.
The profile is marked `made_by` startup-quick or startup-full and written to the store, so the next start
with the same identity reuses it. A store that cannot be written is logged as an error naming it; the server
plans with the profile all the same, and measures again at its next start.

`bastion calibrate` stays the thorough path: a wider grid, more repeats and prompts, and a plot.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import torch

from bastion_sglang.calibration.acceptance_fit import (
    AcceptanceResult,
    AcceptanceSettings,
    describe_acceptance,
    fit_held_out,
    prompt_token_ids,
)
from bastion_sglang.calibration.fitting import build_profile, now_utc
from bastion_sglang.calibration.identity import (
    RuntimeIdentity,
    driver_version,
    installed_version,
    model_config_hash,
)
from bastion_sglang.calibration.lookup import ProfileSource, ResolvedProfile, describe_choice
from bastion_sglang.calibration.microbench import measure_peaks
from bastion_sglang.calibration.profile_cli import describe_profile, leave_out_lines
from bastion_sglang.calibration.runner_measurement import SglangMeasurement
from bastion_sglang.calibration.store import ProfileStore
from bastion_sglang.calibration.sweep import (
    SweepSettings,
    context_grid,
    measure_step_costs,
    measure_verify_grid,
    width_grid,
)
from bastion_sglang.controller.latency import LatencyModel
from bastion_sglang.controller.profile import CalibrationProfile, ProfileError, ProfileMetadata, save_profile
from bastion_sglang.controller.roofline import ModelShape, RooflineModel
from bastion_sglang.integration.config import StartupMode
from bastion_sglang.integration.draft_vocab import DraftVocabChoice

if TYPE_CHECKING:
    from sglang.srt.model_executor.model_runner import ModelRunner


logger = logging.getLogger(__name__)


QUICK_CONTEXTS = (64, 256, 1024)
"""Contexts of the quick grid, tokens (cut to what the server holds)."""
QUICK_BATCHES = (1, 4, 16)
"""Requests per pass of the quick grid (cut to what the server holds)."""
FULL_BATCHES = (1, 2, 4, 8, 16, 32, 64)
"""Requests per pass of the full grid (cut to what the server holds)."""
FULL_MAX_CONTEXT = 8192
"""Largest context of the full grid, tokens (cut to what the server holds)."""
MIN_GRID_CONTEXT = 64
"""Smallest context either grid measures, tokens."""


@dataclass(frozen=True)
class StartupSettings:
    """What one start-up calibration measures: the verify grid and its timing counts, and the acceptance
    run (prompts, new tokens per prompt, held-out budgets scored)."""

    mode: Literal["quick", "full"]
    sweep: SweepSettings
    acceptance: AcceptanceSettings

    @classmethod
    def for_server(
        cls,
        mode: Literal["quick", "full"],
        planning_widths: Sequence[int],
        max_context: int,
        topk: int,
        max_batch: int = 1,
    ) -> StartupSettings:
        """The grid of `mode` (module docstring) for a server whose verify passes run at `planning_widths`
        (tokens per request, root included; the widest is the cap), that holds `max_context` cached tokens
        besides one widest pass and `max_batch` requests of the smallest context at once. ValueError when it
        holds fewer than MIN_GRID_CONTEXT."""
        if max_context < MIN_GRID_CONTEXT:
            raise ValueError(
                f"the server holds {max_context} cached tokens besides a verify pass; start-up calibration "
                f"needs at least {MIN_GRID_CONTEXT} (raise --max-total-tokens or --context-length)"
            )
        cap = max(planning_widths)
        if mode == "quick":
            widths = tuple(sorted({w for w in planning_widths if w >= 2} | {2, cap}))
            contexts = tuple(sorted({min(c, max_context) for c in QUICK_CONTEXTS}))
            batches = tuple(b for b in QUICK_BATCHES if b <= max_batch)
            sweep = SweepSettings(
                widths=widths, contexts=contexts, topk=topk, warmup=1, repeats=3, batches=batches
            )
            acceptance = AcceptanceSettings(num_prompts=24, max_new_tokens=32, topk=topk)
        else:
            sweep = SweepSettings(
                widths=width_grid(cap),
                contexts=context_grid(min(FULL_MAX_CONTEXT, max_context)),
                topk=topk,
                warmup=2,
                repeats=5,
                batches=tuple(b for b in FULL_BATCHES if b <= max_batch),
            )
            acceptance = AcceptanceSettings(num_prompts=36, max_new_tokens=48, topk=topk)
        return cls(mode, sweep, acceptance)


def needs_startup_calibration(
    mode: StartupMode, resolved: ResolvedProfile, explicit_profile: bool, plans_on_latency: bool
) -> str | None:
    """Why this server calibrates at start-up (module docstring), or None when it does not. A drafter whose
    weights cannot be hashed is never found in the store, so it does not make a server calibrate at every
    start."""
    if mode == "off" or explicit_profile or not plans_on_latency:
        return None
    if resolved.profile is None:
        return resolved.reason or "no stored profile matches this runtime"
    if measured_batch_one_only(resolved.profile):
        return f"the stored start-up profile {resolved.path} measured verify passes of one request only"
    identity = resolved.identity
    wants_acceptance = not identity.serving.marks and identity.drafter_weights_hash is not None
    if wants_acceptance and resolved.acceptance_profile is None:
        return f"no stored profile measured this drafter's acceptance ({resolved.acceptance_miss})"
    return None


def measured_batch_one_only(profile: CalibrationProfile) -> bool:
    """Whether `profile` is a start-up profile whose grid held no batch above one request (made before
    start-up calibration measured batches): a server measures again rather than price its batches by
    extrapolation."""
    made_by = profile.metadata.made_by or ""
    return made_by.startswith("startup-") and all(sample.batch == 1 for sample in profile.samples)


@dataclass(frozen=True)
class StartupCalibration:
    """A starting server's means to calibrate itself (module docstring).

    runner: the target's ModelRunner, its KV pools empty (they are emptied again afterwards). draft_path:
    the drafter's folder. tokenizer_path: the target tokenizer's folder (chat template of the prompts).
    planning_widths: the server's width buckets and its cap (tokens per request, root included). topk: K.
    verify_context: the context a verify pass of a given width and batch size runs in, the server's captured
    graph of that width on CUDA (`TargetForward.verify_graph`); None: eagerly. draft_vocab: the server's
    `--bastion-draft-vocab` (the drafter's head is timed and its acceptance recorded over it).
    """

    mode: Literal["quick", "full"]
    runner: ModelRunner
    draft_path: str
    tokenizer_path: str
    device: torch.device
    dtype: torch.dtype
    planning_widths: tuple[int, ...]
    topk: int
    verify_context: Callable[[int, int], AbstractContextManager[None]] | None = None
    draft_vocab: DraftVocabChoice = "auto"

    def settings(self) -> StartupSettings:
        """The grid and prompts for this server: contexts up to what its KV pool and context length hold
        besides two widest passes and, with pages of several tokens, two pages (SGLang's prefill asks for a
        page more than its tokens, and the verify slots round up to a page); batches up to the requests its
        request pool and KV pool hold at the smallest context with a widest pass each."""
        cap = max(self.planning_widths)
        page = self._page_size()
        pages = 2 * page if page > 1 else 0
        pool = int(self.runner.max_total_num_tokens)
        holds = min(pool - 2 * cap - 1 - pages, int(self.runner.model_config.context_len) - cap - 1)
        per_request = self._whole_pages(MIN_GRID_CONTEXT + cap + 1) + pages
        max_batch = min(int(self.runner.req_to_token_pool.size), pool // per_request)
        return StartupSettings.for_server(self.mode, self.planning_widths, holds, self.topk, max_batch)

    def run(self, identity: RuntimeIdentity, store: ProfileStore, why: str) -> ResolvedProfile:
        """Measure, fit, log and store this server's profile; the result as `resolve_latency_profile` gives
        one (source STARTUP). ProfileError or ValueError when the measurement cannot give one."""
        from bastion_sglang.integration import sglang_adapter

        sglang_adapter.require(sglang_adapter.MEASUREMENT_INTERNALS)
        settings = self.settings()
        started = time.perf_counter()
        logger.info(
            "BASTION: start-up calibration (%s) because %s: verify widths %s × contexts %s, batches %s, %d "
            "timed rounds; acceptance on %d prompts",
            self.mode,
            why,
            list(settings.sweep.widths),
            list(settings.sweep.contexts),
            list(settings.sweep.batches),
            settings.sweep.repeats,
            settings.acceptance.num_prompts,
        )
        peaks = measure_peaks(self.device, self.dtype, identity.device_name)
        measurement = SglangMeasurement(
            self.runner,
            self.draft_path,
            device=self.device,
            dtype=self.dtype,
            max_width=settings.sweep.widths[-1],
            owns_runtime=False,
            verify_context=self.verify_context,
            draft_vocab=self.draft_vocab,
        )
        try:
            shape = ModelShape.from_hf_config(self.runner.model_config.hf_config.to_dict())
            element_bytes = self.dtype.itemsize
            samples = measure_verify_grid(measurement, settings.sweep)
            fitted = LatencyModel(RooflineModel(shape, peaks.hardware_spec(), element_bytes)).fit(samples)
            steps = measure_step_costs(measurement, settings.sweep, fitted)
            acceptance = self._acceptance(measurement, settings.acceptance)
        finally:
            measurement.close()
        profile = build_profile(
            metadata=self._metadata(identity),
            shape=shape,
            hardware=peaks.hardware_spec(),
            bytes_per_element=float(element_bytes),
            samples=samples,
            step_costs=steps.costs,
            max_context=settings.sweep.contexts[-1],
        )
        if acceptance is not None:
            profile = profile.model_copy(
                update={"acceptance": acceptance.calibration, "acceptance_report": acceptance.report}
            )
        logger.info("BASTION: start-up calibration done in %.1f s", time.perf_counter() - started)
        path = store.path_for(profile)
        if _leads():
            for line in [*describe_profile(profile, path), *leave_out_lines(profile.leave_out)]:
                logger.info("BASTION: %s", line)
            stored = store_profile(profile, path)
        else:
            stored = path  # rank 0 stores it there
        miss = identity.acceptance_mismatch(profile)
        resolved = ResolvedProfile(
            profile,
            ProfileSource.STARTUP,
            stored,
            identity,
            (),
            acceptance_profile=profile if miss is None else None,
            acceptance_path=stored if miss is None else None,
            acceptance_miss=miss,
        )
        return replace(resolved, reason=describe_choice(resolved))

    def _metadata(self, identity: RuntimeIdentity) -> ProfileMetadata:
        model_path = identity.model_path or str(self.runner.model_config.model_path)
        return ProfileMetadata(
            device_name=identity.device_name,
            driver_version=driver_version(self.device),
            cuda_version=torch.version.cuda if self.device.type == "cuda" else None,
            sglang_version=installed_version("sglang"),
            engine="sglang",
            model_path=model_path,
            model_config_hash=identity.model_config_hash,
            dtype=identity.dtype,
            attention_backend=identity.attention_backend,
            tp_size=identity.tp_size,
            created_at=now_utc(),
            made_by=f"startup-{self.mode}",
            settings=identity.serving,
            draft_model_path=self.draft_path,
            drafter_weights_hash=identity.drafter_weights_hash,
        )

    def _acceptance(
        self, measurement: SglangMeasurement, settings: AcceptanceSettings
    ) -> AcceptanceResult | None:
        """The drafter's acceptance calibration (top-K or, for a DFlash2 drafter, lattice records) from
        greedy continuations in the server's own forwards, or None (with a warning saying why: no prompts,
        no tokenizer, too few events to fit)."""
        try:
            prompts = self._prompts_that_fit(
                prompt_token_ids(self.tokenizer_path, settings), settings.max_new_tokens + measurement.depth
            )
            eos_ids = set(self.runner.model_config.hf_eos_token_id or ())
            per_prompt = measurement.greedy_records(prompts, settings.max_new_tokens, settings.topk, eos_ids)
            result = fit_held_out(per_prompt, model_config_hash(self.draft_path), settings.report_budgets)
        except (ValueError, OSError) as error:
            logger.warning(
                "BASTION: the start-up calibration has no acceptance map (planning with the raw drafter "
                "probabilities, corrected online): %s",
                error,
            )
            return None
        for line in describe_acceptance(result.report):
            logger.info("BASTION: %s", line)
        return result

    def _page_size(self) -> int:
        return int(self.runner.token_to_kv_pool_allocator.page_size)

    def _whole_pages(self, tokens: int) -> int:
        """`tokens` rounded up to whole KV pages, tokens."""
        page = self._page_size()
        return -(-tokens // page) * page

    def _prompts_that_fit(self, prompts: list[list[int]], extra: int) -> list[list[int]]:
        """The first prompts whose tokens and continuations the KV pool holds at once: each prompt takes its
        length plus `extra` tokens (new tokens plus the drafter's depth), rounded up to whole pages, plus a
        page for SGLang's prefill estimate when pages hold several tokens. ValueError when fewer than three
        fit (a third is held out of the fit)."""
        page = self._page_size()
        room = int(self.runner.max_total_num_tokens)
        chosen: list[list[int]] = []
        for ids in prompts:
            room -= self._whole_pages(len(ids) + extra) + (page if page > 1 else 0)
            if room < 0:
                break
            chosen.append(ids)
        if len(chosen) < 3:
            raise ValueError(
                f"the KV pool ({self.runner.max_total_num_tokens} tokens) holds {len(chosen)} calibration "
                "prompts at once; at least 3 are needed"
            )
        return chosen


def _leads() -> bool:
    """Whether this scheduler stores what it measured: rank 0 of its TP group, or the only rank."""
    from bastion_sglang.step.rank_sync import RankSync, scheduler_group

    return RankSync(scheduler_group()).leads


def store_profile(profile: CalibrationProfile, path: Path) -> Path | None:
    """Write a start-up profile to `path` of the store; the path, or None with an error logged that names
    the file and says the server plans with the profile anyway and calibrates again at its next start."""
    try:
        save_profile(profile, path)
    except ProfileError as error:
        logger.error(
            "BASTION: the start-up calibration could not be stored (%s); planning with it now, and this "
            "server will calibrate again at its next start",
            error,
        )
        return None
    logger.info("BASTION: stored the start-up calibration as %s", path)
    return path
