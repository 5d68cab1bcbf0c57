"""`request_support`: which request parameters a BASTION server refuses, by name (`unsupported_parameter`),
and which a synthetic acceptance profile does not describe (`unsupported_under_synthetic_acceptance`)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from bastion_sglang.integration.request_support import (
    GRAMMAR_FIELDS,
    REFUSAL_PREFIX,
    unsupported_parameter,
    unsupported_under_synthetic_acceptance,
)
from bastion_sglang.integration.sglang_adapter import REQUEST_FIELDS, Internal


def fake_req(**fields: Any) -> SimpleNamespace:
    """The fields of SGLang's `Req` the check reads, all at their accepted defaults unless given."""
    unset = ("watermark", "beam_width", "stop_strs", "stop_regex_strs", "stop_token_ids", *GRAMMAR_FIELDS)
    params = SimpleNamespace(
        **{name: fields.pop(name, None) for name in unset},
        ignore_eos=fields.pop("ignore_eos", False),
        temperature=fields.pop("temperature", 0.0),
        top_k=fields.pop("top_k", -1),
    )
    defaults = dict(custom_logit_processor=None)
    return SimpleNamespace(sampling_params=params, **(defaults | fields))


def test_plain_requests_pass() -> None:
    assert unsupported_parameter(fake_req()) is None
    assert unsupported_parameter(fake_req(beam_width=1)) is None
    assert unsupported_parameter(fake_req(ignore_eos=True)) is None
    for name in GRAMMAR_FIELDS:
        assert unsupported_parameter(fake_req(**{name: "x"})) is None


@pytest.mark.parametrize("fields", [{"return_hidden_states": True}, {"return_sampling_mask": True}])
def test_hidden_states_and_sampling_masks_are_served(fields: dict[str, Any]) -> None:
    """BASTION returns both (`request_outputs`); SGLang's own checks for the DFlash family still apply."""
    assert unsupported_parameter(fake_req(**fields)) is None


@pytest.mark.parametrize(
    ("name", "fields"),
    [
        ("custom_logit_processor", {"custom_logit_processor": "{}"}),
        ("watermark", {"watermark": {"key": 1}}),
        ("beam_width", {"beam_width": 4}),
        *(("ignore_eos with a grammar", {"ignore_eos": True, name: "x"}) for name in GRAMMAR_FIELDS),
    ],
)
def test_each_refusal_names_its_parameter(name: str, fields: dict[str, Any]) -> None:
    message = unsupported_parameter(fake_req(**fields))
    assert message is not None and message.startswith(REFUSAL_PREFIX) and name in message


class Recording:
    """A request or its sampling parameters that records which attributes are read (and has no defaults: a
    field it lacks raises AttributeError)."""

    def __init__(self, fields: dict[str, Any]) -> None:
        object.__setattr__(self, "fields", fields)
        object.__setattr__(self, "read", set())

    def __getattr__(self, name: str) -> Any:
        self.read.add(name)
        try:
            return self.fields[name]
        except KeyError:
            raise AttributeError(name) from None


def recording_req(drop: str | None = None) -> Recording:
    """A plain request whose every field a refusal may read is set (ignore_eos on, so the grammar fields are
    read too), except `drop`."""
    fake = fake_req(ignore_eos=True)
    params = {key: value for key, value in vars(fake.sampling_params).items() if key != drop}
    req = {key: value for key, value in vars(fake).items() if key != drop}
    if "sampling_params" in req:
        req["sampling_params"] = Recording(params)
    return Recording(req)


def test_every_field_a_refusal_reads_is_declared_in_the_adapter() -> None:
    """The refusals read exactly the fields `sglang_adapter.REQUEST_FIELDS` declares (and checks against
    the installed SGLang), so an SGLang rename is reported there."""
    req = recording_req()
    assert unsupported_parameter(req) is None
    assert unsupported_under_synthetic_acceptance(req) is None
    read = {("Req", name) for name in req.read} | {
        ("SamplingParams", name) for name in req.fields["sampling_params"].read
    }
    assert read == {(field.name, field.attribute) for field in REQUEST_FIELDS}


@pytest.mark.parametrize("field", REQUEST_FIELDS, ids=str)
def test_a_missing_field_fails_closed(field: Internal) -> None:
    """A field SGLang no longer has is an error, never a silently accepted request."""
    with pytest.raises(AttributeError, match=str(field.attribute)):
        req = recording_req(drop=field.attribute)
        unsupported_parameter(req)
        unsupported_under_synthetic_acceptance(req)


def test_a_greedy_request_of_fixed_length_is_described_by_a_synthetic_profile() -> None:
    assert unsupported_under_synthetic_acceptance(fake_req(ignore_eos=True)) is None
    assert unsupported_under_synthetic_acceptance(fake_req(ignore_eos=True, temperature=0.7, top_k=1)) is None


@pytest.mark.parametrize(
    ("name", "fields"),
    [
        ("temperature 0.7", {"temperature": 0.7}),
        ("a grammar", {"regex": "a+"}),
        ("stop strings", {"stop_strs": ["\\n"]}),
        ("stop regexes", {"stop_regex_strs": ["x"]}),
        ("stop token ids", {"stop_token_ids": {7}}),
        ("EOS as a stop", {"ignore_eos": False}),
    ],
)
def test_what_a_synthetic_profile_does_not_describe_is_refused(name: str, fields: dict[str, Any]) -> None:
    message = unsupported_under_synthetic_acceptance(fake_req(**({"ignore_eos": True} | fields)))
    assert message is not None and message.startswith(REFUSAL_PREFIX)
    assert f"{name} under synthetic acceptance" in message
    assert unsupported_parameter(fake_req(**({"ignore_eos": True} | fields) | {"regex": None})) is None
