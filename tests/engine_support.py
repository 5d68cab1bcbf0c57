"""Shared pieces of the in-process `sglang.Engine` tests (test_sglang_engine.py, test_hardening_engine.py, ...

`make_model_pair` writes the tiny fp32 Qwen3 target (vocabulary 260, the tokenizer's own ids, so outputs
decode to text) and its z-lab-format DFlash drafter; `engine_server_args` builds the CPU `ServerArgs` of an
Engine over that pair, without speculation (config None) or with `--speculative-algorithm BASTION` and the
given `BastionConfig`.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from tiny_models import make_tiny_drafter, make_tiny_target

from bastion_sglang.integration.config import BastionConfig
from bastion_sglang.registration import attach_config

VOCAB_SIZE = 260
"""The tokenizer's own ids only: every output token decodes to text."""
PROMPTS = [
    list(text.encode())
    for text in (
        "hello world",
        "the quick brown fox",
        "abc",
        "once upon a time there",
        "0123456789",
        "BASTION verifies trees",
        "zz",
        "a longer prompt that spans more than one block of sixteen tokens",
    )
]
"""Eight byte-level prompts of 2 to 64 tokens, one longer than a drafter block."""


def make_model_pair(root: Path) -> tuple[Path, Path]:
    """(target, drafter) folders under `root`: a 4-layer random fp32 Qwen3 target with peaky logits
    (initializer_range 0.1, so greedy argmaxes are rarely near-ties) and a 2-layer DFlash drafter reading
    target layers 0 and 2."""
    target = make_tiny_target(root / "target", vocab_size=VOCAB_SIZE, initializer_range=0.1)
    drafter = make_tiny_drafter(root / "drafter", target, target_layer_ids=[0, 2])
    return target, drafter


def engine_server_args(models: tuple[Path, Path], config: BastionConfig | None, **overrides: Any) -> Any:
    """CPU fp32 `ServerArgs` (torch_native attention, no CUDA graphs, 8192 KV tokens, seed 0) for the pair;
    an idle scheduler sleeps on its sockets (`sleep_on_idle`) instead of holding a core between requests.

    config None: no speculation; else BASTION with the drafter and `config` attached. `overrides` are more
    ServerArgs fields (e.g. chunked_prefill_size, disable_radix_cache).
    """
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import ServerArgs

    load_plugins()
    target, drafter = models
    kwargs: dict[str, Any] = dict(
        model_path=str(target),
        device="cpu",
        attention_backend="torch_native",
        disable_cuda_graph=True,
        dtype="float32",
        max_total_tokens=8192,
        mem_fraction_static=0.05,
        random_seed=0,
        log_level="error",
        sleep_on_idle=True,
    )
    if config is not None:
        kwargs |= dict(speculative_algorithm="BASTION", speculative_draft_model_path=str(drafter))
    server_args = ServerArgs(**(kwargs | overrides))
    if config is not None:
        attach_config(server_args, config)
    return server_args


def generate_once(
    models: tuple[Path, Path],
    config: BastionConfig | None,
    prompts: list[list[int]],
    sampling_params: dict[str, Any],
    **overrides: Any,
) -> list[dict[str, Any]]:
    """Start an Engine over the pair (`engine_server_args`), generate `prompts` with `sampling_params`, shut
    it down; the outputs, in prompt order."""
    import sglang

    engine = sglang.Engine(server_args=engine_server_args(models, config, **overrides))
    try:
        return engine.generate(input_ids=prompts, sampling_params=sampling_params)
    finally:
        engine.shutdown()


def first_difference(got: list[int], want: list[int]) -> int:
    """Index of the first differing token of two id lists (the shorter length if one prefixes the other)."""
    return next(
        (i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want))
    )


SEED_PROBE_SEEDS = (1, 2, 3, 4)
SEED_PROBE_REGEX = "x[a-z]{15}"
"""16 one-byte tokens: the first fixed ('x', so SGLang's unseeded prefill sampler has one choice), then 15
letters drawn by BASTION's accept walk, where the tiny target spreads its mass over many tokens."""


def seed_probe_params(**extra: Any) -> list[dict[str, Any]]:
    """Sampling params of the seed probe: one request per seed of SEED_PROBE_SEEDS, all for the same prompt,
    T = 0.8 under SEED_PROBE_REGEX (`extra`: more params for every request)."""
    return [
        {"temperature": 0.8, "max_new_tokens": 16, "regex": SEED_PROBE_REGEX, "sampling_seed": seed} | extra
        for seed in SEED_PROBE_SEEDS
    ]


def seed_probe(engine: Any, prompt: list[int] | None = None, **extra: Any) -> list[list[int]]:
    """Send the seed probe (`seed_probe_params(**extra)`, prompt default PROMPTS[0]) to `engine` as one
    batch; returns the output ids per seed."""
    ids = [PROMPTS[0] if prompt is None else prompt] * len(SEED_PROBE_SEEDS)
    outs = engine.generate(input_ids=ids, sampling_params=seed_probe_params(**extra))
    return [out["output_ids"] for out in outs]


def assert_seeds_sample(outputs: list[list[int]]) -> None:
    """Sampling samples: the seed probe's outputs (one prompt, one per seed) each spell SEED_PROBE_REGEX, and
    no two are equal. The first token is fixed, so a sampler that ignored the temperature, the seed or the
    sampled rows (drawing every token as the argmax) would return one output for every seed."""
    letters = re.compile(SEED_PROBE_REGEX.encode())
    assert len(outputs) == len(SEED_PROBE_SEEDS)
    for ids in outputs:
        assert letters.fullmatch(bytes(ids)), f"{bytes(ids)!r} does not spell {SEED_PROBE_REGEX}"
    distinct = {tuple(ids) for ids in outputs}
    assert len(distinct) == len(outputs), f"seeds {SEED_PROBE_SEEDS} gave {len(distinct)} outputs: {outputs}"
