"""SGLang's Triton kernels of a TARGET_VERIFY pass (the KV index stream, `extend_attention_fwd` with the
flat custom mask BASTION lays out, the paged commit's KV copy) run under Triton's interpreter on the CPU, on
trees from the planner, and equal a dense masked attention (`tests/interpreted/sglang_verify_attention.py`):
the mask layout the GPU reads is checked before a GPU reads it."""

from __future__ import annotations

import pytest
from interpreter_lane import run_interpreted

pytestmark = pytest.mark.slow


def test_sglang_verify_attention_on_bastion_trees_under_the_interpreter() -> None:
    output = run_interpreted("sglang_verify_attention.py")
    assert " passed" in output and "skipped" not in output
