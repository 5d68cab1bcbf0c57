"""Request parameters in a real `sglang.Engine` on CPU: BASTION equals SGLang without speculation.

Tiny random fp32 Qwen3 pair (tests/engine_support.py). The reference is the Engine without speculation and
with overlap scheduling off: SGLang's overlap scheduler cumulates penalty state one step late (a token is
not penalised at the step right after it), so only its non-overlapped run applies the penalties as defined;
BASTION runs without overlap and matches that run. One reference Engine, then one BASTION Engine per policy
(chain, fixed:6, adaptive; module-scoped), each sending the same batches at T = 0, >= 128 new tokens:
- a batch of 8 mixing repetition, frequency and presence penalties, min_new_tokens over stop ids the model
  emits early (banned for the whole run in one request, until token 40 in another, with repetition in a
  third), logit_bias, and one request without parameters. SGLang applies its penalizers one after the
  other in the iteration order of a set of classes, which changes from process to process: requests
  combining repetition with frequency or presence (or frequency with presence) are not reproducible across
  SGLang processes themselves, so each request here combines only penalties whose order does not matter
  (the kernel test checks combinations in every order against SGLang's penalizers);
- stop strings with penalties (a batch of 4, the stop cut from the reference's penalised texts);
- structured outputs: json_schema and regex (a batch of 4, two with penalties), and on each BASTION Engine
  the same grammars sampled at T = 0.8 (seeded, a batch of 4): every output completes its grammar; and
  one prompt under four seeds gives four outputs (engine_support's seed probe).
A parameter BASTION cannot honour exactly (custom_logit_processor) is refused per request with SGLang's
error (a ValueError naming the parameter from `Engine.generate`), and the Engine keeps serving: the next
request equals the reference. The BASTION Engines allow hidden states (`--enable-return-hidden-states`, which
makes the target keep its final-norm states), so these equalities also hold with that switch on.
"""

from __future__ import annotations

import dataclasses
import json
import re
import string
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sglang
from engine_support import (
    PROMPTS,
    assert_seeds_sample,
    engine_server_args,
    first_difference,
    make_model_pair,
    seed_probe,
)
from sglang.srt.sampling.custom_logit_processor import DisallowedTokensLogitsProcessor

from bastion_sglang.integration.request_support import REFUSAL_PREFIX
from bastion_sglang.registration import make_config

pytestmark = pytest.mark.slow

MAX_NEW_TOKENS = 128
GREEDY = {"temperature": 0.0, "max_new_tokens": MAX_NEW_TOKENS, "ignore_eos": True}
MIN_NEW_PARTIAL = 40
JSON_SCHEMA = json.dumps(
    {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    }
)
REGEX = r"(yes|no) [a-z]{3,20}\.( [a-z]{1,10}){2,8}"
ENGINE_ARGS = {"constrained_json_disable_any_whitespace": True}
"""Both Engines: JSON without free whitespace (else a random model writes only whitespace)."""


@dataclasses.dataclass(frozen=True)
class Derived:
    """Request values cut from the reference's own outputs."""

    plain: list[list[int]]  # greedy output ids of prompts 0..5 without parameters
    stop_ids: list[int]  # tokens the unconstrained greedy runs emit early
    banned_token: int  # the first greedy token of prompt 0, pushed down by logit_bias
    stops: list[str]  # stop strings found in the penalised reference texts


def mixed_params(derived: Derived) -> list[dict[str, Any]]:
    """The penalties batch: one parameter set per prompt."""
    stop_ids = derived.stop_ids
    return [
        dict(GREEDY, repetition_penalty=1.3),
        dict(GREEDY, frequency_penalty=0.6),
        dict(GREEDY, presence_penalty=0.8),
        dict(GREEDY, ignore_eos=False, stop_token_ids=stop_ids, min_new_tokens=MAX_NEW_TOKENS),
        dict(GREEDY, ignore_eos=False, stop_token_ids=stop_ids, min_new_tokens=MIN_NEW_PARTIAL),
        dict(GREEDY, logit_bias={str(derived.banned_token): -100.0, "101": 2.0}),
        dict(
            GREEDY,
            ignore_eos=False,
            stop_token_ids=derived.stop_ids,
            repetition_penalty=1.2,
            min_new_tokens=9,
        ),
        dict(GREEDY),
    ]


def stop_params(derived: Derived) -> list[dict[str, Any]]:
    penalties = (dict(frequency_penalty=0.6), dict(presence_penalty=0.8))
    return [
        dict(GREEDY, stop=[stop], **penalty) for stop, penalty in zip(derived.stops, penalties, strict=True)
    ]


STRUCTURED = [
    dict(GREEDY, ignore_eos=False, json_schema=JSON_SCHEMA),
    dict(GREEDY, ignore_eos=False, regex=REGEX),
    dict(GREEDY, ignore_eos=False, json_schema=JSON_SCHEMA, repetition_penalty=1.3),
    dict(GREEDY, ignore_eos=False, regex=REGEX, frequency_penalty=0.5),
]
"""Structured requests end where their grammar completes (EOS)."""
BOUNDED_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "ok": {"type": "boolean"}},
    "required": ["name", "ok"],
    "additionalProperties": False,
}
"""A schema every sampled output can complete within MAX_NEW_TOKENS (no unbounded number or string)."""
SAMPLED = [
    {
        "temperature": 0.8,
        "max_new_tokens": MAX_NEW_TOKENS,
        "sampling_seed": 11 + i,
        **grammar,
        **penalty,
    }
    for i, (grammar, penalty) in enumerate(
        (
            ({"json_schema": json.dumps(BOUNDED_SCHEMA)}, {}),
            ({"regex": REGEX}, {}),
            ({"json_schema": json.dumps(BOUNDED_SCHEMA)}, {"presence_penalty": 0.8}),
            ({"regex": REGEX}, {"top_k": 8, "top_p": 0.9, "min_p": 0.05}),
        )
    )
]
"""Structured requests sampled at T > 0: BASTION's output must always complete the grammar."""


@dataclasses.dataclass(frozen=True)
class Run:
    """Output ids (and texts) one Engine returned per batch."""

    mixed: list[list[int]]
    stop: list[tuple[list[int], str]]
    structured: list[tuple[list[int], str]]
    sampled: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (text, finish reason type)
    probe: list[list[int]] = dataclasses.field(default_factory=list)  # engine_support.seed_probe's outputs


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return make_model_pair(tmp_path_factory.mktemp("request_params"))


def _derive(engine: Any) -> Derived:
    """Plain greedy runs of prompts 0..5, and the request values cut from them and from penalised runs."""
    plain = [out["output_ids"] for out in engine.generate(input_ids=PROMPTS[:6], sampling_params=GREEDY)]
    penalised = engine.generate(
        input_ids=PROMPTS[1:3],
        sampling_params=[dict(GREEDY, frequency_penalty=0.6), dict(GREEDY, presence_penalty=0.8)],
    )
    return Derived(
        plain=plain,
        stop_ids=sorted({token for ids in plain[3:5] for token in ids[2:6]}),
        banned_token=plain[0][0],
        stops=_stops_from([out["text"] for out in penalised]),
    )


def _stops_from(texts: list[str]) -> list[str]:
    """A printable two-character string from the second quarter of each text."""
    printable = set(string.ascii_letters + string.digits + string.punctuation)
    stops = []
    for text in texts:
        pairs = [
            text[j : j + 2] for j in range(len(text) // 4, len(text) - 1) if set(text[j : j + 2]) <= printable
        ]
        assert pairs, f"no printable pair in the reference text {text!r}"
        stops.append(pairs[0])
    return stops


def _run(engine: Any, derived: Derived, sampled: bool = False) -> Run:
    mixed = engine.generate(input_ids=PROMPTS, sampling_params=mixed_params(derived))
    stop = engine.generate(input_ids=PROMPTS[1:3], sampling_params=stop_params(derived))
    structured = engine.generate(input_ids=PROMPTS[4:8], sampling_params=STRUCTURED)
    outputs = engine.generate(input_ids=PROMPTS[:4], sampling_params=SAMPLED) if sampled else []
    probe = seed_probe(engine) if sampled else []
    return Run(
        mixed=[out["output_ids"] for out in mixed],
        stop=[(out["output_ids"], out["text"]) for out in stop],
        structured=[(out["output_ids"], out["text"]) for out in structured],
        sampled=[(out["text"], out["meta_info"]["finish_reason"]["type"]) for out in outputs],
        probe=probe,
    )


@pytest.fixture(scope="module")
def reference_run(models: tuple[Path, Path]) -> tuple[Run, Derived]:
    """The Engine without speculation (overlap off), and the values cut from its outputs."""
    engine = sglang.Engine(
        server_args=engine_server_args(models, None, disable_overlap_schedule=True, **ENGINE_ARGS)
    )
    try:
        derived = _derive(engine)
        return _run(engine, derived), derived
    finally:
        engine.shutdown()


POLICIES = ("chain", "fixed:6", "adaptive")


REFUSED = {
    "custom_logit_processor": {"custom_logit_processor": DisallowedTokensLogitsProcessor.to_str()},
}
"""Engine.generate keyword arguments per refused parameter (the Engine enables the feature)."""
REFUSED_PARAMS = dict(GREEDY, max_new_tokens=4, custom_params={"token_ids": [5]})
"""The refused requests' sampling parameters (SGLang still prefills an aborted request, and the
processor needs its custom_params there)."""


def _refusals(engine: Any) -> dict[str, str]:
    """The error message of one request per refused parameter."""
    messages = {}
    for name, kwargs in REFUSED.items():
        with pytest.raises(ValueError) as error:
            engine.generate(input_ids=PROMPTS[0], sampling_params=REFUSED_PARAMS, **kwargs)
        messages[name] = str(error.value)
    return messages


@pytest.fixture(scope="module", params=POLICIES)
def bastion(
    request: pytest.FixtureRequest, models: tuple[Path, Path], reference_run: tuple[Run, Derived]
) -> Iterator[tuple[str, Run, dict[str, str]]]:
    """One BASTION Engine per policy: (policy, what it returned, its refusal messages)."""
    config = make_config(max_budget=8, policy=request.param, topk=4)
    engine = sglang.Engine(
        server_args=engine_server_args(
            models,
            config,
            enable_custom_logit_processor=True,
            enable_return_hidden_states=True,
            **ENGINE_ARGS,
        )
    )
    try:
        refusals = _refusals(engine)
        yield request.param, _run(engine, reference_run[1], sampled=True), refusals
    finally:
        engine.shutdown()


def test_the_parameters_bite(reference_run: tuple[Run, Derived]) -> None:
    """The reference outputs show each parameter at work (else equality below would prove nothing)."""
    run, derived = reference_run
    assert len(run.mixed[3]) == MAX_NEW_TOKENS and not set(run.mixed[3]) & set(derived.stop_ids)
    assert MIN_NEW_PARTIAL <= len(run.mixed[4]) < MAX_NEW_TOKENS, "min_new_tokens 40 must end at a stop id"
    assert derived.banned_token not in run.mixed[5]
    for i in (0, 1, 2, 5):
        assert run.mixed[i] != derived.plain[i], f"request {i}: its parameter changed nothing"
    assert all(len(ids) < MAX_NEW_TOKENS for ids, _ in run.stop), "the stop strings must cut the runs"
    for _, text in run.structured[0::2]:
        assert re.match(r'\{"name": ?"', text), text
    for _, text in run.structured[1::2]:
        assert re.match(r"(yes|no) [a-z]{3}", text), text


def test_penalties_min_new_tokens_logit_bias_equal_no_speculation(
    bastion: tuple[str, Run, dict[str, str]], reference_run: tuple[Run, Derived]
) -> None:
    name, run, _ = bastion
    for i, (got, want) in enumerate(zip(run.mixed, reference_run[0].mixed, strict=True)):
        assert got == want, f"{name}: request {i} diverges at token {first_difference(got, want)}"


def test_stop_strings_with_penalties_equal_no_speculation(
    bastion: tuple[str, Run, dict[str, str]], reference_run: tuple[Run, Derived]
) -> None:
    name, run, _ = bastion
    assert run.stop == reference_run[0].stop, name


def test_json_schema_and_regex_equal_no_speculation(
    bastion: tuple[str, Run, dict[str, str]], reference_run: tuple[Run, Derived]
) -> None:
    name, run, _ = bastion
    for i, (got, want) in enumerate(zip(run.structured, reference_run[0].structured, strict=True)):
        assert got == want, (
            f"{name}: structured request {i} diverges at token {first_difference(got[0], want[0])}"
        )


def test_sampled_structured_outputs_complete_their_grammar(bastion: tuple[str, Run, dict[str, str]]) -> None:
    """At T = 0.8 every json_schema output parses and fits the schema, every regex output matches whole,
    and each ended because its grammar completed (not at the length limit)."""
    name, run, _ = bastion
    assert len(run.sampled) == len(SAMPLED)
    for (text, finish), params in zip(run.sampled, SAMPLED, strict=True):
        assert finish == "stop", f"{name}: {text!r} ended by {finish}"
        if "regex" in params:
            assert re.fullmatch(REGEX, text), f"{name}: {text!r} does not match the regex"
        else:
            value = json.loads(text, strict=False)  # the grammar admits raw control characters in strings
            assert set(value) == {"name", "ok"}, f"{name}: {text!r}"
            assert isinstance(value["name"], str) and len(value["name"]) <= 8, f"{name}: {text!r}"
            assert isinstance(value["ok"], bool), f"{name}: {text!r}"


def test_sampling_samples(bastion: tuple[str, Run, dict[str, str]]) -> None:
    """One prompt under several seeds gives as many outputs (engine_support.assert_seeds_sample)."""
    _, run, _ = bastion
    assert_seeds_sample(run.probe)


def test_unsupported_parameters_are_refused_per_request(bastion: tuple[str, Run, dict[str, str]]) -> None:
    """Each refused request names its parameter; the requests after them (the batches above) still ran."""
    name, _, refusals = bastion
    for parameter, message in refusals.items():
        assert REFUSAL_PREFIX in message and parameter in message, (name, message)
