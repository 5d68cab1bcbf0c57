"""DFlash2 selector training: a trained DFlash drafter's backbone, frozen, gains SGLang's candidate selector.

Terms (`reference.selector` defines the selector). A training block is the DFlash block of an anchor a
(`train.make_blocks`): slot e = 0..D-1 predicts the target's token t_{a+1+e}. Its lattice row for slot e is
the one after the true predecessor (t_a, the anchor, for slot 0; t_{a+e} after it): scores
unary + <A[pred] ⊙ P h_e, B[candidate]> over slot e's K candidates. A row is *reachable* when every slot
up to e has its true token among its K candidates: only then can a tree of the lattice hold the target's
path to slot e, and only then does the row's distribution decide an accepted token.

Data. The backbone is frozen, so its part of every block is computed once (`draft_blocks`): the final hidden
states of the D slots (`train.drafter_forward`, the reference drafter's math), the LM head's top-K per slot
(`candidate_topk`), their unary logits and the true tokens. Training reads the reachable rows only
(`SelectorRows`).

Loss: cross-entropy of the true candidate under log_softmax(scores) of its reachable row (teacher forcing:
the walk on the target's path), weighted by exp(-e/γ) for slot e as DFlash weighs its positions.
Optimiser: AdamW over the selector's three tensors, linear warmup then cosine decay to zero
(`loop.learning_rate`). Start: `CandidateSelector.reset_for_training`, whose lattice is the unary logits'
independent positions, so the untrained DFlash2 chain is the DFlash chain of its backbone.

Measure (`lattice_acceptance`): on blocks at a stride over held-out responses, the accepted length of
DFlash2's greedy walk (`controller.lattice_tree.lattice_chain`'s rule) and, on the same blocks, of the
backbone's own DFlash chain (the top-1 candidate of every slot), both against the target's greedy tokens.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from tqdm import tqdm

from bastion_sglang.controller.lattice_tree import selector_logprobs
from bastion_sglang.integration.drafter_config import DrafterConfig, SelectorConfig
from bastion_sglang.reference.drafter import DFlashDrafter
from bastion_sglang.reference.selector import CandidateSelector, candidate_topk, transform_unary_logits
from bastion_sglang.training.data import TrainingSequence
from bastion_sglang.training.loop import LogPoint, learning_rate, run_steps
from bastion_sglang.training.train import (
    DEFAULT_LOSS_DECAY,
    STATE_JSON_NAME,
    STATE_TENSORS_NAME,
    AcceptanceReport,
    FrozenTarget,
    InitialDrafter,
    drafter_forward,
    make_blocks,
    sample_anchors,
)

logger = logging.getLogger(__name__)

ROWS_NAME = "selector-rows.pt"
"""The training rows cached in a run's state folder (the backbone's part of every block, computed once)."""


class SelectorTrainConfig(BaseModel):
    """Hyper-parameters of a selector run; a resumed run must use the same values."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    init_from_drafter: str = Field(description="the trained DFlash drafter whose backbone stays frozen")
    rank: int = Field(default=32, gt=0, description="r: columns of the [vocab, r] codebooks")
    top_k: int = Field(default=8, gt=0, description="K: candidates per slot")
    steps: int = Field(gt=0)
    batch_rows: int = Field(default=4096, gt=0, description="reachable lattice rows per optimiser step")
    anchors_per_sequence: int = Field(default=64, gt=0, description="blocks drawn from each sequence")
    loss_decay: float = Field(default=DEFAULT_LOSS_DECAY, gt=0, description="γ of the slot weights exp(-e/γ)")
    lr: float = Field(default=1e-3, gt=0)
    warmup_steps: int = Field(default=20, ge=0)
    weight_decay: float = Field(default=0.0, ge=0)
    init_std: float = Field(default=0.02, gt=0, description="std of the random predecessor codebook and P")
    seed: int = 0
    precision: Literal["fp32"] = Field(default="fp32", description="the backbone pass and the selector, fp32")

    def selector(self) -> SelectorConfig:
        """The selector this run trains (no multiplier, no softcap: the backbone's logits as they are)."""
        return SelectorConfig(rank=self.rank, top_k=self.top_k)


@dataclass(frozen=True)
class DraftBlocks:
    """The frozen backbone's part of n blocks of D slots (module docstring)."""

    hidden: torch.Tensor  # [n, D, h] float32: final hidden state of each slot
    candidates: torch.Tensor  # [n, D, K] int64: the LM head's top-K per slot, largest first
    unary: torch.Tensor  # [n, D, K] float32: their unary logits
    anchors: torch.Tensor  # [n] int64: each block's anchor token
    labels: torch.Tensor  # [n, D] int64: the target's token of each slot, -100 past a response's end
    sources: tuple[str, ...]  # [n] the prompt set of each block's sequence

    @property
    def count(self) -> int:
        return int(self.hidden.shape[0])

    def true_candidates(self) -> torch.Tensor:
        """[n, D] int64: the index of each slot's true token among its candidates, -1 where it is not one."""
        hits = self.candidates == self.labels[..., None]  # [n, D, K]
        return torch.where(hits.any(-1), hits.float().argmax(-1), torch.full_like(self.labels, -1))


@dataclass(frozen=True)
class SelectorRows:
    """The reachable rows of training blocks (module docstring), one per (block, slot)."""

    hidden: torch.Tensor  # [M, h] float32
    candidates: torch.Tensor  # [M, K] int64
    unary: torch.Tensor  # [M, K] float32
    predecessors: torch.Tensor  # [M] int64: the true token before the slot (the anchor for slot 0)
    targets: torch.Tensor  # [M] int64: index of the true token among the candidates
    slots: torch.Tensor  # [M] int64: e

    @property
    def count(self) -> int:
        return int(self.targets.shape[0])

    @classmethod
    def of(cls, blocks: DraftBlocks) -> SelectorRows:
        truth = blocks.true_candidates()  # [n, D]
        reachable = torch.cumprod((truth >= 0).long(), dim=1).bool()  # [n, D]
        predecessors = torch.cat([blocks.anchors[:, None], blocks.labels[:, :-1]], dim=1)  # [n, D]
        slots = torch.arange(truth.shape[1]).expand_as(truth)
        return cls(
            hidden=blocks.hidden[reachable],
            candidates=blocks.candidates[reachable],
            unary=blocks.unary[reachable],
            predecessors=predecessors[reachable],
            targets=truth[reachable],
            slots=slots[reachable],
        )

    @classmethod
    def cat(cls, parts: Sequence[SelectorRows]) -> SelectorRows:
        """The rows of every part, in order."""
        return cls(**{f.name: torch.cat([getattr(p, f.name) for p in parts]) for f in fields(cls)})

    def take(self, index: torch.Tensor) -> SelectorRows:
        """The rows at index [m] int64."""
        return SelectorRows(**{f.name: getattr(self, f.name)[index] for f in fields(self)})

    def tensors(self) -> dict[str, torch.Tensor]:
        """The fields by name (what the rows cache stores)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


@torch.no_grad()
def draft_blocks(
    backbone: DFlashDrafter,
    frozen: FrozenTarget,
    sequences: Sequence[TrainingSequence],
    anchors: Sequence[Sequence[int]],
    selector: SelectorConfig,
    *,
    batch_sequences: int = 4,
) -> DraftBlocks:
    """The backbone's part of the blocks at `anchors` (one list per sequence), `batch_sequences` sequences
    per forward. Blocks of sequences without anchors are absent."""
    config = backbone.config
    parts: list[DraftBlocks] = []
    for start in range(0, len(sequences), batch_sequences):
        group = [i for i in range(start, min(start + batch_sequences, len(sequences))) if anchors[i]]
        if not group:
            continue
        batch = make_blocks(
            [sequences[i] for i in group],
            [list(anchors[i]) for i in group],
            config.block_size,
            config.mask_token_id,
        ).to(frozen.lm_head.device)
        hidden = drafter_forward(backbone, frozen.embed, batch).float()  # [S, n·B, h]
        sequences_in, count, slots = batch.labels.shape
        hidden = hidden.view(sequences_in, count, slots + 1, -1)[:, :, 1:]  # [S, n, D, h]
        real = torch.tensor([[j < len(anchors[i]) for j in range(count)] for i in group])  # [S, n]
        hidden = hidden[real]  # [m, D, h]
        found = candidate_topk(hidden.reshape(-1, hidden.shape[-1]), frozen.lm_head, selector.top_k)
        block_ids = batch.noise_ids.view(sequences_in, count, slots + 1)[:, :, 0]
        parts.append(
            DraftBlocks(
                hidden=hidden.cpu(),
                candidates=found.ids.view(*hidden.shape[:2], -1).cpu(),
                unary=transform_unary_logits(found.raw, selector).view(*hidden.shape[:2], -1).cpu(),
                anchors=block_ids[real].cpu(),
                labels=batch.labels[real].cpu(),
                sources=tuple(
                    sequences[i].source
                    for i, row in zip(group, real, strict=True)
                    for _ in range(int(row.sum()))
                ),
            )
        )
    if not parts:
        raise ValueError("no sequence has an anchor with a block after it")
    tensors = ("hidden", "candidates", "unary", "anchors", "labels")
    return DraftBlocks(
        *(torch.cat([getattr(p, name) for p in parts]) for name in tensors),
        sources=tuple(source for p in parts for source in p.sources),
    )


def lattice_scores(selector: CandidateSelector, blocks: DraftBlocks, chunk: int = 256) -> torch.Tensor:
    """[n, D, K, K] raw selector scores of every block, `chunk` blocks at a time."""
    out = []
    for start in range(0, blocks.count, chunk):
        part = slice(start, start + chunk)
        out.append(
            selector.build_lattice(
                candidate_ids=blocks.candidates[part],
                unary_logits=blocks.unary[part],
                hidden_states=blocks.hidden[part],
                anchor_token_ids=blocks.anchors[part],
            )
        )
    return torch.cat(out)


@dataclass(frozen=True)
class LatticeAcceptance:
    """Held-out chain acceptance of a DFlash2 drafter and of its backbone's DFlash chain, same blocks."""

    dflash2: AcceptanceReport
    dflash: AcceptanceReport


@torch.no_grad()
def lattice_acceptance(selector: CandidateSelector, blocks: DraftBlocks) -> LatticeAcceptance:
    """The two chains' accepted lengths over `blocks` (module docstring, "Measure")."""
    logprobs = selector_logprobs(lattice_scores(selector, blocks))  # [n, D, K, K]
    index = logprobs[:, 0, 0].argmax(-1)  # [n]: slot 0 follows the anchor (row 0)
    walk = [index]
    for slot in range(1, logprobs.shape[1]):
        row = logprobs[torch.arange(blocks.count), slot, index]  # [n, K]: the row after the walk's candidate
        index = row.argmax(-1)
        walk.append(index)
    tokens = blocks.candidates.gather(-1, torch.stack(walk, dim=1)[..., None])[..., 0]  # [n, D]
    return LatticeAcceptance(
        dflash2=_report(tokens, blocks), dflash=_report(blocks.candidates[:, :, 0], blocks)
    )


def _report(tokens: torch.Tensor, blocks: DraftBlocks) -> AcceptanceReport:
    """AcceptanceReport of chains tokens [n, D] against the blocks' labels: 1 + leading matches per block."""
    runs = torch.cumprod((tokens == blocks.labels).long(), dim=-1).sum(-1).tolist()
    histogram = [0] * (blocks.labels.shape[1] + 1)
    by_source: dict[str, list[int]] = {}
    for run, source in zip(runs, blocks.sources, strict=True):
        histogram[run] += 1
        by_source.setdefault(source, []).append(run)
    return AcceptanceReport(
        mean=1.0 + sum(runs) / len(runs),
        blocks=len(runs),
        histogram=histogram,
        by_source={s: 1.0 + sum(r) / len(r) for s, r in sorted(by_source.items())},
    )


def stride_anchors(sequences: Sequence[TrainingSequence], block_size: int, stride: int) -> list[list[int]]:
    """The measured anchors of each sequence: P, P + stride, ... with a full block left (as
    `train.chain_acceptance` takes them)."""
    return [list(range(s.prompt_length, int(s.tokens.shape[0]) - block_size + 1, stride)) for s in sequences]


def training_rows(
    backbone: DFlashDrafter,
    frozen: FrozenTarget,
    sequences: Sequence[TrainingSequence],
    config: SelectorTrainConfig,
) -> SelectorRows:
    """The reachable rows of `anchors_per_sequence` random blocks per sequence (seeded by config.seed)."""
    generator = torch.Generator().manual_seed(config.seed * 1_000_003 + 7)
    anchors = sample_anchors(list(sequences), config.anchors_per_sequence, generator)
    parts = []
    chunk = 32  # sequences per part: the dense hidden states of a part stay small
    for start in tqdm(range(0, len(sequences), chunk), desc="backbone", unit="part"):
        blocks = draft_blocks(
            backbone,
            frozen,
            sequences[start : start + chunk],
            anchors[start : start + chunk],
            config.selector(),
        )
        parts.append(SelectorRows.of(blocks))
    return SelectorRows.cat(parts)


@dataclass(frozen=True)
class RowLoss:
    """loss: the weighted cross-entropy (scalar, differentiable); first_correct / first_total: rows of slot 0
    whose highest score is the true candidate, and the rows of slot 0."""

    loss: torch.Tensor
    first_correct: int
    first_total: int


def row_loss(selector: CandidateSelector, rows: SelectorRows, weights: torch.Tensor) -> RowLoss:
    """Σ w_e · CE(true candidate) / Σ w_e over the rows (module docstring); weights [D] by slot."""
    hidden = selector.hidden_projection(rows.hidden)  # [M, r]
    keys = selector.successor_codebook[rows.candidates]  # [M, K, r]
    query = selector.predecessor_codebook[rows.predecessors] * hidden  # [M, r]
    scores = rows.unary + torch.einsum("mr,mkr->mk", query, keys)  # [M, K]: score_edges on the true row
    weight = weights[rows.slots]
    loss = (weight * F.cross_entropy(scores, rows.targets, reduction="none")).sum() / weight.sum()
    first = rows.slots == 0
    # host syncs: two counts per step, for the progress log
    correct = int((scores[first].argmax(-1) == rows.targets[first]).sum())
    return RowLoss(loss, correct, int(first.sum()))


class SelectorTrainingState(BaseModel):
    """state.json beside state.pt of a selector run: where it is, for resuming and for the model card."""

    model_config = ConfigDict(extra="forbid")

    format_version: Literal[1] = 1
    config: SelectorTrainConfig
    drafter_config: DrafterConfig
    step: int = Field(ge=0, description="optimiser steps done")
    seconds: float = Field(ge=0, description="training wall time (backbone pass included), summed")
    rows: int = Field(ge=0, description="reachable training rows")
    history: list[LogPoint] = Field(default_factory=list)
    initialised_from: InitialDrafter | None = Field(default=None, description="the frozen backbone's drafter")


class SelectorTrainer:
    """Trains the selector of `drafter_config` on top of `backbone` (frozen), resumable from `state_dir`."""

    def __init__(
        self,
        backbone: DFlashDrafter,
        drafter_config: DrafterConfig,
        config: SelectorTrainConfig,
        frozen: FrozenTarget,
        sequences: Sequence[TrainingSequence],
        state_dir: Path,
        initialised_from: InitialDrafter | None = None,
    ) -> None:
        selector = drafter_config.selector
        if selector is None or selector != config.selector():
            raise ValueError(f"drafter_config's selector {selector!r} is not the run's {config.selector()!r}")
        if backbone.candidate_selector is not None:
            raise ValueError("the backbone must be a DFlash drafter (it has a selector already)")
        self.config = config
        self.backbone = backbone.float().eval().requires_grad_(False)
        self.frozen = frozen
        self.sequences = sequences
        self.state_dir = state_dir
        self.weights = torch.exp(
            -torch.arange(drafter_config.block_size - 1, dtype=torch.float32) / config.loss_decay
        )
        self.selector = CandidateSelector(
            hidden_size=drafter_config.hidden_size,
            vocab_size=drafter_config.vocab_size,
            rank=config.rank,
            top_k=config.top_k,
        )
        self.selector.reset_for_training(torch.Generator().manual_seed(config.seed), config.init_std)
        self.optimizer = torch.optim.AdamW(
            self.selector.parameters(), lr=config.lr, betas=(0.9, 0.95), weight_decay=config.weight_decay
        )
        self.state = SelectorTrainingState(
            config=config,
            drafter_config=drafter_config,
            step=0,
            seconds=0.0,
            rows=0,
            initialised_from=initialised_from,
        )
        self._rows: SelectorRows | None = None

    def drafter(self) -> DFlashDrafter:
        """The DFlash2 drafter: the backbone's weights and the selector's (a new module, float32)."""
        drafter = DFlashDrafter(self.state.drafter_config)
        state = {**self.backbone.state_dict()}
        state |= {f"candidate_selector.{name}": t for name, t in self.selector.state_dict().items()}
        drafter.load_state_dict(state)
        return drafter.eval()

    def rows(self) -> SelectorRows:
        """The training rows, from the state folder's cache or computed (and cached) once."""
        if self._rows is None:
            cache = self.state_dir / ROWS_NAME
            if cache.is_file():
                self._rows = SelectorRows(**torch.load(cache, weights_only=True))
            else:
                began = time.perf_counter()
                self._rows = training_rows(self.backbone, self.frozen, self.sequences, self.config)
                self.state.seconds += time.perf_counter() - began
                self.state_dir.mkdir(parents=True, exist_ok=True)
                torch.save(self._rows.tensors(), cache)
            self.state.rows = self._rows.count
            if self._rows.count == 0:
                raise ValueError("no reachable row: the backbone never ranks the target's token in its top-K")
        return self._rows

    def resume(self) -> None:
        """Load state.json and state.pt; ValueError naming a setting that differs."""
        json_path = self.state_dir / STATE_JSON_NAME
        try:
            stored = SelectorTrainingState.model_validate_json(json_path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ValueError(f"{json_path}: no training state to resume; run without --resume") from None
        except ValidationError as error:
            raise ValueError(f"{json_path}: not a selector training state: {error}") from None
        if stored.config != self.config or stored.drafter_config != self.state.drafter_config:
            raise ValueError(
                f"{json_path}: the stored run has other settings ({stored.config!r}); resume with the same "
                "options or start a new run without --resume"
            )
        tensors = torch.load(self.state_dir / STATE_TENSORS_NAME, weights_only=True)
        self.selector.load_state_dict(tensors["selector"])
        self.optimizer.load_state_dict(tensors["optimizer"])
        self.state = stored

    def save(self) -> None:
        """Write state.pt then state.json, each through a temporary file and a rename."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.state_dir / (STATE_TENSORS_NAME + ".tmp")
        torch.save({"selector": self.selector.state_dict(), "optimizer": self.optimizer.state_dict()}, tmp)
        tmp.replace(self.state_dir / STATE_TENSORS_NAME)
        tmp_json = self.state_dir / (STATE_JSON_NAME + ".tmp")
        tmp_json.write_text(self.state.model_dump_json(indent=1) + "\n", encoding="utf-8")
        tmp_json.replace(self.state_dir / STATE_JSON_NAME)

    def train_step(self, step: int) -> RowLoss:
        """One optimiser step on `batch_rows` rows drawn (seeded by step) from the training rows."""
        rows = self.rows()
        generator = torch.Generator().manual_seed(self.config.seed * 1_000_003 + step + 1)
        batch = rows.take(torch.randint(0, rows.count, (self.config.batch_rows,), generator=generator))
        for group in self.optimizer.param_groups:
            group["lr"] = learning_rate(self.config, step)
        result = row_loss(self.selector, batch, self.weights)
        self.optimizer.zero_grad(set_to_none=True)
        result.loss.backward()
        self.optimizer.step()
        return result

    def run(
        self,
        *,
        checkpoint_seconds: float,
        log_every: int = 25,
        on_checkpoint: Callable[[SelectorTrainer], None] | None = None,
    ) -> SelectorTrainingState:
        """Train to config.steps; checkpoint every checkpoint_seconds and at the end, on_checkpoint first.

        SIGTERM or SIGINT ends the run after the current step, with a checkpoint (`loop.run_steps`).
        """
        self.rows()
        run_steps(
            self,
            activity="train-selector",
            checkpoint_seconds=checkpoint_seconds,
            log_every=log_every,
            on_checkpoint=on_checkpoint,
        )
        return self.state
