"""`bastion step-anatomy`: its summaries and tables on hand-made steps, its argument errors, and one run end
to end on the tiny fp32 pair of tests/tiny_models.py (ar, adaptive and fixed:2 at concurrency 1 and 2; three
Engines, so `slow`)."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
from tiny_models import make_tiny_drafter, make_tiny_target

from bastion_sglang import cli
from bastion_sglang.bench.anatomy_cli import command_line, concurrency_list
from bastion_sglang.bench.anatomy_report import (
    REPORT_NAME,
    AnatomyReport,
    AnatomySettings,
    format_tables,
    summarize,
)
from bastion_sglang.bench.anatomy_run import (
    CLOSING_ID,
    WARMUP_ID,
    AnatomyStep,
    read_steps,
    request_id,
    run_of,
)
from bastion_sglang.step.step_anatomy import StageCounts, StepCounts, StepKind


def step(
    policy: str,
    kind: StepKind,
    batch: int,
    stages: dict[str, tuple[int, int]],
    concurrency: int | None = None,
) -> AnatomyStep:
    """A counted step whose regions issued (ops, tolist syncs)."""
    counts = StepCounts(
        index=0,
        kind=kind,
        batch_size=batch,
        requests=tuple(request_id(concurrency or batch, i) for i in range(batch)),
        stages={
            name: StageCounts(ops=ops, syncs={"tolist": syncs} if syncs else {})
            for name, (ops, syncs) in stages.items()
        },
        forwards={"target": 1} if kind in ("plain", "skipped") else {"target": 1, "drafter": 1},
    )
    return AnatomyStep(policy=policy, concurrency=concurrency or batch, counts=counts)


STEPS = (
    step("ar", "plain", 1, {"schedule": (7, 0), "prepare": (4, 1), "result": (0, 1)}),
    step("ar", "plain", 1, {"schedule": (7, 0), "prepare": (4, 1), "result": (40, 1)}),
    step("ar", "plain", 1, {"schedule": (7, 0), "prepare": (4, 1), "result": (0, 1)}),
    step("adaptive", "skipped", 1, {"schedule": (2, 4), "verify": (9, 1)}),
    step("adaptive", "declined", 1, {"schedule": (2, 4), "draft": (11, 1), "verify": (9, 1)}),
    step("adaptive", "skipped", 2, {"schedule": (4, 4), "verify": (9, 1)}),
    step("adaptive", "skipped", 1, {"schedule": (2, 4), "verify": (9, 1)}, concurrency=2),  # a tail step
)


def test_summaries_take_medians_per_region_and_keep_full_batches_only() -> None:
    summaries = summarize(STEPS, ("ar", "adaptive"), (1, 2))
    assert [(s.batch_size, s.policy, s.kind, s.steps) for s in summaries] == [
        (1, "ar", "plain", 3),
        (1, "adaptive", "skipped", 1),
        (1, "adaptive", "declined", 1),
        (2, "adaptive", "skipped", 1),  # the batch-1 step of the run at 2 is left out
    ]
    ar = summaries[0]
    assert list(ar.regions) == ["schedule", "prepare", "result"]
    assert ar.regions["result"].ops.model_dump() == {"median": 0.0, "min": 0, "max": 40}
    assert ar.total.ops.model_dump() == {"median": 11.0, "min": 11, "max": 51}
    assert ar.total.syncs.median == 2 and ar.sync_kinds == {"tolist": 2.0}
    assert ar.forwards == {"target": 1.0}
    declined = summaries[2]
    assert list(declined.regions) == ["schedule", "draft", "verify"]
    assert declined.forwards == {"drafter": 1.0, "target": 1.0}


def report_of(steps: tuple[AnatomyStep, ...]) -> AnatomyReport:
    settings = AnatomySettings(
        model_path="t",
        draft_model_path="d",
        prompts="mtbench",
        policies=("ar", "adaptive"),
        concurrencies=(1, 2, 4),
        max_new_tokens=8,
        max_budget=64,
        startup_calibration="off",
        device="cpu",
        attention_backend="torch_native",
        dtype="float32",
        overlap_schedule=False,
    )
    return AnatomyReport(
        created="2026-01-01T00:00:00+00:00",
        command="bastion step-anatomy",
        commit=None,
        dirty=None,
        device="CPU test",
        host_cpus=2,
        versions={},
        settings=settings,
        summaries=summarize(steps, settings.policies, settings.concurrencies),
        steps=steps,
    )


def test_tables_set_each_kind_beside_the_plain_step() -> None:
    report = report_of(STEPS)
    assert AnatomyReport.model_validate_json(report.model_dump_json()) == report
    text = format_tables(report)
    batch_one, batch_two, batch_four = text.split("\n\n\n")[0], *text.split("Batch ")[2:]
    assert "| region | ar (plain) | adaptive (skipped) | adaptive (declined) |" in batch_one
    assert "| draft | · | · | 11 / 1 |" in batch_one
    assert "| schedule | 7 / 0 | 2 / 4 | 2 / 4 |" in batch_one
    assert "| **total** | **11 / 2** | **11 / 5** | **22 / 6** |" in batch_one
    assert "| total min–max | 11–51 / 2 | 11 / 5 | 22 / 6 |" in batch_one
    assert "| steps | 3 | 1 | 1 |" in batch_one
    assert "| forwards | target 1 | target 1 | drafter 1, target 1 |" in batch_one
    assert "| schedule | 4 / 4 |" in batch_two
    assert batch_four.startswith("4: no step ran with all 4 requests.")


def test_request_ids_name_their_run(tmp_path: Path) -> None:
    assert [run_of(request_id(8, 3)), run_of(WARMUP_ID), run_of(CLOSING_ID), run_of("c-1")] == [
        8,
        None,
        None,
        None,
    ]
    records = tmp_path / "steps.jsonl"
    warm = step("ar", "plain", 1, {"run": (1, 0)}).counts.model_copy(update={"requests": (WARMUP_ID,)})
    kept = [step("ar", "plain", 2, {"run": (1, 0)}).counts, step("ar", "plain", 1, {}, concurrency=2).counts]
    records.write_text("".join(c.model_dump_json() + "\n" for c in [warm, *kept]))
    assert [(s.concurrency, s.counts.batch_size) for s in read_steps("ar", records)] == [(2, 2), (2, 1)]


def test_concurrency_list() -> None:
    assert concurrency_list("1, 8") == (1, 8)
    for bad in ("", "0", "1,1", "a"):
        with pytest.raises(Exception, match="expected"):
            concurrency_list(bad)


def test_argument_errors_name_the_value(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["step-anatomy", "--model-path", str(tmp_path / "absent"), "--policies", "ar"]
    assert cli.main(argv) == 2
    assert "--model-path" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["step-anatomy", "--concurrency", "1,1"])


def test_the_command_line_spells_every_option() -> None:
    args = cli.build_parser().parse_args(["step-anatomy", "--concurrency", "2,4", "--out", "o"])
    line = command_line(args)
    assert line.startswith("bastion step-anatomy ")
    assert "--concurrency 2,4" in line and "--policies ar,adaptive,fixed:16" in line and "--out o" in line
    assert cli.build_parser().parse_args(line.split()[1:]).concurrency == (2, 4)


@pytest.mark.slow
def test_step_anatomy_end_to_end(tmp_path: Path) -> None:
    """Every kind that ran has its steps, with the forwards each kind runs (and their ops left out); SGLang's
    plain step has its own regions; skipped steps never run the drafter."""
    target = make_tiny_target(tmp_path / "target", vocab_size=260, initializer_range=0.1)
    drafter = make_tiny_drafter(tmp_path / "drafter", target, target_layer_ids=[0, 2], block_size=16)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("hello world", "the quick fox")))
    out = tmp_path / "out"
    argv = [
        "step-anatomy", "--model-path", str(target), "--draft-model-path", str(drafter),
        "--prompts", str(prompts), "--policies", "ar,adaptive,fixed:2", "--concurrency", "1,2",
        "--max-new-tokens", "10", "--max-budget", "8", "--device", "cpu", "--dtype", "float32",
        "--mem-fraction-static", "0.05", "--max-total-tokens", "8192", "--sglang-log-level", "error",
        "--out", str(out),
    ]  # fmt: skip
    with contextlib.redirect_stdout(None):
        assert cli.main(argv) == 0
    report = AnatomyReport.model_validate_json((out / REPORT_NAME).read_text(encoding="utf-8"))
    kinds = {(s.policy, s.counts.kind) for s in report.steps}
    assert {("ar", "plain"), ("adaptive", "skipped"), ("fixed:2", "speculative")} <= kinds
    assert kinds <= {("ar", "plain"), ("fixed:2", "speculative")} | {
        ("adaptive", kind) for kind in ("skipped", "declined", "speculative")
    }
    for anatomy_step in report.steps:
        counts = anatomy_step.counts
        drafted = counts.kind in ("declined", "speculative")
        assert counts.forwards == ({"drafter": 1, "target": 1} if drafted else {"target": 1}), counts
        assert ("draft" in counts.stages) == drafted
        if counts.kind == "plain":
            assert {"schedule", "run", "worker", "prepare", "sample", "result"} <= set(counts.stages)
        else:
            assert {"schedule", "run", "worker", "begin", "gate", "plan", "verify", "accept"} <= set(
                counts.stages
            )
            assert {"commit", "observe", "result"} <= set(counts.stages)
    for batch_size in (1, 2):
        assert {(s.policy, s.kind) for s in report.summaries if s.batch_size == batch_size} >= {
            ("ar", "plain"),
            ("fixed:2", "speculative"),
        }
    assert report.settings.concurrencies == (1, 2) and report.settings.overlap_schedule is False
