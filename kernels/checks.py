"""Input validation for the public entry points of `bastion_sglang.kernels`.

Each `check_*` function validates the arguments of the op of the same name once, from shapes, ranks,
dtypes and devices only (never from tensor values, which would force a device->host sync), and raises
ValueError naming the offending argument. The backends in `reference.py` and `triton_*.py` assume
checked inputs.
"""

from __future__ import annotations

import math

import torch

from bastion_sglang.kernels.types import AcceptResult, DraftTreeRows, KvMoves, TreeBatch


def _shape(tensor: torch.Tensor) -> tuple[int, ...]:
    return tuple(tensor.shape)


def _require_tensor(name: str, value: object) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def _require_int64(name: str, tensor: torch.Tensor, layout: str, rank: int) -> None:
    if tensor.dim() != rank:
        raise ValueError(f"{name} must be {layout}, got shape {_shape(tensor)}")
    if tensor.dtype != torch.int64:
        raise ValueError(f"{name} must be int64, got {tensor.dtype}")


def _require_float(name: str, tensor: torch.Tensor, layout: str, rank: int) -> None:
    if tensor.dim() != rank:
        raise ValueError(f"{name} must be {layout}, got shape {_shape(tensor)}")
    if not tensor.is_floating_point():
        raise ValueError(f"{name} must be a floating tensor, got {tensor.dtype}")


def _require_shape(name: str, tensor: torch.Tensor, expected: tuple[int, ...], layout: str) -> None:
    if _shape(tensor) != expected:
        raise ValueError(f"{name} must be {layout} = {expected}, got shape {_shape(tensor)}")


def _require_device(name: str, tensor: torch.Tensor, device: torch.device) -> None:
    if tensor.device != device:
        raise ValueError(f"{name} is on {tensor.device}, expected {device} like the other inputs")


def _require_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def check_tree_batch(trees: TreeBatch) -> None:
    """tokens, parents, depths: each [B, W] int64 on one device, W >= 1."""
    if not isinstance(trees, TreeBatch):
        raise ValueError(f"trees must be a TreeBatch, got {type(trees).__name__}")
    _require_int64("trees.tokens", trees.tokens, "[B, W]", 2)
    if trees.tokens.shape[1] == 0:
        raise ValueError("trees must have width W >= 1 (position 0 is the root)")
    device = trees.tokens.device
    for name in ("parents", "depths"):
        field = getattr(trees, name)
        _require_int64(f"trees.{name}", field, "[B, W]", 2)
        _require_shape(f"trees.{name}", field, _shape(trees.tokens), "[B, W] like trees.tokens")
        _require_device(f"trees.{name}", field, device)


def check_flatten_trees(trees: DraftTreeRows, bonus_tokens: torch.Tensor, width: int) -> None:
    """trees.tokens/parents/depths [B, N] int64; bonus_tokens [B] int64; 1 <= width <= N + 1."""
    tokens = _require_tensor("trees.tokens", trees.tokens)
    _require_int64("trees.tokens", tokens, "[B, N]", 2)
    batch, nodes = _shape(tokens)
    for name in ("parents", "depths"):
        field = _require_tensor(f"trees.{name}", getattr(trees, name))
        _require_int64(f"trees.{name}", field, "[B, N]", 2)
        _require_shape(f"trees.{name}", field, (batch, nodes), "[B, N] like trees.tokens")
        _require_device(f"trees.{name}", field, tokens.device)
    _require_tensor("bonus_tokens", bonus_tokens)
    _require_int64("bonus_tokens", bonus_tokens, "[B]", 1)
    _require_shape("bonus_tokens", bonus_tokens, (batch,), "[B]")
    _require_device("bonus_tokens", bonus_tokens, tokens.device)
    _require_int("width", width, 1)
    if width - 1 > nodes:
        raise ValueError(f"width {width} needs {width - 1} draft nodes per request, trees have N = {nodes}")


def check_root_rows(bonus_tokens: torch.Tensor) -> None:
    """bonus_tokens [B] int64."""
    _require_tensor("bonus_tokens", bonus_tokens)
    _require_int64("bonus_tokens", bonus_tokens, "[B]", 1)


def check_build_verify_layout(trees: TreeBatch, ctx_lens: torch.Tensor) -> None:
    """trees: a TreeBatch [B, W]; ctx_lens [B] int64."""
    check_tree_batch(trees)
    _require_tensor("ctx_lens", ctx_lens)
    _require_int64("ctx_lens", ctx_lens, "[B]", 1)
    _require_shape("ctx_lens", ctx_lens, (trees.batch_size,), "[B]")
    _require_device("ctx_lens", ctx_lens, trees.tokens.device)


def check_flat_custom_mask(
    ancestor_mask: torch.Tensor, seq_lens: torch.Tensor, seq_lens_sum: int | None
) -> None:
    """ancestor_mask [B, W, W] bool; seq_lens [B] int64; seq_lens_sum a non-negative int or None."""
    _require_tensor("ancestor_mask", ancestor_mask)
    if ancestor_mask.dim() != 3 or ancestor_mask.shape[1] != ancestor_mask.shape[2]:
        raise ValueError(f"ancestor_mask must be [B, W, W], got shape {_shape(ancestor_mask)}")
    if ancestor_mask.dtype != torch.bool:
        raise ValueError(f"ancestor_mask must be bool, got {ancestor_mask.dtype}")
    _require_tensor("seq_lens", seq_lens)
    _require_int64("seq_lens", seq_lens, "[B]", 1)
    _require_shape("seq_lens", seq_lens, (ancestor_mask.shape[0],), "[B]")
    _require_device("seq_lens", seq_lens, ancestor_mask.device)
    if seq_lens_sum is not None:
        _require_int("seq_lens_sum", seq_lens_sum, 0)


def check_accept_walk(trees: TreeBatch, target_tokens: torch.Tensor) -> None:
    """trees: a TreeBatch [B, W]; target_tokens [B, W] int64."""
    check_tree_batch(trees)
    _require_tensor("target_tokens", target_tokens)
    _require_int64("target_tokens", target_tokens, "[B, W]", 2)
    _require_shape("target_tokens", target_tokens, _shape(trees.tokens), "[B, W] like trees.tokens")
    _require_device("target_tokens", target_tokens, trees.tokens.device)


def check_accept_paths(trees: TreeBatch, ancestors: torch.Tensor, target_tokens: torch.Tensor) -> None:
    """trees: a TreeBatch [B, W]; ancestors [B, W, W] bool; target_tokens [B, W] int64; one device."""
    check_accept_walk(trees, target_tokens)
    _require_tensor("ancestors", ancestors)
    batch, width = _shape(trees.tokens)
    _require_shape("ancestors", ancestors, (batch, width, width), "[B, W, W] for trees [B, W]")
    if ancestors.dtype != torch.bool:
        raise ValueError(f"ancestors must be bool, got {ancestors.dtype}")
    _require_device("ancestors", ancestors, trees.tokens.device)


def check_accept_roots(target_tokens: torch.Tensor) -> None:
    """target_tokens [B] int64."""
    _require_tensor("target_tokens", target_tokens)
    _require_int64("target_tokens", target_tokens, "[B]", 1)


def check_accept_greedy(trees: TreeBatch, target_logits: torch.Tensor) -> None:
    """trees: a TreeBatch [B, W]; target_logits [B, W, V] floating, V >= 1."""
    check_tree_batch(trees)
    _require_tensor("target_logits", target_logits)
    _require_float("target_logits", target_logits, "[B, W, V]", 3)
    _require_shape(
        "target_logits", target_logits, (*_shape(trees.tokens), target_logits.shape[2]), "[B, W, V]"
    )
    if target_logits.shape[2] == 0:
        raise ValueError("target_logits must have a vocabulary of at least one token, got V = 0")
    _require_device("target_logits", target_logits, trees.tokens.device)


def check_position_uniforms(seeds: torch.Tensor, positions: torch.Tensor, name: str = "seeds") -> None:
    """seeds [B] int64 (called `name`: seeds or keys); positions [B, W] int64, same device."""
    check_seeds(seeds, name)
    _require_tensor("positions", positions)
    _require_int64("positions", positions, "[B, W]", 2)
    if positions.shape[0] != seeds.shape[0]:
        raise ValueError(
            f"positions must be [B, W] with B = {seeds.shape[0]} ({name}), got {_shape(positions)}"
        )
    _require_device("positions", positions, seeds.device)


def check_seeds(seeds: torch.Tensor, name: str = "seeds") -> None:
    """seeds [B] int64 (called `name`)."""
    _require_tensor(name, seeds)
    _require_int64(name, seeds, "[B]", 1)


def check_sample_tokens(probs: torch.Tensor, uniforms: torch.Tensor) -> None:
    """probs [M, V] floating, V >= 1; uniforms [M] floating, same device."""
    _require_tensor("probs", probs)
    _require_float("probs", probs, "[M, V]", 2)
    if probs.shape[1] == 0:
        raise ValueError("probs must have a vocabulary of at least one token, got V = 0")
    _require_tensor("uniforms", uniforms)
    _require_float("uniforms", uniforms, "[M]", 1)
    _require_shape("uniforms", uniforms, (probs.shape[0],), "[M]")
    _require_device("uniforms", uniforms, probs.device)


def check_accept_sampling(trees: TreeBatch, target_probs: torch.Tensor, uniforms: torch.Tensor) -> None:
    """trees: a TreeBatch [B, W]; target_probs [B, W, V] floating, V >= 1; uniforms [B, W] floating."""
    check_tree_batch(trees)
    _require_tensor("target_probs", target_probs)
    _require_float("target_probs", target_probs, "[B, W, V]", 3)
    _require_shape("target_probs", target_probs, (*_shape(trees.tokens), target_probs.shape[2]), "[B, W, V]")
    if target_probs.shape[2] == 0:
        raise ValueError("target_probs must have a vocabulary of at least one token, got V = 0")
    _require_device("target_probs", target_probs, trees.tokens.device)
    _require_tensor("uniforms", uniforms)
    _require_float("uniforms", uniforms, "[B, W]", 2)
    _require_shape("uniforms", uniforms, _shape(trees.tokens), "[B, W] like trees.tokens")
    _require_device("uniforms", uniforms, trees.tokens.device)


def check_accepted_kv_moves(
    accept_index: torch.Tensor, accept_length: torch.Tensor, tree_base: torch.Tensor
) -> None:
    """accept_index [B, W] int64, W >= 1; accept_length [B] int64; tree_base [B] int64; one device."""
    check_compaction_order(accept_index, accept_length)
    _require_tensor("tree_base", tree_base)
    _require_int64("tree_base", tree_base, "[B]", 1)
    _require_shape("tree_base", tree_base, (accept_index.shape[0],), "[B]")
    _require_device("tree_base", tree_base, accept_index.device)


def check_window_kv_moves(order: torch.Tensor, keep: torch.Tensor, slots: torch.Tensor) -> None:
    """order [B, W] int64, W >= 1; keep [B] int64; slots [B, W] int64; one device."""
    _check_rows_and_counts("order", order, "keep", keep)
    _require_tensor("slots", slots)
    _require_int64("slots", slots, "[B, W]", 2)
    _require_shape("slots", slots, tuple(order.shape), "[B, W] like order")
    _require_device("slots", slots, order.device)


def check_compaction_order(accept_index: torch.Tensor, accept_length: torch.Tensor) -> None:
    """accept_index [B, W] int64, W >= 1; accept_length [B] int64; one device."""
    _check_rows_and_counts("accept_index", accept_index, "accept_length", accept_length)


def _check_rows_and_counts(
    rows_name: str, rows: torch.Tensor, counts_name: str, counts: torch.Tensor
) -> None:
    """rows [B, W] int64 whose column 0 is the root (W >= 1); counts [B] int64 on the same device."""
    _require_tensor(rows_name, rows)
    _require_int64(rows_name, rows, "[B, W]", 2)
    if rows.shape[1] == 0:
        raise ValueError(f"{rows_name} must have width W >= 1 (column 0 is the root)")
    _require_tensor(counts_name, counts)
    _require_int64(counts_name, counts, "[B]", 1)
    _require_shape(counts_name, counts, (rows.shape[0],), "[B]")
    _require_device(counts_name, counts, rows.device)


def check_committed_tokens(tokens: torch.Tensor, order: torch.Tensor, accept: AcceptResult) -> None:
    """tokens [B, W] int64; order [B, W] int64; accept's fields [B, W] / [B] int64; one device."""
    _require_tensor("tokens", tokens)
    _require_int64("tokens", tokens, "[B, W]", 2)
    _require_tensor("order", order)
    _require_int64("order", order, "[B, W]", 2)
    _require_shape("order", order, tuple(tokens.shape), "[B, W]")
    _require_device("order", order, tokens.device)
    check_compaction_order(accept.accept_index, accept.accept_length)
    _require_shape("accept.accept_index", accept.accept_index, tuple(tokens.shape), "[B, W]")
    _require_device("accept.accept_index", accept.accept_index, tokens.device)
    _require_tensor("accept.bonus_tokens", accept.bonus_tokens)
    _require_int64("accept.bonus_tokens", accept.bonus_tokens, "[B]", 1)
    _require_shape("accept.bonus_tokens", accept.bonus_tokens, (tokens.shape[0],), "[B]")
    _require_device("accept.bonus_tokens", accept.bonus_tokens, tokens.device)


def check_apply_kv_moves(cache: torch.Tensor, moves: KvMoves) -> None:
    """cache [S, ...] contiguous, rank >= 1; moves.src/dst [B, W] int64, moves.keep [B] int64; one device."""
    _require_tensor("cache", cache)
    if cache.dim() < 1:
        raise ValueError(f"cache must be [S, ...] with rank >= 1, got shape {_shape(cache)}")
    if not cache.is_contiguous():
        raise ValueError(f"cache must be contiguous, got strides {cache.stride()} for shape {_shape(cache)}")
    if not isinstance(moves, KvMoves):
        raise ValueError(f"moves must be KvMoves, got {type(moves).__name__}")
    _require_int64("moves.src", moves.src, "[B, W]", 2)
    _require_int64("moves.dst", moves.dst, "[B, W]", 2)
    _require_shape("moves.dst", moves.dst, _shape(moves.src), "[B, W] like moves.src")
    _require_int64("moves.keep", moves.keep, "[B]", 1)
    _require_shape("moves.keep", moves.keep, (moves.src.shape[0],), "[B]")
    for name, tensor in (("moves.src", moves.src), ("moves.dst", moves.dst), ("moves.keep", moves.keep)):
        _require_device(name, tensor, cache.device)


def check_topk_logprobs(logits: torch.Tensor, k: int) -> None:
    """logits [B, D, V] floating; 1 <= k <= V."""
    _require_tensor("logits", logits)
    _require_float("logits", logits, "[B, D, V]", 3)
    _require_int("k", k, 1)
    if k > logits.shape[2]:
        raise ValueError(f"k = {k} exceeds the vocabulary size V = {logits.shape[2]}")


def check_tree_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> None:
    """q [T, Hq, Dh], k/v [S, Hkv, Dh] floating, Hq a multiple of Hkv; mask [T, S] bool; finite scale."""
    for name, tensor, layout in (("q", q, "[T, Hq, Dh]"), ("k", k, "[S, Hkv, Dh]"), ("v", v, "[S, Hkv, Dh]")):
        _require_tensor(name, tensor)
        _require_float(name, tensor, layout, 3)
        _require_device(name, tensor, q.device)
    tokens, q_heads, head_dim = _shape(q)
    keys, kv_heads, _ = _shape(k)
    _require_shape("k", k, (keys, kv_heads, head_dim), "[S, Hkv, Dh] with Dh of q")
    _require_shape("v", v, _shape(k), "[S, Hkv, Dh] like k")
    if kv_heads == 0 or q_heads % kv_heads != 0:
        raise ValueError(f"q heads Hq = {q_heads} must be a positive multiple of kv heads Hkv = {kv_heads}")
    _require_tensor("mask", mask)
    if mask.dtype != torch.bool:
        raise ValueError(f"mask must be bool, got {mask.dtype}")
    _require_shape("mask", mask, (tokens, keys), "[T, S]")
    _require_device("mask", mask, q.device)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"scale must be a finite float, got {scale!r}")
