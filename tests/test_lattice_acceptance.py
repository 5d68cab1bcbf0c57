"""Acceptance calibration on DFlash2 lattices: conditional events along the parent's transition row, a fit
recovering a known miscalibration, consistency with top-K records where every row of a slot is the same,
`AcceptanceCalibration.apply` on [B, D, K, K], the held-out report on a hand-made lattice, raw path scores
of lattice trees, and the reference engine's lattice records on the tiny DFlash2 pair."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from bastion_sglang.controller.acceptance import (
    AcceptanceCalibration,
    AcceptanceRecord,
    best_accept_curve,
    conditional_events,
    evaluate_acceptance,
    fit_acceptance,
    realised_accept_length,
)
from bastion_sglang.controller.lattice_acceptance import LatticeRecord, lattice_node_log_scores
from bastion_sglang.controller.lattice_tree import build_lattice_tree, build_lattice_trees, selector_logprobs
from bastion_sglang.kernels.types import DraftLattice, DraftTopK

DEPTHS, WIDTH, VOCAB = 4, 6, 60
OUTSIDE = -1
"""A target token outside every slot (never matches a candidate)."""


def hand_lattice() -> tuple[torch.Tensor, torch.Tensor]:
    """D = 3, K = 2: slot 0 is candidates (10, 11), slot 1 (20, 21), slot 2 (30, 31); every row differs by
    its parent (slot 0's two rows are one row, as SGLang's)."""
    probs = torch.tensor(
        [
            [[0.6, 0.4], [0.6, 0.4]],
            [[0.7, 0.3], [0.2, 0.8]],
            [[0.9, 0.1], [0.25, 0.75]],
        ],
        dtype=torch.float64,
    )
    return probs.log(), torch.tensor([[10, 11], [20, 21], [30, 31]])


def test_events_read_the_parents_row() -> None:
    transitions, ids = hand_lattice()
    logs = transitions.tolist()
    # the target's path: candidate 1 of slot 0, candidate 0 of slot 1, then a token outside slot 2
    record = LatticeRecord(transitions, ids, continuation=(11, 20, 7))
    events = conditional_events([record], 3)
    assert events[0][0].tolist() == logs[0][0] and events[0][1].tolist() == [0.0, 1.0]
    assert events[1][0].tolist() == logs[1][1] and events[1][1].tolist() == [1.0, 0.0]  # row [1, 1]
    assert events[2][0].tolist() == logs[2][0] and events[2][1].tolist() == [0.0, 0.0]  # row [2, 0]
    # depth 1 on candidate 0, depth 2 on candidate 1: row [1, 0], then row [2, 1]
    events = conditional_events([LatticeRecord(transitions, ids, continuation=(10, 21, 31))], 3)
    assert [x.tolist() for x, _ in events] == [logs[0][0], logs[1][0], logs[2][1]]
    assert [y.tolist() for _, y in events] == [[1.0, 0.0], [0.0, 1.0], [0.0, 1.0]]


def test_events_stop_where_the_path_leaves_the_lattice() -> None:
    transitions, ids = hand_lattice()
    left = LatticeRecord(transitions, ids, continuation=(11, 99, 30))
    events = conditional_events([left], 3)
    assert events[1][1].tolist() == [0.0, 0.0]  # 99 is no candidate of slot 1: still an event
    assert events[2][0].size == 0  # not conditional: the target's path left the lattice at depth 2
    short = LatticeRecord(transitions, ids, continuation=(10,))  # the output ended after one token
    assert [x.size for x, _ in conditional_events([short], 3)] == [2, 0, 0]
    assert [x.size for x, _ in conditional_events([left, short], 2)] == [4, 2]


def test_lattice_records_check_their_shapes() -> None:
    transitions, ids = hand_lattice()
    with pytest.raises(ValueError, match=r"transitions must be \[D, K, K\]"):
        LatticeRecord(transitions[:, 0], ids, (10,))
    with pytest.raises(ValueError, match=r"token_ids must be \[D, K\]"):
        LatticeRecord(transitions, ids[:2], (10,))


def synthetic_lattices(
    count: int, slopes: list[float], offsets: list[float], seed: int
) -> list[LatticeRecord]:
    """Lattice passes whose target token at depth d is candidate c with probability
    exp(min(0, a_d·log q + b_d)), q read from the row of the target's previous candidate (a known
    miscalibration of the conditional factor), else a token outside the slot (the rest of the path is then
    outside too). Rows differ by parent, so reading another row than the parent's would not recover it."""
    rng = np.random.default_rng(seed)
    records = []
    for _ in range(count):
        rows = rng.dirichlet(np.full(WIDTH, 0.3), size=(DEPTHS, WIDTH))  # [D, K, K]
        rows = np.maximum(rows, 1e-12)
        rows /= rows.sum(-1, keepdims=True)  # no zero probability: finite log-probs
        rows[0] = rows[0, 0]  # slot 0 follows the root: one row
        ids = np.stack([rng.choice(VOCAB, WIDTH, replace=False) for _ in range(DEPTHS)])
        continuation, parent = [], 0
        for d in range(DEPTHS):
            true = np.exp(np.minimum(slopes[d] * np.log(rows[d, parent]) + offsets[d], 0.0))
            assert true.sum() <= 1.0 + 1e-9
            pick = rng.choice(WIDTH + 1, p=[*true, 1.0 - true.sum()])
            if pick == WIDTH:
                continuation += [OUTSIDE] * (DEPTHS - d)
                break
            continuation.append(int(ids[d, pick]))
            parent = int(pick)
        records.append(
            LatticeRecord(
                torch.tensor(np.log(rows), dtype=torch.float32),
                torch.tensor(ids, dtype=torch.int64),
                tuple(continuation),
            )
        )
    return records


TRUE_SLOPES = [1.6, 1.4, 1.8, 1.8]
TRUE_OFFSETS = [-0.3, -0.6, -0.2, -0.2]


@pytest.fixture(scope="module")
def lattice_records() -> list[LatticeRecord]:
    return synthetic_lattices(5000, TRUE_SLOPES, TRUE_OFFSETS, seed=0)


def test_fit_on_lattices_recovers_a_known_miscalibration(lattice_records: list[LatticeRecord]) -> None:
    calibration = fit_acceptance(lattice_records, DEPTHS)
    # depths 1 and 2 have thousands of events: within 0.15 of the truth in slope, 0.15 in offset
    for d in range(2):
        assert calibration.slopes[d] == pytest.approx(TRUE_SLOPES[d], abs=0.15)
        assert calibration.offsets[d] == pytest.approx(TRUE_OFFSETS[d], abs=0.15)
    assert all(count > 0 for count in calibration.events[:2])
    # the held-out report: the raw transitions over-predict, the calibrated ones do not
    held_out = synthetic_lattices(1500, TRUE_SLOPES, TRUE_OFFSETS, seed=7)
    report = evaluate_acceptance(calibration, held_out, budgets=[1, 4, 16])
    assert report.passes == 1500
    assert all(error > 0.08 for error in report.error_raw)
    assert all(abs(error) < 0.04 for error in report.error)


def top_k_records(count: int, seed: int) -> list[AcceptanceRecord]:
    """Top-K passes (sorted rows of a vocabulary distribution) whose target follows a known miscalibration."""
    rng = np.random.default_rng(seed)
    records = []
    for _ in range(count):
        probs = rng.dirichlet(np.full(VOCAB, 0.15), size=DEPTHS)
        order = np.argsort(-probs, axis=1)[:, :WIDTH]
        logprobs = np.log(np.take_along_axis(probs, order, axis=1))
        continuation = []
        for d in range(DEPTHS):
            true = np.exp(np.minimum(TRUE_SLOPES[d] * logprobs[d] + TRUE_OFFSETS[d], 0.0))
            pick = rng.choice(WIDTH + 1, p=[*true, 1.0 - true.sum()])
            continuation.append(int(order[d, pick]) if pick < WIDTH else OUTSIDE)
        records.append(
            AcceptanceRecord(
                torch.tensor(logprobs, dtype=torch.float32), torch.tensor(order), tuple(continuation)
            )
        )
    return records


def as_lattice(record: AcceptanceRecord) -> LatticeRecord:
    """The lattice whose every row of slot e is the top-K's row e: transitions independent of the parent."""
    depth, width = record.logprobs.shape
    transitions = record.logprobs[:, None, :].expand(depth, width, width).contiguous()
    return LatticeRecord(transitions, record.token_ids, record.continuation)


def test_parent_independent_lattices_are_their_top_k() -> None:
    """Same events, the same fitted calibration, the same held-out report, bit for bit."""
    records = top_k_records(3000, seed=3)
    lattices = [as_lattice(r) for r in records]
    for (x, y), (lx, ly) in zip(
        conditional_events(records, DEPTHS), conditional_events(lattices, DEPTHS), strict=True
    ):
        assert np.array_equal(x, lx) and np.array_equal(y, ly)
    calibration = fit_acceptance(records, DEPTHS)
    assert fit_acceptance(lattices, DEPTHS) == calibration
    assert not calibration.is_identity
    held_out = top_k_records(300, seed=4)
    by_top = evaluate_acceptance(calibration, held_out, budgets=[1, 8, 32])
    by_lattice = evaluate_acceptance(calibration, [as_lattice(r) for r in held_out], budgets=[1, 8, 32])
    assert by_lattice == by_top


def random_transitions(seed: int, batch: int = 2, depth: int = 5, width: int = 6) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return selector_logprobs(3.0 * torch.randn(batch, depth, width, width, generator=generator))


def test_apply_maps_every_parent_row_by_its_depth() -> None:
    calibration = AcceptanceCalibration(slopes=[1.7, 0.6, 2.0], offsets=[-0.2, 0.3, -1.0], events=[9, 9, 9])
    transitions = random_transitions(1)
    calibrated = calibration.apply(transitions)
    assert calibrated.shape == transitions.shape and calibrated.dtype == transitions.dtype
    assert (calibrated <= 0).all()
    slopes, offsets = calibration.depth_parameters(5)
    for d in range(5):  # depth d + 1 maps every row [b, d, p] alike; depths 4 and 5 take the last map
        expected = torch.clamp(slopes[d] * transitions[:, d] + offsets[d], max=0.0)
        assert torch.allclose(calibrated[:, d], expected, atol=0.0, rtol=1e-6)
    for p in range(6):  # parent row p of every depth: the [B, D, K] map of those rows
        assert torch.equal(calibrated[:, :, p], calibration.apply(transitions[:, :, p]))
    ranked = transitions.sort(-1, descending=True).values
    mapped = calibration.apply(ranked)
    assert (
        mapped[..., 1:] <= mapped[..., :-1]
    ).all()  # sorted rows stay sorted: per-parent child orders kept
    with pytest.raises(ValueError, match=r"\[B, D, K, K\]"):
        calibration.apply(transitions[None])


def test_calibrated_lattice_trees_are_exact_for_calibrated_scores() -> None:
    """The best-first trees on calibrated transitions: scores best-first, each the sum of calibrated
    transitions along its path; the raw sums of the same nodes are `lattice_node_log_scores` on the raw
    transitions, and equal the trees' own scores when built on raw transitions."""
    calibration = AcceptanceCalibration(slopes=[1.5, 0.8], offsets=[-0.4, -0.1], events=[9, 9])
    transitions = random_transitions(2)
    ids = torch.stack([torch.randperm(100)[:30].view(5, 6) for _ in range(2)])
    calibrated = calibration.apply(transitions)
    trees = build_lattice_trees(calibrated, ids, 40)
    assert (trees.log_scores[:, 1:] <= trees.log_scores[:, :-1]).all()
    rescored = lattice_node_log_scores(trees.tokens, trees.parents, trees.depths, calibrated, ids)
    assert torch.allclose(rescored, trees.log_scores, atol=1e-12, rtol=0.0)
    raw = lattice_node_log_scores(trees.tokens, trees.parents, trees.depths, transitions, ids)
    for b in range(2):  # the raw sum along each node's path, walked by hand
        slots = ids[b].tolist()
        for i in range(trees.num_nodes):
            total, node, path = 0.0, i, []
            while node >= 0:
                path.append(node)
                node = int(trees.parents[b, node])
            parent = 0
            for depth, node in enumerate(reversed(path)):
                candidate = slots[depth].index(int(trees.tokens[b, node]))
                total += float(transitions[b, depth, parent, candidate])
                parent = candidate
            assert float(raw[b, i]) == pytest.approx(total, abs=1e-9)
    raw_trees = build_lattice_trees(transitions, ids, 40)
    rescored_raw = lattice_node_log_scores(
        raw_trees.tokens, raw_trees.parents, raw_trees.depths, transitions, ids
    )
    assert torch.allclose(rescored_raw, raw_trees.log_scores, atol=1e-12, rtol=0.0)


@pytest.mark.parametrize("seed", range(20))
def test_the_accept_bound_holds_above_calibrated_lattice_trees(seed: int) -> None:
    """`best_accept_curve` (the gate's pay bound) caps one node's factor and one row's mass per depth; a
    lattice's rows are distributions too, one per parent, so it bounds calibrated lattice trees as well."""
    generator = torch.Generator().manual_seed(seed)
    depth, width, nodes = 4, 3, 30
    slopes = (0.3 + 2.7 * torch.rand(depth, generator=generator)).tolist()
    offsets = (-3.0 + 3.5 * torch.rand(depth, generator=generator)).tolist()
    calibration = AcceptanceCalibration(slopes=slopes, offsets=offsets, events=[0] * depth)
    bound = best_accept_curve(calibration, depth, width, nodes)
    sharpness = float(torch.rand((), generator=generator)) * 8.0
    scores = sharpness * torch.randn(1, depth, width, width, generator=generator, dtype=torch.float64)
    transitions = torch.log_softmax(scores, dim=-1)
    ids = torch.arange(depth * width).view(1, depth, width)
    tree = build_lattice_trees(calibration.apply(transitions), ids, nodes)
    accept = 1.0 + np.concatenate([[0.0], torch.exp(tree.log_scores[0]).cumsum(0).numpy()])
    assert np.all(accept <= bound[: accept.shape[0]] + 1e-9), (accept - bound[: accept.shape[0]]).max()


def test_evaluate_acceptance_on_a_hand_made_lattice() -> None:
    """D = 2, K = 2 (`hand_lattice`'s first two slots), the target taking candidate 1 twice; a halving map
    (a = 1, b = log 0.5) reorders the best-first tree, so both reports are worked out by hand."""
    transitions, ids = hand_lattice()
    transitions, ids = transitions[:2], ids[:2]
    record = LatticeRecord(transitions, ids, continuation=(11, 21))
    short = LatticeRecord(transitions, ids, continuation=(11,))  # skipped: cut by the end of the output
    halving = AcceptanceCalibration(slopes=[1.0], offsets=[math.log(0.5)], events=[1])
    report = evaluate_acceptance(halving, [record, short], budgets=[1, 2, 4, 6])
    assert report.passes == 1 and report.budgets == [1, 2, 4, 6]
    # raw nodes best-first: 10 (.6), 10→20 (.42), 11 (.4), 11→21 (.32), 10→21 (.18), 11→20 (.08)
    assert report.expected_raw == pytest.approx([1.6, 2.02, 2.74, 3.0])
    assert report.realised_raw == [1.0, 1.0, 3.0, 3.0]
    # calibrated: 10 (.3), 11 (.2), 10→20 (.105), 11→21 (.08), 10→21 (.045), 11→20 (.02)
    assert report.expected == pytest.approx([1.3, 1.5, 1.685, 1.75])
    assert report.realised == [1.0, 2.0, 3.0, 3.0]
    tree = build_lattice_tree(halving.apply(transitions[None])[0], ids, 2)
    assert tree.tokens.tolist() == [10, 11]
    assert (
        realised_accept_length(tree.tokens.tolist(), tree.parents.tolist(), tree.depths.tolist(), (11, 21))
        == 2
    )


@pytest.mark.slow
@pytest.mark.usefixtures("one_torch_thread")
def test_the_reference_engine_records_lattices_of_the_verify_passes(tmp_path: Path) -> None:
    """calibrate's acceptance run with a DFlash2 drafter: one `LatticeRecord` per drafted step, its whole
    lattice, whose best-first tree commits what the step's verify pass committed."""
    from tiny_dflash2 import make_tiny_dflash2_drafter
    from tiny_models import make_tiny_target

    from bastion_sglang.calibration.acceptance_run import PLANNING_HARDWARE, records_of_generation
    from bastion_sglang.reference import ReferenceEngine

    target = make_tiny_target(tmp_path / "target", initializer_range=0.4)
    drafter = make_tiny_dflash2_drafter(
        tmp_path / "drafter", target, rank=8, top_k=4, output_multiplier=0.5, final_logit_softcapping=3.0
    )
    engine = ReferenceEngine(target, drafter, device="cpu", dtype=torch.float32, hardware=PLANNING_HARDWARE)
    prompt = [5, 17, 42, 99, 3]
    result = engine.generate(prompt, 16, policy="fixed:8")
    records = records_of_generation(prompt, result.tokens, result.steps, topk=2)
    drafted = [step for step in result.steps if step.lattice is not None]
    assert len(records) == len(drafted) > 0
    checked = 0
    for record, step in zip(records, drafted, strict=True):
        assert isinstance(record, LatticeRecord)
        assert torch.equal(record.transitions, step.lattice.transitions[0])  # every candidate, not topk
        assert record.token_ids.shape == (record.depth, 4)
        full = [*prompt, *result.tokens]
        assert record.continuation == tuple(full[step.ctx_len + 1 : step.ctx_len + 1 + record.depth])
        if len(record.continuation) < record.depth:
            continue
        tree = record.tree(None, 8)
        committed = realised_accept_length(
            tree.tokens.tolist(), tree.parents.tolist(), tree.depths.tolist(), record.continuation
        )
        assert committed == step.accepted + 1
        checked += 1
    assert checked > 0
    events = conditional_events(records, records[0].depth)
    assert events[0][0].size == 4 * len(records)  # depth 1: every record, K events each


class OracleLattice:
    """A test-only DFlash2-like source that knows the target's greedy sequence: slot e's 3 candidates hold
    the true token at an index that moves with e and the context; a row puts 0.6 on the true token after
    the true predecessor, 0.6 on a wrong one after any other; every fifth output position lacks the true
    token. Its trees are accepted to varied depths."""

    depth = 6
    width = 3

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.sequence: tuple[int, ...] = ()  # the target's greedy sequence, prompt included

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return ()

    def start(self, capacity: int) -> None:
        """Stateless: nothing to reset."""

    def propose(self, draft_input: object, k: int) -> DraftLattice:
        committed = draft_input.committed.tolist()  # type: ignore[attr-defined]
        truth = self.sequence[len(committed) :] if self.sequence[: len(committed)] == tuple(committed) else ()
        generator = torch.Generator().manual_seed(len(committed))
        at = [(2 * e + len(committed)) % self.width for e in range(self.depth)]
        ids = torch.empty((self.depth, self.width), dtype=torch.int64)
        for e in range(self.depth):
            ranked = torch.randperm(self.vocab_size, generator=generator)
            if e < len(truth) and (len(committed) + e) % 5 != 4:  # every fifth position: the truth missing
                ranked = ranked[ranked != truth[e]]
                ranked = torch.cat([ranked[: at[e]], torch.tensor([truth[e]]), ranked[at[e] :]])
            ids[e] = ranked[: self.width]
        rows = torch.full((self.depth, self.width, self.width), 0.2)
        for e in range(self.depth):
            for p in range(self.width):
                on_path = e == 0 or p == at[e - 1]
                rows[e, p, at[e] if on_path else (at[e] + 1) % self.width] = 0.6
        unary = torch.full((1, self.depth, self.width), 1.0 / self.width).log()
        return DraftLattice(DraftTopK(unary, ids[None]), rows.log()[None])


@pytest.mark.slow
@pytest.mark.usefixtures("one_torch_thread")
def test_lattice_records_commit_what_the_verify_passes_committed(tmp_path: Path) -> None:
    """With a lattice source whose trees are accepted to varied depths, every record's best-first tree
    commits exactly what its step's verify pass committed."""
    from tiny_models import make_tiny_target

    from bastion_sglang.calibration.acceptance_run import PLANNING_HARDWARE, records_of_generation
    from bastion_sglang.reference import ReferenceEngine

    target = make_tiny_target(tmp_path / "target", initializer_range=0.4)
    oracle = OracleLattice(512)
    engine = ReferenceEngine(target, oracle, device="cpu", dtype=torch.float32, hardware=PLANNING_HARDWARE)
    prompt = [5, 17, 42, 99, 3]
    plain = engine.generate(prompt, 40, policy="ar")
    oracle.sequence = (*prompt, *plain.tokens)
    for budget in (4, 12):
        result = engine.generate(prompt, 40, policy=f"fixed:{budget}")
        assert result.tokens == plain.tokens
        records = records_of_generation(prompt, result.tokens, result.steps, topk=3)
        drafted = [step for step in result.steps if step.lattice is not None]
        assert len(records) == len(drafted) > 0
        accepted = set()
        for record, step in zip(records, drafted, strict=True):
            if len(record.continuation) < record.depth:
                continue
            tree = record.tree(None, budget)
            committed = realised_accept_length(
                tree.tokens.tolist(), tree.parents.tolist(), tree.depths.tolist(), record.continuation
            )
            assert committed == step.accepted + 1
            accepted.add(step.accepted)
        assert len(accepted) > 1 and max(accepted) > 0
