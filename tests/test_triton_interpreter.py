"""BASTION's Triton kernels (`kernels/triton_tree.py`, `triton_accept.py`, `triton_kv.py`) run under Triton's
interpreter on the CPU and equal their torch references (`tests/interpreted/bastion_kernels.py`), so a kernel
bug fails CI before a GPU runs it."""

from __future__ import annotations

import pytest
from interpreter_lane import run_interpreted

pytestmark = pytest.mark.slow


def test_bastion_kernels_equal_their_references_under_the_interpreter() -> None:
    output = run_interpreted("bastion_kernels.py")
    assert " passed" in output and "skipped" not in output
