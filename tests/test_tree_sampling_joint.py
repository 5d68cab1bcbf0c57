"""The sampling walk keeps the JOINT law of several output tokens exact on branching trees (torch path).

Setting: a vocabulary of V = 5; the target's next-token distribution P(context) depends on the whole context
(every emitted token so far), some tokens have probability 0. Each decode step roots a draft tree at the
current context and builds it the way the worker does: drafter logits [1, D=3, V] per position ->
`kernels.topk_logprobs` (K = 3) -> the controller's best-first `build_trees_unchecked` (10 nodes) ->
`kernels.flatten_trees` (W = 11). The tree's shape depends on the drafter (several children at the root and
deeper, depth 3); `kernels.accept_sampling` walks it with the target's distribution at every position. A step
that emits fewer than three tokens is continued by the next step: its bonus token extends the context and a
new tree is rooted there.

Three drafters: `close` (follows the target), `adversarial` (prefers the target's least likely tokens,
zeros included) and `no_mode` (zero probability on the target's mode along its chain).

Checks, for the first three output tokens:
1. exact law, float64: (a) a recursion over the tree with the kernel's rule, (b) the real kernel run on
   enumerated uniforms (one uniform per reachable cell of each visited node), both equal to the target's
   product of conditionals to 1e-12 on all V^3 = 125 triples;
2. 100,000 seeded samples per drafter through the real kernel: chi-square goodness of fit against the exact
   target joint must give p > 1e-4 (scipy.stats.chisquare, cells of zero target probability must be empty);
   a negative control, a walk that accepts a draft child with the target's probability of its token and
   otherwise samples the bonus from the unmodified target (no rejection correction), must give p < 1e-4;
3. seeded sampling with the worker's uniforms (a hash of seed and sequence position): whatever the drafter
   (tree) and the batch, the walk emits exactly the tokens plain decoding samples with those uniforms.
Statistics print with `pytest -s`.
"""

from __future__ import annotations

import functools
import itertools
import math
import random
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from scipy.stats import chisquare

from bastion_sglang.controller.batched import build_trees_unchecked
from bastion_sglang.kernels import (
    FilterRule,
    TreeBatch,
    accept_sampling,
    apply_tree_penalties,
    build_verify_layout,
    flatten_trees,
    position_uniforms,
    processed_probs,
    sample_tokens,
    topk_logprobs,
)
from bastion_sglang.step.request_penalties import output_penalties, sglang_penalty_order

VOCAB = 5
DEPTH = 3  # drafted positions per step (γ - 1)
BRANCHING = 3  # K candidates per position
BUDGET = 10  # draft nodes per tree; verify width W = BUDGET + 1
OUTPUT_TOKENS = 3  # length of the output prefix whose joint law is tested
EXACT_TOLERANCE = 1e-12
SAMPLES = 100_000
P_VALUE_THRESHOLD = 1e-4
DRAFTS = ("close", "adversarial", "no_mode")

Context = tuple[int, ...]
Law = dict[tuple[int, ...], float]


# ---------------------------------------------------------------- the target and the drafters


@functools.cache
def target_probs(context: Context) -> tuple[float, ...]:
    """P(. | context): squared random weights (positive ones >= 0.01), 0 to 2 tokens of probability 0."""
    rng = random.Random(f"joint-target-{context}")
    weights = [rng.uniform(0.1, 1.0) ** 2 for _ in range(VOCAB)]
    for token in rng.sample(range(VOCAB), rng.choice([0, 1, 1, 2])):
        weights[token] = 0.0
    total = sum(weights)
    return tuple(w / total for w in weights)


def target_mode(context: Context) -> int:
    probs = target_probs(context)
    return max(range(VOCAB), key=probs.__getitem__)


def target_joint(tokens: tuple[int, ...]) -> float:
    """The target's probability of emitting `tokens` first: the product of its conditionals."""
    return math.prod(target_probs(tokens[:i])[token] for i, token in enumerate(tokens))


def draft_logits(kind: str, context: Context) -> torch.Tensor:
    """[DEPTH, V] float32 drafter logits for the positions after a root at `context`.

    Like DFlash, one distribution per position (not per path); position d is built around the drafter's own
    top-1 chain: `close` ~ log of the target there, `adversarial` = -6 x the target (its least likely
    tokens first), `no_mode` = noise with the target's mode after the chain at -inf.
    """
    rng = random.Random(f"joint-draft-{kind}-{context}")
    chain: Context = ()
    rows = []
    for _ in range(DEPTH):
        probs = target_probs(context + chain)
        noise = [rng.gauss(0.0, 0.3) for _ in range(VOCAB)]
        if kind == "close":
            row = [math.log(p + 1e-3) + n for p, n in zip(probs, noise, strict=True)]
        elif kind == "adversarial":
            row = [-6.0 * p + 0.1 * n for p, n in zip(probs, noise, strict=True)]
        else:
            row = [3 * n for n in noise]
            row[target_mode(context + chain)] = -math.inf
        rows.append(row)
        chain += (max(range(VOCAB), key=row.__getitem__),)
    return torch.tensor(rows, dtype=torch.float32)


@dataclass(frozen=True)
class StepTree:
    """One step's verify row at a context, and the target's distribution after each of its positions."""

    rows: TreeBatch  # [1, W]: column 0 = root
    probs: torch.Tensor  # [W, V] float64: P(context + path to position j)
    paths: tuple[Context, ...]  # [W]: draft tokens from the root to position j

    def children(self, position: int) -> dict[int, int]:
        """token -> child position (sibling tokens are distinct)."""
        parents = self.rows.parents[0].tolist()
        tokens = self.rows.tokens[0].tolist()
        return {tokens[c]: c for c in range(1, len(tokens)) if parents[c] == position}


@functools.cache
def step_tree(kind: str, context: Context) -> StepTree:
    """The worker's tree pipeline: topk_logprobs -> build_trees_unchecked -> flatten_trees."""
    top = topk_logprobs(draft_logits(kind, context)[None], BRANCHING)
    trees = build_trees_unchecked(top.logprobs, top.token_ids, BUDGET)
    root = torch.tensor([context[-1] if context else 0])
    rows = flatten_trees(trees, root, trees.num_nodes + 1)
    tokens, parents = rows.tokens[0].tolist(), rows.parents[0].tolist()
    paths: list[Context] = [()]
    for j in range(1, len(tokens)):
        paths.append((*paths[parents[j]], tokens[j]))
    probs = torch.tensor([target_probs(context + path) for path in paths], dtype=torch.float64)
    return StepTree(rows, probs, tuple(paths))


def test_trees_branch_deep_and_drafts_disagree_as_described() -> None:
    """Every drafter's tree at the empty context: W = 11, depth 3, >= 2 children at the root and >= 2 under
    some depth-1 node; `adversarial` drafts a token of target probability 0; `no_mode` never drafts the
    target's mode under the nodes of its chain (the root's mode included)."""
    for kind in DRAFTS:
        tree = step_tree(kind, ())
        depths = tree.rows.depths[0].tolist()
        assert len(depths) == BUDGET + 1 and max(depths) == DEPTH, (kind, depths)
        assert len(tree.children(0)) >= 2, kind
        assert any(len(tree.children(j)) >= 2 for j in range(1, len(depths)) if depths[j] >= 1), kind
    adversarial = step_tree("adversarial", ())
    assert any(target_probs(path[:-1])[path[-1]] == 0.0 for path in adversarial.paths[1:]), (
        "the adversarial tree must contain a node the target can never emit"
    )
    for context in [(), (1,), (2, 4)]:
        no_mode = step_tree("no_mode", context)
        chain = draft_logits("no_mode", context).argmax(dim=1).tolist()
        node, checked = 0, 0
        for token in chain:
            assert target_mode(context + no_mode.paths[node]) not in no_mode.children(node)
            checked += 1
            if token not in no_mode.children(node):
                break
            node = no_mode.children(node)[token]
        assert checked >= 2, context


# ---------------------------------------------------------------- exact laws


def recursive_step_law(tree: StepTree) -> Law:
    """Law of one step's emitted tokens by recursion with the kernel's rule: at a node the target samples t
    from its distribution there; a child carrying t is accepted (the walk goes on from it), else t is the
    bonus and the step ends."""
    law: Law = defaultdict(float)

    def visit(position: int, weight: float) -> None:
        children = tree.children(position)
        for token, prob in enumerate(tree.probs[position].tolist()):
            if prob == 0.0:
                continue
            if token in children:
                visit(children[token], weight * prob)
            else:
                law[(*tree.paths[position], token)] += weight * prob

    visit(0, 1.0)
    return dict(law)


def kernel_step_law(tree: StepTree) -> Law:
    """Law of one step's emitted tokens from the real `accept_sampling`, by enumerating uniforms.

    Each node's uniform is drawn from cells, one per token of positive probability (the midpoint of the
    token's inverse-CDF interval; the cell's weight is the token's probability). A partial assignment fixes
    the cells of some nodes; the kernel runs with the others at two filler values (0.0 and 1 - 2^-20). When
    every node on the accepted path (the nodes whose sample the walk used) is fixed, the assignment is an
    outcome, and both fillers must give the same output (nothing else is read); otherwise it branches over
    the cells of the first unfixed node of the path. The outcomes' weights must add up to 1.
    """
    width = tree.rows.width
    cdf = torch.cumsum(tree.probs, dim=1)
    cells = [
        [(t, float(cdf[j, t] - tree.probs[j, t] / 2), float(tree.probs[j, t])) for t in range(VOCAB)]
        for j in range(width)
    ]
    cells = [[cell for cell in row if cell[2] > 0] for row in cells]
    pending: list[dict[int, tuple[int, float, float]]] = [{}]
    law: Law = defaultdict(float)
    total = 0.0
    while pending:
        batch = len(pending)
        runs = []
        for filler in (0.0, 1.0 - 2.0**-20):
            uniforms = torch.full((batch, width), filler, dtype=torch.float64)
            for b, fixed in enumerate(pending):
                for j, (_, u, _) in fixed.items():
                    uniforms[b, j] = u
            rows = TreeBatch(
                *(t.expand(batch, width) for t in (tree.rows.tokens, tree.rows.parents, tree.rows.depths))
            )
            runs.append(accept_sampling(rows, tree.probs.expand(batch, width, VOCAB), uniforms))
        following = []
        for b, fixed in enumerate(pending):
            length = int(runs[0].accept_length[b])
            path = runs[0].accept_index[b, : length + 1].tolist()
            unfixed = [j for j in path if j not in fixed]
            if unfixed:
                following.extend({**fixed, unfixed[0]: cell} for cell in cells[unfixed[0]])
                continue
            for name in ("accept_index", "accept_length", "bonus_tokens"):
                assert torch.equal(getattr(runs[0], name)[b], getattr(runs[1], name)[b]), (fixed, name)
            bonus = int(runs[0].bonus_tokens[b])
            assert all(fixed[j][0] == tree.rows.tokens[0, path[k + 1]] for k, j in enumerate(path[:-1]))
            assert bonus == fixed[path[-1]][0]
            weight = math.prod(fixed[j][2] for j in path)
            law[(*tree.paths[path[-1]], bonus)] += weight
            total += weight
        pending = following
    assert abs(total - 1.0) < EXACT_TOLERANCE
    return dict(law)


def first_tokens_law(step_law: Callable[[Context], Law], context: Context, count: int) -> Law:
    """Law of the next `count` output tokens from `context`: a step, then further steps from its end."""
    law: Law = defaultdict(float)
    for emitted, weight in step_law(context).items():
        if len(emitted) >= count:
            law[emitted[:count]] += weight
            continue
        for tail, tail_weight in first_tokens_law(step_law, context + emitted, count - len(emitted)).items():
            law[emitted + tail] += weight * tail_weight
    return dict(law)


def max_error_against_target(law: Law) -> float:
    triples = itertools.product(range(VOCAB), repeat=OUTPUT_TOKENS)
    return max(abs(law.get(triple, 0.0) - target_joint(triple)) for triple in triples)


@pytest.mark.parametrize("kind", DRAFTS)
def test_exact_joint_of_three_tokens_equals_target(kind: str) -> None:
    """Both exact laws (recursion, enumerated kernel) of the first 3 tokens equal the target's product of
    conditionals within 1e-12 on all 125 triples; per step, each emitted sequence has exactly the target's
    probability, and the kernel's step law has the recursion's support."""
    recursive = functools.cache(lambda context: recursive_step_law(step_tree(kind, context)))
    enumerated = functools.cache(lambda context: kernel_step_law(step_tree(kind, context)))
    for context in [(), (0,), (3,), (1, 2)]:
        by_recursion, by_kernel = recursive(context), enumerated(context)
        assert by_recursion.keys() == by_kernel.keys()
        for emitted, prob in by_kernel.items():
            assert abs(prob - by_recursion[emitted]) < EXACT_TOLERANCE
            assert abs(prob - target_joint(context + emitted) / target_joint(context)) < EXACT_TOLERANCE
    assert max(len(emitted) for emitted in recursive(())) >= 2  # draft tokens do get accepted
    errors = {}
    for name, step_law in (("recursion", recursive), ("kernel", enumerated)):
        law = first_tokens_law(step_law, (), OUTPUT_TOKENS)
        assert abs(sum(law.values()) - 1.0) < EXACT_TOLERANCE
        errors[name] = max_error_against_target(law)
        assert errors[name] < EXACT_TOLERANCE, (name, errors[name])
    print(f"\n[exact] draft={kind}: max |law - target joint| over 125 triples: {errors}")


# ---------------------------------------------------------------- Monte Carlo: chi-square

StepSampler = Callable[[StepTree, int, torch.Generator], tuple[torch.Tensor, torch.Tensor]]


def kernel_step(tree: StepTree, batch: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """`accept_sampling` on `batch` copies of the tree with seeded uniforms. Returns (emitted [batch, W]
    int64, accepted tokens then the bonus, padded with -1; lengths [batch] = accept_length + 1)."""
    width = tree.rows.width
    rows = TreeBatch(
        *(t.expand(batch, width) for t in (tree.rows.tokens, tree.rows.parents, tree.rows.depths))
    )
    uniforms = torch.rand(batch, width, generator=gen, dtype=torch.float64)
    result = accept_sampling(rows, tree.probs.expand(batch, width, VOCAB), uniforms)
    path_tokens = rows.tokens.gather(1, result.accept_index.clamp(min=0))  # [batch, W]
    column = torch.arange(width)[None, :]
    emitted = torch.where(column < result.accept_length[:, None], path_tokens.roll(-1, dims=1), -1)
    emitted[torch.arange(batch), result.accept_length] = result.bonus_tokens
    return emitted, result.accept_length + 1


def biased_step(tree: StepTree, batch: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Negative control: at each node try the children in order and accept a child with the target's
    probability of its token (speculative sampling's min(1, p/q) for a one-hot draft), and when none is
    accepted sample the bonus from the UNMODIFIED target distribution instead of the residual. Biased."""
    width = tree.rows.width
    layout = build_verify_layout(tree.rows, torch.zeros(1, dtype=torch.int64))
    first_child, next_sibling = layout.first_child[0], layout.next_sibling[0]
    tokens = tree.rows.tokens[0]
    current = torch.zeros(batch, dtype=torch.int64)
    emitted = torch.full((batch, width), -1, dtype=torch.int64)
    lengths = torch.zeros(batch, dtype=torch.int64)
    active = torch.ones(batch, dtype=torch.bool)
    rows = torch.arange(batch)
    while bool(active.any()):
        child = first_child[current]
        chosen = torch.full((batch,), -1, dtype=torch.int64)
        while bool((child >= 0).any()):
            prob = tree.probs[current, tokens[child.clamp(min=0)]]
            take = (
                (child >= 0) & (chosen < 0) & (torch.rand(batch, generator=gen, dtype=torch.float64) < prob)
            )
            chosen = torch.where(take, child, chosen)
            child = torch.where(child >= 0, next_sibling[child.clamp(min=0)], -1)
        bonus = sample_tokens(tree.probs[current], torch.rand(batch, generator=gen, dtype=torch.float64))
        token = torch.where(chosen >= 0, tokens[chosen.clamp(min=0)], bonus)
        emitted[rows[active], lengths[active]] = token[active]
        lengths = lengths + active.long()
        active = active & (chosen >= 0)
        current = torch.where(active, chosen, current)
    return emitted, lengths


def sample_first_tokens(kind: str, sampler: StepSampler, samples: int, seed: int) -> torch.Tensor:
    """[samples, 3] int64: the first three output tokens of `samples` independent generations, step by
    step; rows that still need tokens are grouped by their context and continued with that context's tree."""
    gen = torch.Generator().manual_seed(seed)
    out = torch.full((samples, OUTPUT_TOKENS), -1, dtype=torch.int64)
    filled = torch.zeros(samples, dtype=torch.int64)
    while bool((filled < OUTPUT_TOKENS).any()):
        pending = torch.nonzero(filled < OUTPUT_TOKENS)[:, 0]
        digits = torch.where(
            torch.arange(OUTPUT_TOKENS)[None, :] < filled[pending, None], out[pending] + 1, 0
        )
        keys = (digits * torch.tensor([(VOCAB + 1) ** k for k in range(OUTPUT_TOKENS)])).sum(dim=1)
        contexts: dict[Context, torch.Tensor] = {}
        for key in torch.unique(keys).tolist():
            members = pending[keys == key]
            contexts[tuple(out[members[0], : filled[members[0]]].tolist())] = members
        for context, index in sorted(contexts.items()):
            emitted, lengths = sampler(step_tree(kind, context), len(index), gen)
            for k in range(OUTPUT_TOKENS - len(context)):
                has = lengths > k
                out[index[has], len(context) + k] = emitted[has, k]
            filled[index] = torch.clamp(len(context) + lengths, max=OUTPUT_TOKENS)
    return out


def chi_square(triples: torch.Tensor) -> tuple[float, float, int]:
    """(statistic, p-value, degrees of freedom) of the triples' counts against the exact target joint over
    the cells of positive target probability; asserts that cells of probability 0 are empty."""
    codes = (triples * torch.tensor([VOCAB**2, VOCAB, 1])).sum(dim=1)
    counts = torch.bincount(codes, minlength=VOCAB**OUTPUT_TOKENS).tolist()
    expected = [target_joint(t) * len(triples) for t in itertools.product(range(VOCAB), repeat=OUTPUT_TOKENS)]
    support = [i for i, e in enumerate(expected) if e > 0.0]
    assert all(counts[i] == 0 for i in range(len(counts)) if expected[i] == 0.0)
    observed = [counts[i] for i in support]
    fitted = [expected[i] for i in support]
    fitted = [e * sum(observed) / sum(fitted) for e in fitted]  # rounding only: sum(fitted) = samples ± 1e-9
    result = chisquare(observed, fitted)
    return float(result.statistic), float(result.pvalue), len(support) - 1


@pytest.mark.parametrize("kind", DRAFTS)
def test_chi_square_of_three_tokens_passes_for_kernel_and_fails_for_biased_walk(kind: str) -> None:
    """100,000 seeded samples of the first 3 tokens through the real kernel: chi-square p > 1e-4 against
    the exact target joint. The biased walk on the same trees and sample size: p < 1e-4."""
    statistic, pvalue, dof = chi_square(sample_first_tokens(kind, kernel_step, SAMPLES, seed=2024))
    bad_statistic, bad_pvalue, bad_dof = chi_square(
        sample_first_tokens(kind, biased_step, SAMPLES, seed=2024)
    )
    print(
        f"\n[chi2] draft={kind} samples={SAMPLES}: kernel stat={statistic:.1f} dof={dof} p={pvalue:.4g}; "
        f"biased walk stat={bad_statistic:.1f} dof={bad_dof} p={bad_pvalue:.4g}; "
        f"threshold p {'>'} {P_VALUE_THRESHOLD} to pass"
    )
    assert pvalue > P_VALUE_THRESHOLD
    assert bad_pvalue < P_VALUE_THRESHOLD


# ---------------------------------------------------------------- seeded sampling: batch- and tree-invariant


def tempered(probs: torch.Tensor, temperature: float) -> torch.Tensor:
    """probs^(1/T), renormalised over the last axis (float64)."""
    weights = probs ** (1.0 / temperature)
    return weights / weights.sum(dim=-1, keepdim=True)


def sequential_sample(context: Context, seed: int, temperature: float, count: int) -> Context:
    """`count` tokens of plain decoding: the token at sequence index i is the inverse-CDF sample of the
    tempered target after the tokens before it, with the uniform `position_uniforms(seed, i)`."""
    out = context
    for _ in range(count):
        probs = tempered(torch.tensor([target_probs(out)], dtype=torch.float64), temperature)
        uniform = position_uniforms(torch.tensor([seed]), torch.tensor([[len(out)]]))[0]
        out = (*out, int(sample_tokens(probs, uniform)[0]))
    return out[len(context) :]


def walk_with_position_uniforms(
    requests: list[tuple[Context, int, float, str]], count: int
) -> tuple[list[Context], list[int]]:
    """Decode every (context, seed, temperature, drafter) request in one batch with `accept_sampling` and
    the worker's uniforms (`position_uniforms(seed, len(context) + depth)`) until each has `count` new
    tokens. Returns the new tokens per request and the accepted draft tokens per request."""
    contexts = [context for context, *_ in requests]
    seeds = torch.tensor([seed for _, seed, _, _ in requests])
    accepted = [0] * len(requests)
    while min(len(c) - len(r[0]) for c, r in zip(contexts, requests, strict=True)) < count:
        trees = [
            step_tree(kind, context) for (_, _, _, kind), context in zip(requests, contexts, strict=True)
        ]
        width = max(tree.rows.width for tree in trees)
        assert all(tree.rows.width == width for tree in trees)
        probs = torch.stack([tempered(t.probs, r[2]) for t, r in zip(trees, requests, strict=True)])
        rows = TreeBatch(
            *(torch.cat([getattr(t.rows, f) for t in trees]) for f in ("tokens", "parents", "depths"))
        )
        lengths = torch.tensor([len(context) for context in contexts])
        result = accept_sampling(rows, probs, position_uniforms(seeds, lengths[:, None] + rows.depths))
        for r, tree in enumerate(trees):
            length = int(result.accept_length[r])
            accepted[r] += length
            path = tree.paths[int(result.accept_index[r, length])]
            contexts[r] = (*contexts[r], *path, int(result.bonus_tokens[r]))
    return [c[len(r[0]) : len(r[0]) + count] for c, r in zip(contexts, requests, strict=True)], accepted


def test_seeded_walk_emits_plain_decodings_tokens_whatever_the_tree_or_batch() -> None:
    """8 requests (contexts, temperatures 0.5 / 1 / 2, seeds) decoded 12 tokens, each under all three
    drafters (three different tree sequences, accept lengths and steps), in one batch and in a reversed
    batch: every run emits exactly the tokens plain decoding samples with the same (seed, position)
    uniforms. The drafters accept different numbers of tokens, and another seed changes the output."""
    starts: list[Context] = [(), (0,), (1,), (2, 3), (4,), (3, 1), (1, 1), (0, 2)]
    temperatures = [0.5, 1.0, 2.0, 1.0, 0.5, 2.0, 1.0, 0.5]
    seeds = [100 + 7 * r for r in range(len(starts))]
    count = 12
    expected = [
        sequential_sample(c, s, t, count) for c, s, t in zip(starts, seeds, temperatures, strict=True)
    ]
    accepted_by_drafter = {}
    for kind in DRAFTS:
        requests = [(c, s, t, kind) for c, s, t in zip(starts, seeds, temperatures, strict=True)]
        emitted, accepted = walk_with_position_uniforms(requests, count)
        assert emitted == expected, kind
        reversed_emitted, _ = walk_with_position_uniforms(requests[::-1], count)
        assert reversed_emitted == expected[::-1], kind
        accepted_by_drafter[kind] = sum(accepted)
    print(f"accepted draft tokens per drafter: {accepted_by_drafter}")
    assert accepted_by_drafter["close"] > accepted_by_drafter["no_mode"] >= 0
    other_seed = [
        sequential_sample(c, s + 1, t, count) for c, s, t in zip(starts, seeds, temperatures, strict=True)
    ]
    assert other_seed != expected


# ---------------------------------------------------------------- penalties and filters per node

PENALTIES = {"frequency": 0.4, "presence": 0.3, "repetition": 1.5, "min_new": 2, "stop_ids": {4}}
"""Output penalties of the request below: every one at once, and token 4 banned for the first 2 tokens."""
FILTERS = {"temperature": 0.8, "top_k": 4, "top_p": 0.85, "min_p": 0.12}
"""min-p with top-k and top-p at T > 0: the two filter rules differ on this target."""


def penalised_request(output: Context) -> Any:
    """A stand-in SGLang request with PENALTIES that has output `output` so far."""
    from sglang_penalties import make_req

    return make_req(VOCAB, list(output), **PENALTIES)


def processed_rows(logits: torch.Tensor, rule: FilterRule) -> torch.Tensor:
    """[M, V] penalised logits -> [M, V] float64 processed distributions (FILTERS under `rule`)."""
    rows = logits.shape[0]
    weights = processed_probs(
        logits,
        torch.full((rows,), FILTERS["temperature"]),
        torch.full((rows,), FILTERS["top_k"], dtype=torch.int64),
        torch.full((rows,), FILTERS["top_p"]),
        torch.full((rows,), FILTERS["min_p"]),
        rule,
    ).double()
    return weights / weights.sum(dim=-1, keepdim=True)


def raw_logits(context: Context) -> torch.Tensor:
    """[V] float32 target logits at `context` (log of target_probs; -inf where it is 0)."""
    return torch.tensor(target_probs(context), dtype=torch.float64).log().float()


@functools.cache
def sequential_probs(context: Context, rule: FilterRule) -> tuple[float, ...]:
    """Plain decoding's distribution after `context` (the whole output so far): SGLang's own penalizers
    cumulated over the context, then the filters."""
    from sglang_penalties import sglang_row

    row = sglang_row(penalised_request(()), list(context), raw_logits(context))
    return tuple(processed_rows(row[None], rule)[0].tolist())


@functools.cache
def penalised_step_tree(kind: str, context: Context, rule: FilterRule) -> StepTree:
    """`step_tree`'s verify row with the worker's per-node distributions: `apply_tree_penalties` over the
    tree (output so far = context, root = its last token), then `processed_probs`."""
    tree = step_tree(kind, context)
    logits = torch.stack([raw_logits(context + path) for path in tree.paths])[None]
    penalties = output_penalties([penalised_request(context)], [context], VOCAB, torch.device("cpu"))
    ancestors = build_verify_layout(tree.rows, torch.tensor([0])).ancestor_mask
    apply_tree_penalties(logits, tree.rows.tokens, ancestors, penalties, sglang_penalty_order())
    return StepTree(tree.rows, processed_rows(logits[0], rule), tree.paths)


@pytest.mark.parametrize("rule", [FilterRule.JOINT, FilterRule.SEQUENTIAL])
@pytest.mark.parametrize("kind", DRAFTS)
def test_exact_joint_with_penalties_and_filters_equals_plain_decoding(kind: str, rule: FilterRule) -> None:
    """With every output penalty and min-p + top-k + top-p at T = 0.8, the kernel's exact law of the first
    three tokens (enumerated uniforms, steps chained) equals plain decoding's product of conditionals, each
    computed by SGLang's penalizers over the whole output so far; the penalties and filters do change it."""
    enumerated = functools.cache(lambda context: kernel_step_law(penalised_step_tree(kind, context, rule)))
    law = first_tokens_law(enumerated, (), OUTPUT_TOKENS)
    assert abs(sum(law.values()) - 1.0) < EXACT_TOLERANCE

    def plain(tokens: tuple[int, ...]) -> float:
        return math.prod(sequential_probs(tokens[:i], rule)[t] for i, t in enumerate(tokens))

    triples = list(itertools.product(range(VOCAB), repeat=OUTPUT_TOKENS))
    error = max(abs(law.get(triple, 0.0) - plain(triple)) for triple in triples)
    assert error < EXACT_TOLERANCE, error
    assert all(law.get(triple, 0.0) == 0.0 for triple in triples if 4 in triple[:2])
    assert max(abs(plain(triple) - target_joint(triple)) for triple in triples) > 0.05
    assert max(len(emitted) for emitted in enumerated(())) >= 2  # draft tokens do get accepted
