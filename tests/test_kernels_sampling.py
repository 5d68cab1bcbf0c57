"""Inverse-CDF sampling and the lossless sampling walk (bastion_sglang.kernels, torch path)."""

from __future__ import annotations

import itertools
import math
import random
from collections import defaultdict
from fractions import Fraction

import pytest
import torch
from op_counting import counted
from scipy.stats import chisquare

from bastion_sglang.kernels import (
    AcceptResult,
    TreeBatch,
    accept_greedy,
    accept_roots,
    accept_sampling,
    keyed_uniforms,
    position_uniforms,
    sample_tokens,
    seed_keys,
)
from bastion_sglang.kernels.reference import positive_running_max, search_cdf

# ---------------------------------------------------------------- sample_tokens


@pytest.mark.parametrize(
    ("weights", "uniform", "token"),
    [
        ([1.0, 0.0, 1.0, 2.0], 0.0, 0),
        ([1.0, 0.0, 1.0, 2.0], 0.2499, 0),
        ([1.0, 0.0, 1.0, 2.0], 0.25, 2),  # cdf 1 is not > 1; token 1 has zero mass; token 2 reaches 2
        ([1.0, 0.0, 1.0, 2.0], 0.5, 3),
        ([1.0, 0.0, 1.0, 2.0], 0.99, 3),
        ([0.0, 0.0, 3.0, 1.0], 0.0, 2),  # leading zero-mass tokens are skipped even at u = 0
        ([0.25, 0.5, 0.25, 0.0], 0.75, 2),
        ([1.0, 1.0, 0.0, 0.0], 1.0, 1),  # u = 1 exceeds every threshold: the first positive token at total
        ([1.0, 1e-9, 0.0], 1.0, 0),  # 1 + 1e-9 rounds to 1 in float32: token 0 already reaches the total
        ([0.0, 5.0, 0.0], 0.3, 1),
    ],
)
def test_sample_tokens_literal_inverse_cdf(weights, uniform, token):
    out = sample_tokens(torch.tensor([weights]), torch.tensor([uniform]))
    assert out.dtype == torch.int64
    assert out.tolist() == [token]


def test_sample_tokens_equals_exact_inverse_cdf_on_integer_weights():
    gen = torch.Generator().manual_seed(11)
    weights = torch.randint(0, 8, (300, 9), generator=gen).float()
    weights[:, 4] += 1  # every row has positive mass
    numerators = torch.randint(0, 1024, (300,), generator=gen)
    uniforms = numerators.float() / 1024  # dyadic: u * total is exact in float32
    out = sample_tokens(weights, uniforms).tolist()
    for row, u_num, token in zip(weights.tolist(), numerators.tolist(), out, strict=True):
        threshold = Fraction(u_num, 1024) * int(sum(row))
        cumulative, expected = 0, None
        for t, w in enumerate(row):
            cumulative += int(w)
            if w > 0 and cumulative > threshold:
                expected = t
                break
        assert token == expected


def test_sample_tokens_never_returns_zero_probability_tokens():
    gen = torch.Generator().manual_seed(5)
    probs = torch.rand(500, 64, generator=gen)
    probs[probs < 0.9] = 0.0  # ~90% zeros
    probs[:, 0] += (probs.sum(dim=1) == 0).float()  # every row keeps some mass
    probs = probs / probs.sum(dim=1, keepdim=True)
    uniforms = torch.rand(500, generator=gen)
    uniforms[:50] = 0.0
    uniforms[50:100] = 1.0 - 2.0**-24  # largest float32 below 1
    out = sample_tokens(probs, uniforms)
    assert bool((probs.gather(1, out[:, None]) > 0).all())


def test_cpu_cumsum_never_decreases_and_repeats_at_zero_weights():
    """`sample_tokens` searches torch's CPU cumulative sums directly: they must be non-decreasing, and a
    zero-weight token must repeat the sum before it (fails if torch's CPU cumsum stops adding in sequence)."""
    gen = torch.Generator().manual_seed(3)
    magnitudes = torch.randint(-40, 3, (64, 4096), generator=gen).float()
    weights = torch.rand(64, 4096, generator=gen) * torch.pow(10.0, magnitudes)  # 42 decades of weight
    weights[torch.rand(64, 4096, generator=gen) < 0.3] = 0.0
    cdf = torch.cumsum(weights, dim=-1)
    steps = cdf[:, 1:] - cdf[:, :-1]
    assert bool((steps >= 0).all())
    assert bool((steps[weights[:, 1:] == 0] == 0).all())


def test_running_max_search_never_returns_zero_weight_tokens_of_a_decreasing_scan():
    """The path for devices whose parallel scan may round a later sum below an earlier one: on sums that
    dip and rise at zero-weight tokens, the draw is the first positive token whose sum exceeds u·total."""
    weights = torch.tensor([[0.0, 1.0, 0.0, 0.0, 1.0, 0.0, 2.0, 0.0]])
    noisy = torch.tensor([[0.1, 1.0, 0.9, 1.5, 2.0, 2.6, 4.0, 3.9]])  # zero-weight tokens off by rounding
    reach = positive_running_max(weights, noisy)
    assert reach.tolist() == [[0.0, 1.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]]
    for uniform, token in ((0.0, 1), (0.2, 1), (0.25, 4), (0.3, 4), (0.5, 6), (0.99, 6), (1.0, 6)):
        assert search_cdf(reach, torch.tensor([uniform])).tolist() == [token], uniform


def test_sample_tokens_issues_the_same_ops_for_any_batch_and_vocabulary():
    counts = set()
    for rows, vocab in ((1, 16), (8, 4096), (64, 49152)):
        probs = torch.softmax(torch.randn(rows, vocab), dim=-1)
        uniforms = torch.rand(rows)
        step = counted(lambda probs=probs, uniforms=uniforms: sample_tokens(probs, uniforms))
        assert step.syncs == {}
        counts.add(step.ops)
    assert len(counts) == 1
    assert counts.pop() <= 7


def test_sample_tokens_batched_equals_one_at_a_time():
    gen = torch.Generator().manual_seed(7)
    probs = torch.softmax(torch.randn(64, 1000, generator=gen) * 4, dim=-1)
    uniforms = torch.rand(64, generator=gen)
    batched = sample_tokens(probs, uniforms)
    single = torch.cat([sample_tokens(probs[i : i + 1], uniforms[i : i + 1]) for i in range(64)])
    assert torch.equal(batched, single)
    assert torch.equal(sample_tokens(probs, uniforms), batched)  # a pure function: same inputs, same draw


def test_sample_tokens_rejects_bad_inputs():
    with pytest.raises(ValueError, match=r"probs must be \[M, V\], got shape \(4,\)"):
        sample_tokens(torch.ones(4), torch.zeros(1))
    with pytest.raises(ValueError, match=r"uniforms must be \[M\] = \(2,\), got shape \(3,\)"):
        sample_tokens(torch.ones(2, 4), torch.zeros(3))
    with pytest.raises(ValueError, match=r"uniforms must be a floating tensor, got torch\.int64"):
        sample_tokens(torch.ones(2, 4), torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="probs must have a vocabulary of at least one token, got V = 0"):
        sample_tokens(torch.ones(2, 0), torch.zeros(2))


# ---------------------------------------------------------------- position_uniforms

WORD = (1 << 64) - 1
CHI_SQUARE_P_THRESHOLD = 1e-4


def splitmix64_finaliser(x: int) -> int:
    """The splitmix64 finaliser on Python ints modulo 2^64 (the exact arithmetic the int64 ops wrap to)."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & WORD
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & WORD
    return x ^ (x >> 31)


def exact_uniform(seed: int, position: int) -> float:
    keyed = splitmix64_finaliser(splitmix64_finaliser((seed + 0x9E3779B97F4A7C15) & WORD) ^ (position & WORD))
    return (keyed >> 40) / (1 << 24)


def test_position_uniforms_equal_exact_integer_hash():
    """Seeds and positions across the whole int64 range (negative, extreme, wrapping sums) against the hash
    computed on unbounded Python ints."""
    rng = random.Random(3)
    seeds = [0, 1, -1, 2**63 - 1, -(2**63), 12345] + [rng.randrange(-(2**63), 2**63) for _ in range(10)]
    positions = [[0, 1, 2, 2**40, -5] + [rng.randrange(0, 2**20) for _ in range(3)] for _ in seeds]
    out = position_uniforms(torch.tensor(seeds), torch.tensor(positions))
    assert out.dtype == torch.float32 and out.shape == (len(seeds), 8)
    expected = [[exact_uniform(s, p) for p in row] for s, row in zip(seeds, positions, strict=True)]
    assert out.tolist() == expected
    keyed = keyed_uniforms(seed_keys(torch.tensor(seeds)), torch.tensor(positions))  # a decode step's form
    assert keyed.tolist() == expected


def test_position_uniforms_are_uniform_and_adjacent_positions_independent():
    """One seed over 200,000 consecutive positions: 64-bin chi-square, and 8 x 8 bins of (u_p, u_p+1); 64
    seeds at one position likewise; every p-value must exceed the threshold."""
    count = 200_000
    stream = position_uniforms(torch.tensor([7]), torch.arange(count)[None])[0].double()
    assert float(stream.min()) >= 0.0 and float(stream.max()) < 1.0
    bins = torch.bincount((stream * 64).long(), minlength=64).tolist()
    pairs = torch.bincount((stream[:-1] * 8).long() * 8 + (stream[1:] * 8).long(), minlength=64).tolist()
    across = position_uniforms(torch.arange(count), torch.zeros(count, 1, dtype=torch.int64))[:, 0].double()
    across_bins = torch.bincount((across * 64).long(), minlength=64).tolist()
    p_values = [chisquare(counts).pvalue for counts in (bins, pairs, across_bins)]
    print(f"position_uniforms chi-square p-values (stream, pairs, across seeds): {p_values}")
    assert min(p_values) > CHI_SQUARE_P_THRESHOLD


def test_position_uniforms_depend_only_on_seed_and_position():
    seeds = torch.tensor([5, 9, 5])
    positions = torch.tensor([[10, 11, 11, 12], [10, 11, 11, 12], [12, 11, 10, 10]])
    out = position_uniforms(seeds, positions)
    assert out[0, 1] == out[0, 2] and out[0, 0] != out[0, 1]
    assert out[2].tolist() == [out[0, 3].item(), out[0, 1].item(), out[0, 0].item(), out[0, 0].item()]
    assert out[1, 0] != out[0, 0]
    alone = position_uniforms(seeds[1:2], positions[1:2])
    assert torch.equal(alone[0], out[1])


def test_position_uniforms_reject_bad_inputs():
    seeds, positions = torch.tensor([1, 2]), torch.zeros(2, 3, dtype=torch.int64)
    with pytest.raises(ValueError, match="seeds must be int64"):
        position_uniforms(seeds.int(), positions)
    with pytest.raises(ValueError, match=r"seeds must be \[B\]"):
        position_uniforms(seeds[None], positions)
    with pytest.raises(ValueError, match=r"positions must be \[B, W\] with B = 2"):
        position_uniforms(seeds, positions[:1])
    with pytest.raises(ValueError, match="positions must be int64"):
        position_uniforms(seeds, positions.float())
    with pytest.raises(ValueError, match="seeds must be int64"):
        seed_keys(seeds.int())
    with pytest.raises(ValueError, match=r"positions must be \[B, W\] with B = 2 \(keys\)"):
        keyed_uniforms(seeds, positions[:1])


def test_a_step_with_keys_skips_the_seeds_hash():
    """A decode step hashes its positions only: `keyed_uniforms` issues `position_uniforms`' ops less those
    of `seed_keys` (hashed once per request, at prefill)."""
    seeds, positions = torch.tensor([3, 4]), torch.tensor([[10], [20]])
    keys = seed_keys(seeds)
    from_seeds = counted(lambda: position_uniforms(seeds, positions)).ops
    hashing_seeds = counted(lambda: seed_keys(seeds)).ops
    from_keys = counted(lambda: keyed_uniforms(keys, positions)).ops
    assert hashing_seeds >= 10
    assert from_keys == from_seeds - hashing_seeds


# ---------------------------------------------------------------- accept_sampling: losslessness

VOCAB = 4
DENOM = 16  # target probabilities are multiples of 1/16: exact in float32, and a 16-cell grid of u is exact

# A fixed tree over vocabulary {0, 1, 2, 3}, depth 3, with branches at the root and at depth 1.
# position: token (parent)     path of tokens from the root
#   0: root                    ()
#   1: 0 (0)                   (0,)
#   2: 1 (0)                   (1,)
#   3: 2 (0)                   (2,)
#   4: 1 (1)                   (0, 1)
#   5: 3 (1)                   (0, 3)
#   6: 0 (2)                   (1, 0)
#   7: 2 (4)                   (0, 1, 2)
TREE_TOKENS = [7, 0, 1, 2, 1, 3, 0, 2]
TREE_PARENTS = [-1, 0, 0, 0, 1, 1, 2, 4]
TREE_DEPTHS = [0, 1, 1, 1, 2, 2, 2, 3]


def path_of(position: int) -> tuple[int, ...]:
    tokens: list[int] = []
    while position > 0:
        tokens.append(TREE_TOKENS[position])
        position = TREE_PARENTS[position]
    return tuple(reversed(tokens))


def target_counts(context: tuple[int, ...]) -> tuple[int, ...]:
    """The target's next-token distribution after `context`, as counts out of DENOM (some may be 0)."""
    rng = random.Random(f"target-11-{context}")  # seed chosen so that every tree node is reachable
    support = rng.sample(range(VOCAB), rng.choice([2, 3, 3, 4]))
    counts = [1 if token in support else 0 for token in range(VOCAB)]
    for _ in range(DENOM - len(support)):
        counts[rng.choice(support)] += 1
    return tuple(counts)


def target_prob(context: tuple[int, ...], token: int) -> Fraction:
    return Fraction(target_counts(context)[token], DENOM)


def target_joint(tokens: tuple[int, ...]) -> Fraction:
    """The target's probability of emitting `tokens` first: the product of its conditionals."""
    prob = Fraction(1)
    for i, token in enumerate(tokens):
        prob *= target_prob(tokens[:i], token)
    return prob


def tree_batch(batch: int) -> TreeBatch:
    row = (TREE_TOKENS, TREE_PARENTS, TREE_DEPTHS)
    return TreeBatch(*(torch.tensor([values] * batch) for values in row))


def tree_target_probs() -> torch.Tensor:
    """[W, V] float32: the target's distribution after each tree position (depends on the path)."""
    counts = [target_counts(path_of(j)) for j in range(len(TREE_TOKENS))]
    return torch.tensor(counts, dtype=torch.float32) / DENOM


def emitted_sequences(result: AcceptResult) -> list[tuple[int, ...]]:
    """Per row of the tree batch: the accepted draft tokens, then the bonus token."""
    rows = zip(
        result.accept_index.tolist(), result.accept_length.tolist(), result.bonus_tokens.tolist(), strict=True
    )
    return [(*(TREE_TOKENS[j] for j in index[1 : length + 1]), bonus) for index, length, bonus in rows]


def test_target_table_is_position_dependent_and_has_zeros():
    tables = {path_of(j): target_counts(path_of(j)) for j in range(len(TREE_TOKENS))}
    assert len(set(tables.values())) >= 5
    assert any(0 in counts for counts in tables.values())
    for j in range(1, len(TREE_TOKENS)):  # every node carries a token the target can emit there
        assert target_prob(path_of(TREE_PARENTS[j]), TREE_TOKENS[j]) > 0
    assert all(sum(counts) == DENOM for counts in tables.values())


def test_accept_sampling_is_lossless_by_exact_enumeration():
    """Every uniform of every node on a 16-cell grid (exact for multiples of 1/16): the probability of
    each emitted sequence, and of the first 2 and 3 output tokens, equals the target's exactly."""
    width = len(TREE_TOKENS)
    probs = tree_target_probs()
    grid = (torch.arange(DENOM, dtype=torch.float32) + 0.5) / DENOM
    # Per node: the token each grid cell samples, grouped into (representative uniform, cells).
    outcomes = []
    for j in range(width):
        cells = sample_tokens(probs[j].expand(DENOM, VOCAB), grid).tolist()
        groups = {}
        for cell, token in enumerate(cells):
            groups.setdefault(token, [grid[cell].item(), 0])[1] += 1
        for token, (_, count) in groups.items():
            assert Fraction(count, DENOM) == target_prob(path_of(j), token)
        outcomes.append(list(groups.values()))
    combos = list(itertools.product(*outcomes))
    uniforms = torch.tensor([[u for u, _ in combo] for combo in combos])
    weights = [math.prod(Fraction(count, DENOM) for _, count in combo) for combo in combos]
    trees = tree_batch(len(combos))
    result = accept_sampling(trees, probs.expand(len(combos), width, VOCAB), uniforms)

    step = defaultdict(Fraction)
    for sequence, weight in zip(emitted_sequences(result), weights, strict=True):
        step[sequence] += weight
    assert sum(step.values()) == 1
    assert max(len(s) for s in step) == 4  # the depth-3 path is reached
    for sequence, prob in step.items():
        assert prob == target_joint(sequence), sequence

    # Output prefixes: a step that emits fewer than n tokens is continued by the target (the next steps).
    for n in (2, 3):
        joint = defaultdict(Fraction)
        for sequence, prob in step.items():
            for tail in itertools.product(range(VOCAB), repeat=max(0, n - len(sequence))):
                full = sequence + tail
                joint[full[:n]] += prob * target_joint(full) / target_joint(sequence)
        for prefix in itertools.product(range(VOCAB), repeat=n):
            assert joint[prefix] == target_joint(prefix), prefix


def test_accept_sampling_monte_carlo_first_two_tokens():
    """2e4 seeded steps; (first, second) output tokens vs the target's joint by a chi-square test.

    Tolerance: the statistic must stay below the 0.999 quantile of chi-square with (cells - 1) degrees
    of freedom (Wilson-Hilferty approximation, z = 3.090); cells of zero target probability must be empty.
    """
    samples, width = 20_000, len(TREE_TOKENS)
    gen = torch.Generator().manual_seed(1234)
    probs = tree_target_probs()
    trees = tree_batch(samples)
    result = accept_sampling(
        trees, probs.expand(samples, width, VOCAB), torch.rand(samples, width, generator=gen)
    )
    first = torch.where(
        result.accept_length > 0,
        trees.tokens.gather(1, result.accept_index[:, 1:2].clamp(min=0))[:, 0],
        result.bonus_tokens,
    )
    # When the step emitted one token, the second comes from the target after it (the next step).
    after_first = torch.tensor([target_counts((t,)) for t in range(VOCAB)], dtype=torch.float32) / DENOM
    continuation = sample_tokens(after_first[first], torch.rand(samples, generator=gen))
    second_in_step = torch.where(
        result.accept_length > 1,
        trees.tokens.gather(1, result.accept_index[:, 2:3].clamp(min=0))[:, 0],
        result.bonus_tokens,
    )
    second = torch.where(result.accept_length > 0, second_in_step, continuation)
    counts = torch.bincount(first * VOCAB + second, minlength=VOCAB * VOCAB).tolist()

    expected = [float(target_joint((a, b))) * samples for a in range(VOCAB) for b in range(VOCAB)]
    support = [i for i, e in enumerate(expected) if e > 0]
    assert all(counts[i] == 0 for i in range(VOCAB * VOCAB) if i not in support)
    dof = len(support) - 1
    threshold = dof * (1 - 2 / (9 * dof) + 3.090 * math.sqrt(2 / (9 * dof))) ** 3
    statistic = sum((counts[i] - expected[i]) ** 2 / expected[i] for i in support)
    assert statistic < threshold
    # Power: the same counts are far from a uniform spread over the support.
    uniform = samples / len(support)
    assert sum((counts[i] - uniform) ** 2 / uniform for i in support) > 10 * threshold


def test_accept_sampling_with_one_hot_targets_equals_greedy():
    gen = torch.Generator().manual_seed(9)
    logits = torch.randn(16, len(TREE_TOKENS), VOCAB, generator=gen)
    one_hot = torch.nn.functional.one_hot(logits.argmax(dim=-1), VOCAB).float()
    trees = tree_batch(16)
    sampled = accept_sampling(trees, one_hot, torch.rand(16, len(TREE_TOKENS), generator=gen))
    greedy = accept_greedy(trees, logits)
    assert torch.equal(sampled.accept_index, greedy.accept_index)
    assert torch.equal(sampled.accept_length, greedy.accept_length)
    assert torch.equal(sampled.bonus_tokens, greedy.bonus_tokens)


def test_accept_sampling_rejects_bad_inputs():
    trees = tree_batch(2)
    probs = tree_target_probs().expand(2, len(TREE_TOKENS), VOCAB)
    with pytest.raises(ValueError, match=r"uniforms must be \[B, W\] like trees.tokens = \(2, 8\)"):
        accept_sampling(trees, probs, torch.rand(2, 7))
    with pytest.raises(ValueError, match=r"target_probs must be \[B, W, V\], got shape \(2, 8\)"):
        accept_sampling(trees, probs[..., 0], torch.rand(2, 8))
    with pytest.raises(ValueError, match=r"target_probs must be a floating tensor, got torch\.int64"):
        accept_sampling(trees, probs.long(), torch.rand(2, 8))


def test_accept_roots_equals_the_walk_over_roots_only_rows():
    """A plain step's rows hold only their roots: accept_roots returns what both walks return there."""
    gen = torch.Generator().manual_seed(5)
    batch = 6
    roots = TreeBatch(
        tokens=torch.randint(0, VOCAB, (batch, 1), generator=gen),
        parents=torch.full((batch, 1), -1, dtype=torch.int64),
        depths=torch.zeros((batch, 1), dtype=torch.int64),
    )
    logits = torch.randn(batch, 1, VOCAB, generator=gen)
    probs = torch.softmax(logits, dim=-1)
    uniforms = torch.rand(batch, 1, generator=gen)
    for walked, targets in (
        (accept_greedy(roots, logits), logits[:, 0].argmax(dim=-1)),
        (accept_sampling(roots, probs, uniforms), sample_tokens(probs[:, 0], uniforms[:, 0])),
    ):
        plain = accept_roots(targets)
        assert torch.equal(plain.accept_index, walked.accept_index)
        assert torch.equal(plain.accept_length, walked.accept_length)
        assert torch.equal(plain.bonus_tokens, walked.bonus_tokens)


def test_accept_roots_rejects_bad_inputs():
    with pytest.raises(ValueError, match=r"target_tokens must be \[B\], got shape \(2, 1\)"):
        accept_roots(torch.zeros((2, 1), dtype=torch.int64))
    with pytest.raises(ValueError, match=r"target_tokens must be int64, got torch\.int32"):
        accept_roots(torch.zeros(2, dtype=torch.int32))
