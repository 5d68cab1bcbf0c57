"""What BASTION needs inside SGLang 0.5.23 on a plain CPU (torch CPU build, no sgl-kernel, no Triton driver).

Only in a process that serves BASTION on the CPU (`serves_bastion_on_cpu`: `--speculative-algorithm
BASTION` with `--device cpu`, or no device on a CPU-only torch build); a process that loads the plugin but
serves another algorithm, or BASTION on CUDA, gets nothing from here. Two stages:

`prepare_cpu_serving` runs from registration's hook on `ServerArgs.resolve_once`, before SGLang resolves
the arguments, and installs the import placeholders (each only when the real package is absent):
- `torchvision` placeholder: resolving server arguments imports `sglang.srt.configs`, whose
  `deepseek_ocr` and `multimodal/internvl_utils` modules import names from `torchvision.transforms` at
  module level for their image paths. A PyPI torchvision wheel cannot be installed instead: it is built
  against CUDA torch and breaks `import sglang` beside CPU torch. The placeholder's names raise
  ImportError when used, so only those multimodal paths (never BASTION's) would notice. (SGLang's scheduler
  and detokenizer modules import those configs before any plugin loads in their processes, so those
  processes need an importable torchvision whatever this module does.)
- `vllm._custom_ops` placeholder: `RotaryEmbedding.__init__` (`layers/rotary_embedding/base.py`) imports
  `vllm._custom_ops.rotary_embedding` on a device that is neither CUDA nor SGLang's CPU engine, although
  it then runs `forward_native`.

`prepare_scheduler_process` runs in each scheduler process (registration's hook on `Scheduler.__init__`),
before the scheduler builds its models; `install_bastion_stand_ins` installs the placeholders above (the
scheduler builds the rotary layers) and each stand-in through SGLang's `HookRegistry` (which also rebinds
every `from X import name` copy):
- `TorchNativeAttnBackend.forward_extend` gains a TARGET_VERIFY branch (SGLang's has none: it reads
  extend_prefix_lens, which verify batches lack): per request, queries attend to the cached prefix and
  to the verify tokens the flat custom mask allows (`kernels.tree_attention`). With `--page-size` above 1
  it reads the keys through each page's first slot, as paged CUDA kernels do (`paged_slots`), so a commit
  that broke SGLang's page invariant changes the CPU outputs instead of passing unnoticed.
- `mem_cache.allocation.assign_req_to_token_pool_func` -> one indexed store, its indices laid out in numpy
  from the host offsets (SGLang's runs the Triton kernel `assign_req_to_token_pool` unless its CPU engine is
  on; decode allocation for speculation calls it).
- `kernels.ops.kvcache.cache_move.copy_all_layer_kv_cache_func` -> host byte copies (SGLang's launches a
  Triton kernel unless its CPU engine is on; the KV pool warms it up when speculation is on).
- `ModelRunner._extend_forward_kwargs` casts `input_embeds` to the model dtype instead of always
  `.bfloat16()` (the drafter's block arrives as embeddings; an fp32 CPU model would get bf16 inputs).
- `LogitsProcessor._get_logits` marks a TARGET_VERIFY pass and `LogitsProcessor._compute_lm_head` computes
  such a pass's logits of 2 to 8 rows as (W @ hᵀ)ᵀ, several times faster on the CPU than SGLang's h @ Wᵀ at
  those sizes (`lm_head_product_of_few_rows`); plain decode and prefill keep SGLang's product.
- `torch_native` joins SGLang's draft attention backend choices (`arg_groups.choices`, a list SGLang
  exports for extension), so the drafter worker keeps the CPU backend instead of falling back to flashinfer.
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import importlib.util
import logging
import sys
import threading
import types
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from bastion_sglang.integration.config import ALGORITHM, CPU_ATTENTION_BACKEND
from bastion_sglang.kernels import tree_attention

if TYPE_CHECKING:
    from collections.abc import Callable

    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

logger = logging.getLogger(__name__)


def is_cpu_torch_build() -> bool:
    """True when torch was built without CUDA and HIP (so every SGLang device here is the CPU)."""
    return torch.version.cuda is None and torch.version.hip is None


def serves_bastion_on_cpu(speculative_algorithm: str | None, device: str | None) -> bool:
    """Whether server arguments with this `--speculative-algorithm` and `--device` serve BASTION on the CPU:
    the algorithm is BASTION (any case) and the device is the CPU ("cpu", "cpu:0"), or None (SGLang then
    detects it) on a CPU-only torch build."""
    if str(speculative_algorithm or "").upper() != ALGORITHM:
        return False
    if device is None:
        return is_cpu_torch_build()
    return str(device).split(":")[0] == "cpu"


def prepare_cpu_serving(server_args: Any) -> None:
    """Install the import placeholders in this process when `server_args` (as given, before resolution)
    serve BASTION on the CPU; nothing otherwise."""
    if serves_bastion_on_cpu(server_args.speculative_algorithm, server_args.device):
        install_import_placeholders()


def prepare_scheduler_process(server_args: Any) -> None:
    """Install the import placeholders and BASTION's CPU stand-ins in this scheduler process when it runs
    BASTION on the CPU; nothing otherwise."""
    if serves_bastion_on_cpu(server_args.speculative_algorithm, server_args.device):
        install_bastion_stand_ins()


def install_import_placeholders() -> None:
    """The `torchvision` and `vllm._custom_ops` placeholders, each only when the real package is absent."""
    install_torchvision_placeholder()
    install_vllm_placeholder()


class TorchvisionUnavailable:
    """What every name of the torchvision placeholder is: using it raises ImportError."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise ImportError("torchvision is not installed; this SGLang path needs it (pip install torchvision)")


def _placeholder_module(name: str) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__path__ = []
    module.__spec__ = importlib.machinery.ModuleSpec(name, loader=None, is_package=True)
    module.__getattr__ = lambda attr: TorchvisionUnavailable  # PEP 562: any other name
    return module


def install_torchvision_placeholder() -> None:
    """Register placeholders for `torchvision`, `.transforms`, `.transforms.functional` if it is absent."""
    if "torchvision" in sys.modules or importlib.util.find_spec("torchvision") is not None:
        return
    package = _placeholder_module("torchvision")
    transforms = _placeholder_module("torchvision.transforms")
    functional = _placeholder_module("torchvision.transforms.functional")
    package.transforms = transforms
    transforms.functional = functional
    for module in (package, transforms, functional):
        sys.modules[module.__name__] = module


def install_vllm_placeholder() -> None:
    """Register an empty `vllm._custom_ops` whose functions raise, unless a real vllm is importable."""
    if "vllm" in sys.modules or importlib.util.find_spec("vllm") is not None:
        return
    package = types.ModuleType("vllm")
    package.__path__ = []
    ops = types.ModuleType("vllm._custom_ops")

    def unavailable(*args: Any, **kwargs: Any) -> None:
        raise NotImplementedError("vllm._custom_ops is a placeholder on CPU; SGLang runs forward_native here")

    for name in ("rotary_embedding", "rms_norm", "fused_add_rms_norm"):
        setattr(ops, name, unavailable)
    package._custom_ops = ops
    sys.modules["vllm"] = package
    sys.modules["vllm._custom_ops"] = ops


def install_bastion_stand_ins() -> None:
    """Install the import placeholders, then register the torch stand-ins with SGLang's HookRegistry and apply
    them (idempotent). For a process that builds models to run BASTION on the CPU."""
    install_import_placeholders()
    from bastion_sglang.integration import sglang_adapter as sgl

    if CPU_ATTENTION_BACKEND not in sgl.DRAFT_ATTENTION_BACKEND_CHOICES:
        sgl.add_draft_attention_backend_choices([CPU_ATTENTION_BACKEND])
    hooks: tuple[tuple[sgl.Internal, Callable[..., Any], sgl.HookType], ...] = (
        (sgl.TORCH_NATIVE_FORWARD_EXTEND, forward_extend_with_verify, sgl.HookType.AROUND),
        (sgl.ASSIGN_REQ_TO_TOKEN_POOL, assign_req_to_token_pool_torch, sgl.HookType.REPLACE),
        (sgl.COPY_ALL_LAYER_KV_CACHE, copy_all_layer_kv_cache_host, sgl.HookType.REPLACE),
        (sgl.EXTEND_FORWARD_KWARGS, extend_forward_kwargs_in_model_dtype, sgl.HookType.AROUND),
        (sgl.LOGITS_OF_PASS, logits_marking_verify, sgl.HookType.AROUND),
        (sgl.LM_HEAD_PRODUCT, lm_head_product_of_few_rows, sgl.HookType.AROUND),
    )
    for target, hook, kind in hooks:
        if not sgl.hook_applied(target):
            sgl.HookRegistry.register(target.target, hook, kind)
    sgl.HookRegistry.apply_hooks()
    missing = [target.target for target, _, _ in hooks if not sgl.hook_applied(target)]
    if missing:
        raise RuntimeError(f"BASTION could not install its CPU stand-ins for {missing}; see the log above")


# ---- stand-ins -------------------------------------------------------------------------------------


def assign_req_to_token_pool_torch(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    batch_size: int,
) -> None:
    """Stands in for `sglang.srt.mem_cache.allocation.assign_req_to_token_pool_func` (Triton).

    req_to_token[req_pool_indices[i], start_offset[i]:end_offset[i]] = the next (end - start) entries of
    out_cache_loc, requests in order. All index tensors [batch_size] on the host (CPU run). Two torch ops
    (the cast and one indexed store) at any batch size, as the Triton kernel is one launch: the indices of
    every written entry are laid out in numpy from the host offsets.
    """
    rows = np.asarray(req_pool_indices[:batch_size].tolist(), dtype=np.int64)
    starts = np.asarray(start_offset[:batch_size].tolist(), dtype=np.int64)
    lengths = np.asarray(end_offset[:batch_size].tolist(), dtype=np.int64) - starts
    total = int(lengths.sum())
    if total == 0:
        return
    entry_rows = np.repeat(rows, lengths)  # [total] the request row of each entry
    first_entry = np.cumsum(lengths) - lengths  # [B] where each request's entries start in out_cache_loc
    entry_cols = np.arange(total) + np.repeat(starts - first_entry, lengths)  # [total] token positions
    req_to_token[torch.from_numpy(entry_rows), torch.from_numpy(entry_cols)] = out_cache_loc[:total].to(
        req_to_token.dtype
    )


def copy_all_layer_kv_cache_host(
    data_ptrs: torch.Tensor,
    strides: torch.Tensor,
    tgt_loc: torch.Tensor,
    src_loc: torch.Tensor,
    num_locs: int,
    num_locs_upper: int | None = None,
    kv_copy_config: dict | None = None,
) -> None:
    """Stands in for `sglang.kernels.ops.kvcache.cache_move.copy_all_layer_kv_cache_func` (Triton).

    data_ptrs: [buffers] int64 host addresses of the per-layer K/V buffers; strides: [buffers] bytes per
    slot row. For each buffer, row src_loc[i] is copied over row tgt_loc[i], i < num_locs (host memory).
    num_locs_upper / kv_copy_config only shape the Triton launch.
    """
    pairs = [
        (tgt, src)
        for tgt, src in zip(tgt_loc[:num_locs].tolist(), src_loc[:num_locs].tolist(), strict=True)
        if tgt != src
    ]
    for base, stride in zip(data_ptrs.tolist(), strides.tolist(), strict=True):
        for tgt, src in pairs:
            ctypes.memmove(base + tgt * stride, base + src * stride, stride)


def extend_forward_kwargs_in_model_dtype(
    original: Callable[..., dict], runner: Any, forward_batch: ForwardBatch, pp_proxy_tensors: Any
) -> dict:
    """AROUND `ModelRunner._extend_forward_kwargs`: `input_embeds` in the model's dtype, not bfloat16."""
    kwargs = original(runner, forward_batch, pp_proxy_tensors)
    if forward_batch.input_embeds is not None and "input_embeds" in kwargs:
        kwargs["input_embeds"] = forward_batch.input_embeds.to(runner.model_config.dtype)
    return kwargs


VERIFY_HEAD_ROWS = range(2, 9)
"""Row counts of a TARGET_VERIFY pass whose LM head product `lm_head_product_of_few_rows` takes as W @ hᵀ."""
_pass = threading.local()
"""`verify`: whether the logits being computed are a TARGET_VERIFY pass's (`logits_marking_verify`)."""


def logits_marking_verify(
    original: Callable[..., torch.Tensor],
    processor: Any,
    hidden_states: torch.Tensor,
    lm_head: torch.nn.Module,
    logits_metadata: Any,
    *args: Any,
    **kwargs: Any,
) -> torch.Tensor:
    """AROUND `LogitsProcessor._get_logits`: marks, for `lm_head_product_of_few_rows`, the logits of a
    TARGET_VERIFY pass (BASTION's tree verify, and calibration's timing of it); every other pass keeps
    SGLang's product."""
    previous = getattr(_pass, "verify", False)
    _pass.verify = bool(logits_metadata.forward_mode.is_target_verify())
    try:
        return original(processor, hidden_states, lm_head, logits_metadata, *args, **kwargs)
    finally:
        _pass.verify = previous


def lm_head_product_of_few_rows(
    original: Callable[..., torch.Tensor],
    processor: Any,
    hidden_states: torch.Tensor,
    lm_head: torch.nn.Module,
    embedding_bias: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """AROUND `LogitsProcessor._compute_lm_head`: a TARGET_VERIFY pass of 2 to 8 rows on the CPU computes the
    plain product's logits [M, V] as (W @ hᵀ)ᵀ, the same sums, where SGLang computes h @ Wᵀ.

    On the CPU, torch's product of a few rows with the transposed [V, H] head is several times slower than
    with the head as the left operand: on the 2-core VM (fp32, the demo target's [49152, 576] head, median of
    20 calls) 22.6 ms against 3.2 ms at 2 rows, 17.7 against 5.0 at 4 and 17.1 against 8.1 at 8, the same at
    12 rows and up, while one row (SGLang's plain decode step) is a matrix-vector product either way. Plain
    decode and prefill passes keep SGLang's product, so a declined step costs what SGLang's step costs.
    """
    from bastion_sglang.integration import sglang_adapter as sgl

    rows = hidden_states.shape[0]
    if (
        getattr(_pass, "verify", False)
        and rows in VERIFY_HEAD_ROWS
        and embedding_bias is None
        and sgl.plain_lm_head_product(processor, lm_head, hidden_states)
    ):
        weight = lm_head.weight
        return torch.matmul(weight, hidden_states.to(weight.dtype).T).T.contiguous()
    return original(processor, hidden_states, lm_head, embedding_bias, **kwargs)


def forward_extend_with_verify(
    original: Callable[..., torch.Tensor],
    backend: Any,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer: RadixAttention,
    forward_batch: ForwardBatch,
    save_kv_cache: bool = True,
    **kwargs: Any,
) -> torch.Tensor:
    """AROUND `TorchNativeAttnBackend.forward_extend`: TARGET_VERIFY forwards go to `verify_attention`."""
    if forward_batch.forward_mode.is_target_verify():
        return verify_attention(backend, q, k, v, layer, forward_batch, save_kv_cache)
    return original(backend, q, k, v, layer, forward_batch, save_kv_cache, **kwargs)


def verify_attention(
    backend: Any,
    q: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    layer: RadixAttention,
    forward_batch: ForwardBatch,
    save_kv_cache: bool,
) -> torch.Tensor:
    """TARGET_VERIFY attention on the torch_native backend: n tokens per request after a cached prefix.

    q: [B·n, Hq·Dh]; k, v: [B·n, Hkv·Dh] (written to the KV cache at out_cache_loc first). Request b's
    keys are at the slots of positions 0 .. L_b + n - 1 with L_b = forward_batch.seq_lens[b] (the committed
    prefix), read from req_to_token[r_b] page by page (`paged_slots`).
    Mask per request, [n, L_b + n]: the block of spec_info.custom_mask when present (triton layout,
    see `kernels.flat_custom_mask`); else all True for non-causal layers (the DFlash drafter's block);
    else the prefix plus a lower triangle. Returns [B·n, Hq·Dv].
    """
    from bastion_sglang.integration import sglang_adapter as sgl

    if layer.sliding_window_size is not None and layer.sliding_window_size > -1:
        raise NotImplementedError(
            f"layer {layer.layer_id} uses a sliding window, which the CPU verify path does not implement"
        )
    if save_kv_cache and k is not None and v is not None:
        backend.token_to_kv_pool.set_kv_buffer(
            layer, sgl.KVWriteLoc(loc=forward_batch.out_cache_loc, swa_loc=backend.swa_out_cache_loc), k, v
        )

    spec_info = forward_batch.spec_info
    batch = int(forward_batch.req_pool_indices.shape[0])
    per_request = int(spec_info.num_tokens_per_req) if spec_info is not None else -1
    if per_request <= 0:
        per_request = q.shape[0] // batch
    causal = not (layer.is_cross_attention or layer.attn_type == sgl.AttentionType.ENCODER_ONLY)
    custom_mask = spec_info.custom_mask if spec_info is not None else None

    queries = q.view(-1, layer.tp_q_head_num, layer.qk_head_dim)
    out = q.new_empty((queries.shape[0], layer.tp_q_head_num, layer.v_head_dim))
    k_cache = backend.token_to_kv_pool.get_key_buffer(layer.layer_id)
    v_cache = backend.token_to_kv_pool.get_value_buffer(layer.layer_id)
    req_to_token = backend.req_to_token_pool.req_to_token
    page_size = int(backend.token_to_kv_pool.page_size)
    mask_offset = 0
    prefixes = forward_batch.seq_lens.tolist()  # host copy: CPU tensors, no device sync
    rows = forward_batch.req_pool_indices.tolist()
    for b, (prefix, row) in enumerate(zip(prefixes, rows, strict=True)):
        keys_len = prefix + per_request
        slots = paged_slots(req_to_token[row], keys_len, page_size)
        if custom_mask is not None:
            size = per_request * keys_len
            mask = custom_mask[mask_offset : mask_offset + size].view(per_request, keys_len).to(torch.bool)
            mask_offset += size
        else:
            mask = torch.ones((per_request, keys_len), dtype=torch.bool, device=q.device)
            if causal:
                mask[:, prefix:] = torch.ones(
                    (per_request, per_request), dtype=torch.bool, device=q.device
                ).tril()
        tokens = slice(b * per_request, (b + 1) * per_request)
        out[tokens] = tree_attention(queries[tokens], k_cache[slots], v_cache[slots], mask, layer.scaling)
    return out.view(q.shape[0], layer.tp_q_head_num * layer.v_head_dim)


def paged_slots(row_slots: torch.Tensor, length: int, page_size: int) -> torch.Tensor:
    """[length] KV slots of positions 0..length-1 of one request, read as a paged attention kernel reads them:
    each page's first slot (row_slots[p * page_size]) plus the position's offset in its page.

    row_slots: [max context] the request's req_to_token row. With pages of one token this is the row itself;
    with larger pages it equals the row exactly where SGLang's page invariant holds (the positions of one page
    sit at consecutive slots of one page), so a verify pass on the CPU reads what a paged CUDA backend reads.
    """
    if page_size == 1:
        return row_slots[:length]
    firsts = row_slots[:length:page_size]
    offsets = torch.arange(page_size, dtype=row_slots.dtype, device=row_slots.device)
    return (firsts[:, None] + offsets).reshape(-1)[:length]
