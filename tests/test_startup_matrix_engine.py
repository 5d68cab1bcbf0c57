"""Start-up calibration (on, the default) under every option the worker serves: each configuration starts a
real `sglang.Engine` on the CPU from an empty profile store, calibrates itself, serves greedy requests equal
to the target without speculation, and starts again on the profile it stored (slow).

One target (the tiny fp32 pair of tests/engine_support.py) and one greedy reference for every case:
Hugging Face's greedy continuation on the same weights (`sglang_server.hf_greedy`, what SGLang without
speculation returns, as tests/test_sglang_server.py checks). The options are combined so that the matrix
takes four pairs of Engine starts: page size 16 with the overlap scheduler, chunked prefill, the radix cache
off and a small KV pool; page size 64 with a DFlash2 drafter; --tp-size 2; --dp-size 2. The calibration grid
is the smallest a server has: N_max 3 (widths 2 and 4), K 2.

Per case: every scheduler of the first start logs that it calibrates, and the start stores one profile
(up to two with --dp-size 2, one per replica), marked as a quick start-up calibration; the second logs
that it plans with a stored profile, calibrates nothing, and leaves the store as it was.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import pytest
from engine_support import PROMPTS, engine_server_args, make_model_pair
from sglang_server import hf_greedy
from tiny_dflash2 import make_tiny_dflash2_drafter

from bastion_sglang.calibration.store import STORE_ENV, ProfileStore
from bastion_sglang.integration.config import STARTUP_CALIBRATION_ENV
from bastion_sglang.registration import make_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

REQUESTS = PROMPTS[:3]
NEW_TOKENS = 12
GREEDY = {"temperature": 0.0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
MEM_FRACTION = 0.3
"""Of the machine's memory: SGLang's CPU check (1 - available after loading / before) fails at 0.05 or 0.1
when other processes take memory while the weights load; the KV pool stays max_total_tokens."""
THREADS_BIND = "0|1"
"""One core per scheduler under --tp-size 2 or --dp-size 2 (tests/test_tensor_parallel_engine.py)."""
CALIBRATES = re.compile(r"BASTION: start-up calibration \(quick\) because no stored latency profile matches")
LOADS = re.compile(r"BASTION: latency profile (\S+\.json) \(quick start-up calibration, [^)]*\): (.*?);")
"""The one line that says which stored profile a server plans with, and why."""


@dataclasses.dataclass(frozen=True)
class Case:
    """One configuration: ServerArgs fields, whether BASTION runs under the overlap scheduler, whether the
    drafter is the DFlash2 one, its schedulers (each TP rank and DP replica calibrates) and the most
    profiles its first start stores (one per DP replica; two replicas may store in the same second, under
    one name)."""

    overrides: dict[str, Any]
    overlap: bool = False
    dflash2: bool = False
    schedulers: int = 1
    stored: int = 1


CASES = {
    "page16-overlap-chunked-no-radix-small-pool": Case(
        dict(
            page_size=16,
            disable_overlap_schedule=False,
            chunked_prefill_size=32,
            disable_radix_cache=True,
            max_total_tokens=512,
        ),
        overlap=True,
    ),
    "page64-dflash2": Case(dict(page_size=64, max_total_tokens=1024), dflash2=True),
    "tp2": Case(dict(tp_size=2, max_total_tokens=1024), schedulers=2),
    "dp2": Case(dict(dp_size=2, max_total_tokens=1024), schedulers=2, stored=2),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """(target, DFlash drafter, DFlash2 drafter)."""
    root = tmp_path_factory.mktemp("startup_matrix")
    target, drafter = make_model_pair(root)
    dflash2 = make_tiny_dflash2_drafter(root / "dflash2", target)
    config = json.loads((dflash2 / "config.json").read_text())
    config["dflash_config"]["target_layer_ids"] = [0, 2]  # as the DFlash drafter's: layers SGLang captures
    (dflash2 / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return target, drafter, dflash2


@pytest.fixture(scope="module")
def reference(models: tuple[Path, Path, Path]) -> list[list[int]]:
    return hf_greedy(models[0], REQUESTS, NEW_TOKENS)


def serve(models: tuple[Path, Path], case: Case) -> list[list[int]]:
    """One Engine of `case` (start-up calibration at its default, quick), greedy over REQUESTS."""
    import sglang

    config = make_config(max_budget=3, policy="adaptive", topk=2, overlap=case.overlap)
    overrides = {"log_level": "info", "mem_fraction_static": MEM_FRACTION, **case.overrides}
    server_args = engine_server_args(models, config, **overrides)
    engine = sglang.Engine(server_args=server_args)
    try:
        outputs = engine.generate(input_ids=REQUESTS, sampling_params=GREEDY)
    finally:
        engine.shutdown()
    return [output["output_ids"] for output in outputs]


@pytest.mark.parametrize("name", list(CASES))
def test_a_fresh_server_calibrates_serves_exactly_and_restarts_on_its_profile(
    name: str,
    models: tuple[Path, Path, Path],
    reference: list[list[int]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
) -> None:
    case = CASES[name]
    pair = (models[0], models[2] if case.dflash2 else models[1])
    store = ProfileStore(tmp_path / "store")
    monkeypatch.setenv(STORE_ENV, str(store.root))  # the scheduler processes inherit these
    monkeypatch.delenv(STARTUP_CALIBRATION_ENV, raising=False)  # the default: quick
    monkeypatch.setenv("SGLANG_CPU_OMP_THREADS_BIND", THREADS_BIND)
    capfd.readouterr()

    assert serve(pair, case) == reference
    first = capfd.readouterr()
    first_log = first.out + first.err
    assert len(CALIBRATES.findall(first_log)) == case.schedulers
    entries = store.list_profiles()
    assert 1 <= len(entries) <= case.stored and all(entry.profile is not None for entry in entries)
    assert {entry.profile.metadata.made_by for entry in entries if entry.profile} == {"startup-quick"}
    written = {entry.path: entry.path.read_bytes() for entry in entries}

    assert serve(pair, case) == reference
    second = capfd.readouterr()
    second_log = second.out + second.err
    assert "BASTION: start-up calibration (" not in second_log
    loads = LOADS.findall(second_log)
    assert len(loads) == case.schedulers
    assert {Path(path) for path, _ in loads} <= set(written)
    assert all(
        why.endswith("stored profile matching this runtime") or "stored profiles matching" in why
        for _, why in loads
    )
    assert {entry.path: entry.path.read_bytes() for entry in store.list_profiles()} == written
