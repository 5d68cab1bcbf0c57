"""Request parameters BASTION cannot honour exactly, refused per request with SGLang's own error path.

SGLang's scheduler validates every request of a DFlash-family algorithm with `validate_dflash_request`;
an error message there finishes the request with an abort that carries the message back to the client
(HTTP 400 on the server), and the server keeps serving. `registration` wraps that check so a BASTION server
also refuses what its tree step would otherwise silently change:

- `custom_logit_processor`: SGLang calls it once per request per step, after the output so far; a tree
  step verifies many positions of a request in one pass, and a processor's result may depend on the
  position or the request's state (it receives the request), which BASTION cannot replay per node;
- `watermark`: SGLang's watermark biases its own sampler's candidates, which the sampling walk bypasses;
- `beam_width` > 1: beam search replaces decoding, speculation does not apply to it;
- `ignore_eos` with a grammar (`json_schema`, `regex`, `ebnf`, `structural_tag`): once the grammar is
  complete it admits only EOS, which `ignore_eos` forbids; SGLang then emits one token outside the grammar
  (the argmax of a fully masked row) before it stops, which a tree step does not reproduce.

Every field a refusal reads is declared in `sglang_adapter.REQUEST_FIELDS` (checked against the installed
SGLang when the adapter is imported, which importing this module does) and read directly, never through a
default: a field SGLang renames is named by that check, and reading it raises, so a refusal never turns off
silently.

Under synthetic acceptance (`BastionConfig.synthetic_acceptance`, a speed benchmark whose acceptance follows a
profile of greedy continuations, not the target) a request is also refused when the profile does not describe
it (`unsupported_under_synthetic_acceptance`): a temperature above 0 (the profiles are measured at T = 0),
a grammar (it would constrain tokens the profile draws), or any stop condition but the length (stop strings,
stop regexes, stop token ids, or EOS without `ignore_eos`: the synthetic tokens say nothing of where the text
would end).

`return_hidden_states` and `return_sampling_mask` are served (`request_outputs`), under SGLang's own rules for
the DFlash family: no hidden states under overlap scheduling, no sampling masks with min_p.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from bastion_sglang.integration import sglang_adapter  # noqa: F401  (importing it checks REQUEST_FIELDS)

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req

GRAMMAR_FIELDS = ("json_schema", "regex", "ebnf", "structural_tag")
"""Sampling parameters that constrain the output with a grammar."""
REFUSAL_PREFIX = "--speculative-algorithm BASTION cannot honour"
"""How every refusal message starts (the parameter's name follows)."""


def unsupported_parameter(req: Req) -> str | None:
    """The refusal message for the first parameter of `req` BASTION cannot honour exactly, or None."""
    params = req.sampling_params
    refusals = (
        (req.custom_logit_processor is not None, "custom_logit_processor", "it may depend on the position"),
        (params.watermark is not None, "watermark", "the tree sampler bypasses it"),
        ((params.beam_width or 1) > 1, "beam_width", "beam search is not speculative"),
        (
            bool(params.ignore_eos) and _has_grammar(params),
            "ignore_eos with a grammar",
            "a complete grammar admits only EOS",
        ),
    )
    for refused, name, reason in refusals:
        if refused:
            return f"{REFUSAL_PREFIX} {name} ({reason}); send it to a server without speculation"
    return None


def unsupported_under_synthetic_acceptance(req: Req) -> str | None:
    """The refusal message for the first parameter of `req` a synthetic acceptance profile does not describe
    (module docstring), or None."""
    params = req.sampling_params
    refusals = (
        (params.top_k != 1 and params.temperature > 0.0, f"temperature {params.temperature}", "T = 0 only"),
        (_has_grammar(params), "a grammar", "it constrains the tokens the profile draws"),
        (bool(params.stop_strs), "stop strings", "only the length may end a request"),
        (bool(params.stop_regex_strs), "stop regexes", "only the length may end a request"),
        (bool(params.stop_token_ids), "stop token ids", "only the length may end a request"),
        (not params.ignore_eos, "EOS as a stop", "send ignore_eos=True: only the length may end a request"),
    )
    for refused, name, reason in refusals:
        if refused:
            return (
                f"{REFUSAL_PREFIX} {name} under synthetic acceptance ({reason}); synthetic acceptance "
                "profiles describe greedy continuations of a fixed length"
            )
    return None


def _has_grammar(params: Any) -> bool:
    """Whether the sampling parameters constrain the output with a grammar (any of GRAMMAR_FIELDS set; a
    missing field raises AttributeError)."""
    return any(getattr(params, name) is not None for name in GRAMMAR_FIELDS)
