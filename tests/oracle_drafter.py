"""Test-only oracle drafter: makes the drafter propose the target's own non-speculative continuation.

Plugged into `bastion_sglang.worker.BastionWorker` through its documented seam,
`BastionConfig(draft_proposer="oracle_drafter:make_oracle", draft_proposer_arg=<json path>)`; the
scheduler process imports this module (tests/ is on its sys.path). The JSON file holds the reference
run: {"prompts": [[ids], ...], "outputs": [[ids], ...]}. For a request whose prompt is known, draft
position d (1..D) after the root gets BOOST added to the logit of the reference token that follows the
root at distance d, so the tree search puts the reference path first and long accepted paths happen
even with random drafter weights. Requests with unknown prompts keep the drafter's logits.

With a decoy gap g (in the JSON: "decoy_gap"), every position also boosts a wrong token by BOOST - g, so
the reference token has probability ~e^g / (1 + e^g) per position. Best-first order then interleaves
the decoys with the reference path (e.g. ref1, decoy1, ref1·ref2, ...): the accepted path is not a
prefix of the verify row, so a mask that let a node see a non-ancestor would change the target's logits.

Wrong prompts (in the JSON: "wrong_prompts") get the boost on a token that is never the reference one
(reference + 1 mod V): a confident drafter that is never accepted. Switching prompts ("switch_prompts",
"switch_period" P) are boosted right while (tokens emitted // P) is even and wrong while it is odd, so a
request moves between text the drafter predicts and text it cannot.

With a record directory (in the JSON: "record_dir", "record_prompts"), each call first saves the drafter's
own logits (before any boost) of the requests whose prompt is listed, as `load_records` reads them: what
the drafter predicted from its KV at each step, to compare between Engines.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

BOOST = 30.0
"""Logit added to the reference token: its probability is ~1 after the softmax."""


class OracleProposer:
    """A DraftLogitsRewriter that boosts the reference continuation (see the module docstring)."""

    def __init__(
        self,
        references: dict[tuple[int, ...], list[int]],
        decoy_gap: float | None,
        record_dir: Path | None = None,
        record_prompts: frozenset[tuple[int, ...]] = frozenset(),
        wrong_prompts: frozenset[tuple[int, ...]] = frozenset(),
        switch_prompts: frozenset[tuple[int, ...]] = frozenset(),
        switch_period: int = 64,
    ) -> None:
        self._references = references
        self._decoy_gap = decoy_gap
        self._wrong = wrong_prompts
        self._switch = switch_prompts
        self._switch_period = switch_period
        self._record_dir = record_dir
        self._record_prompts = record_prompts
        self._calls = itertools.count()

    def __call__(
        self, reqs: Sequence[Any], draft_logits: torch.Tensor, prefix_lens: Sequence[int]
    ) -> torch.Tensor:
        """reqs: B SGLang requests; draft_logits: [B, h, V] (h: the draft horizon); prefix_lens: [B] committed
        tokens with KV. Returns [B, h, V] boosted logits."""
        emitted_counts = [_emitted(req, prefix) for req, prefix in zip(reqs, prefix_lens, strict=True)]
        if self._record_dir is not None:
            self._record(reqs, draft_logits, emitted_counts)
        boosted = draft_logits.clone()
        depth = draft_logits.shape[1]
        for b, req in enumerate(reqs):
            prompt = tuple(req.origin_input_ids)
            reference = self._references.get(prompt)
            if reference is None:
                continue
            emitted = emitted_counts[b]  # the last emitted token is the root of this step's tree
            continuation = reference[emitted : emitted + depth]
            wrong = prompt in self._wrong or (
                prompt in self._switch and (emitted // self._switch_period) % 2 == 1
            )
            if continuation:
                index = torch.tensor(continuation, dtype=torch.int64, device=boosted.device)
                if wrong:
                    index = (index + 1) % boosted.shape[-1]
                rows = torch.arange(len(continuation), device=boosted.device)
                boosted[b, rows, index] += BOOST
                if self._decoy_gap is not None:
                    decoy = (index + 1) % boosted.shape[-1]
                    boosted[b, rows, decoy] += BOOST - self._decoy_gap
        return boosted

    def _record(self, reqs: Sequence[Any], draft_logits: torch.Tensor, emitted_counts: list[int]) -> None:
        """Save [n, D, V] raw logits of the listed requests with their (prompt, tokens emitted) keys."""
        assert self._record_dir is not None
        picked = [b for b, req in enumerate(reqs) if tuple(req.origin_input_ids) in self._record_prompts]
        if not picked:
            return
        keys = [(list(reqs[b].origin_input_ids), emitted_counts[b]) for b in picked]
        name = f"{os.getpid()}-{next(self._calls):06d}.pt"
        torch.save({"keys": keys, "logits": draft_logits[picked].float().cpu()}, self._record_dir / name)


def _emitted(req: Any, prefix_len: int) -> int:
    """Tokens the request has emitted before a step whose root sits at `prefix_len` (the root is the last
    of them); its own `output_ids` may lag one step under overlap scheduling."""
    return prefix_len - len(req.origin_input_ids) + 1


def write_references(
    path: Path,
    prompts: Sequence[Sequence[int]],
    outputs: Sequence[Sequence[int]],
    decoy_gap: float | None = None,
    record_dir: Path | None = None,
    record_prompts: Sequence[Sequence[int]] = (),
    wrong_prompts: Sequence[Sequence[int]] = (),
    switch_prompts: Sequence[Sequence[int]] = (),
    switch_period: int = 64,
) -> Path:
    """Store a reference run (prompt ids and output ids, same order), the decoy gap and where to record the
    raw drafter logits of `record_prompts` (None: no recording) for `make_oracle`."""
    data = {
        "prompts": [list(p) for p in prompts],
        "outputs": [list(o) for o in outputs],
        "decoy_gap": decoy_gap,
        "record_dir": None if record_dir is None else str(record_dir),
        "record_prompts": [list(p) for p in record_prompts],
        "wrong_prompts": [list(p) for p in wrong_prompts],
        "switch_prompts": [list(p) for p in switch_prompts],
        "switch_period": switch_period,
    }
    path.write_text(json.dumps(data))
    return path


def make_oracle(path: str) -> OracleProposer:
    """The seam's factory: read the reference run written by `write_references`."""
    data = json.loads(Path(path).read_text())
    references = {tuple(p): list(o) for p, o in zip(data["prompts"], data["outputs"], strict=True)}
    record_dir = data.get("record_dir")
    return OracleProposer(
        references,
        data["decoy_gap"],
        None if record_dir is None else Path(record_dir),
        frozenset(tuple(p) for p in data.get("record_prompts", [])),
        frozenset(tuple(p) for p in data.get("wrong_prompts", [])),
        frozenset(tuple(p) for p in data.get("switch_prompts", [])),
        int(data.get("switch_period", 64)),
    )


def load_records(record_dir: Path) -> dict[tuple[tuple[int, ...], int], torch.Tensor]:
    """The raw drafter logits saved in `record_dir`: (prompt, tokens emitted before the step) -> [D, V]."""
    records: dict[tuple[tuple[int, ...], int], torch.Tensor] = {}
    for path in sorted(record_dir.glob("*.pt")):
        saved = torch.load(path)
        for (prompt, emitted), logits in zip(saved["keys"], saved["logits"], strict=True):
            key = (tuple(prompt), int(emitted))
            assert key not in records, f"two drafter passes recorded for {key[1]} emitted tokens"
            records[key] = logits
    return records
