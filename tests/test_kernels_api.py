"""Package-level contract of bastion_sglang.kernels: exports, device dispatch, no Triton import on load."""

from __future__ import annotations

import subprocess
import sys

import torch

import bastion_sglang.kernels as kernels


def test_public_names_are_exported():
    for name in kernels.__all__:
        assert hasattr(kernels, name), name
    assert kernels.NO_NODE == -1
    assert kernels.NO_MOVE == -1


def test_cpu_tensors_use_the_torch_reference():
    assert not kernels.uses_triton(torch.zeros(1))


def test_importing_the_package_does_not_import_triton():
    code = "import sys, bastion_sglang.kernels; print('triton' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert result.stdout.strip() == "False"
