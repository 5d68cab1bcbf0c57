"""The heavy lane of SGLang's speculative-server kits against BASTION (tests/test_spec_server_kits.py).

Not collected by the suite (the file name does not match `test_*.py`); `scripts/spec-kits.sh` runs it by
path. Its own BASTION server, with the fixture, flags and thresholds of the suite's lane, runs the kit tests
that lane leaves out or shrinks, at SGLang's sizes:
- SpecCorrectnessKit.test_acc_length (5 x 512 new tokens) and test_eos_token (up to 1,024);
- SpecLogprobKit.test_logprob_match (512 sampled tokens, then their rescoring by a prefill);
- SpecFeatureKit.test_constrained_decoding (a json_object chat reply without max_tokens: the demo target
  went past 900 tokens, at under 1 token/s on a loaded 2-core machine with a grammar on every tree node);
- SpecFeatureKit.test_radix_attention on SGLang's 400-request tree and test_request_abort with SGLang's
  fixture's 1,024 new tokens per surviving request.
"""

from __future__ import annotations

import test_spec_server_kits as suite


class TestBastionSpecKitsHeavy(suite.BastionKitsBase):
    """The kit tests the suite's lane leaves out or shrinks, at SGLang's sizes (module docstring)."""

    __test__ = True
    abort_kit_new_tokens = 1024
    test_parity_vs_reference = None
    test_batch_generation = None
    test_first_token_finish = None
    test_logprob_start_len = None
    test_logprob_mixed = None
    test_logprob_decode_match_prefill = None
    test_token_ids_logprob_ragged = None
    test_penalty_mixed = None
    test_return_hidden_states = None
    test_grammar_structured_output_no_trailing_tokens = None
    test_grammar_logprob_count_matches_completion_tokens = None
    test_sampling_mask = None

    @classmethod
    def setUpClass(cls) -> None:
        """The BASTION server only: SpecParityKit's reference server serves no test of this lane."""
        cls.set_up_model()
        suite.BastionServerBase.setUpClass.__func__(cls)
