"""SpeedupLedger: the realised speedup of a step from its plan, measured seconds and committed tokens."""

from __future__ import annotations

import pytest

from bastion_sglang.step.step_controller import SpeedupLedger


def test_speedup_completes_in_either_order() -> None:
    ledger = SpeedupLedger()
    ledger.plan(0, l_ar=0.05, batch=2)
    assert ledger.timed(0, 0.1) is None  # tokens not known yet
    assert ledger.committed(0, 6) == pytest.approx(6 * 0.05 / (2 * 0.1))
    ledger.plan(1, l_ar=0.05, batch=1)
    assert ledger.committed(1, 3) is None
    assert ledger.timed(1, 0.05) == pytest.approx(3.0)
    # a completed step is reported once
    assert ledger.timed(1, 0.05) is None


def test_unplanned_and_stale_steps_report_nothing() -> None:
    ledger = SpeedupLedger(keep=2)
    assert ledger.timed(5, 0.1) is None
    ledger.plan(0, l_ar=0.05, batch=1)
    ledger.plan(1, l_ar=0.05, batch=1)
    ledger.plan(2, l_ar=0.05, batch=1)  # drops step 0
    ledger.timed(0, 0.1)
    assert ledger.committed(0, 2) is None
    ledger.timed(2, 0.1)
    assert ledger.committed(2, 2) == pytest.approx(1.0)
