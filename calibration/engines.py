"""Measurement back ends: the engines whose forwards `calibrate` times (`sweep.MeasurementEngine`).

- `reference`: the Transformers reference engine's own pieces (`bastion_sglang.reference`): `TargetModel`
  over a preallocated `SlotCache` (verify = a forward of the tree rows with the ancestor mask, collecting
  the drafter's feature layers as a decode step does), the DFlash drafter through `DFlashProposer`, plain
  decoding through the same model without feature capture. Attention backend = the Transformers attention
  implementation (sdpa or eager). Runs on CUDA and on the CPU.
- `sglang`: SGLang's model runner for the target (`calibration.sglang_runner`): TARGET_VERIFY forwards with
  BASTION's flat custom mask through `BastionVerifyInput`, exactly as the worker runs them (eager: no
  CUDA graph), DECODE forwards for L_AR, and the DFlash drafter of the reference engine for T_draft (see
  that module for why). Attention backend = SGLang's --attention-backend.

Each engine's models are imported only when it is opened, so importing this module needs neither
Transformers nor SGLang. Imports point one way: this module opens `sglang_runner`; both take their seeded
random inputs from `random_inputs`.
"""

from __future__ import annotations

from pathlib import Path

import torch

from bastion_sglang.calibration.identity import Engine
from bastion_sglang.calibration.random_inputs import random_context
from bastion_sglang.calibration.sweep import MeasurementEngine
from bastion_sglang.kernels.types import DraftTopK, TreeBatch, VerifyLayout

REFERENCE_BACKENDS = ("sdpa", "eager")
"""Attention implementations the reference engine runs."""


class ReferenceMeasurement:
    """The `reference` engine (module docstring). max_context, max_width: the grid's largest context and
    widest verify pass (the KV cache holds both)."""

    needs_flat_mask = False

    def __init__(
        self,
        target_path: str | Path,
        draft_path: str | Path,
        *,
        device: torch.device,
        dtype: torch.dtype,
        attention_backend: str,
        max_context: int,
        max_width: int,
    ) -> None:
        from bastion_sglang.integration.drafter_config import check_drafter_fits
        from bastion_sglang.reference import DFlashDrafter, DFlashProposer, TargetModel, load_causal_lm

        if attention_backend not in REFERENCE_BACKENDS:
            raise ValueError(
                f"--attention-backend {attention_backend!r} is not a reference-engine attention "
                f"implementation; choose one of {', '.join(REFERENCE_BACKENDS)}"
            )
        self._device = torch.device(device)
        model = load_causal_lm(
            target_path, device=self._device, dtype=dtype, attn_implementation=attention_backend
        )
        config = model.config.to_dict()
        drafter = DFlashDrafter.from_pretrained(
            draft_path, device=self._device, dtype=dtype, target_num_layers=int(config["num_hidden_layers"])
        )
        check_drafter_fits(drafter.config, config)
        self._proposer = DFlashProposer(drafter, model.get_input_embeddings(), model.get_output_embeddings())
        self._target = TargetModel(model, self._proposer.feature_layers)
        self._plain = TargetModel(model)
        self._vocab = int(config["vocab_size"])
        capacity = max_context + max_width + 1
        self._capacity = capacity
        self._cache = self._target.new_cache(capacity)
        self._committed = random_context(0, self._vocab, self._device)
        self._no_features = torch.empty(
            (0, drafter.fc.in_features), device=self._device, dtype=drafter.fc.weight.dtype
        )

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def max_batch(self) -> int:
        """1: the reference engine's slot cache holds one request."""
        return 1

    @property
    def draft_vocab_size(self) -> None:
        """None: the reference drafter scores the whole vocabulary."""
        return None

    def vocab_size(self) -> int:
        return self._vocab

    @property
    def context(self) -> int:
        """Committed tokens in the target's KV cache."""
        return int(self._committed.shape[0]) - 1

    @torch.no_grad()
    def set_context(self, context: int, batch: int = 1, width: int | None = None) -> None:
        from bastion_sglang.reference import DraftInput

        if batch != 1:
            raise ValueError(f"the reference engine measures one request at a time, not {batch}")
        if not 1 <= context < self._capacity:
            raise ValueError(f"context {context} does not fit the KV cache of {self._capacity} tokens")
        self._committed = random_context(context, self._vocab, self._device)
        self._cache.truncate(0)
        prefill = self._target.prefill(self._cache, self._committed[:context])
        self._proposer.start(self._capacity)
        self._proposer.propose(DraftInput(self._committed, prefill.features), 1)  # ingests the context

    @torch.no_grad()
    def draft(self, k: int) -> DraftTopK:
        from bastion_sglang.reference import DraftInput

        return self._proposer.propose(DraftInput(self._committed, self._no_features), k)

    @torch.no_grad()
    def verify(self, rows: TreeBatch, layout: VerifyLayout) -> None:
        self._target.forward(self._cache, rows.tokens[0], layout.positions[0], layout.ancestor_mask[0])

    @torch.no_grad()
    def decode(self) -> None:
        context = self.context
        position = torch.tensor([context], device=self._device)
        visible = torch.ones((1, 1), dtype=torch.bool, device=self._device)
        out = self._plain.forward(self._cache, self._committed[context:], position, visible)
        torch.argmax(out.logits, dim=-1)

    def discard(self) -> None:
        self._cache.truncate(self.context)

    def close(self) -> None:
        """Nothing to release beyond what garbage collection frees."""


def open_engine(
    engine: Engine,
    *,
    target_path: str | Path,
    draft_path: str | Path,
    device: torch.device,
    dtype: torch.dtype,
    attention_backend: str,
    max_context: int,
    max_width: int,
    max_batch: int = 1,
    load_format: str = "auto",
) -> MeasurementEngine:
    """Load the models of `engine` on `device`, sized for contexts up to max_context tokens, verify
    passes up to max_width tokens and (sglang) batched passes of up to max_batch requests. load_format:
    SGLang's (`dummy`: the target's weights random, from its config.json alone); the reference engine reads
    the weights (ValueError for any other value)."""
    if engine == "reference":
        if load_format != "auto":
            raise ValueError(f"--load-format {load_format} needs --engine sglang (SGLang's loader)")
        return ReferenceMeasurement(
            target_path,
            draft_path,
            device=device,
            dtype=dtype,
            attention_backend=attention_backend,
            max_context=max_context,
            max_width=max_width,
        )
    if engine == "sglang":
        from bastion_sglang.calibration.sglang_runner import open_sglang_measurement

        return open_sglang_measurement(
            target_path,
            draft_path,
            device=device,
            dtype=dtype,
            attention_backend=attention_backend,
            max_context=max_context,
            max_width=max_width,
            max_batch=max_batch,
            load_format=load_format,
        )
    raise ValueError(f"unknown engine {engine!r}; expected 'reference' or 'sglang'")
