"""Torch stand-ins for the sglang-kernel (`sgl_kernel`) functions SGLang 0.5.23 calls serving a dense model.

On CUDA, SGLang imports these names from `sgl_kernel` at module level (`layers/layernorm.py`,
`layers/activation.py`, `layers/sampler.py`, `layers/attention/triton_backend.py`,
`model_executor/runner_backend_utils/weak_ref_tensor.py`). Where sglang-kernel is not installed and
`tools/offline_gpu/gpu-install.sh` put its hook in place, `offline_gpu.sgl_kernel_finder` serves the module
`sgl_kernel` from the tables below (warning once per process that it does). Each function keeps
sglang-kernel's signature (including the optional preallocated `out` and the ignored `enable_pdl`) and is
plain torch, so it runs on any device; the arithmetic is done in float32 and cast back, as the
CUDA kernels do.

`PLACEHOLDER_NAMES` lists the names SGLang imports at module level on CUDA for paths a dense bf16 model
never takes (int8 GEMM, MoE sums, GGUF, host KV transfer): importing them succeeds, calling one raises
NotImplementedError naming it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F


def _store(result: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """Write `result` into `out` when given (cast to its dtype) and return the tensor that holds it."""
    if out is None:
        return result
    out.copy_(result)
    return out


def _act_and_mul(act: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, out: torch.Tensor | None):
    """act(x[..., :d]) * x[..., d:] for x [..., 2d]; returns [..., d] in x's dtype."""
    if x.shape[-1] % 2:
        raise ValueError(f"the last dimension must be even (gate and up halves), got {tuple(x.shape)}")
    gate, up = x.float().chunk(2, dim=-1)
    return _store((act(gate) * up).to(x.dtype), out)


def silu_and_mul(input: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """SwiGLU: silu(input[..., :d]) * input[..., d:]. input [..., 2d] -> [..., d]."""
    return _act_and_mul(F.silu, input, out)


def gelu_and_mul(input: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """GeGLU with exact (erf) GELU: gelu(input[..., :d]) * input[..., d:]. input [..., 2d] -> [..., d]."""
    return _act_and_mul(F.gelu, input, out)


def gelu_tanh_and_mul(input: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """GeGLU with the tanh GELU approximation. input [..., 2d] -> [..., d]."""
    return _act_and_mul(lambda gate: F.gelu(gate, approximate="tanh"), input, out)


def _rms_normalised(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x², last dim) + eps) in float32. x [..., hidden]."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)


def _add_then_normalise(input: torch.Tensor, residual: torch.Tensor, scale: torch.Tensor, eps: float) -> None:
    """In place: residual += input (float32 sum), then input = rms-normalised residual * scale [hidden]."""
    summed = input.float() + residual.float()
    residual.copy_(summed)
    input.copy_(_rms_normalised(summed, eps) * scale)


def rmsnorm(
    input: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    out: torch.Tensor | None = None,
    enable_pdl: bool | None = None,
) -> torch.Tensor:
    """RMSNorm: input / rms(input) * weight. input [tokens, hidden], weight [hidden]; input's dtype."""
    return _store((_rms_normalised(input, eps) * weight.float()).to(input.dtype), out)


def fused_add_rmsnorm(
    input: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    enable_pdl: bool | None = None,
) -> None:
    """In place: residual += input, then input = rmsnorm(residual) * weight. Both [tokens, hidden]."""
    _add_then_normalise(input, residual, weight.float(), eps)


def gemma_rmsnorm(
    input: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    out: torch.Tensor | None = None,
    enable_pdl: bool | None = None,
) -> torch.Tensor:
    """Gemma's RMSNorm: input / rms(input) * (1 + weight). input [tokens, hidden], weight [hidden]."""
    return _store((_rms_normalised(input, eps) * (1.0 + weight.float())).to(input.dtype), out)


def gemma_fused_add_rmsnorm(
    input: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    enable_pdl: bool | None = None,
) -> None:
    """In place: residual += input, then input = gemma_rmsnorm(residual). Both [tokens, hidden]."""
    _add_then_normalise(input, residual, 1.0 + weight.float(), eps)


def _per_row(value: torch.Tensor | float | int, probs: torch.Tensor) -> torch.Tensor:
    """A scalar or a [batch] tensor as a [batch, 1] tensor on probs' device."""
    column = torch.as_tensor(value, device=probs.device)
    return column.expand(probs.shape[0]).reshape(-1, 1) if column.dim() == 0 else column.view(-1, 1)


def top_k_renorm_prob(probs: torch.Tensor, top_k: torch.Tensor | int) -> torch.Tensor:
    """Keep each row's top_k largest probabilities (first in sorted order on ties), renormalise.

    probs: [batch, vocab] float; top_k: int or [batch] int (values >= vocab keep every token).
    Returns [batch, vocab] float32 rows summing to 1.
    """
    probs = probs.float()
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    ranks = torch.arange(probs.shape[-1], device=probs.device).view(1, -1)
    sorted_probs = sorted_probs.masked_fill(ranks >= _per_row(top_k, probs), 0.0)
    kept = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return kept / kept.sum(dim=-1, keepdim=True)


def top_p_renorm_prob(probs: torch.Tensor, top_p: torch.Tensor | float) -> torch.Tensor:
    """Keep each row's smallest top set with mass >= top_p, renormalise (SGLang's torch sampler rule).

    A token stays when the mass of the tokens ranked before it is <= top_p, so the top token always stays.
    probs: [batch, vocab] float; top_p: float or [batch] float in (0, 1]. Returns [batch, vocab] float32.
    """
    probs = probs.float()
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    before = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(before > _per_row(top_p, probs).float(), 0.0)
    kept = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return kept / kept.sum(dim=-1, keepdim=True)


def weak_ref_tensor(tensor: Any) -> Any:
    """Returns `tensor` itself: sglang-kernel's returns a view that does not keep the storage alive.

    SGLang calls it on CUDA-graph outputs whose storage its graph memory pool already owns, so a strong
    reference only delays freeing them until the graph runner drops its outputs.
    """
    return tensor


def is_arch_support_pdl() -> bool:
    """Programmatic dependent launch is an sglang-kernel launch option; the torch stand-ins never use it."""
    return False


FUNCTIONS: dict[str, dict[str, Callable[..., Any]]] = {
    "sgl_kernel": {
        "silu_and_mul": silu_and_mul,
        "gelu_and_mul": gelu_and_mul,
        "gelu_tanh_and_mul": gelu_tanh_and_mul,
        "rmsnorm": rmsnorm,
        "fused_add_rmsnorm": fused_add_rmsnorm,
        "gemma_rmsnorm": gemma_rmsnorm,
        "gemma_fused_add_rmsnorm": gemma_fused_add_rmsnorm,
        "top_k_renorm_prob": top_k_renorm_prob,
        "top_p_renorm_prob": top_p_renorm_prob,
        "weak_ref_tensor": weak_ref_tensor,
    },
    "sgl_kernel.utils": {"is_arch_support_pdl": is_arch_support_pdl},
}
"""Implemented names per stand-in module."""

PLACEHOLDER_NAMES: dict[str, tuple[str, ...]] = {
    "sgl_kernel": ("int8_scaled_mm", "moe_sum", "moe_sum_reduce"),
    "sgl_kernel.quantization": ("ggml_dequantize", "ggml_moe_a8", "ggml_mul_mat_a8", "ggml_mul_mat_vec_a8"),
    "sgl_kernel.kvcacheio": (
        "transfer_kv_all_layer",
        "transfer_kv_all_layer_direct_lf_pf",
        "transfer_kv_all_layer_lf_pf",
        "transfer_kv_all_layer_lf_ph",
        "transfer_kv_all_layer_mla",
        "transfer_kv_all_layer_mla_lf_pf",
        "transfer_kv_direct",
        "transfer_kv_per_layer",
        "transfer_kv_per_layer_direct_pf_lf",
        "transfer_kv_per_layer_mla",
        "transfer_kv_per_layer_mla_pf_lf",
        "transfer_kv_per_layer_pf_lf",
        "transfer_kv_per_layer_ph_lf",
    ),
}
"""Names SGLang imports on CUDA for paths a dense model does not take; calling one raises."""

MODULES: tuple[str, ...] = (
    "sgl_kernel",
    "sgl_kernel.utils",
    "sgl_kernel.quantization",
    "sgl_kernel.kvcacheio",
)
"""Every module the stand-in serves. Others (e.g. `sgl_kernel.scalar_type`) stay missing, so SGLang's own
`except ImportError` fallbacks apply."""


def placeholder(qualified_name: str) -> Callable[..., Any]:
    """A function that raises NotImplementedError naming `qualified_name` when called."""

    def unavailable(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"{qualified_name} needs sglang-kernel, which is not installed; BASTION's torch stand-ins cover "
            "only the dense-model serving path"
        )

    unavailable.__name__ = qualified_name.rsplit(".", 1)[-1]
    unavailable.__qualname__ = unavailable.__name__
    return unavailable


def module_namespace(module: str) -> dict[str, Callable[..., Any]]:
    """The names the stand-in module `module` (one of MODULES) holds: its functions and placeholders."""
    if module not in MODULES:
        raise ValueError(f"no sgl_kernel stand-in module {module!r}; known: {MODULES}")
    names = {name: placeholder(f"{module}.{name}") for name in PLACEHOLDER_NAMES.get(module, ())}
    names.update(FUNCTIONS.get(module, {}))
    return names
