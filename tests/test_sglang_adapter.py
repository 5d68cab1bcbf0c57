"""`sglang_adapter`: every SGLang internal BASTION relies on resolves on the installed SGLang, and what
moved is reported at once. An SGLang upgrade that moves one fails here, naming it."""

from __future__ import annotations

import ast
import re
import warnings
from pathlib import Path

import pytest

from bastion_sglang.sglang_adapter import (
    CPU_HOOKS,
    MEASUREMENT_INTERNALS,
    PINNED_VERSION,
    REGISTRATION_HOOKS,
    SERVING_INTERNALS,
    Internal,
    SglangMismatchError,
    SglangVersionWarning,
    missing_internals,
    require,
)

ROOT = Path(__file__).resolve().parents[1]
DECLARED = (*SERVING_INTERNALS, *CPU_HOOKS, *REGISTRATION_HOOKS, *MEASUREMENT_INTERNALS)
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
    """Outside the adapter and registration's plugin hooks, glue modules import SGLang only for types."""
    glue = ("worker", "spec_input", "graphs", "cpu_support", "metrics", "request_penalties")
    for name in glue:
        path = ROOT / "bastion_sglang" / f"{name}.py"
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
