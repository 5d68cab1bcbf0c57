"""`request_support.unsupported_parameter`: which request parameters a BASTION server refuses, by name."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from bastion_sglang.request_support import (
    GRAMMAR_FIELDS,
    REFUSAL_PREFIX,
    unsupported_parameter,
)


def fake_req(**fields: Any) -> SimpleNamespace:
    """The fields of SGLang's `Req` the check reads, all at their accepted defaults unless given."""
    params = SimpleNamespace(
        **{name: fields.pop(name, None) for name in ("watermark", "beam_width", *GRAMMAR_FIELDS)},
        ignore_eos=fields.pop("ignore_eos", False),
    )
    defaults = dict(custom_logit_processor=None, return_hidden_states=False, return_sampling_mask=False)
    return SimpleNamespace(sampling_params=params, **(defaults | fields))


def test_plain_requests_pass() -> None:
    assert unsupported_parameter(fake_req()) is None
    assert unsupported_parameter(fake_req(beam_width=1)) is None
    assert unsupported_parameter(fake_req(ignore_eos=True)) is None
    for name in GRAMMAR_FIELDS:
        assert unsupported_parameter(fake_req(**{name: "x"})) is None


@pytest.mark.parametrize(
    ("name", "fields"),
    [
        ("custom_logit_processor", {"custom_logit_processor": "{}"}),
        ("return_hidden_states", {"return_hidden_states": True}),
        ("watermark", {"watermark": {"key": 1}}),
        ("return_sampling_mask", {"return_sampling_mask": True}),
        ("beam_width", {"beam_width": 4}),
        *(("ignore_eos with a grammar", {"ignore_eos": True, name: "x"}) for name in GRAMMAR_FIELDS),
    ],
)
def test_each_refusal_names_its_parameter(name: str, fields: dict[str, Any]) -> None:
    message = unsupported_parameter(fake_req(**fields))
    assert message is not None and message.startswith(REFUSAL_PREFIX) and name in message
