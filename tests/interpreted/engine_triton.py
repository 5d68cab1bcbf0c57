"""BASTION served by `sglang.Engine` on SGLang's CUDA attention path (`--attention-backend triton`), on the
CPU, every Triton kernel under Triton's interpreter: greedy outputs equal SGLang without speculation on the
same backend.

Run by `tests/test_engine_triton_interpreter.py` (the interpreter lane, `tests/interpreter_lane.py`). The
tiny fp32 pair of `tests/engine_support.py`; the drafter is the test-only oracle with decoys
(`tests/oracle_drafter.py`, fixed:12 trees whose accepted path is not a prefix of the verify row), so the
TARGET_VERIFY passes go through SGLang's triton `extend_attention_fwd` with BASTION's flat tree mask and
only an exact mask keeps the outputs equal.

What stands in the way on the CPU, patched here only (`triton_on_cpu`):
- `registration.supported_attention_backends("cpu")` is torch_native alone, so `choose_attention_backend`
  (SGLang's `handle_cpu_backends` resolution step, in the launching process) refuses `--attention-backend
  triton` for BASTION on the CPU. The patch adds triton for the CPU. Nothing else is patched: SGLang's own
  triton backend and its Triton kernels (for the target and, as SGLang overrides the drafter's backend to
  the target's, for the drafter) and BASTION's worker run as served, with the CPU stand-ins BASTION's
  `cpu_support` installs in any CPU server (host versions of `assign_req_to_token_pool` and of the KV copy
  among them); on CPU tensors the worker's own ops
  take their torch references (`kernels.uses_triton` is CUDA only), `tests/interpreted/bastion_kernels.py`
  holds their Triton versions.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sglang
from engine_support import PROMPTS, engine_server_args, first_difference, make_model_pair
from interpreter_lane import require_interpreted
from oracle_drafter import write_references
from sglang.kernels.ops.attention import extend_attention

from bastion_sglang import registration
from bastion_sglang.kernels import triton_tree
from bastion_sglang.registration import make_config

require_interpreted(extend_attention._fwd_kernel, triton_tree._flat_custom_mask_kernel)

REQUESTS = PROMPTS[:3]
GREEDY = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}


@pytest.fixture(scope="module")
def triton_on_cpu() -> Iterator[None]:
    """BASTION accepts `--attention-backend triton` on the CPU in this process (the module doc)."""
    supported = registration.supported_attention_backends

    def with_triton(device: str) -> tuple[str, ...]:
        found = supported(device)
        return (*found, "triton") if device.split(":")[0] == "cpu" else found

    registration.supported_attention_backends = with_triton
    yield
    registration.supported_attention_backends = supported


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return make_model_pair(tmp_path_factory.mktemp("engine_triton"))


def run_greedy(server_args: Any) -> list[dict[str, Any]]:
    engine = sglang.Engine(server_args=server_args)
    try:
        return engine.generate(input_ids=REQUESTS, sampling_params=GREEDY)
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def reference(models: tuple[Path, Path]) -> list[list[int]]:
    """SGLang without speculation on the triton backend."""
    outs = run_greedy(engine_server_args(models, None, attention_backend="triton"))
    return [out["output_ids"] for out in outs]


def test_bastion_on_the_triton_backend_equals_no_speculation(
    triton_on_cpu: None, models: tuple[Path, Path], reference: list[list[int]], tmp_path: Path
) -> None:
    references = write_references(tmp_path / "reference.json", REQUESTS, reference, decoy_gap=0.4)
    config = dataclasses.replace(
        make_config(max_budget=12, policy="fixed:12", topk=2),
        draft_proposer="oracle_drafter:make_oracle",
        draft_proposer_arg=str(references),
    )
    outs = run_greedy(engine_server_args(models, config, attention_backend="triton"))
    for i, (out, want) in enumerate(zip(outs, reference, strict=True)):
        got = out["output_ids"]
        assert got == want, f"prompt {i} diverges at token {first_difference(got, want)}"
    verify_passes = sum(int(out["meta_info"].get("spec_verify_ct") or 0) for out in outs)
    tokens = sum(len(out["output_ids"]) for out in outs)
    assert 0 < verify_passes < tokens  # trees were verified, and accepted more than one token per pass
