"""BASTION's sglang-kernel stand-ins on CUDA equal the same formulas computed on the CPU."""

from __future__ import annotations

import pytest
import torch
from offline_gpu import sgl_kernel_ops


@pytest.mark.parametrize("name", ["silu_and_mul", "gelu_and_mul", "gelu_tanh_and_mul"])
def test_act_and_mul_on_cuda_equals_cpu(device: torch.device, name: str) -> None:
    x = torch.randn(64, 2 * 1024, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    fn = getattr(sgl_kernel_ops, name)
    out = torch.empty(64, 1024, dtype=torch.bfloat16, device=device)
    fn(x.to(device), out)
    torch.testing.assert_close(out.cpu(), fn(x), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("gemma", [False, True])
def test_fused_add_rmsnorm_on_cuda_equals_cpu(device: torch.device, gemma: bool) -> None:
    generator = torch.Generator().manual_seed(1)
    x, residual = (torch.randn(16, 4096, generator=generator).to(torch.bfloat16) for _ in range(2))
    weight = torch.randn(4096, generator=generator).to(torch.bfloat16)
    fused = sgl_kernel_ops.gemma_fused_add_rmsnorm if gemma else sgl_kernel_ops.fused_add_rmsnorm
    x_gpu, residual_gpu = x.to(device), residual.to(device)
    fused(x_gpu, residual_gpu, weight.to(device), 1e-6)
    fused(x, residual, weight, 1e-6)
    torch.testing.assert_close(residual_gpu.cpu(), residual)
    torch.testing.assert_close(x_gpu.cpu(), x, atol=2e-2, rtol=2e-2)


def test_renorm_on_cuda_equals_cpu(device: torch.device) -> None:
    probs = torch.softmax(torch.randn(8, 32000, generator=torch.Generator().manual_seed(2)), dim=-1)
    top_k = torch.tensor([1, 2, 5, 20, 100, 1000, 32000, 1 << 30])
    top_p = torch.linspace(0.05, 1.0, 8)
    for fn, limit in ((sgl_kernel_ops.top_k_renorm_prob, top_k), (sgl_kernel_ops.top_p_renorm_prob, top_p)):
        torch.testing.assert_close(fn(probs.to(device), limit.to(device)).cpu(), fn(probs, limit))
