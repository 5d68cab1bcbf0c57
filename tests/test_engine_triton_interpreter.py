"""BASTION in `sglang.Engine` on SGLang's CUDA attention path (`--attention-backend triton`) on the CPU,
every Triton kernel under Triton's interpreter: greedy outputs with tree verification equal SGLang without
speculation on the same backend (`tests/interpreted/engine_triton.py`, which names the refusal it patches)."""

from __future__ import annotations

import pytest
from interpreter_lane import run_interpreted

pytestmark = pytest.mark.slow

ENGINE_LANE_TIMEOUT_S = 1080
"""Two Engine starts and their interpreted forwards: 310 s at load 30 on two cores."""


@pytest.mark.timeout(1200)
def test_bastion_engine_on_the_triton_backend_under_the_interpreter() -> None:
    output = run_interpreted("engine_triton.py", timeout_s=ENGINE_LANE_TIMEOUT_S)
    assert " passed" in output and "skipped" not in output
