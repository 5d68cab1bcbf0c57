"""The accept and commit stages of a tree step issue ops fixed by their bucket (B requests, W verify width):
`Acceptor.walk` (greedy and sampled batches) and `TreeCommit.commit` (pages of one token and of several),
counted by the step anatomy's counter on the CPU for different contents of one bucket."""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from op_counting import counted, sampling_info_stand_in

from bastion_sglang import kernels
from bastion_sglang.kernels import NO_NODE, TreeBatch
from bastion_sglang.step.accept import Acceptor, RowLogits
from bastion_sglang.step.commit import TreeCommit
from bastion_sglang.step.step_anatomy import StageCounts

VOCAB, HIDDEN = 64, 8


def random_rows(seed: int, batch: int, width: int) -> TreeBatch:
    """B random verify rows of width W, each node's parent an earlier position, sibling tokens distinct."""
    rng = random.Random(seed)
    tokens, parents, depths = [], [], []
    for _ in range(batch):
        row_parents = [NO_NODE] + [rng.randrange(j) for j in range(1, width)]
        row_depths = [0] * width
        for j in range(1, width):
            row_depths[j] = row_depths[row_parents[j]] + 1
        tokens.append(rng.sample(range(VOCAB), width))
        parents.append(row_parents)
        depths.append(row_depths)
    return TreeBatch(torch.tensor(tokens), torch.tensor(parents), torch.tensor(depths))


def fake_batch(batch: int, greedy: bool) -> Any:
    """What `Acceptor.walk` reads of SGLang's ScheduleBatch: requests without output penalties, no grammar,
    no logit_bias; temperature 0.7 and no filter when not greedy."""
    params = SimpleNamespace(
        frequency_penalty=0.0, presence_penalty=0.0, repetition_penalty=1.0, min_new_tokens=0
    )
    sampling_info = sampling_info_stand_in(batch, VOCAB, greedy)
    reqs = [SimpleNamespace(sampling_params=params, rid=f"r{b}") for b in range(batch)]
    return SimpleNamespace(reqs=reqs, sampling_info=sampling_info)


def target_logits(rows: TreeBatch, follow: bool, seed: int) -> torch.Tensor:
    """[B * W, V] logits peaked (by 30) at the token of each position's first child (`follow`, where it has
    one) or at a random token."""
    batch, width = rows.tokens.shape
    gen = torch.Generator().manual_seed(seed)
    targets = torch.randint(0, VOCAB, (batch, width), generator=gen)
    if follow:
        for b in range(batch):
            parents = rows.parents[b].tolist()
            for j in range(width):
                children = [k for k in range(width) if parents[k] == j]
                if children:
                    targets[b, j] = rows.tokens[b, children[0]]
    return torch.nn.functional.one_hot(targets, VOCAB).float().view(batch * width, VOCAB) * 30


def walk_once(batch: int, width: int, greedy: bool, seed: int, follow: bool) -> tuple[StageCounts, Any]:
    """One `Acceptor.walk` over random rows: its counts and its TreeAccept."""
    rows = random_rows(seed, batch, width)
    layout = kernels.build_verify_layout(rows, torch.zeros(batch, dtype=torch.int64))
    row_logits = RowLogits(rows.tokens, layout.ancestor_mask, None, None)
    acceptor = Acceptor(VOCAB, "pytorch")
    fake = fake_batch(batch, greedy)
    logits = target_logits(rows, follow, seed)
    keys = kernels.seed_keys(torch.arange(batch, dtype=torch.int64) + seed)
    prefix = torch.full((batch,), 5, dtype=torch.int64)
    results = []
    step = counted(
        lambda: results.append(acceptor.walk(fake, logits, rows, row_logits, [5] * batch, keys, prefix))
    )
    return step, results[0]


@pytest.mark.parametrize("greedy", [True, False])
@pytest.mark.parametrize(("batch", "width"), [(1, 17), (8, 17)])
def test_accept_walk_ops_depend_on_the_bucket_alone(batch: int, width: int, greedy: bool) -> None:
    """Rows whose target follows a child at every position and rows whose target follows none: the same
    ops, no host read."""
    counts, lengths = [], []
    for seed, follow in ((0, True), (1, False), (2, True), (3, False)):
        step, accept = walk_once(batch, width, greedy, seed, follow)
        counts.append((step.ops, step.syncs))
        lengths.append(accept.commit_lens.tolist())
    assert all(count == counts[0] for count in counts), counts
    assert counts[0][1] == {}
    assert max(max(row) for row in lengths) > 2 and min(min(row) for row in lengths) == 1


def commit_once(page_size: int, order: torch.Tensor, commit_lens: list[int]) -> StageCounts:
    """The counts of one `TreeCommit.commit` of 3 rows of width W (SGLang's drafter-KV append and KV copy
    are no-ops here)."""
    width = order.shape[1]
    req_to_token = torch.arange(3 * 64, dtype=torch.int32).view(3, 64)
    kv_pool = SimpleNamespace(move_kv_cache=lambda tgt_loc, src_loc: None)
    runner = SimpleNamespace(
        req_to_token_pool=SimpleNamespace(req_to_token=req_to_token), token_to_kv_pool=kv_pool
    )
    worker = SimpleNamespace(
        model_runner=runner, device="cpu", _append_target_hidden_to_draft_kv_by_loc=lambda **kwargs: None
    )
    rows_index = torch.tensor([[2], [0], [1]])
    window = torch.tensor([[6], [8], [1]]) + torch.arange(width)
    slots = req_to_token[rows_index, window].to(torch.int64)
    hidden = torch.randn(3, width, HIDDEN)
    lens = torch.tensor(commit_lens, dtype=torch.int32)
    commit = TreeCommit(worker, page_size)
    return counted(lambda: commit.commit(rows_index, slots, window, order, hidden, lens))


@pytest.mark.parametrize("page_size", [1, 4])
def test_commit_ops_depend_on_the_bucket_alone(page_size: int) -> None:
    """BASTION's own ops of a commit are the same for different paths of one bucket: four with pages of one
    token (the path's slot ids, their int32 cast, the req_to_token write, the path's hidden states)."""
    width = 9
    whole = torch.arange(width).expand(3, width).clone()
    path = torch.tensor([0, width - 1, *range(1, width - 1)])
    everything = commit_once(page_size, whole, [width] * 3)
    some = commit_once(page_size, torch.stack([path, whole[0], path]), [2, 1, 2])
    assert (everything.ops, everything.syncs) == (some.ops, some.syncs)
    assert some.syncs == {}
    if page_size == 1:
        assert some.ops == 4
