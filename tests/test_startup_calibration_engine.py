"""A server with an empty profile store calibrates itself before it serves, stores the profile, and the next
start with the same identity reuses it (real `sglang.Engine` on the tiny fp32 pair, CPU; slow)."""

from __future__ import annotations

from pathlib import Path

import pytest
from engine_support import PROMPTS, generate_once, make_model_pair

from bastion_sglang.calibration.store import STORE_ENV, ProfileStore
from bastion_sglang.integration.config import STARTUP_CALIBRATION_ENV
from bastion_sglang.registration import make_config

pytestmark = pytest.mark.slow

NEW_TOKENS = 12


def serve_once(models: tuple[Path, Path], mode: str) -> list[list[int]]:
    """Start an Engine with start-up calibration `mode`, decode two prompts greedily, shut it down."""
    config = make_config(max_budget=8, policy="adaptive", topk=4, startup_calibration=mode)  # type: ignore[arg-type]
    sampling = {"temperature": 0.0, "max_new_tokens": NEW_TOKENS}
    outputs = generate_once(models, config, PROMPTS[:2], sampling, max_total_tokens=4096)
    return [output["output_ids"] for output in outputs]


def test_a_fresh_server_calibrates_stores_and_the_next_start_reuses_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    models = make_model_pair(tmp_path / "pair")
    store = ProfileStore(tmp_path / "store")
    monkeypatch.setenv(STORE_ENV, str(store.root))  # the scheduler process inherits both
    monkeypatch.setenv(STARTUP_CALIBRATION_ENV, "off")
    plain = serve_once(models, "off")
    assert store.list_profiles() == []  # off measures nothing

    calibrated = serve_once(models, "quick")
    entries = store.list_profiles()
    assert len(entries) == 1 and entries[0].profile is not None
    profile, path = entries[0].profile, entries[0].path
    assert profile.metadata.made_by == "startup-quick" and profile.metadata.engine == "sglang"
    assert {s.s for s in profile.samples if s.mode == "verify"} == {2, 4, 8, 9}  # buckets and the cap
    assert {s.c for s in profile.samples} == {64, 256, 1024}
    batched = {(s.mode, s.s, s.batch) for s in profile.samples if s.batch > 1 and s.c == 64}
    assert batched == {
        (mode, s, b)
        for b in (4, 16)
        for mode, s in (("verify", 2), ("verify", 8), ("verify", 9), ("decode", 1))
    }
    assert profile.step_costs.t_draft > 0 and profile.step_costs.l_ar > 0
    assert calibrated == plain  # the pools it measured on were handed back clean
    written = path.read_bytes()

    assert serve_once(models, "quick") == plain
    assert [entry.path for entry in store.list_profiles()] == [path]  # reused, not measured again
    assert path.read_bytes() == written
