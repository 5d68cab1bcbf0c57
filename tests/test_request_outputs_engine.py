"""Hidden states and sampling masks in a real `sglang.Engine` on CPU: BASTION returns what SGLang without
speculation returns, token for token.

Tiny random fp32 Qwen3 pair (tests/engine_support.py), radix cache off in every Engine (a cached prefix is
not prefilled again, so its hidden states would not be returned). One reference Engine without speculation
(overlap off), then one BASTION Engine per configuration, then the reference again for the replays below;
one after another (two Engines in one process share its configuration). The reference and each BASTION
Engine send:
- a greedy batch of 4 (hidden states whole or "last", masks with the selected or the whole support's
  log-probabilities);
- a batch of 8 mixing greedy requests (one with a frequency penalty) and seeded sampled ones (top-k,
  top-p), each with or without hidden states and masks;
- (BASTION only) one prompt under four seeds, which must give four outputs (engine_support's seed probe).
Greedy requests emit the reference's tokens, so their hidden states (per token, fp32 tolerance) and masks
(token ids exactly, log-probabilities to 1e-4) are compared with the reference's. A seeded sampled request
emits other tokens than SGLang's sampler would, so the reference is asked along BASTION's own tokens: one
prefill of the prompt and all but the last output token gives the hidden state at every position, and one
request per output token, prefilling the prompt and the tokens before it, gives the support SGLang's
sampler draws that token from. Configurations: fixed:8 and the adaptive policy with the test-only oracle
drafter (tests/oracle_drafter.py, with decoys beside the reference path; half the prompts switch between
text the drafter predicts and text it does not, so accepted paths vary from none to several nodes and the
adaptive policy also decodes plainly),
and fixed:8 under overlap scheduling. SGLang refuses hidden states with overlap scheduling for the whole
DFlash family (`validate_dflash_request`), BASTION included: that Engine checks masks only, and the refusal.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import sglang
import torch
from engine_support import (
    PROMPTS,
    assert_seeds_sample,
    engine_server_args,
    first_difference,
    make_model_pair,
    seed_probe,
)
from oracle_drafter import write_references
from sglang.srt.managers.io_struct import GenerateReqInput

from bastion_sglang.registration import make_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]
"""Five Engine runs in one fixture, which the first test pays for (196 s on two cores at load 5 to 8)."""

MAX_NEW_TOKENS = 24
GREEDY = {"temperature": 0.0, "max_new_tokens": MAX_NEW_TOKENS, "ignore_eos": True}
ENGINE_ARGS = {"enable_return_hidden_states": True, "disable_radix_cache": True}
HIDDEN_ATOL = 1e-4
"""fp32: a verify pass and a decode step sum in different orders (measured differences ~2e-6)."""
LOGPROB_ATOL = 1e-4


@dataclasses.dataclass(frozen=True)
class Ask:
    """One request: its sampling parameters, return_hidden_states (False, True or "last") and
    sampling_logprobs_mode (None: no mask; "selected" or "support")."""

    params: dict[str, Any]
    hidden: bool | str = False
    mask: str | None = None

    @property
    def greedy(self) -> bool:
        return self.params["temperature"] == 0.0


def sampled(seed: int, **filters: Any) -> dict[str, Any]:
    return {
        "temperature": 0.8,
        "max_new_tokens": MAX_NEW_TOKENS,
        "ignore_eos": True,
        "sampling_seed": seed,
        **filters,
    }


GREEDY_BATCH = [
    Ask(GREEDY, hidden=True, mask="selected"),
    Ask(GREEDY, hidden="last", mask="support"),
    Ask(GREEDY, hidden=True),
    Ask(GREEDY, mask="support"),
]
MIXED_BATCH = [
    Ask(GREEDY, hidden=True, mask="selected"),
    Ask(sampled(11, top_k=8), hidden=True, mask="support"),
    Ask(dict(GREEDY, frequency_penalty=0.6), hidden="last", mask="support"),
    Ask(sampled(12, top_k=16, top_p=0.9), mask="selected"),
    Ask(GREEDY),
    Ask(sampled(13, presence_penalty=0.5), hidden=True),
    Ask(sampled(14, top_k=8), hidden="last", mask="support"),
    Ask(GREEDY, hidden=True, mask="support"),
]
"""Sampled requests with masks carry no output penalty: the reference's replays prefill the output as prompt,
which output penalties would not see."""
SWITCHING = [PROMPTS[i] for i in (1, 3, 5, 7)]
SWITCH_PERIOD = 8
DECOY_GAP = 0.4
"""The oracle's reference token ~0.6, a decoy ~0.4 at every draft position: the accepted path is not a prefix
of the verify row, so only the compaction order puts its hidden states and masks in place."""


def generate(engine: Any, prompts: list[list[int]], asks: list[Ask]) -> list[dict[str, Any]]:
    """`Engine.generate` with per-request hidden states and sampling masks (which `Engine.generate` does not
    take): the output dicts, in order."""
    obj = GenerateReqInput(
        input_ids=prompts,
        sampling_params=[ask.params for ask in asks],
        return_hidden_states=[ask.hidden for ask in asks],
        return_sampling_mask=[ask.mask is not None for ask in asks],
        sampling_logprobs_mode=[ask.mask for ask in asks],
    )
    return engine.loop.run_until_complete(engine.tokenizer_manager.generate_request(obj, None).__anext__())


@dataclasses.dataclass(frozen=True)
class Output:
    """What one request returned: token ids, hidden states [rows, H] (None: not asked), masks and their
    log-probabilities (None: not asked)."""

    ids: list[int]
    hidden: torch.Tensor | None
    masks: list[list[int]] | None
    logprobs: list[list[float]] | None

    @classmethod
    def of(cls, out: dict[str, Any]) -> Output:
        meta = out["meta_info"]
        hidden = meta.get("hidden_states")
        logprobs = meta.get("output_token_sampling_logprobs")
        return cls(
            ids=out["output_ids"],
            hidden=None if hidden is None else _state_rows(hidden),
            masks=meta.get("output_token_sampling_mask"),
            logprobs=None if logprobs is None else [v if isinstance(v, list) else [v] for v in logprobs],
        )


def _state_rows(hidden: list[Any]) -> torch.Tensor:
    """SGLang's returned hidden states as rows: "last" gives one state; a whole return gives the prefill's
    rows (one list of rows) and then one state per decode token."""
    if not isinstance(hidden[0], list):
        return torch.tensor([hidden])
    rows = [row for entry in hidden for row in (entry if isinstance(entry[0], list) else [entry])]
    return torch.tensor(rows)


@dataclasses.dataclass(frozen=True)
class Run:
    greedy: list[Output]
    mixed: list[Output]
    verify_calls: int
    completion_tokens: int


def _run(engine: Any, hidden: bool = True) -> Run:
    """Both batches; hidden=False asks for no hidden states (overlap scheduling refuses them)."""

    def strip(asks: list[Ask]) -> list[Ask]:
        return asks if hidden else [dataclasses.replace(ask, hidden=False) for ask in asks]

    greedy = generate(engine, PROMPTS[:4], strip(GREEDY_BATCH))
    mixed = generate(engine, PROMPTS, strip(MIXED_BATCH))
    meta = [out["meta_info"] for out in greedy + mixed]
    return Run(
        greedy=[Output.of(out) for out in greedy],
        mixed=[Output.of(out) for out in mixed],
        verify_calls=sum(int(m.get("spec_verify_ct", 0)) for m in meta),
        completion_tokens=sum(int(m["completion_tokens"]) for m in meta),
    )


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return make_model_pair(tmp_path_factory.mktemp("request_outputs"))


CONFIGS = ("fixed:8", "adaptive", "fixed:8 overlap")


@dataclasses.dataclass(frozen=True)
class BastionRun:
    """One BASTION Engine's outputs, its refusal of hidden states under overlap scheduling ("" without), the
    seed probe's outputs, and the reference along its sampled requests' tokens (by index in MIXED_BATCH)."""

    run: Run
    refusal: str
    probe: list[list[int]]
    replays: dict[int, Output]


@dataclasses.dataclass(frozen=True)
class Runs:
    reference: Run
    bastion: dict[str, BastionRun]


@pytest.fixture(scope="module")
def runs(models: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Runs:
    """Every Engine of the module docstring, one after another (an Engine's configuration is its process's:
    two Engines in one process do not run side by side): the reference, one per configuration, then the
    reference again for the replays."""
    reference_args = engine_server_args(models, None, disable_overlap_schedule=True, **ENGINE_ARGS)
    engine = sglang.Engine(server_args=reference_args)
    try:
        plain = [out["output_ids"] for out in engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)]
        reference = _run(engine)
    finally:
        engine.shutdown()
    oracle = write_references(
        tmp_path_factory.mktemp("oracle") / "reference.json",
        PROMPTS,
        plain,
        decoy_gap=DECOY_GAP,
        switch_prompts=SWITCHING,
        switch_period=SWITCH_PERIOD,
    )
    bastion = {name: _bastion_run(name, models, oracle) for name in CONFIGS}
    engine = sglang.Engine(server_args=reference_args)
    try:
        for result in bastion.values():
            for i, ask in enumerate(MIXED_BATCH):
                if not ask.greedy:
                    asked = dataclasses.replace(ask, hidden=False if result.refusal else ask.hidden)
                    result.replays[i] = _replay(engine, PROMPTS[i], result.run.mixed[i].ids, asked)
    finally:
        engine.shutdown()
    return Runs(reference, bastion)


def _bastion_run(name: str, models: tuple[Path, Path], oracle: Path) -> BastionRun:
    """The configuration `name` ("<policy>" or "<policy> overlap") with the oracle drafter: both batches,
    without hidden states under overlap scheduling, where a request for them is refused."""
    policy, _, overlap = name.partition(" ")
    config = dataclasses.replace(
        make_config(policy=policy, max_budget=8, topk=4, overlap=bool(overlap)),
        draft_proposer="oracle_drafter:make_oracle",
        draft_proposer_arg=str(oracle),
    )
    engine = sglang.Engine(
        server_args=engine_server_args(models, config, disable_overlap_schedule=not overlap, **ENGINE_ARGS)
    )
    try:
        refusal = ""
        if overlap:
            with pytest.raises(ValueError) as error:
                generate(engine, PROMPTS[:1], [Ask(dict(GREEDY, max_new_tokens=4), hidden=True)])
            refusal = str(error.value)
        run = _run(engine, hidden=not overlap)
        return BastionRun(run, refusal, seed_probe(engine), {})
    finally:
        engine.shutdown()


def _replay(engine: Any, prompt: list[int], ids: list[int], ask: Ask) -> Output:
    """The reference along BASTION's tokens: hidden states of every position of prompt + ids[:-1] (one
    prefill) and, when asked, the support of each output token (one prefill per token, whole support)."""
    hidden = None
    if ask.hidden:
        prefix = prompt + ids[:-1]
        (out,) = generate(engine, [prefix], [Ask(dict(GREEDY, max_new_tokens=1), hidden=True)])
        hidden = Output.of(out).hidden
        if ask.hidden == "last":
            hidden = hidden[-1:]
    masks = logprobs = None
    if ask.mask is not None:
        one = dict(ask.params, max_new_tokens=1)
        outs = generate(
            engine, [prompt + ids[:j] for j in range(len(ids))], [Ask(one, mask="support")] * len(ids)
        )
        masks = [Output.of(out).masks[0] for out in outs]
        logprobs = [Output.of(out).logprobs[0] for out in outs]
    return Output(ids, hidden, masks, logprobs)


def assert_same_hidden(got: torch.Tensor | None, want: torch.Tensor | None, where: str) -> None:
    assert (got is None) == (want is None), where
    if got is not None:
        assert got.shape == want.shape, f"{where}: {tuple(got.shape)} rows, want {tuple(want.shape)}"
        worst = (got - want).abs().max().item()
        assert worst <= HIDDEN_ATOL, f"{where}: hidden states differ by {worst}"


def assert_same_masks(got: Output, want: Output, where: str) -> None:
    assert (got.masks is None) == (want.masks is None), where
    if got.masks is None:
        return
    assert len(got.masks) == len(got.ids), where
    for j, (mask, wanted) in enumerate(zip(got.masks, want.masks, strict=True)):
        assert mask == wanted, f"{where}, token {j}: mask {mask}, want {wanted}"
        assert got.logprobs[j] == pytest.approx(want.logprobs[j], abs=LOGPROB_ATOL), f"{where}, token {j}"


@pytest.mark.parametrize("name", CONFIGS)
def test_greedy_tokens_hidden_states_and_masks_equal_no_speculation(runs: Runs, name: str) -> None:
    bastion = runs.bastion[name]
    for batch, asks, got_run, want_run in (
        ("greedy", GREEDY_BATCH, bastion.run.greedy, runs.reference.greedy),
        ("mixed", MIXED_BATCH, bastion.run.mixed, runs.reference.mixed),
    ):
        for i, ask in enumerate(asks):
            if not ask.greedy:
                continue
            got, want, where = got_run[i], want_run[i], f"{name}: {batch} request {i}"
            assert got.ids == want.ids, f"{where}: diverges at token {first_difference(got.ids, want.ids)}"
            if not bastion.refusal:
                assert_same_hidden(got.hidden, want.hidden, where)
            assert_same_masks(got, want, where)


@pytest.mark.parametrize("name", CONFIGS)
def test_sampled_hidden_states_and_masks_equal_no_speculation_along_their_tokens(
    runs: Runs, name: str
) -> None:
    """Each sampled request's hidden states and masks against the reference fed the same tokens; a token in
    "selected" mode carries the log-probability of itself within its support."""
    bastion = runs.bastion[name]
    for i, want in bastion.replays.items():
        ask, got, where = MIXED_BATCH[i], bastion.run.mixed[i], f"{name}: mixed request {i}"
        assert_same_hidden(got.hidden, want.hidden, where)
        if ask.mask == "selected":
            selected = [
                [support[mask.index(token)]]
                for token, mask, support in zip(got.ids, want.masks, want.logprobs, strict=True)
            ]
            want = dataclasses.replace(want, logprobs=selected)
        assert_same_masks(got, want, where)


@pytest.mark.parametrize("name", CONFIGS)
def test_seeds_sample(runs: Runs, name: str) -> None:
    """One prompt under several seeds gives as many outputs (engine_support.assert_seeds_sample)."""
    assert_seeds_sample(runs.bastion[name].probe)


@pytest.mark.parametrize("name", CONFIGS)
def test_speculation_ran(runs: Runs, name: str) -> None:
    """fixed:8 verifies a tree at every step and the oracle's paths are accepted, though half the prompts
    switch to text it does not predict and sampled tokens leave its paths (the adaptive policy's trees follow
    this machine's timings)."""
    run = runs.bastion[name].run
    assert 0 < run.verify_calls < run.completion_tokens, name
    if name.startswith("fixed"):
        assert run.completion_tokens / run.verify_calls > 1.5, (name, run.completion_tokens, run.verify_calls)


def test_overlap_scheduling_refuses_hidden_states_as_sglang_does_for_dflash(runs: Runs) -> None:
    refusal = runs.bastion["fixed:8 overlap"].refusal
    assert "return_hidden_states" in refusal, refusal
