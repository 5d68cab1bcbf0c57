"""`sglang_adapter`: every SGLang internal BASTION relies on resolves on the installed SGLang, and what
moved is reported at once. An SGLang upgrade that moves one fails here, naming it."""

from __future__ import annotations

import ast
import re
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from bastion_sglang.integration.sglang_adapter import (
    IMPORT_CHECKED,
    MEASUREMENT_INTERNALS,
    PINNED_VERSION,
    REGISTRATION_HOOKS,
    RESOLUTION_INTERNALS,
    SERVING_INTERNALS,
    Internal,
    SglangMismatchError,
    SglangVersionWarning,
    add_graph_usage,
    append_target_hidden_to_draft_kv,
    committed_kv_len,
    count_decode_step,
    future_map,
    gathered_verify_logits,
    missing_internals,
    require,
)
from bastion_sglang.registration import CHOOSE_BACKEND_STEP

ROOT = Path(__file__).resolve().parents[1]
DECLARED = (*IMPORT_CHECKED, *MEASUREMENT_INTERNALS)
BOGUS = Internal("sglang.srt.speculative.dflash_worker_v2", "DFlashWorkerV2", "_no_such_attribute")


@pytest.mark.parametrize("internal", DECLARED, ids=str)
def test_declared_internal_resolves(internal: Internal) -> None:
    assert missing_internals([internal]) == []


def test_the_pin_is_pyprojects() -> None:
    pin = re.search(r'"sglang==([^"]+)"', (ROOT / "pyproject.toml").read_text())
    assert pin is not None and pin.group(1) == PINNED_VERSION


def test_missing_internals_are_listed_together_with_both_versions() -> None:
    module_gone = Internal("sglang.srt.no_such_module", "Thing")
    name_gone = Internal("sglang.srt.speculative.dflash_worker_v2", "NoSuchWorker")
    present = Internal("sglang.srt.managers.utils", "GenerationBatchResult")
    internals = [present, BOGUS, module_gone, name_gone]
    assert missing_internals(internals) == [BOGUS, module_gone, name_gone]
    with pytest.raises(SglangMismatchError) as error:
        require(internals, installed="0.6.0")
    message = str(error.value)
    listed = [line.removeprefix("  - ") for line in message.splitlines() if line.startswith("  - ")]
    assert listed == [str(BOGUS), str(module_gone), str(name_gone)]
    assert "0.6.0" in message and PINNED_VERSION in message


def test_another_version_with_every_internal_warns() -> None:
    with pytest.warns(SglangVersionWarning, match=f"{PINNED_VERSION}.*0.5.99"):
        require(SERVING_INTERNALS[:3], installed="0.5.99")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        require(SERVING_INTERNALS[:3], installed=PINNED_VERSION)


def test_instance_and_class_attributes_resolve_but_not_others() -> None:
    """Private attributes set in __init__ (not on the class) count; a name no method assigns does not."""
    set_in_init = Internal("sglang.srt.speculative.dflash_worker_v2", "DFlashWorkerV2", "_mask_token_id")
    method = Internal("sglang.srt.speculative.dflash_worker_v2", "DFlashWorkerV2", "init_cuda_graphs")
    assert missing_internals([set_in_init, method]) == []
    assert missing_internals([BOGUS]) == [BOGUS]


def test_parameters_passed_by_keyword_are_checked_by_name() -> None:
    """A keyword BASTION passes must be a parameter of the callable (a class: its constructor); a renamed one
    is reported with the parameters BASTION passes."""
    future = Internal("sglang.srt.managers.overlap_utils", "FutureMap", None, ("device", "spec_algo"))
    method = Internal(
        "sglang.srt.mem_cache.kv_index_translator", "KVIndexTranslator", "plan", ("read_extent",)
    )
    renamed = Internal("sglang.srt.managers.overlap_utils", "FutureMap", None, ("device", "speculative_algo"))
    field = Internal("sglang.srt.managers.schedule_batch", "ReqKvInfo", "kv_committed_len", ("x",))
    assert missing_internals([future, method, renamed, field]) == [renamed, field]
    assert str(renamed) == "sglang.srt.managers.overlap_utils.FutureMap(device, speculative_algo)"


def test_the_attention_backend_step_is_declared() -> None:
    """registration wraps a resolution step by name (SGLang refuses an unknown name at registration); the
    step is a declared function of SGLang's pipeline."""
    assert Internal("sglang.srt.arg_groups.platform_hook", CHOOSE_BACKEND_STEP) in RESOLUTION_INTERNALS


def test_every_hook_registration_makes_is_declared() -> None:
    """registration.py registers its hooks by dotted name; each must be a declared target."""
    tree = ast.parse((ROOT / "bastion_sglang" / "registration.py").read_text())
    targets = {
        node.args[0].value
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "register"
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "HookRegistry"
        and node.args
        and isinstance(node.args[0], ast.Constant)
    }
    assert targets and targets <= {hook.target for hook in REGISTRATION_HOOKS}


def test_glue_takes_sglang_internals_from_the_adapter() -> None:
    """Outside the adapter and the plugin hooks (registration's, the step anatomy's), modules of
    `bastion_sglang/` (every glue module, new ones included) import SGLang only for types."""
    package = ROOT / "bastion_sglang"
    glue = sorted(
        path
        for folder in (package, *(package / group for group in ("step", "integration", "demo", "assets")))
        for path in folder.glob("*.py")
        if path.stem not in ("sglang_adapter", "registration", "step_anatomy_hooks")
    )
    assert {"worker", "spec_input", "request_support"} <= {path.stem for path in glue}
    for path in glue:
        name = path.stem
        tree = ast.parse(path.read_text())
        type_only = {
            id(node)
            for block in ast.walk(tree)
            if isinstance(block, ast.If) and ast.unparse(block.test) == "TYPE_CHECKING"
            for node in ast.walk(block)
        }
        runtime = [
            node.module
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom)
            and (node.module or "").startswith("sglang")
            and id(node) not in type_only
        ]
        assert runtime == [], (name, runtime)


class DeferredProcessor:
    """Stands in for SGLang's LogitsProcessor with a deferred vocabulary gather: doubles the logits."""

    def is_deferred_shard(self, logits: torch.Tensor) -> bool:
        return logits.shape[-1] == 2

    def finish_deferred_gather(self, logits: torch.Tensor) -> torch.Tensor:
        return torch.cat([logits, logits], dim=-1)


def test_verify_logits_are_gathered_only_when_deferred() -> None:
    shard = torch.ones(3, 2)
    worker = SimpleNamespace(_target_logits_processor=DeferredProcessor())
    assert gathered_verify_logits(worker, shard).shape == (3, 4)
    whole = torch.ones(3, 4)
    assert gathered_verify_logits(worker, whole) is whole
    assert gathered_verify_logits(SimpleNamespace(_target_logits_processor=None), shard) is shard


def test_graph_usage_adds_to_the_workers_records() -> None:
    worker = SimpleNamespace(
        _additional_graph_memory_usage={"target_verify": 1.0}, _additional_graph_time_usage={}
    )
    add_graph_usage(worker, "target_verify", 0.5, 2.0)
    add_graph_usage(worker, "target_verify", 0.25, 1.0)
    assert worker._additional_graph_memory_usage == {"target_verify": 1.75}
    assert worker._additional_graph_time_usage == {"target_verify": 3.0}


def test_draft_kv_commit_passes_the_flat_and_2d_slots() -> None:
    calls: list[dict[str, torch.Tensor]] = []
    worker = SimpleNamespace(_append_target_hidden_to_draft_kv_by_loc=lambda **kw: calls.append(kw))
    slots = torch.tensor([[4, 5], [9, 8]])
    hidden, positions, lens = torch.zeros(4, 3), torch.arange(4), torch.tensor([1, 2], dtype=torch.int32)
    append_target_hidden_to_draft_kv(worker, hidden, slots, positions, lens)
    (call,) = calls
    assert torch.equal(call["cache_loc"], torch.tensor([4, 5, 9, 8])) and call["cache_loc_2d"] is slots
    assert call["target_hidden"] is hidden and call["positions"] is positions and call["commit_lens"] is lens


def test_committed_length_and_decode_counter_of_requests() -> None:
    reqs = [SimpleNamespace(kv=SimpleNamespace(kv_committed_len=7), decode_batch_idx=0) for _ in range(2)]
    assert committed_kv_len(reqs[0]) == 7
    count_decode_step(reqs)
    count_decode_step(reqs[:1])
    assert [req.decode_batch_idx for req in reqs] == [2, 1]


def test_future_map_is_sglangs_with_host_lengths() -> None:
    """Built by keyword: the scheduler's relay with the host copy of the sequence lengths kept."""
    from sglang.srt.managers.overlap_utils import FutureMap
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    pool = ReqToTokenPool(size=4, max_context_len=8, device="cpu", enable_memory_saver=False)
    algorithm = SimpleNamespace(name="BASTION")
    relay = future_map(torch.device("cpu"), algorithm, pool, True, False)
    assert isinstance(relay, FutureMap) and relay.spec_algo is algorithm
    assert (relay.needs_cpu_seq_lens, relay.needs_confidence_relay) == (True, False)
