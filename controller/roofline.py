"""Roofline latency of one target verify pass (BASTION appendix F, eqs. 8 and 9).

Terms (BASTION table 2). s: tokens verified in the pass (the root plus the tree nodes, >= 1); c: cached
context tokens (>= 0); L layers; h hidden size; n_q / n_kv query / key-value heads of size d, with
h_q = n_q·d and h_kv = n_kv·d; h_ffn the FFN width (for a mixture of experts, the width a token activates:
experts per token × expert width, plus the shared expert); V vocabulary; bp bytes per element.

    FLOPs(s, c) = L(4·s·h·h_q + 4·s·h·h_kv + 4·s·(c+s)·h_q + 6·s·h·h_ffn) + 2·s·h·V               (8)
    Bytes(s, c) = bp·[2Vh + s(h+V) + L(2h(h_q+h_kv) + 3h·h_ffn + 2h_kv(c+2s)
                      + 4s(h+h_q+h_ffn) + 2n_q·s(c+s))]                                          (9)
    R(s, c)     = max(FLOPs / peak FLOP/s, Bytes / bandwidth)   seconds

Bytes splits into the weights, read once per pass (2Vh + L(2h(h_q+h_kv) + 3h·h_ffn)), and the
per-request traffic (KV cache and activations, the rest). A pass over a batch of B requests with
s_i tokens and c_i cached tokens each therefore costs

    FLOPs_batch = Σ_i FLOPs(s_i, c_i)
    Bytes_batch = bp·[2Vh + L(2h(h_q+h_kv) + 3h·h_ffn)]
                  + Σ_i bp·[s_i(h+V) + L(2h_kv(c_i+2s_i) + 4s_i(h+h_q+h_ffn) + 2n_q·s_i(c_i+s_i))]

which equals eqs. (8) and (9) for B = 1.

The parts of a pass (`gemm_flops`, `weight_bytes`, `attention_flops`, `request_bytes`, `kv_bytes`, their
seconds, and `pass_terms_batch` for a whole pass), which the calibrated latency model weighs apart:

    GEMM FLOPs(T)      = L(4T·h·h_q + 4T·h·h_kv + 6T·h·h_ffn) + 2T·h·V       T tokens in the pass
    weight bytes       = bp·[2Vh + L(2h(h_q+h_kv) + 3h·h_ffn)]                 read once per pass
    attention FLOPs    = 4·s·(c+s)·h_q·L                                        per request
    request bytes      = bp·[s(h+V) + L(2h_kv(c+2s) + 4s(h+h_q+h_ffn))]         per request: KV + activations
    KV bytes           = bp·L·2h_kv·(c+2s)                                      per request: the KV cache
    gemm seconds       = max(GEMM FLOPs(Σ_i s_i) / peak, weight bytes / bandwidth)
    GEMM ridge T*      = tokens where GEMM FLOPs(T*) / peak = weight bytes / bandwidth
    attention seconds  = Σ_i max(attention FLOPs_i / peak, request bytes_i / bandwidth)

Eq. (8) is GEMM FLOPs(s) + attention FLOPs. The request bytes leave out eq. (9)'s score matrix
(2n_q·s(c+s) per layer): fused attention kernels never write it, and at s = 1024, c = 8192 it would be most
of T_mem.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from numbers import Integral
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, FiniteFloat

TokenCounts = Sequence[int] | torch.Tensor
"""Per-request token counts of a batch: a sequence of ints or a [B] int64 tensor."""

HF_CONFIG_NAME = "config.json"
"""File name of a Hugging Face model config inside a model folder."""


class ModelShape(BaseModel):
    """The target model's dimensions that enter the roofline (BASTION table 2)."""

    model_config = ConfigDict(frozen=True, strict=True, extra="forbid")

    num_layers: int = Field(gt=0, description="L, transformer layers")
    hidden_size: int = Field(gt=0, description="h, residual stream width")
    num_q_heads: int = Field(gt=0, description="n_q, attention query heads")
    num_kv_heads: int = Field(gt=0, description="n_kv, attention key/value heads")
    head_dim: int = Field(gt=0, description="d, width of one attention head")
    ffn_size: int = Field(gt=0, description="h_ffn, FFN width a token activates (MoE: active experts)")
    vocab_size: int = Field(gt=0, description="V, vocabulary size")

    @property
    def hq(self) -> int:
        """h_q = n_q·d: total query width."""
        return self.num_q_heads * self.head_dim

    @property
    def hkv(self) -> int:
        """h_kv = n_kv·d: total key (or value) width."""
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf_config(cls, config: dict[str, Any] | str | Path) -> ModelShape:
        """Shape from a Hugging Face `config.json`: a dict, the file, or the model folder holding it.

        Reads Qwen2/Qwen3, Llama, Mistral (dense) and Qwen2-MoE/Qwen3-MoE/Mixtral (sparse) configs.
        A nested `text_config` (multimodal wrappers) is read first, falling back to top-level keys.
        `head_dim` absent or null -> hidden_size / num_attention_heads; `num_key_value_heads` absent ->
        num_attention_heads. Sparse models (`num_experts_per_tok` present): h_ffn = num_experts_per_tok ×
        expert width (`moe_intermediate_size`, else `intermediate_size`) + `shared_expert_intermediate_size`
        if present. Raises ValueError naming the missing or bad key and the source.
        """
        raw, source = read_hf_config(config)
        text = raw.get("text_config")
        keys = _ConfigKeys({**raw, **text} if isinstance(text, dict) else raw, source)
        hidden = keys.need("hidden_size")
        heads = keys.need("num_attention_heads")
        head_dim = keys.optional("head_dim")
        if head_dim is None:
            if hidden % heads:
                raise ValueError(
                    f"{source}: no 'head_dim' and hidden_size {hidden} is not divisible by "
                    f"num_attention_heads {heads}"
                )
            head_dim = hidden // heads
        return cls(
            num_layers=keys.need("num_hidden_layers"),
            hidden_size=hidden,
            num_q_heads=heads,
            num_kv_heads=keys.optional("num_key_value_heads") or heads,
            head_dim=head_dim,
            ffn_size=keys.ffn_size(),
            vocab_size=keys.need("vocab_size"),
        )


QWEN3_8B = ModelShape(
    num_layers=36,
    hidden_size=4096,
    num_q_heads=32,
    num_kv_heads=8,
    head_dim=128,
    ffn_size=12288,
    vocab_size=151936,
)
"""Qwen3-8B, the reference target shape of the planner bench, the GPU benchmarks and the tests."""


@dataclass(frozen=True)
class _ConfigKeys:
    """Positive-integer lookups in a config dict; errors name the key and the source."""

    values: dict[str, Any]
    source: str

    def need(self, key: str) -> int:
        if self.values.get(key) is None:
            raise ValueError(f"{self.source}: required key {key!r} is missing")
        return self._positive(key)

    def optional(self, key: str) -> int | None:
        return None if self.values.get(key) is None else self._positive(key)

    def _positive(self, key: str) -> int:
        value = self.values[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{self.source}: key {key!r} must be a positive integer, got {value!r}")
        return value

    def ffn_size(self) -> int:
        """h_ffn: the dense FFN width, or for a sparse model the expert widths one token activates."""
        per_token = self.optional("num_experts_per_tok")
        if per_token is None:
            return self.need("intermediate_size")
        if self.values.get("mlp_only_layers"):
            raise ValueError(
                f"{self.source}: 'mlp_only_layers' = {self.values['mlp_only_layers']!r} mixes dense and "
                "sparse layers; one h_ffn cannot describe it"
            )
        sparse_step = self.optional("decoder_sparse_step")
        if sparse_step not in (None, 1):
            raise ValueError(
                f"{self.source}: 'decoder_sparse_step' = {sparse_step} mixes dense and sparse layers"
            )
        expert = self.optional("moe_intermediate_size") or self.need("intermediate_size")
        shared = self.optional("shared_expert_intermediate_size") or 0
        return per_token * expert + shared


def read_hf_config(config: dict[str, Any] | str | Path) -> tuple[dict[str, Any], str]:
    """(config dict, a name for it in error messages) from a dict, a config.json path, or a model folder.

    Raises ValueError naming the file when it is missing, unreadable, not JSON, or not a JSON object.
    """
    if isinstance(config, dict):
        return config, "config dict"
    if not isinstance(config, str | Path):
        raise ValueError(f"config must be a dict, a path to config.json or a model folder, got {config!r}")
    path = Path(config)
    if path.is_dir():
        path = path / HF_CONFIG_NAME
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"{path}: cannot read model config: {error}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(
            f"{path}: not valid JSON at line {error.lineno} column {error.colno}: {error.msg}"
        ) from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a model config must be a JSON object, got {type(data).__name__}")
    return data, str(path)


class HardwareSpec(BaseModel):
    """Peak dense tensor-core throughput and memory bandwidth of one GPU."""

    model_config = ConfigDict(frozen=True, strict=True, extra="forbid")

    name: str = Field(min_length=1)
    peak_flops: FiniteFloat = Field(gt=0, description="FLOP/s, dense bf16/fp16 tensor core")
    bandwidth: FiniteFloat = Field(gt=0, description="bytes/s, device memory")


KNOWN_GPUS: dict[str, HardwareSpec] = {
    spec.name: spec
    for spec in (
        HardwareSpec(name="A100-SXM4-40GB", peak_flops=312e12, bandwidth=1555e9),
        HardwareSpec(name="A100-SXM4-80GB", peak_flops=312e12, bandwidth=2039e9),
        HardwareSpec(name="A100-PCIe-40GB", peak_flops=312e12, bandwidth=1555e9),
        HardwareSpec(name="A100-PCIe-80GB", peak_flops=312e12, bandwidth=1935e9),
        HardwareSpec(name="H100-SXM", peak_flops=989.4e12, bandwidth=3.35e12),
        HardwareSpec(name="H100-PCIe", peak_flops=756e12, bandwidth=2.0e12),
        HardwareSpec(name="H200", peak_flops=989.4e12, bandwidth=4.8e12),
        HardwareSpec(name="L40S", peak_flops=362.05e12, bandwidth=864e9),
        HardwareSpec(name="RTX-6000-Ada", peak_flops=364.2e12, bandwidth=960e9),
        HardwareSpec(name="RTX-PRO-6000-Blackwell", peak_flops=503.8e12, bandwidth=1792e9),
        HardwareSpec(name="A10G", peak_flops=70e12, bandwidth=600e9),
        HardwareSpec(name="L4", peak_flops=121e12, bandwidth=300e9),
    )
}
"""Datasheet figures: dense (no sparsity) bf16 tensor-core FLOP/s with fp32 accumulate, and memory bytes/s.
A100/H100/H200 are the SXM boards unless named PCIe; RTX-PRO-6000-Blackwell is the 600 W edition
(workstation or server), not Max-Q."""


@dataclass(frozen=True)
class _GpuPattern:
    """Words a normalised device name must hold: all of `needs`, none of `avoid`, one of `any_of` if set."""

    key: str
    needs: frozenset[str]
    avoid: frozenset[str]
    any_of: frozenset[str]

    @classmethod
    def of(cls, key: str, needs: str, avoid: str = "", any_of: str = "") -> _GpuPattern:
        """Pattern from space-separated word lists."""
        return cls(key, frozenset(needs.split()), frozenset(avoid.split()), frozenset(any_of.split()))

    def matches(self, words: set[str]) -> bool:
        return (
            self.needs <= words and not self.avoid & words and (not self.any_of or bool(self.any_of & words))
        )


_GPU_PATTERNS = (
    _GpuPattern.of("A100-SXM4-40GB", "a100 40gb", avoid="pcie", any_of="sxm sxm4"),
    _GpuPattern.of("A100-SXM4-80GB", "a100 80gb", avoid="pcie", any_of="sxm sxm4"),
    _GpuPattern.of("A100-PCIe-40GB", "a100 pcie 40gb"),
    _GpuPattern.of("A100-PCIe-80GB", "a100 pcie 80gb"),
    _GpuPattern.of("H100-SXM", "h100", avoid="pcie nvl", any_of="sxm sxm5 hbm3"),
    _GpuPattern.of("H100-PCIe", "h100 pcie"),
    _GpuPattern.of("H200", "h200", avoid="nvl"),
    _GpuPattern.of("L40S", "l40s"),
    _GpuPattern.of("RTX-6000-Ada", "rtx 6000 ada", avoid="pro"),
    _GpuPattern.of("RTX-PRO-6000-Blackwell", "rtx pro 6000 blackwell", avoid="max"),
    _GpuPattern.of("A10G", "a10g"),
    _GpuPattern.of("L4", "l4"),
)


CPU_HARDWARE = HardwareSpec(name="cpu", peak_flops=1.0e11, bandwidth=2.0e10)
"""Roofline peaks assumed on a CPU: 100 GFLOP/s and 20 GB/s, the order of a small x86 server under
PyTorch. Only the shape of the uncalibrated roofline depends on them; the EMA factor rescales it."""


def lookup_gpu(device_name: str) -> HardwareSpec:
    """Datasheet spec for a device name as CUDA reports it, e.g. "NVIDIA H100 80GB HBM3" -> H100-SXM.

    Matching is on whole words of the lower-cased name (so "L4" never matches "L40S", and an H100 NVL or
    an RTX PRO 6000 Max-Q matches nothing). Raises ValueError listing the known GPUs when nothing matches:
    measure the peaks instead, or pass a HardwareSpec.
    """
    words = set(re.split(r"[^a-z0-9]+", device_name.lower())) - {""}
    for pattern in _GPU_PATTERNS:
        if pattern.matches(words):
            return KNOWN_GPUS[pattern.key]
    raise ValueError(f"unknown GPU {device_name!r}; known GPUs: {', '.join(KNOWN_GPUS)}")


def _check_tokens(s: int, c: int) -> tuple[int, int]:
    """(s, c) as Python ints; ValueError unless s is an integer >= 1 and c an integer >= 0."""
    if isinstance(s, bool) or not isinstance(s, Integral) or s < 1:
        raise ValueError(f"s (tokens verified) must be an int >= 1, got {s!r}")
    if isinstance(c, bool) or not isinstance(c, Integral) or c < 0:
        raise ValueError(f"c (cached context tokens) must be an int >= 0, got {c!r}")
    return int(s), int(c)


def _check_token_tensor(s: torch.Tensor) -> None:
    if not isinstance(s, torch.Tensor) or s.dtype != torch.int64 or s.dim() != 1:
        got = f"{s.dtype} {tuple(s.shape)}" if isinstance(s, torch.Tensor) else type(s).__name__
        raise ValueError(f"s must be a 1-D int64 tensor [M], got {got}")
    if s.numel() and int(s.min()) < 1:  # host sync: validation of a host-side planning input
        raise ValueError(f"s (tokens verified) must be >= 1, got min {int(s.min())}")


def _as_requests(s: TokenCounts, c: TokenCounts) -> tuple[list[int], list[int]]:
    s_list = s.tolist() if isinstance(s, torch.Tensor) else list(s)
    c_list = c.tolist() if isinstance(c, torch.Tensor) else list(c)
    if not s_list:
        raise ValueError("a batch needs at least one request, got an empty s")
    if len(s_list) != len(c_list):
        raise ValueError(f"s has {len(s_list)} requests but c has {len(c_list)}")
    pairs = [_check_tokens(s_i, c_i) for s_i, c_i in zip(s_list, c_list, strict=True)]
    return [p[0] for p in pairs], [p[1] for p in pairs]


@dataclass(frozen=True)
class PassTerms:
    """The parts of one pass the calibrated latency model weighs (see `controller.latency`), seconds unless
    named otherwise. Requests i of the pass; T = Σ_i s_i tokens."""

    tokens: int  # T, tokens in the pass, all requests together
    gemm_seconds: float  # G = max(GEMM FLOPs(T) / peak, weight bytes / bandwidth)
    narrow_tokens: float  # min(T, T*), T* the GEMM ridge (`gemm_ridge_tokens`): tokens up to the ridge
    attention_compute_seconds: float  # Σ_i attention FLOPs_i / peak
    kv_seconds: float  # Σ_i KV-cache bytes_i / bandwidth
    attention_seconds: float  # Σ_i max(attention FLOPs_i / peak, request bytes_i / bandwidth)


@dataclass(frozen=True)
class RooflineModel:
    """Eqs. (8) and (9) for one target model on one GPU, and their parts. Scalar, vectorised and batch forms.

    bytes_per_element: bp, bytes of one weight / activation element (2 for bf16).
    """

    shape: ModelShape
    hw: HardwareSpec
    bytes_per_element: float = 2

    def __post_init__(self) -> None:
        bp = self.bytes_per_element
        if isinstance(bp, bool) or not isinstance(bp, int | float) or not 0 < bp < float("inf"):
            raise ValueError(f"bytes_per_element must be a finite number > 0, got {bp!r}")

    # Element counts. Generic over Python ints (exact) and float64 tensors (vectorised).

    def _gemm_flops(self, tokens: Any) -> Any:
        """FLOPs of the linear layers and the LM head for `tokens` tokens: L(4Th·h_q + 4Th·h_kv + 6Th·h_ffn)
        + 2ThV."""
        m = self.shape
        h = m.hidden_size
        per_layer = 4 * tokens * h * m.hq + 4 * tokens * h * m.hkv + 6 * tokens * h * m.ffn_size
        return m.num_layers * per_layer + 2 * tokens * h * m.vocab_size

    def _attention_flops(self, s: Any, c: Any) -> Any:
        """FLOPs of one request's attention, s queries over c + s keys: 4·s·(c+s)·h_q·L."""
        return 4 * s * (c + s) * self.shape.hq * self.shape.num_layers

    def _flops(self, s: Any, c: Any) -> Any:
        """Eq. (8), FLOPs of one request's s tokens over c cached tokens."""
        return self._gemm_flops(s) + self._attention_flops(s, c)

    def _weight_elements(self) -> int:
        """Weight elements read once per pass: 2Vh + L(2h(h_q+h_kv) + 3h·h_ffn)."""
        m = self.shape
        h = m.hidden_size
        return 2 * m.vocab_size * h + m.num_layers * (2 * h * (m.hq + m.hkv) + 3 * h * m.ffn_size)

    def _request_elements(self, s: Any, c: Any) -> Any:
        """Per-request KV cache and activation elements, no score matrix:
        s(h+V) + L(2h_kv(c+2s) + 4s(h+h_q+h_ffn))."""
        m = self.shape
        h = m.hidden_size
        activations = 4 * s * (h + m.hq + m.ffn_size)
        return s * (h + m.vocab_size) + m.num_layers * activations + self._kv_elements(s, c)

    def _kv_elements(self, s: Any, c: Any) -> Any:
        """One request's KV-cache elements: L·2h_kv·(c+2s) (read c + s cached and new, write s)."""
        return self.shape.num_layers * 2 * self.shape.hkv * (c + 2 * s)

    def _score_elements(self, s: Any, c: Any) -> Any:
        """The attention score matrix eq. (9) counts: 2n_q·s(c+s)·L (fused kernels never write it)."""
        return 2 * self.shape.num_q_heads * s * (c + s) * self.shape.num_layers

    # The parts of a pass (no score matrix): what `controller.latency` weighs.

    def gemm_flops(self, tokens: int) -> float:
        """FLOPs of the linear layers and LM head over `tokens` tokens (all requests of a pass together)."""
        tokens, _ = _check_tokens(tokens, 0)
        return float(self._gemm_flops(tokens))

    def weight_bytes(self) -> float:
        """Bytes of the weights, read once per pass: bp·[2Vh + L(2h(h_q+h_kv) + 3h·h_ffn)]."""
        return float(self.bytes_per_element * self._weight_elements())

    def attention_flops(self, s: int, c: int) -> float:
        """FLOPs of one request's attention: 4·s·(c+s)·h_q·L."""
        s, c = _check_tokens(s, c)
        return float(self._attention_flops(s, c))

    def request_bytes(self, s: int, c: int) -> float:
        """Bytes of one request's KV cache and activations, without the score matrix term:
        bp·[s(h+V) + L(2h_kv(c+2s) + 4s(h+h_q+h_ffn))]."""
        s, c = _check_tokens(s, c)
        return float(self.bytes_per_element * self._request_elements(s, c))

    def kv_bytes(self, s: int, c: int) -> float:
        """Bytes of one request's KV cache (the part of `request_bytes` that grows with c):
        bp·L·2h_kv·(c+2s)."""
        s, c = _check_tokens(s, c)
        return float(self.bytes_per_element * self._kv_elements(s, c))

    def gemm_flops_per_token(self) -> int:
        """GEMM FLOPs of one token: `gemm_flops(T)` = T · this, exactly (an integer)."""
        return int(self._gemm_flops(1))

    def attention_flops_per_pair(self) -> int:
        """Attention FLOPs per query-key pair, 4·h_q·L: one request's s queries over c + s keys cost
        s·(c+s) times this (an integer)."""
        return int(self._attention_flops(1, 0))

    def kv_elements_per_token(self) -> int:
        """KV-cache elements per cached token read or new token written, L·2h_kv: one request's KV elements
        are (c + 2s) times this (an integer)."""
        return int(self._kv_elements(0, 1))

    def gemm_ridge_tokens(self) -> float:
        """T*: the tokens at which a pass's GEMM FLOPs / peak equal its weight bytes / bandwidth. Below it the
        roofline prices the GEMMs at the weight read, above it at the FLOPs."""
        return self.weight_bytes() * self.hw.peak_flops / (self.hw.bandwidth * self.gemm_flops(1))

    def gemm_seconds(self, tokens: int) -> float:
        """max(GEMM FLOPs / peak, weight bytes / bandwidth) of a pass over `tokens` tokens, seconds."""
        return max(self.gemm_flops(tokens) / self.hw.peak_flops, self.weight_bytes() / self.hw.bandwidth)

    def attention_seconds(self, s: int, c: int) -> float:
        """max(attention FLOPs / peak, request bytes / bandwidth) of one request, seconds."""
        return max(
            self.attention_flops(s, c) / self.hw.peak_flops, self.request_bytes(s, c) / self.hw.bandwidth
        )

    def gemm_seconds_many(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens: [M] int64 tokens per pass -> [M] float64 `gemm_seconds` on tokens' device."""
        _check_token_tensor(tokens)
        compute = self._gemm_flops(tokens.to(torch.float64)) / self.hw.peak_flops
        return compute.clamp_min(self.weight_bytes() / self.hw.bandwidth)

    def attention_seconds_many(self, s: torch.Tensor, c: int) -> torch.Tensor:
        """s: [M] int64 widths, c: cached tokens -> [M] float64 `attention_seconds` on s's device."""
        _check_token_tensor(s)
        _, c = _check_tokens(1, c)
        widths = s.to(torch.float64)
        compute = self._attention_flops(widths, float(c)) / self.hw.peak_flops
        memory = self.bytes_per_element * self._request_elements(widths, float(c)) / self.hw.bandwidth
        return torch.maximum(compute, memory)

    def pass_terms(self, s: int, c: int) -> PassTerms:
        """The parts of one request's pass of s tokens over c cached tokens."""
        return self.pass_terms_batch([s], [c])

    def pass_terms_batch(self, s: TokenCounts, c: TokenCounts) -> PassTerms:
        """The parts of one pass over a batch: GEMMs over Σ_i s_i tokens, attention summed per request.
        s, c: [B] tokens verified and cached tokens per request."""
        s_list, c_list = _as_requests(s, c)
        tokens = sum(s_list)
        pairs = list(zip(s_list, c_list, strict=True))
        return PassTerms(
            tokens=tokens,
            gemm_seconds=self.gemm_seconds(tokens),
            narrow_tokens=min(float(tokens), self.gemm_ridge_tokens()),
            attention_compute_seconds=sum(self.attention_flops(s_i, c_i) for s_i, c_i in pairs)
            / self.hw.peak_flops,
            kv_seconds=sum(self.kv_bytes(s_i, c_i) for s_i, c_i in pairs) / self.hw.bandwidth,
            attention_seconds=sum(self.attention_seconds(s_i, c_i) for s_i, c_i in pairs),
        )

    @cached_property
    def _plain_counts(self) -> tuple[int, int, int, int, float, float]:
        """What `plain_pass_terms` prices with, exact integers counted once: attention FLOPs per query-key
        pair, KV elements per token, a one-token request's elements beside its KV, GEMM FLOPs per token;
        the weight read in seconds and the GEMM ridge T*."""
        fixed = self._request_elements(1, 0) - self._kv_elements(1, 0)
        return (
            self.attention_flops_per_pair(),
            self.kv_elements_per_token(),
            fixed,
            self.gemm_flops_per_token(),
            self.weight_bytes() / self.hw.bandwidth,
            self.gemm_ridge_tokens(),
        )

    def plain_pass_terms(self, contexts: list[int]) -> PassTerms:
        """`pass_terms_batch([1] * B, contexts)` of a plain decode step, the same values: contexts [B] cached
        tokens per request, ints >= 0 the caller has checked. The counts are the same exact integers, in
        closed form (a plain step is priced at every decode step)."""
        pair, per_token, fixed, gemm_per_token, weight_seconds, ridge = self._plain_counts
        bp, peak, bandwidth = self.bytes_per_element, self.hw.peak_flops, self.hw.bandwidth
        flops = [float(pair * (c + 1)) for c in contexts]
        kv = [per_token * (c + 2) for c in contexts]
        tokens = len(contexts)
        return PassTerms(
            tokens=tokens,
            gemm_seconds=max(float(tokens * gemm_per_token) / peak, weight_seconds),
            narrow_tokens=min(float(tokens), ridge),
            attention_compute_seconds=sum(flops) / peak,
            kv_seconds=sum(float(bp * k) for k in kv) / bandwidth,
            attention_seconds=sum(
                max(f / peak, float(bp * (fixed + k)) / bandwidth) for f, k in zip(flops, kv, strict=True)
            ),
        )

    # Eqs. (8) and (9) for a single request (exact integer arithmetic, then one rounding to float).

    def flops(self, s: int, c: int) -> float:
        """Eq. (8): FLOPs of verifying s tokens over c cached tokens."""
        s, c = _check_tokens(s, c)
        return float(self._flops(s, c))

    def bytes(self, s: int, c: int) -> float:
        """Eq. (9): bytes moved by verifying s tokens over c cached tokens (score matrix included)."""
        s, c = _check_tokens(s, c)
        elements = self._weight_elements() + self._request_elements(s, c) + self._score_elements(s, c)
        return float(self.bytes_per_element * elements)

    def compute_seconds(self, s: int, c: int) -> float:
        """FLOPs / peak FLOP/s, seconds."""
        return self.flops(s, c) / self.hw.peak_flops

    def memory_seconds(self, s: int, c: int) -> float:
        """Bytes / bandwidth (bytes/s), seconds."""
        return self.bytes(s, c) / self.hw.bandwidth

    def verify_seconds(self, s: int, c: int) -> float:
        """R(s, c) = max(compute, memory) seconds: the bare roofline."""
        return max(self.compute_seconds(s, c), self.memory_seconds(s, c))

    # Many candidate widths at one context (the policy's whole curve at once).

    def compute_seconds_many(self, s: torch.Tensor, c: int) -> torch.Tensor:
        """s: [M] int64 widths, c: cached tokens -> [M] float64 compute seconds on s's device."""
        _check_token_tensor(s)
        _, c = _check_tokens(1, c)
        return self._flops(s.to(torch.float64), float(c)) / self.hw.peak_flops

    def memory_seconds_many(self, s: torch.Tensor, c: int) -> torch.Tensor:
        """s: [M] int64 widths, c: cached tokens -> [M] float64 memory seconds on s's device."""
        _check_token_tensor(s)
        _, c = _check_tokens(1, c)
        widths = s.to(torch.float64)
        elements = (
            self._weight_elements()
            + self._request_elements(widths, float(c))
            + self._score_elements(widths, float(c))
        )
        return self.bytes_per_element * elements / self.hw.bandwidth

    def verify_seconds_many(self, s: torch.Tensor, c: int) -> torch.Tensor:
        """s: [M] int64 widths, c: cached tokens -> [M] float64 bare roofline seconds."""
        return torch.maximum(self.compute_seconds_many(s, c), self.memory_seconds_many(s, c))

    # One pass over a batch of requests (weights read once; see the module docstring).

    def flops_batch(self, s: TokenCounts, c: TokenCounts) -> float:
        """Σ_i FLOPs(s_i, c_i). s, c: [B] tokens verified and cached tokens per request."""
        s_list, c_list = _as_requests(s, c)
        return float(sum(self._flops(s_i, c_i) for s_i, c_i in zip(s_list, c_list, strict=True)))

    def bytes_batch(self, s: TokenCounts, c: TokenCounts) -> float:
        """bp·[weights + Σ_i per-request traffic, score matrix included]. s, c: [B] per request."""
        s_list, c_list = _as_requests(s, c)
        traffic = sum(
            self._request_elements(s_i, c_i) + self._score_elements(s_i, c_i)
            for s_i, c_i in zip(s_list, c_list, strict=True)
        )
        return float(self.bytes_per_element * (self._weight_elements() + traffic))

    def compute_seconds_batch(self, s: TokenCounts, c: TokenCounts) -> float:
        """FLOPs_batch / peak FLOP/s, seconds. s, c: [B] per request."""
        return self.flops_batch(s, c) / self.hw.peak_flops

    def memory_seconds_batch(self, s: TokenCounts, c: TokenCounts) -> float:
        """Bytes_batch / bandwidth (bytes/s), seconds. s, c: [B] per request."""
        return self.bytes_batch(s, c) / self.hw.bandwidth

    def verify_seconds_batch(self, s: TokenCounts, c: TokenCounts) -> float:
        """max(compute, memory) seconds of one pass over the batch."""
        return max(self.compute_seconds_batch(s, c), self.memory_seconds_batch(s, c))
