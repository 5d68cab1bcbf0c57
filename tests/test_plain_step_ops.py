"""A width-1 decode step's own ops (`BastionWorker._plain_step` around SGLang's DECODE forward): fixed by
the batch size, whatever the batch holds, and for a greedy batch only what SGLang's plain step also computes
(the lengths with the roots, the argmax) plus the roots' KV slots (an index and its int64 cast). Counted by
the step anatomy's counter on the CPU, with the target's forward replaced by its precomputed outputs."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from op_counting import counted, sampling_info_stand_in

from bastion_sglang.step.accept import Acceptor
from bastion_sglang.step.commit import DraftContextWriter
from bastion_sglang.step.step_anatomy import StageCounts
from bastion_sglang.step.target_forward import DecodeInputs, TargetForward
from bastion_sglang.worker import BastionWorker

VOCAB, HIDDEN, BATCH, POOL_COLUMNS = 32, 6, 3, 40


class Timer:
    """The step controller's stage timer, timing nothing."""

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        yield


PARAMS = SimpleNamespace(
    frequency_penalty=0.0, presence_penalty=0.0, repetition_penalty=1.0, min_new_tokens=0
)
REQS = [SimpleNamespace(sampling_params=PARAMS, rid=f"r{b}") for b in range(BATCH)]
"""The running batch's requests (no output penalties), the same in every step."""


def fake_batch(greedy: bool) -> Any:
    """What a width-1 step reads of SGLang's ScheduleBatch: REQS, no grammar, no logit_bias, nothing returned
    besides the tokens; temperature 0.7 and no filter when not greedy."""
    sampling_info = sampling_info_stand_in(BATCH, VOCAB, greedy)
    return SimpleNamespace(
        reqs=REQS,
        sampling_info=sampling_info,
        has_grammar=False,
        return_hidden_states=False,
        return_logprob=False,
    )


def fake_worker(req_to_token: torch.Tensor, graph: bool) -> tuple[Any, list[Any]]:
    """The parts of a BastionWorker a width-1 step uses, its TargetForward's DECODE forward replaced by the
    outputs appended to the returned list (`graph`: whether that forward replayed a CUDA graph)."""
    runner = SimpleNamespace(req_to_token_pool=SimpleNamespace(req_to_token=req_to_token))
    base = SimpleNamespace(
        model_runner=runner,
        target_worker=SimpleNamespace(model_runner=SimpleNamespace(decode_cuda_graph_runner=None)),
        device="cpu",
    )
    target = TargetForward.__new__(TargetForward)
    target._worker = base
    outputs: list[Any] = []
    target.decode_plain = lambda inputs, slots, seq_lens, seq_lens_sum: SimpleNamespace(  # type: ignore[method-assign]
        logits_output=outputs[-1], can_run_cuda_graph=graph
    )
    worker = SimpleNamespace(
        _controller=SimpleNamespace(timer=Timer(), end=lambda record: None),
        _target=target,
        _acceptor=Acceptor(VOCAB, "pytorch"),
        _context=DraftContextWriter(base),
        _reserve=8,
    )
    return worker, outputs


def step_of(seed: int, greedy: bool) -> tuple[DecodeInputs, Any, Any]:
    """A random batch of BATCH requests: its step inputs, its step start and the forward's outputs."""
    gen = torch.Generator().manual_seed(seed)
    prefix = torch.randint(1, POOL_COLUMNS - 1, (BATCH,), generator=gen)
    inputs = DecodeInputs(
        batch=fake_batch(greedy),
        roots=torch.randint(0, VOCAB, (BATCH,), generator=gen),
        seed_keys=torch.randint(0, 2**40, (BATCH,), generator=gen),
        prefix=prefix,
        prefix_cpu=prefix.clone(),
        rows_index=torch.randperm(BATCH, generator=gen)[:, None],
        on_publish=None,
        grammar_barrier=None,
    )
    step = SimpleNamespace(index=seed, contexts=prefix.tolist(), l_ar=0.0, other_seconds=None)
    output = SimpleNamespace(
        next_token_logits=torch.randn(BATCH, VOCAB, generator=gen),
        hidden_states=torch.randn(BATCH, HIDDEN, generator=gen),
        last_hidden_states=None,
    )
    return inputs, step, output


def plain_steps(greedy: bool, graph: bool) -> list[tuple[StageCounts, Any, DecodeInputs, Any]]:
    """Consecutive width-1 steps of one worker and one batch of requests, with different tokens, lengths,
    rows and forward outputs: the second and third step (the first allocates the commit lengths' buffer), each
    with its counts, its result, its inputs and the forward's outputs."""
    req_to_token = torch.randperm(BATCH * POOL_COLUMNS, dtype=torch.int32).view(BATCH, POOL_COLUMNS)
    worker, outputs = fake_worker(req_to_token, graph)
    steps = []
    for seed in (0, 1, 2):
        inputs, step, output = step_of(seed, greedy)
        outputs.append(output)
        results: list[Any] = []
        counts = counted(
            lambda: results.append(BastionWorker._plain_step(worker, inputs, step, False)),  # noqa: B023
            "skipped",
        )
        steps.append((counts, results[0], inputs, output))
    return steps[1:]


@pytest.mark.parametrize("greedy", [True, False])
def test_a_width_one_steps_ops_do_not_depend_on_the_batch(greedy: bool) -> None:
    (first, *_), (second, *_) = plain_steps(greedy, graph=False)
    assert (first.ops, first.syncs, first.sites) == (second.ops, second.syncs, second.sites)
    assert second.syncs == {}


def test_a_greedy_width_one_step_adds_only_the_roots_slots_to_sglangs_work() -> None:
    """The lengths with the roots, the roots' KV slots (index, int64 cast) and the argmax: 4 ops, no read;
    the commit lengths are a view of a buffer and the held drafter rows are the forward's own."""
    for counts, result, inputs, output in plain_steps(greedy=True, graph=False):
        assert counts.ops == 4, counts.sites
        assert torch.equal(result.next_token_ids, output.next_token_logits.argmax(dim=-1))
        assert torch.equal(result.new_seq_lens, inputs.prefix + 1)
        assert result.accept_lens.dtype == torch.int32 and result.accept_lens.tolist() == [1] * BATCH
        assert torch.equal(result.next_draft_input.bonus_tokens, result.next_token_ids)


@pytest.mark.parametrize("graph", [False, True])
def test_the_held_drafter_rows_are_copied_only_from_a_graphs_buffer(graph: bool) -> None:
    req_to_token = torch.randperm(BATCH * POOL_COLUMNS, dtype=torch.int32).view(BATCH, POOL_COLUMNS)
    worker, outputs = fake_worker(req_to_token, graph)
    inputs, step, output = step_of(3, greedy=True)
    outputs.append(output)
    hidden = output.hidden_states  # the step hands SGLang the output without it
    BastionWorker._plain_step(worker, inputs, step, False)
    held = worker._context._held.take()
    assert torch.equal(held.hidden, hidden)
    assert (held.hidden.data_ptr() == hidden.data_ptr()) is not graph
    expected_slots = req_to_token[inputs.rows_index[:, 0], inputs.prefix].to(torch.int64)
    assert torch.equal(held.slots, expected_slots) and torch.equal(held.positions, inputs.prefix)
