"""Roofline (BASTION eqs. 8, 9): hand-computed Qwen3-8B values, HF config parsing, vectorised and batch
forms, GPU lookup."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from bastion_sglang.controller.roofline import (
    KNOWN_GPUS,
    HardwareSpec,
    ModelShape,
    RooflineModel,
    lookup_gpu,
)

QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 12288,
    "max_position_embeddings": 40960,
    "max_window_layers": 36,
    "model_type": "qwen3",
    "num_attention_heads": 32,
    "num_hidden_layers": 36,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}

# Llama-3.1-8B: no head_dim key (d = 4096 / 32 = 128).
LLAMA31_8B = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "vocab_size": 128256,
}

# Qwen1.5-MoE-A2.7B: 4 of 60 experts of width 1408 per token, plus a shared expert of width 5632.
QWEN15_MOE = {
    "architectures": ["Qwen2MoeForCausalLM"],
    "decoder_sparse_step": 1,
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "model_type": "qwen2_moe",
    "moe_intermediate_size": 1408,
    "mlp_only_layers": [],
    "num_attention_heads": 16,
    "num_experts": 60,
    "num_experts_per_tok": 4,
    "num_hidden_layers": 24,
    "num_key_value_heads": 16,
    "shared_expert_intermediate_size": 5632,
    "vocab_size": 151936,
}

# Qwen3-30B-A3B: 8 of 128 experts of width 768, no shared expert.
QWEN3_MOE = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "decoder_sparse_step": 1,
    "head_dim": 128,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "model_type": "qwen3_moe",
    "moe_intermediate_size": 768,
    "mlp_only_layers": [],
    "num_attention_heads": 32,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_key_value_heads": 4,
    "vocab_size": 151936,
}

H100 = HardwareSpec(name="test-gpu", peak_flops=1.0e15, bandwidth=2.0e12)


@pytest.fixture
def qwen3_8b() -> RooflineModel:
    return RooflineModel(ModelShape.from_hf_config(QWEN3_8B), H100, bytes_per_element=2)


# Hand arithmetic for Qwen3-8B: L = 36, h = 4096, n_q = 32, n_kv = 8, d = 128 -> h_q = 4096, h_kv = 1024,
# h_ffn = 12288, V = 151936.


def test_flops_by_hand_s1_c0(qwen3_8b: RooflineModel) -> None:
    q_and_o = 4 * 1 * 4096 * 4096  # 67_108_864
    k_and_v = 4 * 1 * 4096 * 1024  # 16_777_216
    attention = 4 * 1 * (0 + 1) * 4096  # 16_384
    ffn = 6 * 1 * 4096 * 12288  # 301_989_888
    lm_head = 2 * 1 * 4096 * 151936  # 1_244_659_712
    assert 36 * (q_and_o + k_and_v + attention + ffn) + lm_head == 15_136_784_384
    assert qwen3_8b.flops(1, 0) == 15_136_784_384


@pytest.mark.parametrize(("s", "c"), [(16, 1024), (512, 8192), (7, 3)])
def test_flops_by_hand(qwen3_8b: RooflineModel, s: int, c: int) -> None:
    q_and_o = 4 * s * 4096 * 4096
    k_and_v = 4 * s * 4096 * 1024
    attention = 4 * s * (c + s) * 4096
    ffn = 6 * s * 4096 * 12288
    lm_head = 2 * s * 4096 * 151936
    assert qwen3_8b.flops(s, c) == 36 * (q_and_o + k_and_v + attention + ffn) + lm_head


def test_bytes_by_hand_s1_c0(qwen3_8b: RooflineModel) -> None:
    embed_and_head = 2 * 151936 * 4096  # 1_244_659_712
    lm_head_io = 1 * (4096 + 151936)  # 156_032
    attention_weights = 2 * 4096 * (4096 + 1024)  # 41_943_040
    ffn_weights = 3 * 4096 * 12288  # 150_994_944
    kv_cache = 2 * 1024 * (0 + 2 * 1)  # 4_096
    activations = 4 * 1 * (4096 + 4096 + 12288)  # 81_920
    scores = 2 * 32 * 1 * (0 + 1)  # 64
    per_layer = attention_weights + ffn_weights + kv_cache + activations + scores  # 193_024_064
    elements = embed_and_head + lm_head_io + 36 * per_layer
    assert elements == 8_193_682_048
    assert qwen3_8b.bytes(1, 0) == 2 * 8_193_682_048 == 16_387_364_096


@pytest.mark.parametrize(("s", "c"), [(16, 1024), (512, 8192), (7, 3)])
def test_bytes_by_hand(qwen3_8b: RooflineModel, s: int, c: int) -> None:
    embed_and_head = 2 * 151936 * 4096
    lm_head_io = s * (4096 + 151936)
    attention_weights = 2 * 4096 * (4096 + 1024)
    ffn_weights = 3 * 4096 * 12288
    kv_cache = 2 * 1024 * (c + 2 * s)
    activations = 4 * s * (4096 + 4096 + 12288)
    scores = 2 * 32 * s * (c + s)
    per_layer = attention_weights + ffn_weights + kv_cache + activations + scores
    assert qwen3_8b.bytes(s, c) == 2 * (embed_and_head + lm_head_io + 36 * per_layer)


def test_seconds_are_counts_over_peaks(qwen3_8b: RooflineModel) -> None:
    assert qwen3_8b.compute_seconds(1, 0) == 15_136_784_384 / 1.0e15
    assert qwen3_8b.memory_seconds(1, 0) == 16_387_364_096 / 2.0e12
    # One token is memory-bound; 4096 tokens are compute-bound on this GPU.
    assert qwen3_8b.verify_seconds(1, 0) == qwen3_8b.memory_seconds(1, 0)
    assert qwen3_8b.verify_seconds(4096, 0) == qwen3_8b.compute_seconds(4096, 0)
    assert qwen3_8b.compute_seconds(4096, 0) > qwen3_8b.memory_seconds(4096, 0)


@pytest.mark.parametrize(("s", "c"), [(1, 0), (16, 1024), (512, 8192), (7, 3)])
def test_pass_parts_by_hand(qwen3_8b: RooflineModel, s: int, c: int) -> None:
    """The parts the latency model weighs: GEMMs (linear layers + LM head), weights, attention FLOPs, and
    per-request KV cache + activation bytes without the score matrix. Eq. (8) is GEMMs + attention; eq. (9)
    is weights + request bytes + the score matrix."""
    gemm = 36 * (4 * s * 4096 * 4096 + 4 * s * 4096 * 1024 + 6 * s * 4096 * 12288) + 2 * s * 4096 * 151936
    attention = 4 * s * (c + s) * 4096 * 36
    weights = 2 * 151936 * 4096 + 36 * (2 * 4096 * (4096 + 1024) + 3 * 4096 * 12288)
    request = s * (4096 + 151936) + 36 * (2 * 1024 * (c + 2 * s) + 4 * s * (4096 + 4096 + 12288))
    scores = 36 * 2 * 32 * s * (c + s)
    assert qwen3_8b.gemm_flops(s) == gemm
    assert qwen3_8b.attention_flops(s, c) == attention
    assert qwen3_8b.weight_bytes() == 2 * weights
    assert qwen3_8b.request_bytes(s, c) == 2 * request
    assert qwen3_8b.flops(s, c) == gemm + attention
    assert qwen3_8b.bytes(s, c) == 2 * (weights + request + scores)
    assert qwen3_8b.gemm_seconds(s) == max(gemm / 1.0e15, 2 * weights / 2.0e12)
    assert qwen3_8b.attention_seconds(s, c) == max(attention / 1.0e15, 2 * request / 2.0e12)


def test_score_matrix_is_most_of_the_paper_bytes_for_wide_passes_over_long_contexts(
    qwen3_8b: RooflineModel,
) -> None:
    scores = 2 * 36 * 2 * 32 * 1024 * (8192 + 1024)
    assert scores > 0.5 * qwen3_8b.bytes(1024, 8192)
    assert qwen3_8b.bytes(1024, 8192) == qwen3_8b.weight_bytes() + qwen3_8b.request_bytes(1024, 8192) + scores


def test_one_token_pass_is_memory_bound_and_a_wide_one_compute_bound(qwen3_8b: RooflineModel) -> None:
    assert qwen3_8b.gemm_seconds(1) == qwen3_8b.weight_bytes() / 2.0e12
    assert qwen3_8b.gemm_seconds(4096) == qwen3_8b.gemm_flops(4096) / 1.0e15
    assert qwen3_8b.attention_seconds(1, 8192) == qwen3_8b.request_bytes(1, 8192) / 2.0e12


def test_pass_terms_batch_sums_attention_per_request_and_runs_gemms_over_all_tokens(
    qwen3_8b: RooflineModel,
) -> None:
    terms = qwen3_8b.pass_terms_batch([16, 48], [100, 3000])
    assert terms.tokens == 64
    assert terms.gemm_seconds == qwen3_8b.gemm_seconds(64)
    assert terms.attention_seconds == qwen3_8b.attention_seconds(16, 100) + qwen3_8b.attention_seconds(
        48, 3000
    )
    one = qwen3_8b.pass_terms(16, 100)
    assert (one.tokens, one.gemm_seconds, one.attention_seconds) == (
        16,
        qwen3_8b.gemm_seconds(16),
        qwen3_8b.attention_seconds(16, 100),
    )
    with pytest.raises(ValueError, match="2 requests but c has 1"):
        qwen3_8b.pass_terms_batch([1, 2], [3])
    with pytest.raises(ValueError, match="s \\(tokens verified\\)"):
        qwen3_8b.gemm_flops(0)


@pytest.mark.parametrize("bytes_per_element", [1, 2, 0.5625])
def test_plain_pass_terms_equal_the_batch_terms_of_one_token_each(bytes_per_element: float) -> None:
    """The closed form a plain decode step is priced with gives `pass_terms_batch`'s values bit for bit, for
    integer and fractional bytes per element and contexts from none to a billion tokens."""
    roofline = RooflineModel(ModelShape.from_hf_config(QWEN3_8B), H100, bytes_per_element=bytes_per_element)
    generator = torch.Generator().manual_seed(11)
    for batch in (1, 3, 8, 64):
        for high in (10, 5000, 2_000_000):
            contexts = torch.randint(0, high, (batch,), generator=generator).tolist()
            assert roofline.plain_pass_terms(contexts) == roofline.pass_terms_batch([1] * batch, contexts)
    long = [0, 10**9]
    assert roofline.plain_pass_terms(long) == roofline.pass_terms_batch([1, 1], long)


@pytest.mark.parametrize("c", [0, 64, 8192])
def test_vectorised_parts_equal_scalar_parts(qwen3_8b: RooflineModel, c: int) -> None:
    widths = torch.tensor([1, 2, 3, 16, 17, 100, 512, 1024, 4096], dtype=torch.int64)
    gemm = qwen3_8b.gemm_seconds_many(widths)
    attention = qwen3_8b.attention_seconds_many(widths, c)
    assert gemm.dtype == attention.dtype == torch.float64 and gemm.shape == attention.shape == widths.shape
    expected_gemm = torch.tensor([qwen3_8b.gemm_seconds(int(s)) for s in widths], dtype=torch.float64)
    expected_attention = torch.tensor(
        [qwen3_8b.attention_seconds(int(s), c) for s in widths], dtype=torch.float64
    )
    torch.testing.assert_close(gemm, expected_gemm, rtol=1e-14, atol=0.0)
    torch.testing.assert_close(attention, expected_attention, rtol=1e-14, atol=0.0)


def test_bytes_per_element_scales_traffic_only() -> None:
    shape = ModelShape.from_hf_config(QWEN3_8B)
    fp8 = RooflineModel(shape, H100, bytes_per_element=1)
    bf16 = RooflineModel(shape, H100, bytes_per_element=2)
    assert bf16.bytes(64, 512) == 2 * fp8.bytes(64, 512)
    assert bf16.flops(64, 512) == fp8.flops(64, 512)


def test_from_hf_config_qwen3() -> None:
    shape = ModelShape.from_hf_config(QWEN3_8B)
    assert shape == ModelShape(
        num_layers=36,
        hidden_size=4096,
        num_q_heads=32,
        num_kv_heads=8,
        head_dim=128,
        ffn_size=12288,
        vocab_size=151936,
    )
    assert (shape.hq, shape.hkv) == (4096, 1024)


def test_from_hf_config_llama_without_head_dim() -> None:
    shape = ModelShape.from_hf_config(LLAMA31_8B)
    assert (shape.num_layers, shape.head_dim, shape.num_kv_heads) == (32, 128, 8)
    assert (shape.ffn_size, shape.vocab_size) == (14336, 128256)


def test_from_hf_config_defaults_kv_heads_and_null_head_dim() -> None:
    config = {**LLAMA31_8B, "head_dim": None}
    del config["num_key_value_heads"]
    shape = ModelShape.from_hf_config(config)
    assert (shape.num_kv_heads, shape.head_dim) == (32, 128)


def test_from_hf_config_moe_with_shared_expert() -> None:
    shape = ModelShape.from_hf_config(QWEN15_MOE)
    assert shape.ffn_size == 4 * 1408 + 5632
    assert shape.head_dim == 2048 // 16


def test_from_hf_config_qwen3_moe() -> None:
    shape = ModelShape.from_hf_config({**QWEN3_MOE, "num_experts_per_tok": 4})
    assert shape.ffn_size == 4 * 768
    assert (shape.num_layers, shape.hq, shape.hkv) == (48, 4096, 512)


def test_from_hf_config_mixtral_uses_intermediate_size_per_expert() -> None:
    mixtral = {**LLAMA31_8B, "num_local_experts": 8, "num_experts_per_tok": 2, "vocab_size": 32000}
    assert ModelShape.from_hf_config(mixtral).ffn_size == 2 * 14336


def test_from_hf_config_rejects_mixed_dense_and_sparse_layers() -> None:
    with pytest.raises(ValueError, match="mlp_only_layers"):
        ModelShape.from_hf_config({**QWEN3_MOE, "mlp_only_layers": [0, 1]})
    with pytest.raises(ValueError, match="decoder_sparse_step"):
        ModelShape.from_hf_config({**QWEN3_MOE, "decoder_sparse_step": 2})


def test_from_hf_config_nested_text_config() -> None:
    wrapper = {"architectures": ["Mistral3ForConditionalGeneration"], "text_config": QWEN3_8B}
    assert ModelShape.from_hf_config(wrapper) == ModelShape.from_hf_config(QWEN3_8B)


def test_from_hf_config_file_and_folder(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_8B))
    expected = ModelShape.from_hf_config(QWEN3_8B)
    assert ModelShape.from_hf_config(tmp_path) == expected
    assert ModelShape.from_hf_config(str(tmp_path / "config.json")) == expected


def test_from_hf_config_missing_key_names_key_and_file(tmp_path: Path) -> None:
    config = dict(QWEN3_8B)
    del config["num_hidden_layers"]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match="num_hidden_layers") as error:
        ModelShape.from_hf_config(path)
    assert str(path) in str(error.value)


def test_from_hf_config_bad_inputs(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="head_dim"):
        ModelShape.from_hf_config({**QWEN3_8B, "head_dim": "128"})
    with pytest.raises(ValueError, match="not divisible"):
        ModelShape.from_hf_config({**LLAMA31_8B, "num_attention_heads": 30})
    with pytest.raises(ValueError, match="cannot read"):
        ModelShape.from_hf_config(tmp_path / "absent")
    (tmp_path / "config.json").write_text('{"hidden_size": 4096,')
    with pytest.raises(ValueError, match="line 1 column"):
        ModelShape.from_hf_config(tmp_path)


def test_model_shape_and_hardware_validation() -> None:
    with pytest.raises(ValidationError, match="num_layers"):
        ModelShape(
            num_layers=0,
            hidden_size=8,
            num_q_heads=1,
            num_kv_heads=1,
            head_dim=8,
            ffn_size=8,
            vocab_size=8,
        )
    with pytest.raises(ValidationError, match="peak_flops"):
        HardwareSpec(name="x", peak_flops=0.0, bandwidth=1.0)
    with pytest.raises(ValidationError, match="bandwidth"):
        HardwareSpec(name="x", peak_flops=1.0, bandwidth=float("inf"))
    with pytest.raises(ValueError, match="bytes_per_element"):
        RooflineModel(ModelShape.from_hf_config(QWEN3_8B), H100, bytes_per_element=0)


def test_token_count_validation(qwen3_8b: RooflineModel) -> None:
    with pytest.raises(ValueError, match="s \\(tokens verified\\)"):
        qwen3_8b.flops(0, 10)
    with pytest.raises(ValueError, match="c \\(cached"):
        qwen3_8b.bytes(1, -1)
    with pytest.raises(ValueError, match="int64"):
        qwen3_8b.compute_seconds_many(torch.tensor([1.0, 2.0]), 0)
    with pytest.raises(ValueError, match=">= 1"):
        qwen3_8b.memory_seconds_many(torch.tensor([0, 2]), 0)


@pytest.mark.parametrize("c", [0, 64, 8192])
def test_vectorised_forms_equal_scalar_forms(qwen3_8b: RooflineModel, c: int) -> None:
    widths = torch.tensor([1, 2, 3, 16, 17, 100, 512, 1024], dtype=torch.int64)
    for many, one in (
        (qwen3_8b.compute_seconds_many, qwen3_8b.compute_seconds),
        (qwen3_8b.memory_seconds_many, qwen3_8b.memory_seconds),
        (qwen3_8b.verify_seconds_many, qwen3_8b.verify_seconds),
    ):
        values = many(widths, c)
        assert values.dtype == torch.float64 and values.shape == widths.shape
        expected = torch.tensor([one(int(s), c) for s in widths], dtype=torch.float64)
        torch.testing.assert_close(values, expected, rtol=1e-14, atol=0.0)


def test_batch_of_one_equals_single_request(qwen3_8b: RooflineModel) -> None:
    for s, c in ((1, 0), (16, 1024), (512, 8192)):
        assert qwen3_8b.flops_batch([s], [c]) == qwen3_8b.flops(s, c)
        assert qwen3_8b.bytes_batch([s], [c]) == qwen3_8b.bytes(s, c)
        assert qwen3_8b.compute_seconds_batch([s], [c]) == qwen3_8b.compute_seconds(s, c)
        assert qwen3_8b.memory_seconds_batch(torch.tensor([s]), torch.tensor([c])) == qwen3_8b.memory_seconds(
            s, c
        )
        assert qwen3_8b.verify_seconds_batch([s], [c]) == qwen3_8b.verify_seconds(s, c)


def test_batch_reads_weights_once(qwen3_8b: RooflineModel) -> None:
    weights = 2 * (2 * 151936 * 4096 + 36 * (2 * 4096 * (4096 + 1024) + 3 * 4096 * 12288))
    one, two = qwen3_8b.bytes(16, 100), qwen3_8b.bytes(32, 2000)
    assert qwen3_8b.bytes_batch([16, 32], [100, 2000]) == one + two - weights
    assert qwen3_8b.flops_batch([16, 32], [100, 2000]) == qwen3_8b.flops(16, 100) + qwen3_8b.flops(32, 2000)


def test_batch_validation(qwen3_8b: RooflineModel) -> None:
    with pytest.raises(ValueError, match="empty"):
        qwen3_8b.flops_batch([], [])
    with pytest.raises(ValueError, match="2 requests but c has 1"):
        qwen3_8b.bytes_batch([1, 2], [3])
    with pytest.raises(ValueError, match="c \\(cached"):
        qwen3_8b.memory_seconds_batch([1, 2], [3, -4])


@pytest.mark.parametrize(
    ("device_name", "key"),
    [
        ("NVIDIA A100-SXM4-40GB", "A100-SXM4-40GB"),
        ("NVIDIA A100-SXM4-80GB", "A100-SXM4-80GB"),
        ("NVIDIA A100 80GB PCIe", "A100-PCIe-80GB"),
        ("NVIDIA A100-PCIE-40GB", "A100-PCIe-40GB"),
        ("NVIDIA H100 80GB HBM3", "H100-SXM"),
        ("NVIDIA H100 PCIe", "H100-PCIe"),
        ("NVIDIA H200", "H200"),
        ("NVIDIA L40S", "L40S"),
        ("NVIDIA RTX 6000 Ada Generation", "RTX-6000-Ada"),
        ("NVIDIA RTX PRO 6000 Blackwell Workstation Edition", "RTX-PRO-6000-Blackwell"),
        ("NVIDIA RTX PRO 6000 Blackwell Server Edition", "RTX-PRO-6000-Blackwell"),
        ("NVIDIA A10G", "A10G"),
        ("NVIDIA L4", "L4"),
    ],
)
def test_lookup_gpu(device_name: str, key: str) -> None:
    assert lookup_gpu(device_name) is KNOWN_GPUS[key]


def test_lookup_gpu_accepts_table_keys() -> None:
    for key, spec in KNOWN_GPUS.items():
        assert lookup_gpu(key) is spec


def test_known_gpu_figures() -> None:
    assert KNOWN_GPUS["H100-SXM"].peak_flops == pytest.approx(989.4e12)
    assert KNOWN_GPUS["H100-SXM"].bandwidth == pytest.approx(3.35e12)
    assert KNOWN_GPUS["A100-SXM4-80GB"].bandwidth == pytest.approx(2.039e12)
    assert KNOWN_GPUS["H200"].bandwidth > KNOWN_GPUS["H100-SXM"].bandwidth


@pytest.mark.parametrize(
    "device_name",
    ["NVIDIA H100 NVL", "NVIDIA RTX PRO 6000 Blackwell Max-Q Workstation Edition", "NVIDIA L40", "Tesla T4"],
)
def test_lookup_gpu_unknown_lists_known_names(device_name: str) -> None:
    with pytest.raises(ValueError, match="unknown GPU") as error:
        lookup_gpu(device_name)
    assert all(key in str(error.value) for key in KNOWN_GPUS)
