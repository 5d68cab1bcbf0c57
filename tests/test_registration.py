"""`--speculative-algorithm BASTION` through SGLang's plugin entry point: registration, flags, refusals.

Everything runs SGLang's own code paths: `load_plugins()` (the entry point in pyproject.toml),
`SpeculativeAlgorithm.from_string`, `prepare_server_args` (the launch_server parser) and
`ServerArgs.resolve_once` (the resolution pipeline that calls BASTION's server-argument handler).
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import subprocess
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import pytest
from sglang.srt.arg_groups.attention_hook import handle_attention_backend_compatibility
from sglang.srt.arg_groups.overrides import resolved_view
from sglang.srt.arg_groups.platform_hook import handle_cpu_backends
from sglang.srt.arg_groups.resolution_hooks import run_hook
from sglang.srt.plugins import load_plugins
from sglang.srt.server_args import prepare_server_args
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
from tiny_dflash2 import make_tiny_dflash2_drafter
from tiny_models import make_tiny_drafter, make_tiny_target

from bastion_sglang.controller import FixedPolicy
from bastion_sglang.controller.profile import ProfileError
from bastion_sglang.integration.config import config_of
from bastion_sglang.integration.drafter_config import DrafterMismatchError, SelectorConfig
from bastion_sglang.registration import BastionSpecAlgo, check_draft_logits_supported

load_plugins()


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bastion_registration")
    target = make_tiny_target(root / "target", vocab_size=260)
    other = make_tiny_target(root / "other", vocab_size=260, hidden_size=32, heads=2, kv_heads=1)
    return {
        "target": target,
        "drafter": make_tiny_drafter(root / "drafter", target, target_layer_ids=[0, 2]),
        "foreign_drafter": make_tiny_drafter(root / "foreign", other, target_layer_ids=[0, 2]),
        "dflash2": make_tiny_dflash2_drafter(
            root / "dflash2", target, output_multiplier=0.5, final_logit_softcapping=3.0
        ),
    }


def _argv(
    models: dict[str, Path], *extra: str, drafter: str = "drafter", device: str = "cpu", backend: bool = True
) -> list[str]:
    """BASTION's launch arguments on the tiny pair; backend False leaves `--attention-backend` out."""
    return [
        "--model-path",
        str(models["target"]),
        "--speculative-algorithm",
        "BASTION",
        "--speculative-draft-model-path",
        str(models[drafter]),
        "--device",
        device,
        *(("--attention-backend", "torch_native") if backend else ()),
        *extra,
    ]


def _resolve(argv: list[str]) -> object:
    server_args = prepare_server_args(argv)
    server_args.resolve_once()
    return server_args


def test_bastion_resolves_after_load_plugins() -> None:
    algorithm = SpeculativeAlgorithm.from_string("bastion")
    assert isinstance(algorithm, BastionSpecAlgo)
    assert algorithm.name == "BASTION"
    assert algorithm.is_dflash_family() and not algorithm.is_dflash()


def test_without_the_plugin_bastion_is_unknown_as_in_sglang() -> None:
    code = (
        "from sglang.srt.plugins import load_plugins\n"
        "load_plugins()\n"
        "from sglang.srt.speculative.spec_info import SpeculativeAlgorithm\n"
        "SpeculativeAlgorithm.from_string('BASTION')\n"
    )
    env = dict(os.environ, SGLANG_PLUGINS="a-plugin-that-is-not-installed")
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode != 0
    assert "ValueError: Unknown speculative algorithm name: BASTION" in result.stderr


def test_spec_class_defines_every_method_of_the_enum() -> None:
    enum_methods = {
        name
        for name, value in vars(SpeculativeAlgorithm).items()
        if not name.startswith("_") and isinstance(value, types.FunctionType)
    }
    spec_methods = {name for name in dir(BastionSpecAlgo) if callable(getattr(BastionSpecAlgo, name))}
    assert enum_methods, "the enum's methods were not found"
    assert enum_methods - spec_methods == set()


def test_spec_class_answers_what_the_scheduler_asks() -> None:
    algorithm = SpeculativeAlgorithm.from_string("BASTION")
    assert algorithm.carries_draft_hidden_states() is False
    assert algorithm.need_topk() is False
    assert algorithm.get_platform_worker_cls() is None
    assert algorithm.has_draft_kv() and algorithm.supports_target_verify_for_draft()


@pytest.mark.parametrize(
    ("algorithm", "draft", "bastion_runner"),
    [("BASTION", False, True), ("BASTION", True, False), ("EAGLE", False, False), (None, False, False)],
)
def test_only_the_bastion_target_captures_with_the_bastion_verify_graph_runner(
    algorithm: str | None, draft: bool, bastion_runner: bool
) -> None:
    """SGLang builds decode graph runners through `ModelRunner._decode_cuda_graph_runner_cls`; the plugin's
    hook gives BASTION's target runner (not its drafter, not other algorithms) the tree-masked runner."""
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner

    from bastion_sglang.step.graphs import BastionVerifyGraphRunner

    runner = ModelRunner.__new__(ModelRunner)  # only the two attributes the method reads are set
    runner.spec_algorithm = SpeculativeAlgorithm.from_string(algorithm)
    runner.is_draft_worker = draft
    expected = BastionVerifyGraphRunner if bastion_runner else DecodeCudaGraphRunner
    assert runner._decode_cuda_graph_runner_cls() is expected


def test_cli_flags_build_the_config_and_travel_with_the_record(models: dict[str, Path]) -> None:
    server_args = prepare_server_args(
        _argv(
            models,
            "--bastion-max-budget",
            "12",
            "--bastion-policy",
            "fixed:5",
            "--bastion-ema-alpha",
            "0.25",
            "--bastion-width-buckets",
            "4,8,13",
            "--bastion-topk",
            "3",
        )
    )
    config = config_of(server_args)
    assert (config.max_budget, config.policy, config.ema_alpha) == (12, FixedPolicy(5), 0.25)
    assert (config.width_buckets, config.topk, config.profile_path) == ((4, 8, 13), 3, None)
    assert config_of(pickle.loads(pickle.dumps(server_args))) == config


def test_resolution_sets_the_verify_width_and_turns_overlap_off(models: dict[str, Path]) -> None:
    from sglang.srt.arg_groups.overrides import resolved_view

    view = resolved_view(_resolve(_argv(models, "--bastion-max-budget", "10")))
    assert view.speculative_num_draft_tokens == 11
    assert view.speculative_dflash_block_size == 16
    assert (view.speculative_num_steps, view.speculative_eagle_topk) == (1, 1)
    assert view.disable_overlap_schedule is True
    assert view.speculative_draft_attention_backend == "torch_native"


@pytest.mark.parametrize(
    ("extra", "disabled"),
    [
        (("--bastion-overlap-schedule", "on"), False),
        (("--bastion-overlap-schedule", "on", "--disable-overlap-schedule"), True),
        (("--bastion-overlap-schedule", "off"), True),
    ],
)
def test_overlap_scheduling_is_opt_in(
    models: dict[str, Path], extra: tuple[str, ...], disabled: bool
) -> None:
    """`--bastion-overlap-schedule on` leaves SGLang's own `--disable-overlap-schedule` to decide (SGLang's
    CPU rule for its own speculative algorithms does not apply to BASTION); off switches overlap off."""
    from sglang.srt.arg_groups.overrides import resolved_view

    server_args = _resolve(_argv(models, *extra))
    assert resolved_view(server_args).disable_overlap_schedule is disabled
    assert config_of(server_args).overlap is (extra[1] == "on")


def test_bad_overlap_switch_is_a_usage_error(models: dict[str, Path]) -> None:
    with pytest.raises(SystemExit):
        prepare_server_args(_argv(models, "--bastion-overlap-schedule", "yes"))


def test_registered_with_overlap_support() -> None:
    from sglang.srt.speculative.spec_registry import get_spec

    assert get_spec("BASTION").supports_overlap is True


@pytest.mark.parametrize(("tp_size", "dp_size"), [(2, 1), (1, 2), (2, 2)])
def test_tensor_and_data_parallel_resolve(models: dict[str, Path], tp_size: int, dp_size: int) -> None:
    from sglang.srt.arg_groups.overrides import resolved_view

    view = resolved_view(_resolve(_argv(models, "--tp-size", str(tp_size), "--dp-size", str(dp_size))))
    assert (view.tp_size, view.dp_size, view.attn_dp_size) == (tp_size, dp_size, 1)
    assert view.speculative_num_draft_tokens is not None


def test_flags_without_the_algorithm_are_refused(models: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match="--bastion-topk need --speculative-algorithm BASTION"):
        prepare_server_args(["--model-path", str(models["target"]), "--bastion-topk", "3"])


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (("--bastion-policy", "greedy"), "unknown policy 'greedy'"),
        (("--bastion-policy", "fixed:0"), "fixed:N needs a positive integer N"),
        (("--bastion-max-budget", "5000"), "--bastion-max-budget 5000 exceeds the limit 1024"),
        (("--bastion-max-budget", "0"), "max_budget \\(N_max\\) must be a positive int"),
        (("--bastion-max-budget", "4", "--bastion-policy", "fixed:6"), "policy fixed:6 verifies more nodes"),
        (("--bastion-ema-alpha", "1.5"), "ema_alpha must be in \\(0, 1\\]"),
        (("--bastion-width-buckets", "8,4"), "width_buckets must be sorted, unique ints"),
        (("--bastion-width-buckets", "1,4"), "width_buckets must be sorted, unique ints >= 2"),
        (("--bastion-width-buckets", "2,128"), "width_buckets \\(2, 128\\) must lie in \\[2, 65\\]"),
    ],
)
def test_bad_options_are_refused_when_parsed(
    models: dict[str, Path], extra: tuple[str, ...], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        prepare_server_args(_argv(models, *extra))


@pytest.mark.parametrize("page_size", [16, 64])
def test_paged_kv_resolves(models: dict[str, Path], page_size: int) -> None:
    """Pages of several tokens are served (a tree commit copies the accepted path's KV, `commit`)."""
    assert resolved_view(_resolve(_argv(models, "--page-size", str(page_size)))).page_size == page_size


def test_incompatible_drafter_is_refused(models: dict[str, Path]) -> None:
    with pytest.raises(
        DrafterMismatchError, match="drafter hidden_size 32 differs from the target's hidden_size 64"
    ):
        _resolve(_argv(models, drafter="foreign_drafter"))


def test_missing_profile_is_refused_naming_the_file(models: dict[str, Path], tmp_path: Path) -> None:
    missing = tmp_path / "no-such-profile.json"
    with pytest.raises(ProfileError, match=f"{missing}: calibration profile not found"):
        _resolve(_argv(models, "--bastion-profile", str(missing)))


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            ("--attention-backend", "triton"),
            "--attention-backend triton: BASTION on cpu verifies draft trees with a per-request tree mask, "
            "which triton does not read; supported: torch_native",
        ),
        (
            ("--decode-attention-backend", "triton"),
            "--decode-attention-backend triton: BASTION on cpu .* supported: torch_native",
        ),
        (("--speculative-num-draft-tokens", "16"), "--bastion-max-budget 15"),
        (("--context-length", "64", "--bastion-max-budget", "40"), "more than half the context length 64"),
        (("--pp-size", "2"), "BASTION supports --pp-size 1 only, got 2: a decode step drafts"),
        (("--attn-dp-size", "2", "--tp-size", "2"), "BASTION does not support DP attention"),
        (
            ("--tp-size", "3"),
            r"--tp-size 3: the target's 4 attention heads \(2 KV heads\) do not split over 3 ranks; "
            r"tensor-parallel sizes that fit: \[1, 2, 4\]",
        ),
    ],
)
def test_unsupported_setups_are_refused_at_resolution(
    models: dict[str, Path], extra: tuple[str, ...], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        _resolve(_argv(models, *extra))


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("final_logit_softcapping", 30.0),
        ("output_multiplier", 2.0),
        ("selector_rank", 4),
        ("projector_type", "domino"),
    ],
)
def test_plain_dflash_drafters_whose_draft_logits_bastion_bypasses_are_refused(
    field: str, value: object
) -> None:
    """On SGLang's plain DFlashDraftModel these fields change nothing (its greedy draft takes the raw argmax)
    while BASTION's trees would read the distribution they were meant to reshape."""
    dflash = {"target_layer_ids": [0, 2], field: value}
    if field == "selector_rank":
        dflash["selector_top_k"] = 8
    if field == "projector_type":
        dflash |= {"gru_hidden_dim": 16, "emb_dim": 16, "pure_draft_prefix_len": 1, "shift_label": True}
    config = {"num_hidden_layers": 2, "block_size": 8, "dflash_config": dflash}
    with pytest.raises(ValueError, match=rf"dflash_config\.{field}"):
        check_draft_logits_supported(config)


def test_a_plain_dflash_drafter_is_accepted() -> None:
    check_draft_logits_supported({"num_hidden_layers": 2, "dflash_config": {"output_multiplier": 1.0}})


DFLASH2_SELECTOR = SelectorConfig(rank=4, top_k=8, output_multiplier=2.0, final_logit_softcapping=30.0)
DFLASH2_FIELDS = {
    "selector_rank": 4,
    "selector_top_k": 8,
    "output_multiplier": 2.0,
    "final_logit_softcapping": 30.0,
}


def test_a_dflash2_drafters_selector_fields_are_honoured() -> None:
    config = {
        "num_hidden_layers": 2,
        "block_size": 8,
        "dflash_config": {"target_layer_ids": [0, 2]} | DFLASH2_FIELDS,
    }
    check_draft_logits_supported(config, DFLASH2_SELECTOR)


def test_a_dflash2_drafter_with_a_domino_projector_is_refused() -> None:
    domino = {
        "projector_type": "domino",
        "gru_hidden_dim": 16,
        "emb_dim": 16,
        "pure_draft_prefix_len": 1,
        "shift_label": True,
    }
    config = {"num_hidden_layers": 2, "block_size": 8, "dflash_config": DFLASH2_FIELDS | domino}
    with pytest.raises(ValueError, match=r"dflash_config\.projector_type"):
        check_draft_logits_supported(config, DFLASH2_SELECTOR)


def test_a_dflash2_drafter_resolves(models: dict[str, Path]) -> None:
    view = resolved_view(_resolve(_argv(models, drafter="dflash2")))
    assert view.speculative_dflash_block_size == 16


def test_a_dflash2_drafter_under_tensor_parallel_is_refused(models: dict[str, Path]) -> None:
    with pytest.raises(
        ValueError, match=r"DFlash2 drafter \(DFlash2DraftModel\) with --tp-size 1 only, got --tp-size 2"
    ):
        _resolve(_argv(models, "--tp-size", "2", drafter="dflash2"))


# ---- the attention backend: chosen when not given, refused only when named ---------------------------

CHOICE_LOG = "--attention-backend not given; using"


class ChoiceLines(logging.Handler):
    """Collects the backend-choice lines on registration's logger itself (SGLang's logging set-up during
    resolution replaces the root logger's handlers, where pytest's log capture listens)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if CHOICE_LOG in record.getMessage():
            self.lines.append(record.getMessage())


@pytest.fixture
def choice_lines() -> Iterator[list[str]]:
    """The backend-choice lines logged while the test runs."""
    logger = logging.getLogger("bastion_sglang.registration")
    handler, level = ChoiceLines(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield handler.lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def test_cpu_without_a_backend_flag_resolves_to_torch_native_with_one_log_line(
    models: dict[str, Path], choice_lines: list[str]
) -> None:
    view = resolved_view(_resolve(_argv(models, backend=False)))
    assert view.attention_backend == "torch_native"
    assert view.speculative_draft_attention_backend == "torch_native"
    (line,) = choice_lines
    assert "using torch_native" in line and "tree mask" in line


def test_cpu_with_torch_native_named_logs_no_choice(models: dict[str, Path], choice_lines: list[str]) -> None:
    assert resolved_view(_resolve(_argv(models))).attention_backend == "torch_native"
    assert choice_lines == []


def _resolve_backend_on_cuda(argv: list[str]) -> object:
    """The launch arguments parsed by SGLang's parser, then the resolution steps that settle the attention
    backend (BASTION's hook on `handle_cpu_backends`, SGLang's default fill in
    `handle_attention_backend_compatibility`), with `--device cuda` standing in for a GPU."""
    server_args = prepare_server_args(argv)
    run_hook(handle_cpu_backends, server_args)
    run_hook(handle_attention_backend_compatibility, server_args)
    return resolved_view(server_args)


@pytest.mark.parametrize(
    ("extra", "attention", "prefill", "chosen"),
    [
        ((), "triton", None, True),
        (("--attention-backend", "triton"), "triton", None, False),
        (("--attention-backend", "flashinfer"), "flashinfer", None, False),
        (("--prefill-attention-backend", "flashinfer"), "triton", "flashinfer", True),
    ],
)
def test_cuda_backend_is_chosen_when_not_given_and_kept_when_named(
    models: dict[str, Path],
    choice_lines: list[str],
    extra: tuple[str, ...],
    attention: str,
    prefill: str | None,
    chosen: bool,
) -> None:
    """The README's launch line names no backend: on CUDA BASTION picks triton (SGLang would pick fa3 on
    Hopper, which cannot read the tree mask) and says so once; a supported backend the user names stays."""
    view = _resolve_backend_on_cuda(_argv(models, *extra, device="cuda", backend=False))
    assert (view.attention_backend, view.prefill_attention_backend) == (attention, prefill)
    assert len(choice_lines) == int(chosen)
    if chosen:
        assert "using triton" in choice_lines[0] and "triton, flashinfer" in choice_lines[0]


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--attention-backend", "fa3"),
        ("--attention-backend", "torch_native"),
        ("--decode-attention-backend", "fa3"),
        ("--prefill-attention-backend", "trtllm_mha"),
    ],
)
def test_cuda_backend_bastion_cannot_use_is_refused_only_when_named(
    models: dict[str, Path], flag: str, value: str
) -> None:
    with pytest.raises(
        ValueError, match=rf"^{flag} {value}: BASTION on cuda .* supported: triton, flashinfer"
    ):
        _resolve_backend_on_cuda(_argv(models, flag, value, device="cuda", backend=False))


def test_other_algorithms_keep_sglangs_backend_choice(models: dict[str, Path]) -> None:
    """Without BASTION the hook leaves the backend to SGLang (nothing declared before its default fill)."""
    server_args = prepare_server_args(["--model-path", str(models["target"]), "--device", "cuda"])
    run_hook(handle_cpu_backends, server_args)
    assert resolved_view(server_args).attention_backend is None


# ---- CPU placeholders: only where BASTION serves on the CPU ------------------------------------------

PLACEHOLDER_PROBE = """
import json
import sys
from types import SimpleNamespace

from sglang.srt.plugins import load_plugins
from sglang.srt.server_args import prepare_server_args

from bastion_sglang.integration import cpu_support
from bastion_sglang.registration import _scheduler_init_hook

calls = []
cpu_support.install_import_placeholders = lambda: calls.append(1)
load_plugins()
states = {"registered": len(calls)}
_scheduler_init_hook(None, SimpleNamespace(device="cpu", speculative_algorithm="EAGLE"))
states["EAGLE scheduler"] = len(calls)
for name, argv in json.loads(sys.argv[1]):
    prepare_server_args(argv).resolve_once()
    states[name] = len(calls)
print(json.dumps(states))
"""
"""Loads the plugin, then resolves argument sets in turn, reporting after each how often the plugin has
installed its import placeholders (`cpu_support.install_import_placeholders`, recorded instead of run, so
an environment that provides the modules itself does not hide the calls). A fresh interpreter: this one
has loaded the plugin already."""


def test_placeholders_install_only_where_bastion_serves_on_cpu() -> None:
    dummy = ["--model-path", "dummy"]
    runs = [
        ("plain CPU", [*dummy, "--device", "cpu"]),
        ("EAGLE on CPU", [*dummy, "--device", "cpu", "--speculative-algorithm", "EAGLE"]),
        ("BASTION on CUDA", [*dummy, "--device", "cuda", "--speculative-algorithm", "BASTION"]),
        ("BASTION on CPU", [*dummy, "--device", "cpu", "--speculative-algorithm", "BASTION"]),
    ]
    result = subprocess.run(
        [sys.executable, "-c", PLACEHOLDER_PROBE, json.dumps(runs)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    states = json.loads(result.stdout.strip().splitlines()[-1])
    assert states == {
        "registered": 0,
        "EAGLE scheduler": 0,
        "plain CPU": 0,
        "EAGLE on CPU": 0,
        "BASTION on CUDA": 0,
        "BASTION on CPU": 1,
    }


def test_vllm_placeholder_is_installed_only_when_vllm_is_absent(monkeypatch: pytest.MonkeyPatch) -> None:
    """The placeholder's functions raise; a vllm that imports (real, or the CPU environment's) is kept."""
    from bastion_sglang.integration import cpu_support

    monkeypatch.delitem(sys.modules, "vllm", raising=False)
    monkeypatch.delitem(sys.modules, "vllm._custom_ops", raising=False)
    monkeypatch.setattr(cpu_support.importlib.util, "find_spec", lambda name: None)
    cpu_support.install_vllm_placeholder()
    with pytest.raises(NotImplementedError, match="placeholder"):
        sys.modules["vllm._custom_ops"].rotary_embedding()
    present = sys.modules["vllm"]
    cpu_support.install_vllm_placeholder()
    assert sys.modules["vllm"] is present
