"""`kernels.apply_tree_penalties` against SGLang's own penalizers rerun on every root-to-node path.

For each node of random trees (small vocabulary, so paths repeat tokens and repeat the output's tokens),
a fresh `BatchedPenalizerOrchestrator` over that request alone cumulates the request's output and then the
node's path one token at a time, as SGLang's scheduler does one decode step at a time; its additive and
scaling penalties are applied to the node's raw logits as `SamplingBatchInfo` applies them. The kernel's
row must be bit-identical.
"""

from __future__ import annotations

import pytest
import torch
from sglang.srt.sampling import penaltylib
from sglang_penalties import FakeReq, make_req, sglang_row

from bastion_sglang import kernels
from bastion_sglang.kernels import reference
from bastion_sglang.kernels.penalties import OutputPenalties, Penalty, apply_tree_penalties
from bastion_sglang.step.request_penalties import (
    min_new_tokens_stop_ids,
    output_penalties,
    sglang_penalty_order,
)

VOCAB = 12


def random_tree(generator: torch.Generator, batch: int, width: int) -> kernels.TreeBatch:
    parents = torch.full((batch, width), kernels.NO_NODE, dtype=torch.int64)
    depths = torch.zeros((batch, width), dtype=torch.int64)
    for b in range(batch):
        for j in range(1, width):
            parents[b, j] = int(torch.randint(0, j, (), generator=generator))
            depths[b, j] = depths[b, parents[b, j]] + 1
    tokens = torch.randint(0, VOCAB, (batch, width), generator=generator)
    return kernels.TreeBatch(tokens=tokens, parents=parents, depths=depths)


def path_tokens(trees: kernels.TreeBatch, b: int, j: int) -> list[int]:
    """Tokens from depth 1 to node j (the root excluded)."""
    path = []
    while j > 0:
        path.append(int(trees.tokens[b, j]))
        j = int(trees.parents[b, j])
    return path[::-1]


def batch_reqs(trees: kernels.TreeBatch) -> list[FakeReq]:
    """Requests mixing every penalty; each output ends with its verify root."""
    roots = [int(t) for t in trees.tokens[:, 0]]
    return [
        make_req(VOCAB, [3, 5, 3, roots[0]], frequency=0.7),
        make_req(VOCAB, [1, roots[1]], presence=0.9, eos={2}),
        make_req(VOCAB, [4, 4, 7, roots[2]], repetition=1.3),
        make_req(VOCAB, [roots[3]], min_new=3, stop_ids={6}, eos={2}, tokenizer_eos=0),
        make_req(
            VOCAB, [2, 9, 9, 1, roots[4]], frequency=0.3, presence=0.4, repetition=0.8, min_new=7, eos={5}
        ),
        make_req(VOCAB, [8, roots[5]]),
    ]


PENALIZER_OF = {
    Penalty.FREQUENCY: penaltylib.BatchedFrequencyPenalizer,
    Penalty.MIN_NEW_TOKENS: penaltylib.BatchedMinNewTokensPenalizer,
    Penalty.PRESENCE: penaltylib.BatchedPresencePenalizer,
    Penalty.REPETITION: penaltylib.BatchedRepetitionPenalizer,
}
ORDERS = [
    sglang_penalty_order(),
    (Penalty.REPETITION, Penalty.FREQUENCY, Penalty.PRESENCE, Penalty.MIN_NEW_TOKENS),
    (Penalty.PRESENCE, Penalty.MIN_NEW_TOKENS, Penalty.REPETITION, Penalty.FREQUENCY),
]
"""SGLang's order in this process, and two others (the order changes the result where repetition and an
additive penalty meet)."""


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("seed", range(4))
def test_tree_penalties_equal_a_rerun_per_path(seed: int, order: tuple[Penalty, ...]) -> None:
    generator = torch.Generator().manual_seed(seed)
    width = 9
    trees = random_tree(generator, 6, width)
    reqs = batch_reqs(trees)
    raw = torch.randn((6, width, VOCAB), generator=generator) * 3
    penalties = output_penalties(reqs, [req.output_ids for req in reqs], VOCAB, torch.device("cpu"))
    logits = raw.clone()
    apply_tree_penalties(logits, trees.tokens, reference.ancestor_mask(trees.parents), penalties, order)
    penalizers = [PENALIZER_OF[penalty] for penalty in order]
    for b, req in enumerate(reqs):
        for j in range(width):
            want = sglang_row(req, path_tokens(trees, b, j), raw[b, j], penalizers)
            assert torch.equal(logits[b, j], want), (b, j, logits[b, j], want)


def test_min_new_tokens_bans_stop_ids_only_below_the_minimum() -> None:
    # a chain of depth 3 after 2 output tokens; min_new_tokens 4: nodes at depth 0, 1 predict tokens 3, 4
    trees = kernels.TreeBatch(
        tokens=torch.tensor([[1, 3, 4, 7]]),
        parents=torch.tensor([[kernels.NO_NODE, 0, 1, 2]]),
        depths=torch.tensor([[0, 1, 2, 3]]),
    )
    req = make_req(VOCAB, [5, 1], min_new=4, eos={2})
    penalties = output_penalties([req], [req.output_ids], VOCAB, torch.device("cpu"))
    logits = torch.zeros((1, 4, VOCAB))
    apply_tree_penalties(logits, trees.tokens, reference.ancestor_mask(trees.parents), penalties, ORDERS[0])
    banned = torch.isneginf(logits[0])
    assert banned[:2, 2].all() and banned[:2, VOCAB - 1].all()
    assert not banned[2:].any()
    assert banned.sum() == 4


def test_stop_ids_are_sglangs_set() -> None:
    req = make_req(VOCAB, [1], stop_ids={6}, eos={2, 6}, tokenizer_eos=0)
    assert min_new_tokens_stop_ids(req) == [0, 2, 6, VOCAB - 1]


def test_bad_shapes_are_refused() -> None:
    penalties = OutputPenalties(
        output_ids=torch.zeros((1, 2), dtype=torch.int64),
        output_lens=torch.ones(1, dtype=torch.int64),
        frequency=torch.zeros(1),
        presence=torch.zeros(1),
        repetition=torch.ones(1),
        min_new_tokens=torch.zeros(1, dtype=torch.int64),
        stop_tokens=torch.zeros((1, 1), dtype=torch.int64),
    )
    with pytest.raises(ValueError, match="ancestor_mask"):
        apply_tree_penalties(
            torch.zeros((1, 2, VOCAB)),
            torch.zeros((1, 2), dtype=torch.int64),
            torch.ones((1, 2, 3)),
            penalties,
            ORDERS[0],
        )
    with pytest.raises(ValueError, match=r"penalties\.frequency"):
        apply_tree_penalties(
            torch.zeros((1, 2, VOCAB)),
            torch.zeros((1, 2), dtype=torch.int64),
            torch.ones((1, 2, 2), dtype=torch.bool),
            OutputPenalties(**{**penalties.__dict__, "frequency": torch.zeros(1, dtype=torch.float64)}),
            ORDERS[0],
        )
    with pytest.raises(ValueError, match="order"):
        apply_tree_penalties(
            torch.zeros((1, 2, VOCAB)),
            torch.zeros((1, 2), dtype=torch.int64),
            torch.ones((1, 2, 2), dtype=torch.bool),
            penalties,
            ORDERS[0][:3],
        )
