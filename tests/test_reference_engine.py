"""The reference engine on tiny fp32 models: exact greedy equality with `generate`, the tree mask, KV
compaction, the drafter's math against Transformers' own DFlash-style drafter, and seeded sampling.

Long accepted paths come from `OracleProposer` (a draft source that knows the target's continuation);
the random-weight DFlash drafter exercises the real drafting path (it rarely gets accepted).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from calibration_profiles import COSTS, SERVING_EMA_ALPHA, SERVING_FIT
from tiny_models import EOS_ID, make_tiny_drafter, make_tiny_target, make_tokenizer
from transformers import AutoModelForCausalLM, PreTrainedModel
from transformers.models.muse_glimmer_assistant import (
    MuseGlimmerAssistantConfig,
    MuseGlimmerAssistantModel,
)

from bastion_sglang.controller import build_trees
from bastion_sglang.controller.gate import STRETCH_STEPS
from bastion_sglang.controller.latency import LatencyModel
from bastion_sglang.controller.roofline import HardwareSpec
from bastion_sglang.integration.drafter_config import DrafterMismatchError
from bastion_sglang.kernels import build_verify_layout, flatten_trees, topk_logprobs
from bastion_sglang.kernels.types import DraftTopK
from bastion_sglang.reference import (
    DFlashDrafter,
    DFlashProposer,
    DraftInput,
    ReferenceEngine,
    TargetModel,
)

CPU = torch.device("cpu")
HARDWARE = HardwareSpec(name="test-cpu", peak_flops=1e11, bandwidth=2e10)
BUCKETS = (2, 4, 8, 16, 32, 64)
POLICIES = ("ar", "chain", "fixed:1", "fixed:8", "adaptive", "bucketed")
PROMPTS = (
    "Hello",
    "The quick brown fox",
    "def f(x):",
    "1 + 1 =",
    "Once upon a time",
    "<|bos|>user: hi",
    "zzz",
    "A",
)
NEW_TOKENS = 24
DRAFTER_NEW_TOKENS = 16  # the random drafter is rarely accepted: one step per token, keep it short
INIT = 0.4  # weight init std of the tiny targets: peaky logits, no near-ties in greedy decoding
TREE_TOL = 1e-3
"""Tree forward vs a rerun of each branch: fp32 with another summation order (masked attention over the whole
tree vs causal over one branch), 1.7e-4 apart at most on an AVX2-only CPU; a wrong mask or position changes
what a node attends to, which moves them on the scale of the activations themselves."""


@dataclass(frozen=True)
class OracleProposer:
    """A test-only draft source that knows where decoding goes: it proposes, at every depth, the next
    token of the matching reference sequence with probability 0.9 and k - 1 random other tokens.

    references: full sequences (prompt + continuation); the one extending the committed tokens is used
    (none: every depth is random). corrupt_depth: at this depth (1-based) a wrong token takes rank 0 and
    the true one rank 1 (probabilities 0.5 and 0.45), so a chain stops there while a tree can branch past it.
    """

    references: tuple[tuple[int, ...], ...]
    vocab_size: int
    depth: int = 15
    corrupt_depth: int | None = None

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return ()

    def start(self, capacity: int) -> None:
        """Stateless: nothing to reset."""

    def propose(self, draft_input: DraftInput, k: int) -> DraftTopK:
        committed = tuple(draft_input.committed.tolist())
        truth = next(
            (ref[len(committed) :] for ref in self.references if ref[: len(committed)] == committed), ()
        )
        generator = torch.Generator().manual_seed(len(committed))
        tokens = torch.empty((self.depth, k), dtype=torch.int64)
        for d in range(self.depth):
            ranked = torch.randperm(self.vocab_size, generator=generator)[: k + 2]
            if d < len(truth):
                others = ranked[ranked != truth[d]]
                first = [others[0], truth[d]] if self.corrupt_depth == d + 1 else [truth[d], others[0]]
                ranked = torch.cat([torch.tensor(first), others[1:]])
            tokens[d] = ranked[:k]
        tail = [0.05 / 2**r for r in range(1, k - 1)]
        probs = torch.tensor([[0.9, 0.05, *tail]] * self.depth)[:, :k]
        if self.corrupt_depth is not None:
            probs[self.corrupt_depth - 1] = torch.tensor([0.5, 0.45, *tail])[:k]
        return DraftTopK(logprobs=probs.log().float()[None], token_ids=tokens[None])


@dataclass(frozen=True)
class Target:
    path: Path
    model: PreTrainedModel
    drafter_path: Path
    prompts: tuple[tuple[int, ...], ...]
    references: tuple[tuple[int, ...], ...]  # greedy continuation of each prompt (NEW_TOKENS tokens)

    def sequences(self) -> tuple[tuple[int, ...], ...]:
        return tuple(p + r for p, r in zip(self.prompts, self.references, strict=True))


def greedy(
    model: PreTrainedModel, prompt: tuple[int, ...], new_tokens: int, eos: int = EOS_ID
) -> tuple[int, ...]:
    out = model.generate(
        torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False, eos_token_id=eos, pad_token_id=eos
    )
    return tuple(out[0, len(prompt) :].tolist())


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def target(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Target:
    folder = tmp_path_factory.mktemp(request.param)
    path = make_tiny_target(folder / "target", arch=request.param, initializer_range=INIT)
    drafter_path = make_tiny_drafter(folder / "drafter", path, num_layers=2, block_size=16)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tokenizer = make_tokenizer()
    prompts = tuple(tuple(tokenizer(text)["input_ids"]) for text in PROMPTS)
    references = tuple(greedy(model, prompt, NEW_TOKENS) for prompt in prompts)
    return Target(path, model, drafter_path, prompts, references)


def engine_for(target: Target, drafter: object) -> ReferenceEngine:
    return ReferenceEngine(
        target.model,
        drafter,  # type: ignore[arg-type]
        device=CPU,
        dtype=torch.float32,
        hardware=HARDWARE,
        width_buckets=BUCKETS,
        max_nodes=63,
    )


@pytest.mark.parametrize("policy", POLICIES)
def test_greedy_equals_generate_with_the_dflash_drafter(target: Target, policy: str) -> None:
    engine = engine_for(target, target.drafter_path)
    for prompt, reference in zip(target.prompts, target.references, strict=True):
        result = engine.generate(list(prompt), DRAFTER_NEW_TOKENS, policy=policy)
        assert tuple(result.tokens) == reference[:DRAFTER_NEW_TOKENS], (policy, prompt)
    assert all(step.width == step.nodes + 1 for step in result.steps)
    resolved = engine.resolve_policy(policy)
    if resolved is not None and not resolved.may_decline:  # those that may: test_adaptive_skips_...
        assert all(step.nodes >= 1 for step in result.steps)


@pytest.mark.parametrize("policy", POLICIES)
def test_greedy_equals_generate_with_long_accepted_paths(target: Target, policy: str) -> None:
    engine = engine_for(target, OracleProposer(target.sequences(), target.model.config.vocab_size))
    taus = []
    for prompt, reference in zip(target.prompts, target.references, strict=True):
        result = engine.generate(list(prompt), NEW_TOKENS, policy=policy)
        assert tuple(result.tokens) == reference, (policy, prompt)
        taus.append(result.mean_accept_length)
    mean_tau = sum(taus) / len(taus)
    if policy in ("ar", "fixed:1"):
        assert mean_tau <= 2.0
    else:
        assert mean_tau > 4.0, (policy, taus)


SKIP_TOKENS = 300
"""Long enough for the gate to skip the drafter, then refresh-probe it (`max_refresh`: 256 steps at most)."""


def test_adaptive_skips_a_drafter_that_does_not_pay_and_keeps_its_context(target: Target) -> None:
    """The random-weight drafter's flat distributions (Â near 1) never pay for a drafter pass: after its first
    drafted steps adaptive decodes plainly, skipping the drafter, and a refresh probe later drafts again from
    a context that holds every committed position's target features; the output is plain decoding's."""
    engine = engine_for(target, target.drafter_path)
    assert isinstance(engine.proposer, DFlashProposer)
    prompt = target.prompts[0]
    reference = greedy(target.model, prompt, SKIP_TOKENS)
    state = engine.start(list(prompt), SKIP_TOKENS, policy="adaptive")
    steps, skipped = [], 0
    while not state.finished:
        steps.append(engine.step(state))
        if steps[-1].draft is None:
            skipped += 1
        elif skipped > 16:
            break  # the first probe after a run of skipped steps: its drafter pass read the skipped positions
        else:
            skipped = 0
    first_skip = next(index for index, step in enumerate(steps) if step.draft is None)
    probe = len(steps) - 1
    # the first steps plan at the uncorrected estimate (1.6 to 1.7 for this drafter) until the acceptance
    # correction has verified passes to learn from; the stretch then ends once its mean estimate falls
    assert first_skip <= 2 + STRETCH_STEPS, first_skip
    assert steps[probe].draft is not None and skipped > 16, (probe, skipped)
    assert all(step.draft is None and step.nodes == 0 for step in steps[probe - skipped : probe])
    assert state.controller is not None and state.controller.gate.skipped_share > 0.5

    drafter, context = engine.proposer.drafter, engine.proposer.cache
    assert context is not None and context.length == state.ctx_len - state.new_features.shape[0]
    features = TargetModel(target.model, drafter.config.target_layer_ids)
    capacity = len(prompt) + SKIP_TOKENS + 1
    plain = features.prefill(features.new_cache(capacity), state.tokens[: context.length]).features
    fresh = drafter.new_cache(capacity)
    drafter.append_context(fresh, plain)
    torch.testing.assert_close(
        context.keys[:, :, : context.length], fresh.keys[:, :, : fresh.length], rtol=1e-4, atol=1e-4
    )

    while not state.finished:
        steps.append(engine.step(state))
    assert tuple(state.output) == reference


def oracle_engine_for(target: Target) -> ReferenceEngine:
    """An engine with the oracle drafter that plans on a serving engine's latency and step costs, not on this
    machine's timings (which a loaded machine distorts enough to decline an oracle's trees)."""
    oracle = OracleProposer(target.sequences(), target.model.config.vocab_size)
    roofline = engine_for(target, oracle).latency.roofline
    return ReferenceEngine(
        target.model,
        oracle,  # type: ignore[arg-type]
        device=CPU,
        dtype=torch.float32,
        latency=LatencyModel(roofline, SERVING_FIT, ema_alpha=SERVING_EMA_ALPHA),
        step_costs=COSTS,
        max_nodes=63,
    )


def test_adaptive_with_an_oracle_never_skips(target: Target) -> None:
    """Planned on a serving engine's latency and step costs (not this machine's timings), an oracle's trees
    pay at every step: adaptive drafts and verifies a tree every step."""
    engine = oracle_engine_for(target)
    for prompt, reference in zip(target.prompts, target.references, strict=True):
        result = engine.generate(list(prompt), NEW_TOKENS, policy="adaptive")
        assert tuple(result.tokens) == reference
        assert all(step.draft is not None and step.nodes >= 1 for step in result.steps), prompt


def test_trees_accept_past_a_corrupted_depth_where_a_chain_stops(target: Target) -> None:
    oracle = OracleProposer(target.sequences(), target.model.config.vocab_size, corrupt_depth=3)
    engine = engine_for(target, oracle)
    taus = {}
    for policy in ("chain", "fixed:8", "adaptive"):
        results = [engine.generate(list(p), NEW_TOKENS, policy=policy) for p in target.prompts]
        assert [tuple(r.tokens) for r in results] == list(target.references)
        taus[policy] = sum(r.mean_accept_length for r in results) / len(results)
    assert taus["chain"] <= 3.0
    assert taus["fixed:8"] > taus["chain"] + 1.0
    assert taus["adaptive"] > taus["chain"] + 1.0


@pytest.mark.parametrize("max_new_tokens", [1, 2, 3])
@pytest.mark.parametrize("policy", ["ar", "fixed:8", "adaptive"])
def test_max_new_tokens_cuts_an_accepted_path_exactly(
    target: Target, max_new_tokens: int, policy: str
) -> None:
    engine = oracle_engine_for(target)
    for prompt, reference in zip(target.prompts, target.references, strict=True):
        result = engine.generate(list(prompt), max_new_tokens, policy=policy)
        assert tuple(result.tokens) == reference[:max_new_tokens]
        assert len(result.steps) == (
            0 if max_new_tokens == 1 else 1 if policy != "ar" else max_new_tokens - 1
        )


def test_eos_inside_an_accepted_path_ends_the_output(target: Target) -> None:
    prompt, reference = target.prompts[1], target.references[1]
    index = next(i for i in range(6, NEW_TOKENS) if reference[i] not in reference[:i])
    eos = reference[index]
    expected = greedy(target.model, prompt, NEW_TOKENS, eos=eos)
    assert expected == reference[: index + 1]
    engine = ReferenceEngine(
        target.model,
        OracleProposer(target.sequences(), target.model.config.vocab_size),
        device=CPU,
        dtype=torch.float32,
        hardware=HARDWARE,
        eos_token_ids=[eos],
    )
    result = engine.generate(list(prompt), NEW_TOKENS, policy="fixed:16")
    assert tuple(result.tokens) == expected
    last = result.steps[-1]
    assert last.accepted + 1 > last.emitted  # the path went on past the EOS token and was cut


def test_a_wrong_tree_mask_breaks_equality(target: Target) -> None:
    """Negative control: let every tree token see the whole tree block; the output must change."""

    class AllVisibleTree(TargetModel):
        def attention_mask(self, cached: int, visible: torch.Tensor) -> torch.Tensor:
            if cached > 0 and visible.shape[0] > 1:
                visible = torch.ones_like(visible)
            return super().attention_mask(cached, visible)

    engine = engine_for(target, OracleProposer(target.sequences(), target.model.config.vocab_size))
    right = [tuple(engine.generate(list(p), NEW_TOKENS, policy="fixed:8").tokens) for p in target.prompts]
    assert right == list(target.references)
    engine.target = AllVisibleTree(target.model, ())
    wrong = [tuple(engine.generate(list(p), NEW_TOKENS, policy="fixed:8").tokens) for p in target.prompts]
    assert sum(w != r for w, r in zip(wrong, target.references, strict=True)) >= len(PROMPTS) - 1


def ancestors(parents: list[int], node: int) -> list[int]:
    """Positions from the root down to `node` in a verify row (parents[0] = -1)."""
    path = [node]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


def test_tree_forward_equals_a_naive_rerun_of_every_branch(target: Target) -> None:
    layers = (0, 2)
    model = TargetModel(target.model, feature_layers=layers)
    prompt = torch.tensor(target.prompts[1])
    cache = model.new_cache(64)
    model.prefill(cache, prompt)
    generator = torch.Generator().manual_seed(0)
    draft = topk_logprobs(torch.randn(1, 5, 512, generator=generator) * 3, 4)
    trees = build_trees(draft.logprobs, draft.token_ids, 20)
    rows = flatten_trees(trees, torch.tensor([7]), 21)
    layout = build_verify_layout(rows, torch.tensor([len(prompt)]))
    assert int(rows.depths.max()) >= 3 and (rows.parents[0, 2:] != torch.arange(1, 20)).any()  # a real tree
    out = model.forward(cache, rows.tokens[0], layout.positions[0], layout.ancestor_mask[0])
    parents = rows.parents[0].tolist()
    for node in range(rows.width):
        branch = rows.tokens[0, ancestors(parents, node)]
        naive = target.model(torch.cat([prompt, branch])[None], output_hidden_states=True)
        torch.testing.assert_close(out.logits[node], naive.logits[0, -1], rtol=TREE_TOL, atol=TREE_TOL)
        expected = torch.cat([naive.hidden_states[layer + 1][0, -1] for layer in layers])
        torch.testing.assert_close(out.features[node], expected, rtol=TREE_TOL, atol=TREE_TOL)


@pytest.mark.parametrize(("policy", "bucket"), [("fixed:1", 2), ("fixed:8", 16), ("fixed:16", 32)])
def test_verify_passes_run_at_their_width_bucket(
    target: Target, policy: str, bucket: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pass of W = n + 1 real rows runs padded to the smallest bucket >= W; the tokens stay plain's."""
    engine = engine_for(target, target.drafter_path)
    forward = engine.target.forward
    widths: list[int] = []

    def recording_forward(cache, tokens, positions, visible, last_logits_only=False):  # type: ignore[no-untyped-def]
        widths.append(int(tokens.shape[0]))
        return forward(cache, tokens, positions, visible, last_logits_only)

    monkeypatch.setattr(engine.target, "forward", recording_forward)
    result = engine.generate(list(target.prompts[1]), DRAFTER_NEW_TOKENS, policy=policy)
    assert tuple(result.tokens) == target.references[1][:DRAFTER_NEW_TOKENS]
    prompt_len = len(target.prompts[1])  # the prefill, then one pass per step
    assert result.steps and widths == [prompt_len] + [bucket] * len(result.steps)
    assert all(step.width == int(policy.split(":")[1]) + 1 for step in result.steps)


def test_kv_cache_after_steps_equals_a_plain_forward_of_the_committed_tokens(target: Target) -> None:
    engine = engine_for(
        target, OracleProposer(target.sequences(), target.model.config.vocab_size, corrupt_depth=4)
    )
    state = engine.start(list(target.prompts[0]), 2 * NEW_TOKENS, policy="fixed:16")
    accepted = [engine.step(state).accepted for _ in range(3)]
    assert max(accepted) >= 3 and state.cache.length == state.length - 1
    committed = state.tokens[: state.length - 1]
    fresh = engine.target.new_cache(64)
    engine.target.prefill(fresh, committed)
    for kept, plain in zip(state.cache.layers, fresh.layers, strict=True):
        torch.testing.assert_close(
            kept.key_rows[: fresh.length], plain.key_rows[: fresh.length], rtol=1e-4, atol=1e-4
        )
        torch.testing.assert_close(kept.keys, plain.keys, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(kept.values, plain.values, rtol=1e-4, atol=1e-4)


def test_drafter_context_holds_the_target_features_of_the_committed_tokens(target: Target) -> None:
    engine = engine_for(target, target.drafter_path)
    assert isinstance(engine.proposer, DFlashProposer)
    state = engine.start(list(target.prompts[2]), NEW_TOKENS, policy="fixed:8")
    for _ in range(4):
        engine.step(state)
    drafter, context = engine.proposer.drafter, engine.proposer.cache
    assert context is not None and context.length == state.ctx_len - state.new_features.shape[0]
    features = TargetModel(target.model, drafter.config.target_layer_ids)
    plain = features.prefill(features.new_cache(64), state.tokens[: context.length]).features
    fresh = drafter.new_cache(64)
    drafter.append_context(fresh, plain)
    torch.testing.assert_close(
        context.keys[:, :, : context.length], fresh.keys[:, :, : fresh.length], rtol=1e-4, atol=1e-4
    )
    torch.testing.assert_close(context.values[:, :, : context.length], fresh.values[:, :, : fresh.length])


def test_drafter_matches_transformers_dflash_style_drafter(target: Target) -> None:
    """Transformers' MuseGlimmerAssistantModel is the same architecture (fc + norm 'encoder', K/V injection,
    non-causal attention): with our weights under its names it must give the same hidden states."""
    drafter = DFlashDrafter.from_pretrained(target.drafter_path)
    config = drafter.config
    reference = MuseGlimmerAssistantModel(
        MuseGlimmerAssistantConfig(
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_hidden_layers=config.num_hidden_layers,
            num_attention_heads=config.num_attention_heads,
            num_key_value_heads=config.num_key_value_heads,
            head_dim=config.head_dim,
            rms_norm_eps=config.rms_norm_eps,
            rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
            layer_types=["full_attention"] * config.num_hidden_layers,
            target_layer_ids=list(config.target_layer_ids),
            block_size=config.block_size,
            mask_token_id=config.mask_token_id,
        )
    ).eval()
    renamed = {"fc.weight": "encoder.fc.weight", "hidden_norm.weight": "encoder.output_norm_enc.weight"}
    reference.load_state_dict({renamed.get(k, k): v for k, v in drafter.state_dict().items()}, strict=True)
    generator = torch.Generator().manual_seed(1)
    context = torch.randn(11, config.num_context_features * config.hidden_size, generator=generator)
    noise = torch.randn(config.block_size, config.hidden_size, generator=generator)
    expected = reference(
        noise_embeds=noise[None],
        context_hidden_states=context[None],
        position_ids=torch.arange(11 + config.block_size)[None],
    ).last_hidden_state[0]
    cache = drafter.new_cache(32)
    drafter.append_context(cache, context[:4])  # appended in two rounds, as decoding does
    drafter.append_context(cache, context[4:])
    torch.testing.assert_close(drafter(noise, cache), expected, rtol=1e-4, atol=1e-4)


def test_sampling_is_reproducible_and_the_same_for_every_policy(target: Target) -> None:
    """Uniforms are tied to output positions, so for one seed every policy emits plain decoding's tokens."""
    engine = engine_for(target, target.drafter_path)
    prompts = target.prompts[:4]
    params = dict(temperature=0.8, top_p=0.95, top_k=40, min_p=0.02, seed=11)

    def run(policy: str, **overrides: object) -> list[tuple[int, ...]]:
        options = {**params, **overrides}
        return [tuple(engine.generate(list(p), NEW_TOKENS, policy=policy, **options).tokens) for p in prompts]

    plain = run("ar")
    assert plain == run("ar") and plain != run("ar", seed=12)
    assert plain != list(target.references[:4])
    vocab = target.model.config.vocab_size
    assert all(0 <= token < vocab for tokens in plain for token in tokens)
    for policy in ("chain", "adaptive"):
        assert run(policy) == plain, policy
    sequences = tuple(p + t for p, t in zip(prompts, plain, strict=True))
    oracle_engine = engine_for(target, OracleProposer(sequences, vocab))
    results = [oracle_engine.generate(list(p), NEW_TOKENS, policy="bucketed", **params) for p in prompts]
    assert [tuple(r.tokens) for r in results] == plain
    assert sum(r.mean_accept_length for r in results) / len(results) > 4.0


def test_top_k_one_sampling_is_greedy(target: Target) -> None:
    engine = engine_for(target, target.drafter_path)
    for prompt, reference in zip(target.prompts[:3], target.references[:3], strict=True):
        result = engine.generate(list(prompt), NEW_TOKENS, temperature=1.3, top_k=1, seed=0, policy="fixed:8")
        assert tuple(result.tokens) == reference


def test_step_statistics_are_consistent(target: Target) -> None:
    engine = engine_for(target, OracleProposer(target.sequences(), target.model.config.vocab_size))
    result = engine.generate(list(target.prompts[3]), NEW_TOKENS, policy="adaptive")
    assert sum(step.emitted for step in result.steps) + 1 == len(result.tokens)
    for step in result.steps:
        assert 0 <= step.accepted <= step.nodes and step.width == step.nodes + 1
        assert 1.0 <= step.expected_accept <= step.nodes + 1
        assert step.predicted_verify_seconds > 0 and step.seconds.verify > 0
        stages = step.seconds.draft + step.seconds.plan + step.seconds.verify + step.seconds.accept
        assert 0 < stages <= step.seconds.total
    assert engine.latency.ema_factor != 1.0  # the measured verify times reached the latency model


def test_engine_rejects_bad_setups(target: Target, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no latency model"):
        ReferenceEngine(target.model, target.drafter_path, device=CPU, dtype=torch.float32)
    other = make_tiny_target(tmp_path / "wide", hidden_size=96, heads=4, head_dim=24)
    with pytest.raises(DrafterMismatchError, match="hidden_size 64 differs"):
        ReferenceEngine(other, target.drafter_path, device=CPU, dtype=torch.float32, hardware=HARDWARE)
    engine = ReferenceEngine(target.model, None, device=CPU, dtype=torch.float32, hardware=HARDWARE)
    with pytest.raises(ValueError, match="no drafter"):
        engine.generate([1, 2], 4, policy="adaptive")
    with pytest.raises(ValueError, match="width buckets"):
        engine.resolve_policy("bucketed")
    with pytest.raises(ValueError, match="largest width bucket"):
        engine_for(target, target.drafter_path).generate([1, 2], 4, policy="fixed:100")
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.generate([1, 2], 0, policy="ar")
    with pytest.raises(ValueError, match="top_p"):
        engine.generate([1, 2], 4, temperature=1.0, top_p=0.0, policy="ar")


LAW_DRAWS = 400
"""Seeds of the law check: the counts it compares are a function of them (fixed seeds, fixed outputs)."""


def test_sampled_tokens_follow_the_targets_law(target: Target) -> None:
    """The law, where it is cheap: over LAW_DRAWS seeds, the pair (the prefill's token, the first token of the
    first speculative step) follows the target's processed distribution (temperature 2, top-k 3). Every pair's
    count lies within five standard deviations of its expected count, and the counts' total variation from the
    law is under 0.08. A walk that ignored the temperature or the top-k, or emitted the drafter's token
    unverified, draws another law."""
    engine = engine_for(target, target.drafter_path)
    prompt = list(target.prompts[1])
    temperature, top_k = 2.0, 3

    def law(ids: list[int]) -> dict[int, float]:
        with torch.no_grad():
            logits = target.model(torch.tensor([ids])).logits[0, -1].double() / temperature
        kept = torch.topk(logits, top_k)
        return dict(zip(kept.indices.tolist(), torch.softmax(kept.values, -1).tolist(), strict=True))

    counts: dict[tuple[int, int], int] = {}
    for seed in range(LAW_DRAWS):
        result = engine.generate(prompt, 2, temperature=temperature, top_k=top_k, seed=seed, policy="chain")
        pair = (int(result.tokens[0]), int(result.tokens[1]))
        counts[pair] = counts.get(pair, 0) + 1
    expected = {
        (first, second): p * q
        for first, p in law(prompt).items()
        for second, q in law([*prompt, first]).items()
    }
    assert set(counts) <= set(expected), f"pairs outside the law's support: {set(counts) - set(expected)}"
    for pair, probability in expected.items():
        mean = LAW_DRAWS * probability
        spread = 5 * (LAW_DRAWS * probability * (1 - probability)) ** 0.5 + 1
        assert abs(counts.get(pair, 0) - mean) <= spread, (pair, counts.get(pair, 0), mean)
    distance = 0.5 * sum(abs(counts.get(pair, 0) / LAW_DRAWS - p) for pair, p in expected.items())
    assert distance < 0.08, distance
