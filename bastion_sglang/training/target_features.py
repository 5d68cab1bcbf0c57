"""The target's features of token-id sequences, computed when training needs them.

Committed training data holds token ids only (`training.token_data`); the drafter reads the outputs of
the target's layers `target_layer_ids` at every position. `TargetFeatures` runs the target's decoder (HF,
float32) on a batch of sequences, truncated after the deepest read layer (the layers above it, the final
norm and the LM head are never run), and records the read layers' outputs with forward hooks: the
`hidden_states[l + 1]` of a full forward, as `data.generate_with_features` captures them. With
`teacher=True` (`train.TrainConfig.distill`) it runs every layer and the final norm as well and keeps that
last hidden state of every position, from which the loss computes the target's next-token distributions.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from bastion_sglang.training.data import TrainingSequence
from bastion_sglang.training.token_data import TokenSequence


def training_sequence(sequence: TokenSequence) -> TrainingSequence:
    """A TrainingSequence of the token sequence (prompt then response) whose features are still empty
    ([0, 0]); `TargetFeatures.fill` computes them."""
    tokens = torch.from_numpy(np.concatenate([sequence.prompt, sequence.response]))
    return TrainingSequence(
        key=sequence.key,
        tokens=tokens.long(),
        features=torch.empty(0, 0, dtype=torch.bfloat16),
        prompt_length=len(sequence.prompt),
    )


class TargetFeatures:
    """Computes [T, F·h] bf16 features of sequences with the target's first max(layer_ids) + 1 layers, or
    with every layer and the final norm when `teacher` (then also the [T, h] float32 last hidden states)."""

    def __init__(
        self, target: Path, layer_ids: Sequence[int], device: torch.device, teacher: bool = False
    ) -> None:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
        layers = model.model.layers
        bad = [i for i in layer_ids if not 0 <= i < len(layers)]
        if bad:
            raise ValueError(f"target_layer_ids {bad} outside 0..{len(layers) - 1} of {target}'s layers")
        if not teacher:
            model.model.layers = layers[: max(layer_ids) + 1]
        self.decoder = model.model.to(device).eval()
        self.layer_ids = tuple(layer_ids)
        self.device = device
        self.teacher = teacher

    @torch.no_grad()
    def compute(self, token_rows: Sequence[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """(features, last hidden) of each token row ([T_i] int64): features [T_i, F·h] bfloat16 in
        layer_ids order; last hidden [T_i, h] float32 after the final norm when `teacher`, else None.

        The rows run as one right-padded batch; a row's outputs depend on its own tokens only (causal
        attention, padding masked out).
        """
        captured: dict[int, torch.Tensor] = {}

        def hook(index: int):
            def record(_module: torch.nn.Module, _inputs: object, output: object) -> None:
                captured[index] = (output[0] if isinstance(output, tuple) else output).detach()

            return record

        width = max(int(row.shape[0]) for row in token_rows)
        ids = torch.zeros((len(token_rows), width), dtype=torch.long)
        mask = torch.zeros((len(token_rows), width), dtype=torch.long)
        for i, row in enumerate(token_rows):
            ids[i, : row.shape[0]] = row
            mask[i, : row.shape[0]] = 1
        handles = [self.decoder.layers[i].register_forward_hook(hook(i)) for i in self.layer_ids]
        try:
            output = self.decoder(
                input_ids=ids.to(self.device), attention_mask=mask.to(self.device), use_cache=False
            )
        finally:
            for handle in handles:
                handle.remove()
        stacked = torch.cat([captured[i] for i in self.layer_ids], dim=-1).to(torch.bfloat16).cpu()
        last = output.last_hidden_state.float().cpu() if self.teacher else None
        return [
            (stacked[i, : row.shape[0]], None if last is None else last[i, : row.shape[0]])
            for i, row in enumerate(token_rows)
        ]

    def fill(self, sequences: Sequence[TrainingSequence]) -> list[TrainingSequence]:
        """The sequences with their features (and, when `teacher`, last hidden states) computed; those that
        already have them are kept as they are."""
        todo = [
            i
            for i, s in enumerate(sequences)
            if s.features.numel() == 0 or (self.teacher and s.teacher_hidden is None)
        ]
        result = list(sequences)
        if todo:
            outputs = self.compute([sequences[i].tokens for i in todo])
            for i, (features, last) in zip(todo, outputs, strict=True):
                result[i] = dataclasses.replace(sequences[i], features=features, teacher_hidden=last)
        return result
